#!/usr/bin/env bash
# Fill .device/ (git-ignored) for bench/gpu.sh: the CUDA build of redlite (stripped) and the
# fixtures the parity run needs. Usage: bench/prepare_device.sh [path/to/redlite] [MODEL...]
# Default models: F16 Q4_K_M IQ2_XXS CF2 (the run carries at most 64 MiB in all).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-target/release/redlite}
shift || true
MODELS=${*:-F16 Q4_K_M IQ2_XXS CF2}
REF=../shared/reference
rm -rf .device && mkdir -p .device/fixtures/logits .device/fixtures/models
cp "$BIN" .device/redlite
strip .device/redlite 2>/dev/null || true
cp "$REF/logits/index.json" .device/fixtures/logits/
for m in $MODELS; do
    cp "$REF/models/tiny-$m.gguf" .device/fixtures/models/
    cp "$REF"/logits/"$m"__P?__exact.bin .device/fixtures/logits/
done
du -sh .device
