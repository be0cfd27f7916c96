#!/usr/bin/env bash
# Decode and prefill speed of redlite and of llama.cpp on the same GGUF file, same threads, in the
# same run, with the ratio redlite / llama.cpp.
#
#   bench/vs-llamacpp.sh MODEL [THREADS] [DECODE_STEPS] [PREFILL_TOKENS]
#
# Defaults: threads = physical cores (as redlite counts them), 32 decode steps after an 8-token
# prompt, a 512-token prefill. llama.cpp runs through llama-cpp-python (pip install
# llama-cpp-python); redlite is $REDLITE or target/release/redlite (built when missing).
# Decode is reported two ways: mean over the steps, and from the median step (robust to other
# load on the machine). Timings are measurements, not pass/fail checks.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${1:?usage: bench/vs-llamacpp.sh MODEL [THREADS] [DECODE_STEPS] [PREFILL_TOKENS]}
THREADS=${2:-0}
STEPS=${3:-32}
PREFILL=${4:-512}
REDLITE=${REDLITE:-target/release/redlite}
BACKEND=${BACKEND:-cpu}

if [ ! -x "$REDLITE" ]; then
    echo "building $REDLITE ..." >&2
    cargo build --release -p redlite >&2
fi
if [ "$THREADS" = 0 ]; then
    # The thread count redlite picks by default (physical cores), so both engines get the same.
    THREADS=$("$REDLITE" bench kernel --type Q8_0 --shape 32x256 -n 1 --working-set-mib 1 \
        --bw-mib 8 --bw-runs 1 --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["threads"])')
fi

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

echo "model: $MODEL, threads: $THREADS, decode: 8-token prompt + $STEPS steps, prefill: $PREFILL tokens" >&2
"$REDLITE" bench decode -m "$MODEL" --backend "$BACKEND" -t "$THREADS" -n "$STEPS" -p 8 --json > "$TMP/rd.json"
# Median of 3 prompt passes: the first one maps the weights in (page faults), like the untimed
# warm-up pass llama_cpp_bench.py gives llama.cpp.
"$REDLITE" bench prefill -m "$MODEL" --backend "$BACKEND" -t "$THREADS" -p "$PREFILL" -n "${PREFILL_RUNS:-3}" --json > "$TMP/rp.json"
python3 bench/llamacpp_bench.py "$MODEL" --threads "$THREADS" -n "$STEPS" -p "$PREFILL" > "$TMP/ll.json"

python3 - "$TMP" "$MODEL" <<'PY'
import json, sys, os
tmp, model = sys.argv[1], sys.argv[2]
rd = json.load(open(os.path.join(tmp, "rd.json")))
rp = json.load(open(os.path.join(tmp, "rp.json")))
ll = json.load(open(os.path.join(tmp, "ll.json")))
rows = [
    ("decode tok/s (mean)", rd["tok_per_s"], ll["decode_tok_per_s"]),
    ("decode tok/s (median step)", 1e3 / max(rd["median_step_ms"], 1e-9), ll["decode_median_tok_per_s"]),
    ("prefill tok/s", rp["tok_per_s"], ll["prefill_tok_per_s"]),
]
print(f"model: {model}")
print(f"threads: {rd['threads']}, memory read bandwidth: {rd['bandwidth']['gbps']:.2f} GB/s, "
      f"weights read per decode token: {rd['bytes_per_token'] / 1e6:.1f} MB")
print(f"{'':28} {'redlite':>10} {'llama.cpp':>10} {'ratio':>7}")
for name, r, l in rows:
    print(f"{name:28} {r:10.2f} {l:10.2f} {r / max(l, 1e-12):6.2f}x")
PY
