#!/usr/bin/env bash
# The pi coding agent (npm @mariozechner/pi-coding-agent) pointed at `redlite serve`: one session
# with a tool-call round trip. The model's turns are replayed: turn 1 calls pi's `read` tool on
# a file, turn 2 answers. The check: pi ran the tool (its result, with the file's content, is in
# pi's JSON event stream and was sent back to the server) and printed the final answer.
# Usage: crates/server/tests/pi/run.sh [path/to/redlite]  (default target/release/redlite)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../../.." && pwd)"
bin="${1:-$root/target/release/redlite}"
model="$root/../shared/reference/models/tiny-Q8_0.gguf"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm install --silent --no-audit --no-fund @mariozechner/pi-coding-agent@0.73.1 > /dev/null)
pi="$tmp/node_modules/.bin/pi"

mkdir -p "$tmp/work" "$tmp/home/.pi/agent"
echo "The secret word is mango." > "$tmp/work/hello.txt"
python3 - "$tmp/replay.json" <<'PY'
import json, sys
json.dump([
    "I will read the file.\n<tool_call>\n<function=read>\n<parameter=path>\nhello.txt\n</parameter>\n</function>\n</tool_call>",
    "The file says the secret word is mango.",
], open(sys.argv[1], "w"))
PY
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat > "$tmp/home/.pi/agent/models.json" <<JSON
{"providers": {"redlite": {"baseUrl": "http://127.0.0.1:$port/v1", "api": "openai-completions",
  "apiKey": "pi-test", "compat": {"supportsDeveloperRole": false, "supportsReasoningEffort": false},
  "models": [{"id": "tiny", "contextWindow": 4096, "maxTokens": 512}]}}}
JSON
"$bin" serve -m "$model" --port "$port" --api-key pi-test --replay "$tmp/replay.json" 2> "$tmp/server.log" &
pid=$!
trap 'kill $pid 2>/dev/null || true; rm -rf "$tmp"' EXIT
for _ in $(seq 1 100); do
  curl -fs "http://127.0.0.1:$port/health" > /dev/null 2>&1 && break
  sleep 0.1
done
(cd "$tmp/work" && HOME="$tmp/home" PI_OFFLINE=1 PI_TELEMETRY=0 timeout 120 "$pi" --offline --no-session \
  --provider redlite --model tiny --tools read --mode json -p "What does hello.txt say?" \
  > "$tmp/events.jsonl" 2> "$tmp/pi.err") || { echo "pi failed:"; tail -20 "$tmp/pi.err"; }
metrics="$(curl -fs "http://127.0.0.1:$port/metrics")"
python3 - "$tmp/events.jsonl" "$metrics" <<'PY'
import json, re, sys
passed = failed = 0
def check(name, ok, detail=""):
    global passed, failed
    if ok:
        passed += 1; print(f"ok   {name}")
    else:
        failed += 1; print(f"FAIL {name}: {detail}")
events = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
text = json.dumps(events)
tool_ends = [e for e in events if e.get("type") == "tool_execution_end"]
check("pi ran the read tool", any("mango" in json.dumps(e) for e in tool_ends), [e.get("type") for e in events][:40])
check("final answer printed", "The file says the secret word is mango." in text, text[-800:])
m = re.search(r"^redlite_requests_total (\d+)", sys.argv[2], re.M)
check("two model turns", m and int(m.group(1)) >= 2, sys.argv[2][:300])
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
PY
