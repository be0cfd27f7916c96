#!/usr/bin/env bash
# Run the CUDA checks on the GPU machine with a binary built elsewhere (that machine has no Rust
# toolchain and no network). Everything it needs travels in the git-ignored folder .device/cuda/
# (`run` with `carry: [".device/cuda"]`):
#
#   .device/cuda/redlite.gz                    built with `cargo build --release -p redlite --features cuda`
#   .device/cuda/qwen3-vocab.gguf.gz           (optional) for the full-size bench
#   .device/cuda/fixtures/logits/index.json    from shared/reference/logits/
#   .device/cuda/fixtures/logits/<M>__P{1,2,3}__exact.bin
#   .device/cuda/fixtures/models/tiny-<M>.gguf
#
# (bench/prepare_device.sh fills it.) In one go: the kernel self-test (every kernel and type
# against the CPU reference on fresh random data, twice: compile then disk cache), then the
# fixture parity run through the device-resident model (prefill on every prompt, plus the first
# prompt token by token through the captured decode graph), then the CLI on the GPU (logits and
# generate --backend cuda, greedy ids against the CPU backend's). With the vocabulary present: a
# full-size layout made there with `redlite make-model` and `bench decode|prefill --backend cuda`
# on it (graph on and off). Full logs go to $OUT (or .device/cuda/out); the summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
DEV=${DEV:-.device/cuda}
LOGS=${OUT:-$DEV/out}
mkdir -p "$LOGS"

. bench/device_lib.sh
use_nvrtc || echo "warning: no libnvrtc found"
export REDLITE_CUDA_CACHE="$LOGS/cache"   # a fresh cache: the first run compiles, the second reads it
BIN=/tmp/redlite-cuda/redlite
mkdir -p /tmp/redlite-cuda
if [ -f "$DEV/redlite.gz" ]; then gunzip -c "$DEV/redlite.gz" >"$BIN"; else cp "$DEV/redlite" "$BIN"; fi
chmod +x "$BIN"

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee "$LOGS/gpu.txt"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

status=0
echo "== kernel self-test (compile)"
"$BIN" selftest --backend cuda >"$LOGS/selftest1.log" 2>&1 || status=1
echo "== kernel self-test (cached) + fixture parity"
"$BIN" selftest --backend cuda --fixtures "$DEV/fixtures" --step >"$LOGS/selftest2.log" 2>&1 || status=1

echo "== CLI on the GPU"
M=$(ls "$DEV"/fixtures/models/*.gguf | head -1)
IDS=$(python3 -c 'import json,sys; e=json.load(open(sys.argv[1]))["entries"][0]; print(",".join(map(str,e["token_ids"])))' "$DEV/fixtures/logits/index.json")
{
    echo "model $M, prompt ids $IDS"
    "$BIN" logits --backend cuda -m "$M" --ids "$IDS" --out "$LOGS/l_cuda.bin" 2>&1
    "$BIN" logits --backend cuda --mode step -m "$M" --ids "$IDS" --out "$LOGS/l_cuda_step.bin" 2>&1
    "$BIN" logits --backend oracle -m "$M" --ids "$IDS" --out "$LOGS/l_cpu.bin" 2>&1
    python3 - "$LOGS" <<'PY'
import array, sys
d = sys.argv[1]
rd = lambda n: array.array("f", open(f"{d}/{n}", "rb").read())
c, s, p = rd("l_cuda.bin"), rd("l_cuda_step.bin"), rd("l_cpu.bin")
print("logits cli: max |cuda prefill - oracle| = %.3g, max |cuda step - oracle| = %.3g over %d values"
      % (max(abs(a - b) for a, b in zip(c, p)), max(abs(a - b) for a, b in zip(s, p)), len(p)))
PY
    for be in cuda cpu; do
        "$BIN" generate --backend $be -m "$M" --ids "$IDS" -n 32 --ignore-eos --print-ids 2>"$LOGS/gen_$be.err" | tail -1 >"$LOGS/gen_$be.ids"
        echo "generate $be: $(cat "$LOGS/gen_$be.ids") | $(grep -h 'tok/s\|launches' "$LOGS/gen_$be.err" | tr '\n' ' ')"
    done
    if cmp -s "$LOGS/gen_cuda.ids" "$LOGS/gen_cpu.ids"; then echo "greedy ids: cuda = cpu"; else echo "greedy ids: cuda != cpu"; fi
    "$BIN" generate --backend cuda -m "$M" --ids "$IDS" -n 32 --ignore-eos --temp 0.8 --top-k 40 --top-p 0.95 --min-p 0.05 --seed 7 --print-ids 2>&1 | tail -2
} >"$LOGS/cli.log" 2>&1 || status=1

if [ -f "$DEV/qwen3-vocab.gguf.gz" ]; then
    echo "== full-size layout: make-model + bench --backend cuda"
    gunzip -c "$DEV/qwen3-vocab.gguf.gz" >/tmp/redlite-cuda/vocab.gguf
    FULLM=/tmp/redlite-cuda/full.gguf
    {
        t0=$SECONDS
        "$BIN" make-model "$FULLM" --vocab /tmp/redlite-cuda/vocab.gguf --force 2>&1 | tail -3
        echo "make-model: $((SECONDS - t0)) s, $(du -h "$FULLM" | cut -f1)"
        "$BIN" bench decode --backend cuda -m "$FULLM" -p 8 -n 128 2>&1
        "$BIN" bench decode --backend cuda -m "$FULLM" -p 8 -n 32 --no-graphs 2>&1
        "$BIN" bench prefill --backend cuda -m "$FULLM" -p 64 -n 3 2>&1
        # Decode at a 32K context (the cache rows between the prompt and 32768 hold zeros).
        "$BIN" bench decode --backend cuda -m "$FULLM" -p 8 -n 64 --position 32768 2>&1
    } >"$LOGS/full.log" 2>&1 || status=1
    if [ -n "${PROFILE:-}" ] && command -v ncu >/dev/null; then
        # One decode step (graph off), kernel by kernel: decode step 1 (after the warm-up step) is
        # bracketed by cuProfilerStart/Stop (--profile-step; NVTX ranges per layer when
        # libnvToolsExt loads), ncu profiles only it.
        echo "== ncu: one decode step of the full-size layout"
        ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \
            "$BIN" bench decode --backend cuda --no-graphs --profile-step 1 -m "$FULLM" -p 8 -n 2 >"$LOGS/ncu.csv" 2>"$LOGS/ncu.err" || status=1
        ncu_summary "$LOGS/ncu.csv" 25 >"$LOGS/ncu.txt"
        # DETAIL=N: a closer look at the N heaviest kernels of that step (the first launch of
        # each): occupancy, registers, and the stall reasons per issued instruction (session 15:
        # no_instruction marks code run once per block, an instruction-cache miss per line).
        for k in $(awk -F'|' 'NR > 3 && NF > 4 { gsub(/ /, "", $2); print $2 }' "$LOGS/ncu.txt" | head -n "${DETAIL:-0}"); do
            ncu --profile-from-start off --clock-control none -k "$k" --launch-count 1 \
                --section SpeedOfLight --section Occupancy --section LaunchStats \
                --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum" \
                "$BIN" bench decode --backend cuda --no-graphs --profile-step 1 -m "$FULLM" -p 8 -n 2 2>&1 \
                | grep -E "^  [a-z_0-9]+|Duration|Throughput|Registers Per|Occupancy|Block Limit|Grid Size|Block Size|stalled|inst_executed" \
                | grep -v "^    ---" | awk '!/stalled/ || $NF + 0 >= 0.5' >>"$LOGS/ncu_detail.txt" || status=1
        done
    fi
fi

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
echo
cat "$LOGS/cli.log"
[ -f "$LOGS/full.log" ] && { echo; cat "$LOGS/full.log"; }
[ -f "$LOGS/ncu.txt" ] && { echo; cat "$LOGS/ncu.txt"; tail -3 "$LOGS/ncu.err"; }
[ -f "$LOGS/ncu_detail.txt" ] && { echo; cat "$LOGS/ncu_detail.txt"; }
exit $status
