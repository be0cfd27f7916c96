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
# load on the machine). ROUNDS (default 3) alternates the two engines (redlite, llama.cpp,
# redlite, ...): each figure is the median over the rounds, and the ratio the median of the
# rounds' ratios (a single run of either engine moves up to 2x on a shared machine). Timings are
# measurements, not pass/fail checks.
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

ROUNDS=${ROUNDS:-3}
echo "model: $MODEL, threads: $THREADS, decode: 8-token prompt + $STEPS steps, prefill: $PREFILL tokens, $ROUNDS rounds" >&2
for r in $(seq 1 "$ROUNDS"); do
    echo "round $r/$ROUNDS ..." >&2
    "$REDLITE" bench decode -m "$MODEL" --backend "$BACKEND" -t "$THREADS" -n "$STEPS" -p 8 --json > "$TMP/rd$r.json"
    # Median of 5 prompt passes (PREFILL_RUNS): the first one maps the weights in (page faults), like the untimed
    # warm-up pass llama_cpp_bench.py gives llama.cpp.
    "$REDLITE" bench prefill -m "$MODEL" --backend "$BACKEND" -t "$THREADS" -p "$PREFILL" -n "${PREFILL_RUNS:-5}" --json > "$TMP/rp$r.json"
    python3 bench/llamacpp_bench.py "$MODEL" --threads "$THREADS" -n "$STEPS" -p "$PREFILL" > "$TMP/ll$r.json"
done

python3 - "$TMP" "$MODEL" "$ROUNDS" <<'PY'
import json, sys, os, statistics
tmp, model, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
load = lambda name, r: json.load(open(os.path.join(tmp, f"{name}{r}.json")))
figures = {  # name: (redlite figure of a round, llama.cpp figure of a round)
    "decode tok/s (mean)": (lambda rd, rp: rd["tok_per_s"], lambda ll: ll["decode_tok_per_s"]),
    "decode tok/s (median step)": (lambda rd, rp: 1e3 / max(rd["median_step_ms"], 1e-9),
                                   lambda ll: ll["decode_median_tok_per_s"]),
    "prefill tok/s": (lambda rd, rp: rp["tok_per_s"], lambda ll: ll["prefill_tok_per_s"]),
}
runs = [(load("rd", r), load("rp", r), load("ll", r)) for r in range(1, rounds + 1)]
rd0 = runs[0][0]
print(f"model: {model}")
print(f"threads: {rd0['threads']}, memory read bandwidth (round 1): {rd0['bandwidth']['gbps']:.2f} GB/s, "
      f"weights read per decode token: {rd0['bytes_per_token'] / 1e6:.1f} MB, {rounds} alternating rounds")
print(f"{'':28} {'redlite':>10} {'llama.cpp':>10} {'ratio':>7}   per round (redlite / llama.cpp)")
for name, (red, lla) in figures.items():
    rs = [red(rd, rp) for rd, rp, _ in runs]
    ls = [lla(ll) for _, _, ll in runs]
    ratio = statistics.median(r / max(l, 1e-12) for r, l in zip(rs, ls))
    each = ", ".join(f"{r:.1f}/{l:.1f}" for r, l in zip(rs, ls))
    print(f"{name:28} {statistics.median(rs):10.2f} {statistics.median(ls):10.2f} {ratio:6.2f}x   {each}")
PY
