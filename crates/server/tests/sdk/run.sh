#!/usr/bin/env bash
# The official openai and anthropic Python SDKs against `redlite serve` (tiny model, replayed
# turns). Usage: crates/server/tests/sdk/run.sh [path/to/redlite]  (default target/release/redlite)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../../.." && pwd)"
bin="${1:-$root/target/release/redlite}"
model="$root/../shared/reference/models/tiny-Q8_0.gguf"
python3 -c "import openai, anthropic" 2>/dev/null || python3 -m pip install --quiet openai anthropic
tmp="$(mktemp -d)"
python3 "$here/test_sdk.py" --replies > "$tmp/replay.json"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$bin" serve -m "$model" --port "$port" --api-key sdk-test --replay "$tmp/replay.json" 2> "$tmp/server.log" &
pid=$!
trap 'kill $pid 2>/dev/null || true; rm -rf "$tmp"' EXIT
for _ in $(seq 1 100); do
  curl -fs "http://127.0.0.1:$port/health" > /dev/null 2>&1 && break
  sleep 0.1
done
python3 "$here/test_sdk.py" "http://127.0.0.1:$port" sdk-test
