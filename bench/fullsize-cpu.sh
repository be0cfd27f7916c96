#!/usr/bin/env bash
# Full-size CPU ratio vs llama.cpp (issue #4): makes the full-size layout (Q4_K dense, IQ2_XXS
# experts, Q6_K head, ≈ 21.5 GB), runs bench/vs-llamacpp.sh on it for decode and for a 512-token
# prefill, and deletes it. Run it on a quiet machine: the file takes ~21.5 GB of the page cache,
# so anything else using memory makes both engines read from disk.
#
#   bench/fullsize-cpu.sh [THREADS] [DECODE_STEPS] [OUT]
#
# Defaults: 2 threads, 32 decode steps, /work/fullsize.gguf. Logs go to stdout; keep them with
# `bench/fullsize-cpu.sh | tee fullsize.log`. LAYERS=N makes an N-layer file instead (a quick
# check of the script: `LAYERS=4 PREFILL=64 bench/fullsize-cpu.sh 2 8 /tmp/l4.gguf`; at least 4,
# as llama.cpp fails without an attention layer); PREFILL=P changes the
# prompt length (default 512).
set -euo pipefail
cd "$(dirname "$0")/.."

THREADS=${1:-2}
STEPS=${2:-32}
OUT=${3:-/work/fullsize.gguf}
PREFILL=${PREFILL:-512}
LAYER_ARGS=()
if [ -n "${LAYERS:-}" ]; then
    LAYER_ARGS=(--layers "$LAYERS")
fi
REDLITE=${REDLITE:-target/release/redlite}
export REDLITE

if [ ! -x "$REDLITE" ]; then
    cargo build --release -p redlite >&2
fi
need=$((23 * 1024 * 1024)) # KiB: the full-size file plus some slack
if [ -n "${LAYERS:-}" ]; then
    need=$((LAYERS * 512 * 1024 + 1024 * 1024))
fi
free_kib=$(df --output=avail -k "$(dirname "$OUT")" | tail -1)
if [ "$free_kib" -lt "$need" ]; then
    echo "not enough disk for $OUT: $((free_kib / 1024 / 1024)) GiB free, need ~23 GiB" >&2
    exit 1
fi

trap 'rm -f "$OUT"' EXIT
echo "== make-model $OUT (full size, Q4_K dense, IQ2_XXS experts, Q6_K head)"
"$REDLITE" make-model "$OUT" --layout qwen3next-80b-a3b --dense Q4_K --experts IQ2_XXS \
    --head Q6_K --force "${LAYER_ARGS[@]}"
# Read the file once so both engines start from a warm page cache.
cat "$OUT" > /dev/null
echo "== load: $(cut -d' ' -f1-3 /proc/loadavg), free: $(free -g | awk '/Mem:/ {print $7}') GiB available"
echo "== kernels (matrices >> cache)"
"$REDLITE" bench kernel -t "$THREADS" --type Q4_K
"$REDLITE" bench kernel -t "$THREADS" --type IQ2_XXS
echo "== decode ($STEPS steps) and prefill $PREFILL, redlite vs llama.cpp, $THREADS threads"
bench/vs-llamacpp.sh "$OUT" "$THREADS" "$STEPS" "$PREFILL"
echo "== load after: $(cut -d' ' -f1-3 /proc/loadavg)"
