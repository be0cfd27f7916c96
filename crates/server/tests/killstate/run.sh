#!/usr/bin/env bash
# kill -9 during state-file writes: the server is killed at random moments right after answering
# (while the worker re-prefills and writes its state file), restarted over the same
# --state-dir, and must never load a corrupt state: every .rls file it finds is either valid or
# refused with a message, and a resumed turn is bit-identical to a fresh computation.
# Usage: crates/server/tests/killstate/run.sh [path/to/redlite]  (default target/release/redlite)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../../.." && pwd)"
bin="${1:-$root/target/release/redlite}"
model="$root/../shared/reference/models/tiny-Q8_0.gguf"
heldout="$root/../shared/reference/logits/heldout.txt"
tmp="$(mktemp -d)"
pid=""
trap '{ [ -n "$pid" ] && kill -9 $pid && wait $pid; } 2>/dev/null || true; rm -rf "$tmp"' EXIT
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
start() {
  "$bin" serve -m "$model" --port "$port" --state-dir "$tmp/state" 2>> "$tmp/server.log" &
  pid=$!
  for _ in $(seq 1 200); do
    curl -fs "http://127.0.0.1:$port/health" > /dev/null 2>&1 && return 0
    sleep 0.05
  done
  echo "server did not start"; cat "$tmp/server.log"; exit 1
}
python3 - "$heldout" "$tmp" <<'PY'
import json, sys
text = open(sys.argv[1], encoding="utf-8").read()
# Every request shares a long first part, so any state that survived is resumable by the last.
for i in range(12):
    user = text[:5000] + "\n" + text[10000 + i * 300:10000 + i * 300 + 600]
    body = {"messages": [{"role": "user", "content": user}], "max_tokens": 4, "temperature": 0}
    json.dump(body, open(f"{sys.argv[2]}/req{i}.json", "w"))
PY
passed=0
failed=0
for i in $(seq 0 11); do
  start
  curl -fs "http://127.0.0.1:$port/v1/chat/completions" -H 'content-type: application/json' \
    -d @"$tmp/req$i.json" > /dev/null
  if [ "$i" -eq 0 ]; then
    # The first conversation is left to reach its file, so at least one survives the kills.
    for _ in $(seq 1 200); do ls "$tmp/state"/*.rls > /dev/null 2>&1 && break; sleep 0.05; done
  else
    # Die somewhere in the re-prefill / state-file write that follows the answer.
    sleep "0.0$((RANDOM % 10))"
  fi
  { kill -9 $pid && wait $pid; } 2>/dev/null || true
  pid=""
done
: > "$tmp/server.log"
start
# No file the restarted server saw was loaded corrupt: each one is valid or was refused.
loaded=$(ls "$tmp/state"/*.rls 2>/dev/null | wc -l)
refused=$(grep -c "refusing state file" "$tmp/server.log" || true)
echo "state files: $loaded ($refused refused), temp files left: $(ls "$tmp/state" | grep -c tmp || true) (removed at start)"
if curl -fs "http://127.0.0.1:$port/health" > /dev/null; then passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL health"; fi
# A turn resumed from whatever loaded equals a fresh server's computation of the same ids: the
# prompt is the conversation of the newest valid state file (its ids read from the file) and a
# few more tokens, so the server resumes from that file's checkpoint whichever kills landed.
body=$(python3 - "$tmp/state" "$tmp/server.log" <<'PY'
import glob, json, os, struct, sys
refused = open(sys.argv[2]).read()
files = sorted((f for f in glob.glob(sys.argv[1] + "/*.rls") if f not in refused), key=os.path.getmtime)
raw = open(files[-1], "rb").read()
assert raw[:8] == b"RLSTATE\0"
hlen = struct.unpack_from("<I", raw, 8)[0]
n = json.loads(raw[12:12 + hlen])["n_ids"]
ids = list(struct.unpack_from(f"<{n}I", raw, 12 + hlen))
print(json.dumps({"prompt": ids + ids[:8], "max_tokens": 4, "temperature": 0, "return_token_ids": True}))
PY
)
resp=$(curl -fs "http://127.0.0.1:$port/v1/completions" -H 'content-type: application/json' -d "$body")
{ kill -9 $pid && wait $pid; } 2>/dev/null || true; pid=""
port2=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$bin" serve -m "$model" --port "$port2" 2>> "$tmp/fresh.log" &
pid=$!
for _ in $(seq 1 200); do curl -fs "http://127.0.0.1:$port2/health" > /dev/null 2>&1 && break; sleep 0.05; done
fresh=$(curl -fs "http://127.0.0.1:$port2/v1/completions" -H 'content-type: application/json' \
  -d "$(python3 -c 'import json,sys; r=json.loads(sys.argv[1]); print(json.dumps({"prompt": r["redlite"]["prompt_token_ids"], "max_tokens": 4, "temperature": 0, "return_token_ids": True}))' "$resp")")
if python3 -c 'import json,sys; a=json.loads(sys.argv[1]); b=json.loads(sys.argv[2]); c=a["usage"]["prompt_tokens_details"]["cached_tokens"]; print("resumed", c, "of", a["usage"]["prompt_tokens"]); assert c > 0; assert a["redlite"]["logits_fnv"] == b["redlite"]["logits_fnv"]' "$resp" "$fresh"; then
  passed=$((passed + 1))
else
  failed=$((failed + 1)); echo "FAIL resumed turn differs from a fresh computation"
fi
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
