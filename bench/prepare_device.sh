#!/usr/bin/env bash
# Fill .device/cuda/ (git-ignored; other runs keep their own folders in .device/) for bench/gpu.sh: the CUDA build of redlite (stripped) and the
# fixtures the parity run needs. Usage: bench/prepare_device.sh [path/to/redlite] [MODEL...]
# Default models: Q4_K_M IQ2_XXS CF2 (the run carries at most 64 MiB in all, the repository itself
# ~35 MB: the binary travels gzipped, ~4.5 MB). FULL=1 also packs the Qwen3 vocabulary (gzipped) so
# that gpu.sh can make the full-size layout there and bench it.
# Run it there with `run` and `carry: [".device/cuda"]`.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-target/release/redlite}
shift || true
MODELS=${*:-Q4_K_M IQ2_XXS CF2}
REF=../shared/reference
D=${DEST:-.device/cuda}   # DEST: another folder under .device/ (one per engineer)
rm -rf "$D" && mkdir -p "$D/fixtures/logits" "$D/fixtures/models"
cp "$BIN" "$D/redlite"
strip "$D/redlite" 2>/dev/null || true
gzip -9 "$D/redlite"
if [ -n "${FULL:-}" ]; then
    gzip -9 -c "$REF/tokenizer/qwen3-vocab.gguf" >"$D/qwen3-vocab.gguf.gz"
fi
cp "$REF/logits/index.json" "$D/fixtures/logits/"
for m in $MODELS; do
    cp "$REF/models/tiny-$m.gguf" "$D/fixtures/models/"
    cp "$REF"/logits/"$m"__P?__exact.bin "$D/fixtures/logits/"
done
du -sh "$D"
