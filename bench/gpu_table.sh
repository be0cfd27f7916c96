#!/usr/bin/env bash
# The #6 / #8 benchmark table on the GPU machine in one call, with the correctness checks first
# (the session-closing measurement; session 20). Uses the binaries gpu_ab.sh's `prepare` packs:
#   T=/work/target-cuda/release bench/gpu_ab.sh prepare        # here
#   OUT=$OUT bash bench/gpu_table.sh                            # there, `carry: [".device/ab"]`
# CONTROL="NAME=0,NAME2=0" (kernel defines, REDLITE_CUDA_DEFINES) adds ROUNDS alternating decode
# rounds of the default against that control build, and their full-size logits compared.
# Steps (each logged to $OUT/table.txt as it ends): make-model of the full-size layout
# (background); the self-test with fixture parity; verify_gpu, expert_cache_gpu, mtp_gpu; decode
# short / at 4,096 / at 32,768 / at --memory 16GiB lfu; prefill 512 and 4,096; bench kernel;
# bench expert; the full-size verify cost; the demo model's file rewrite and verify cost on the GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
DEV=${DEV:-.device/ab}
. bench/device_lib.sh
ab_setup "$DEV" table.txt
quiet() { grep -v "^GPU 0\|^model on the GPU\|^device:\|^experts in"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | keep
[ -f $FULL ] || ($R make-model $FULL --vocab $W/vocab.gguf --force >"$LOGS/make_model.log" 2>&1) &
mm=$!
step "self-test + parity"
timeout 200 $R selftest --backend cuda --fixtures "$FX" --step >"$LOGS/selftest.log" 2>&1
grep -h "^selftest:\|^kernels:\|FAIL\|^error\|panicked" "$LOGS/selftest.log" | head -20 | keep
sed -n '/^fixture parity/,/^$/p' "$LOGS/selftest.log" | keep
step "verify_gpu, expert_cache_gpu, mtp_gpu"
for t in verify_gpu expert_cache_gpu mtp_gpu; do
    REDLITE_TEST_MODELS="$FX/models" REDLITE_DEMO_MODEL=models/redlite-demo.gguf \
        timeout 200 $W/$t --ignored --nocapture 2>&1 | grep -h -A1 "test result\|panicked\|drafts equal\|plain decoding" | grep -v "^--" | keep
done
wait $mm
dec() { timeout 150 $R bench decode --backend cuda -m $FULL "$@" 2>&1 | grep "^cuda \|launches\|hit rate\|rror\|panick"; }
if [ -n "${CONTROL:-}" ]; then
    IDS=9707,11,1879,374,264,1273,315,279,13,576,3974,13876,38835,34208,916,279,15678,5562,13
    step "full-size logits, default against the control ($CONTROL)"
    timeout 150 $R logits --backend cuda --mode step -m $FULL --ids $IDS --out $W/lg0.bin >/dev/null 2>&1
    REDLITE_CUDA_DEFINES=$CONTROL timeout 200 $R logits --backend cuda --mode step -m $FULL --ids $IDS --out $W/lg1.bin >/dev/null 2>&1
    cmp -s $W/lg0.bin $W/lg1.bin && echo "bit-identical ($(stat -c %s $W/lg0.bin) bytes)" | keep || echo "logits differ" | keep
    for round in $(seq "${ROUNDS:-3}"); do
        step "round $round default"
        dec -p 8 -n 128 | keep
        step "round $round control"
        REDLITE_CUDA_DEFINES=$CONTROL dec -p 8 -n 128 | keep
    done
fi
step "decode -p 8 -n 128"
dec -p 8 -n 128 | keep
for p in 4096 32768; do
    step "decode at position $p"
    dec -p 8 -n 64 --position $p | keep
done
step "decode at position 32768, f32 KV cache (the default on the GPU is f16)"
dec -p 8 -n 64 --position 32768 --kv-type f32 | keep
step "decode --memory 16GiB --cache-policy lfu"
dec -p 8 -n 128 --memory 16GiB --cache-policy lfu | keep
step "prefill 512, then 4,096 (--ubatch 4096)"
timeout 150 $R bench prefill --backend cuda -m $FULL -p 512 -n 3 2>&1 | grep "^cuda\|rror" | keep
timeout 200 $R bench prefill --backend cuda -m $FULL -p 4096 -n 3 --ubatch 4096 2>&1 | grep "^cuda\|rror" | keep
step "bench kernel"
# The Q6_K lm_head shape also with the head's split (8:4: one warp a row, 4 rows a warp, as
# decode runs it; 4:4 is what the other matrices of 2,048 columns take and the table's earlier line).
for ts in Q4_K:12288x2048:4:4 Q4_K:151936x2048:4:4 Q6_K:151936x2048:4:4 Q6_K:151936x2048:8:4; do
    timeout 100 $R bench kernel --backend cuda --type ${ts%%:*} --shape $(echo $ts | cut -d: -f2) \
        --split $(echo $ts | cut -d: -f3-4) 2>&1 | quiet | tail -3 | keep
done
step "read bandwidth, the decode attention's cache walk (read_rows) and its split kernels alone"
timeout 100 $R bench kernel --backend cuda --type Q4_K --shape 2048x2048 2>&1 | grep "^read bandwidth\|^decode attention" | keep
# Decode's q8 expert kernels (the default since session 41) at 10 and 512 a call: the
# latency-bound decode shape and the kernels' ceiling with every SM busy.
for k in 10 512; do
    step "bench expert (layer 0, 512 distinct, $k a call)"
    timeout 100 $R bench expert --backend cuda -m $FULL --layer 0 --distinct 512 --per-call $k -n 20 2>&1 | quiet | tail -4 | keep
done
step "full-size verify cost"
timeout 100 $R spec-bench verify --backend cuda -m $FULL --ks 1,3,7,15 --reps 5 --context 16 2>&1 | tail -5 | keep
head -60 "$(python3 -c 'import colorsys; print(colorsys.__file__)')" >$W/colorsys_60.py
step "demo file rewrite on the GPU"
timeout 200 $R spec-bench rewrite --backend cuda -m models/redlite-demo.gguf -f $W/colorsys_60.py \
    --modes lookup,mtp,both --rounds 3 2>&1 | grep "^| " | keep
step "demo verify cost on the GPU"
timeout 100 $R spec-bench verify --backend cuda -m models/redlite-demo.gguf --ks 1,2,3,7 --reps 20 --context 900 2>&1 |
    tail -6 | keep
step "sampled generation with and without speculation (demo)"
spec_sampled_check $R models/redlite-demo.gguf | keep
step "done"
