#!/usr/bin/env bash
# The web chat page in headless Chromium (Debian's `chromium`, driven by npm's puppeteer-core):
# type a message, send it, see the (replayed) reply stream in and the usage line appear.
# Usage: crates/server/tests/web/run.sh [path/to/redlite]  (default target/release/redlite)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../../.." && pwd)"
bin="${1:-$root/target/release/redlite}"
model="$root/../shared/reference/models/tiny-Q8_0.gguf"
browser="$(command -v chromium || command -v chromium-browser || true)"
[ -n "$browser" ] || { echo "chromium is not installed (apt-get install chromium)"; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# puppeteer-core, installed next to the test script's copy (no browser download).
cp "$here/page_test.mjs" "$tmp/"
(cd "$tmp" && npm install --silent --no-audit --no-fund puppeteer-core@24 > /dev/null)
reply='Hello from redlite: <b>not HTML</b> & “quotes”.'
python3 -c 'import json,sys; print(json.dumps([sys.argv[1]]))' "$reply" > "$tmp/replay.json"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$bin" serve -m "$model" --port "$port" --replay "$tmp/replay.json" 2> "$tmp/server.log" &
pid=$!
trap 'kill $pid 2>/dev/null || true; rm -rf "$tmp"' EXIT
for _ in $(seq 1 100); do
  curl -fs "http://127.0.0.1:$port/health" > /dev/null 2>&1 && break
  sleep 0.1
done
node "$tmp/page_test.mjs" "http://127.0.0.1:$port" "$reply" "$browser"
