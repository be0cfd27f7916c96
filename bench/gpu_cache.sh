#!/usr/bin/env bash
# The GPU expert cache on the GPU machine (issue #7): exactness, then decode on the full-size layout
# at near-uniform and skewed routing, every expert resident and under a 16 GiB GPU budget.
#
# Here (prepare; the CUDA build and the test binary from `cargo test --no-run`):
#   bench/gpu_cache.sh prepare path/to/redlite path/to/expert_cache_gpu-<hash>
# fills the git-ignored .device/cuda2/ (bench/prepare_device.sh with DEST, FULL=1, plus the test).
# There (`run` with `carry: [".device/cuda2"]`):
#   bench/gpu_cache.sh
# 1. exactness: the #[ignore]d test expert_cache_gpu (tiny Q4_K_M, IQ2_XXS, CF2: cache min, 2 and
#    3 slots per layer, lfu/lru/static, prompt and step logits bit-identical to full residency),
#    and the CLI (`logits --backend cuda --expert-cache min` vs no flag, prompt and step: cmp);
#    the kernel self-test and the fixture parity through CudaModel (the MoE path changed);
# 2. bench expert (layer 0, 512 distinct, K = 10 and 1; device vs host-mapped experts);
# 3. make-model full-size (Q4_K dense, IQ2_XXS experts, Q6_K head) with uniform routing, then with
#    `--routing-skew 0.5 --routing-locality 1`; on each `bench decode --backend cuda -p 8 -n 128`
#    with every expert resident and with `--memory 16GiB` under the policies in $POLICIES.
# Logs in $OUT (or .device/cuda2/out); a summary at the end. KERNEL_AB / WARPS_AB: see below.
set -uo pipefail
cd "$(dirname "$0")/.."
DEV=${DEV:-.device/cuda2}

if [ "${1:-}" = "prepare" ]; then
    set -e
    DEST=$DEV FULL=1 bench/prepare_device.sh "$2" Q4_K_M IQ2_XXS CF2
    cp "$3" "$DEV/expert_cache_gpu"
    strip "$DEV/expert_cache_gpu" 2>/dev/null || true
    gzip -9 "$DEV/expert_cache_gpu"
    du -sh "$DEV"
    exit 0
fi

LOGS=${OUT:-$DEV/out}
mkdir -p "$LOGS"
. bench/device_lib.sh
use_nvrtc || echo "warning: no libnvrtc found"
export REDLITE_CUDA_CACHE=/tmp/redlite-cuda2/cache
W=/tmp/redlite-cuda2
mkdir -p $W
BIN=$W/redlite
gunzip -c "$DEV/redlite.gz" >$BIN && chmod +x $BIN
gunzip -c "$DEV/expert_cache_gpu.gz" >$W/expert_cache_gpu && chmod +x $W/expert_cache_gpu
POLICIES=${POLICIES:-lfu static lru}
STEPS=${STEPS:-128}
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$LOGS/gpu.txt"
free -g | head -2 | tee -a "$LOGS/gpu.txt"

if [ -n "${KERNEL_AB:-}" ]; then
    # KERNEL_AB="MOE_IQ2_SB=0": the final check of a kernel variant against the default, most
    # important first (a time limit cuts the tail): self-test + fixture parity and the cache
    # exactness test with the default code; on the uniform full-size layout, decode all resident
    # alternating old (REDLITE_CUDA_DEFINES=$KERNEL_AB) and default (A B A B), decode at 16 GiB
    # (lfu, default code), bench expert K = 10 (old, default), 16 GiB with the old code, then the
    # tuning variants in $VARIANTS ("W=8" = REDLITE_MOE_WARPS, else REDLITE_CUDA_DEFINES values),
    # bench expert K = 1 and ncu's kernel times of one decode step.
    A=$KERNEL_AB
    step() { echo "== $* ($(date -u +%T))"; }
    step "self-test + fixture parity (default)"
    timeout 150 $BIN selftest --backend cuda --fixtures "$DEV/fixtures" --step >"$LOGS/selftest.log" 2>&1 || status=1
    head -2 "$LOGS/selftest.log"
    grep -h "^selftest:\|^kernels:\|FAIL\|^error\|iq2_xxs" "$LOGS/selftest.log" | head -40
    sed -n '/^fixture parity/,/^$/p' "$LOGS/selftest.log"
    step "exactness: expert_cache_gpu (default)"
    REDLITE_TEST_MODELS="$DEV/fixtures/models" timeout 150 $W/expert_cache_gpu --ignored --nocapture \
        >"$LOGS/exact_test.log" 2>&1 || status=1
    grep -h "bit\|identical\|test result\|panicked\|FAIL\|error" "$LOGS/exact_test.log" | tail -12
    gunzip -c "$DEV/qwen3-vocab.gguf.gz" >$W/vocab.gguf
    FULL=$W/full.gguf
    step "make-model (uniform)"
    $BIN make-model $FULL --vocab $W/vocab.gguf --force 2>&1 | tail -1
    dec() { timeout 90 $BIN bench decode --backend cuda -m $FULL -p 8 -n $STEPS "$@" 2>&1 | grep "^cuda \|tok/s\|hit rate\|launches\|rror\|panick"; }
    for r in 1 2; do
        step "decode all resident, round $r, old ($A)"
        REDLITE_CUDA_DEFINES=$A dec
        step "decode all resident, round $r, default"
        dec
    done
    step "decode --memory 16GiB --cache-policy lfu (default)"
    timeout 120 $BIN bench decode --backend cuda -m $FULL -p 8 -n $STEPS --memory 16GiB --cache-policy lfu 2>&1 \
        | grep -v "^ *[a-z ]*▕"
    bex() { timeout 60 $BIN bench expert --backend cuda -m $FULL --layer 0 --distinct 512 --per-call ${K:-10} -n 20 2>&1 | grep -v "^GPU\|^model\|^experts in"; }
    step "bench expert K=10, old ($A)"
    REDLITE_CUDA_DEFINES=$A bex
    step "bench expert K=10, default"
    bex
    step "decode --memory 16GiB --cache-policy lfu, old ($A)"
    REDLITE_CUDA_DEFINES=$A timeout 120 $BIN bench decode --backend cuda -m $FULL -p 8 -n $STEPS --memory 16GiB \
        --cache-policy lfu 2>&1 | grep "^cuda \|tok/s\|hit rate\|rror"
    # Tuning variants of the default (same sums, other schedules): bench expert, then decode.
    for v in ${VARIANTS:-}; do
        step "variant $v"
        case $v in
            W=*) REDLITE_MOE_WARPS=${v#W=} bex; REDLITE_MOE_WARPS=${v#W=} dec ;;
            *) REDLITE_CUDA_DEFINES=$v bex; REDLITE_CUDA_DEFINES=$v dec ;;
        esac
    done
    step "bench expert K=1, default"
    K=1 bex
    if command -v ncu >/dev/null; then
        step "ncu: one decode step (default, graph off)"
        timeout 120 ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \
            $BIN bench decode --backend cuda --no-graphs --profile-step 1 -m $FULL -p 8 -n 2 >"$LOGS/ncu.csv" 2>"$LOGS/ncu.err"
        ncu_summary "$LOGS/ncu.csv" 16
    fi
    step "done"
    exit $status
fi

if [ -n "${WARPS_AB:-}" ]; then
    # WARPS_AB="4 8 16": bench expert and decode (all resident, --memory 16GiB) per
    # REDLITE_MOE_WARPS value on the uniform full-size layout; nothing else.
    gunzip -c "$DEV/qwen3-vocab.gguf.gz" >$W/vocab.gguf
    $BIN make-model $W/full.gguf --vocab $W/vocab.gguf --force 2>&1 | tail -1
    for w in $WARPS_AB; do
        echo "== REDLITE_MOE_WARPS=$w"
        REDLITE_MOE_WARPS=$w $BIN bench expert --backend cuda -m $W/full.gguf --per-call 10 -n 20 2>&1 | grep -v "^GPU\|^model\|^experts in"
    done
    for w in $WARPS_AB; do
        for mem in "" "--memory 16GiB"; do
            echo "== REDLITE_MOE_WARPS=$w decode $mem"
            REDLITE_MOE_WARPS=$w $BIN bench decode --backend cuda -m $W/full.gguf -p 8 -n $STEPS $mem 2>&1 | grep "^cuda \|hit rate"
        done
    done
    rm -f $W/full.gguf
    exit 0
fi

echo "== exactness: expert_cache_gpu (ignored test)"
REDLITE_TEST_MODELS="$DEV/fixtures/models" timeout 240 $W/expert_cache_gpu --ignored --nocapture \
    >"$LOGS/exact_test.log" 2>&1 || status=1
tail -3 "$LOGS/exact_test.log"

echo "== exactness: CLI logits, --expert-cache min vs all resident"
M=$DEV/fixtures/models/tiny-CF2.gguf
IDS=$(python3 -c 'import json,sys; e=json.load(open(sys.argv[1]))["entries"][0]; print(",".join(map(str,e["token_ids"])))' "$DEV/fixtures/logits/index.json")
{
    for mode in prefill step; do
        $BIN logits --backend cuda --mode $mode -m $M --ids "$IDS" --out $W/all_$mode.bin 2>&1 | tail -1
        $BIN logits --backend cuda --mode $mode -m $M --ids "$IDS" --expert-cache min --out $W/min_$mode.bin 2>&1 | grep -i "expert cache\|error" | tail -2
        if cmp -s $W/all_$mode.bin $W/min_$mode.bin; then echo "cli $mode: min == all (bit-identical)"; else echo "cli $mode: min != all"; fi
    done
} >"$LOGS/exact_cli.log" 2>&1
grep -q "!=" "$LOGS/exact_cli.log" && status=1
cat "$LOGS/exact_cli.log"

echo "== self-test + fixture parity"
timeout 200 $BIN selftest --backend cuda --fixtures "$DEV/fixtures" --step >"$LOGS/selftest.log" 2>&1 || status=1
grep -h "^selftest:\|^kernels:\|FAIL\|^error" "$LOGS/selftest.log" | head -20
sed -n '/^fixture parity/,/^$/p' "$LOGS/selftest.log"

gunzip -c "$DEV/qwen3-vocab.gguf.gz" >$W/vocab.gguf
FULL=$W/full.gguf
for routing in uniform skewed; do
    flags=""
    [ $routing = skewed ] && flags="--routing-skew 0.5 --routing-locality 1"
    echo "== full-size layout, $routing routing"
    {
        t0=$SECONDS
        $BIN make-model $FULL --vocab $W/vocab.gguf --force $flags 2>&1 | tail -2
        echo "make-model ($routing): $((SECONDS - t0)) s, $(du -h $FULL | cut -f1)"
        if [ $routing = uniform ]; then
            for k in 10 1; do
                timeout 60 $BIN bench expert --backend cuda -m $FULL --layer 0 --distinct 512 --per-call $k -n 20 2>&1 | grep -v "^GPU"
            done
        fi
        echo "-- all experts resident"
        timeout 120 $BIN bench decode --backend cuda -m $FULL -p 8 -n $STEPS 2>&1 | grep -v "^ *[a-z ]*▕\|^plan\|^  "
        for pol in $POLICIES; do
            echo "-- --memory 16GiB --cache-policy $pol"
            timeout 150 $BIN bench decode --backend cuda -m $FULL -p 8 -n $STEPS --memory 16GiB --cache-policy $pol 2>&1 \
                | grep -v "^ *[a-z ]*▕"
        done
    } >"$LOGS/full_$routing.log" 2>&1 || status=1
    grep -h "tok/s\|^cuda \|hit rate\|GPU memory\|model on the GPU\|error\|^device\|^host\|make-model" "$LOGS/full_$routing.log"
done
rm -f $FULL

echo
echo "################ summary ################"
tail -5 "$LOGS/exact_test.log"
cat "$LOGS/exact_cli.log"
for r in uniform skewed; do echo "## $r"; cat "$LOGS/full_$r.log"; done
exit $status
