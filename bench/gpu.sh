#!/usr/bin/env bash
# Run the CUDA checks on the GPU machine with a binary built elsewhere (that machine has no Rust
# toolchain and no network). Everything it needs travels in the git-ignored folder .device/cuda/
# (`run` with `carry: [".device/cuda"]`):
#
#   .device/cuda/redlite                       built with `cargo build --release -p redlite --features cuda`
#   .device/cuda/fixtures/logits/index.json    from shared/reference/logits/
#   .device/cuda/fixtures/logits/<M>__P{1,2,3}__exact.bin
#   .device/cuda/fixtures/models/tiny-<M>.gguf
#
# (bench/prepare_device.sh fills it.) In one go: the kernel self-test (every kernel and type
# against the CPU reference on fresh random data, twice: compile then disk cache), then the
# fixture parity run (prefill on every prompt, plus the first prompt token by token). Full logs go
# to $OUT (or .device/cuda/out); the summary table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
DEV=${DEV:-.device/cuda}
LOGS=${OUT:-$DEV/out}
mkdir -p "$LOGS"

# libnvrtc (13.x): the toolkit's, else the pip package's (nvidia/cu13/lib).
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    "$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))' 2>/dev/null)"; do
    if [ -n "$d" ] && ls "$d"/libnvrtc.so* >/dev/null 2>&1; then
        export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
        break
    fi
done
export REDLITE_CUDA_CACHE="$LOGS/cache"   # a fresh cache: the first run compiles, the second reads it

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee "$LOGS/gpu.txt"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

status=0
echo "== kernel self-test (compile)"
"$DEV/redlite" selftest --backend cuda >"$LOGS/selftest1.log" 2>&1 || status=1
echo "== kernel self-test (cached) + fixture parity"
"$DEV/redlite" selftest --backend cuda --fixtures "$DEV/fixtures" --step >"$LOGS/selftest2.log" 2>&1 || status=1

echo
echo "################ summary ################"
for f in selftest1 selftest2; do
    head -2 "$LOGS/$f.log"               # device line (compile/cache time), seed
done
echo
echo "kernel checks by family (both runs):"
cat "$LOGS/selftest1.log" "$LOGS/selftest2.log" | awk -F'|' '
    /^\| [a-z]/ && $2 !~ /kernel|file/ && NF >= 6 && $6 ~ /ok|FAIL/ {
        split($2, k, " "); fam = k[1]; n[fam]++; if ($6 ~ /FAIL/) bad[fam]++;
        e = $4 + 0; if (e > worst[fam]) worst[fam] = e
    }
    END { printf "| family | checks | failed | worst error |\n|---|---|---|---|\n";
          for (f in n) printf "| %s | %d | %d | %.2e |\n", f, n[f], bad[f] + 0, worst[f] }' | sort
echo
grep -h "FAIL" "$LOGS/selftest1.log" "$LOGS/selftest2.log" | head -40
echo
sed -n '/^fixture parity/,/^$/p' "$LOGS/selftest2.log"
grep -h "^kernels:\|^selftest:\|^error" "$LOGS/selftest1.log" "$LOGS/selftest2.log"
exit $status
