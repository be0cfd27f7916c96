#!/usr/bin/env bash
# A/B of kernel variants on the GPU machine, in one run: the full-size layout made there, then
# `bench decode --backend cuda` for each variant in alternating rounds, then the kernel self-test
# and the fixture parity (prefill and graph step) for each variant of the new build.
# A variant is a REDLITE_CUDA_DEFINES string (kernel tuning switches; "" = the source defaults);
# `old` is the baseline binary .device/cuda/redlite-old.gz. Needs what bench/prepare_device.sh
# packs (FULL=1). Usage there: bench/gpu_variants.sh "" "WB_UNROLL=1" ... (`run`, carry .device/cuda)
set -uo pipefail
cd "$(dirname "$0")/.."
DEV=.device/cuda
T=/tmp/redlite-var
mkdir -p "$T"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export REDLITE_CUDA_CACHE=$T/cache
gunzip -c "$DEV/redlite.gz" >"$T/new" && chmod +x "$T/new"
[ -f "$DEV/redlite-old.gz" ] && gunzip -c "$DEV/redlite-old.gz" >"$T/old" && chmod +x "$T/old"
gunzip -c "$DEV/qwen3-vocab.gguf.gz" >"$T/vocab.gguf"
F=$T/full.gguf
"$T/new" make-model "$F" --vocab "$T/vocab.gguf" --force 2>&1 | tail -1
VARIANTS=("$@")
[ -f "$T/old" ] && VARIANTS=(old "${VARIANTS[@]}")
for round in 1 2; do
    for v in "${VARIANTS[@]}"; do
        if [ "$v" = old ]; then bin=$T/old; defs=; else bin=$T/new; defs=$v; fi
        line=$(REDLITE_CUDA_DEFINES="$defs" "$bin" bench decode --backend cuda -m "$F" -p 8 -n 128 2>&1 | grep -E "^cuda|launches|error")
        echo "round $round | ${v:-default} | $(echo "$line" | tr '\n' ' ')"
    done
done
for v in "$@"; do
    echo "== self-test + parity: ${v:-default}"
    REDLITE_CUDA_DEFINES="$v" "$T/new" selftest --backend cuda --fixtures "$DEV/fixtures" --step >"$T/st.log" 2>&1
    echo "rc $?"
    grep -E "^kernels:|^selftest:|FAIL| ok \|$|not ok" "$T/st.log" | grep -v "^| [a-z_0-9]* .*| ok |$" | tail -12
done
