#!/usr/bin/env bash
# A/B of decode configurations on the GPU machine, with the correctness checks first: what
# session 19's run scripts did, kept so that the next session does not write them again.
#
# Here (fills the git-ignored .device/ab/: redlite and the two GPU test binaries stripped and
# xz-compressed, the Qwen3 vocabulary, the parity fixtures (xz); ≈ 21 MB, inside the 64 MiB a run
# carries with the ≈ 38 MB of tracked files, with room for a few cubins of 1.5 MB):
#   CARGO_TARGET_DIR=/work/target-cuda cargo build --release -p redlite --features cuda
#   CARGO_TARGET_DIR=/work/target-cuda cargo test --release -p redlite-cuda --features cuda --no-run
#   T=/work/target-cuda/release bench/gpu_ab.sh prepare
# (NVRTC_LIB=<NVRTC 13.0's lib folder> CONFIGS="…" also compiles the kernel module here for the
# default and each config's defines, ≈ 2 minutes each, and packs the cubins: see pack_cubins.)
# There (`run` with `carry: [".device/ab"]`):
#   CONFIGS="REDLITE_CUDA_X=0 REDLITE_CUDA_DEFINES=FOO=0" ROUNDS=3 OUT=$OUT bash bench/gpu_ab.sh
# CONFIGS: space-separated, each a comma-separated list of VAR=VALUE set for that config (several
# kernel defines in one config: REDLITE_CUDA_DEFINES=A=1;B=2)
# (REDLITE_CUDA_DEFINES=… recompiles the kernels on the GPU once, ≈ 70 s, unless prepare packed its
# cubin). Steps, each logged to
# $OUT/summary.txt as it ends: make-model of the full-size layout (background); the self-test
# with fixture parity and `--step` (default, then each config); `verify_gpu` and
# `expert_cache_gpu` per config; the full-size logits of 27 steps per config against the
# default's (`cmp`, then KL per step when they differ: the random full-size layout is chaotic,
# so only bit-identical changes compare there); ROUNDS rounds of `bench decode -p 8 -n 128`
# alternating default and configs, with medians; TRACE=1 the phase trace of the default;
# POS=32768 a decode at that position, default and each config (POS_ROUNDS rounds alternating,
# medians); CHECK_CONFIGS (as CONFIGS, with "default"): the configs the checks run for (all by
# default); KSWEEP=1 `bench kernel` of decode's dense shapes over row splits (KSPLITS); KNCU=1 ncu sections of the dense decode kernel in `bench kernel` (Q6_K head, Q4_K
# 12288x2048); VKNOCK=1 the default's 8-row verify with kernels left out (REDLITE_CUDA_SKIP); VERIFY=1 the full-size verify
# cost (2 / 4 / 8 / 16 rows against a step), default and each config. SPEC=1 (after the default's
# checks): the MTP drafts against the oracle (`mtp_gpu`), the demo model's file rewrite with
# every draft source (`spec-bench rewrite --backend cuda`, SPEC_ROUNDS rounds) and its verify
# cost; SPEC_CONFIGS (as CONFIGS) adds MTP-only rewrites alternating the default with each config.
# SPEC_TRACE=1 (with SPEC=1): the demo verify's phase trace (REDLITE_TRACE build, one NVRTC compile).
# A wrapper that runs its own commands after this script calls `device_env /tmp/redlite-ab`
# (bench/device_lib.sh) first: without the module cache and libnvrtc in its environment each
# command compiles the kernels again (minutes; session 32's `bench kernel` lines timed out so).
# ROUNDS=0 and no CONFIGS: no full-size layout is made. The `bench` and `generate` commands' cache is
# f16 on the GPU by default (session 25), the test binaries' and the self-test's parity f32; set
# REDLITE_KV_TYPE in a config to pin both.
set -uo pipefail
cd "$(dirname "$0")/.."
DEV=${DEV:-.device/ab}

if [ "${1:-}" = "prepare" ]; then
    T=${T:-target/release}
    pick() { ls -t "$T"/deps/"$1"-* | grep -v '\.d$' | head -1; }
    . bench/device_lib.sh
    pack_device "$DEV" "redlite:$T/redlite" "verify_gpu:$(pick verify_gpu)" "expert_cache_gpu:$(pick expert_cache_gpu)" "mtp_gpu:$(pick mtp_gpu)" || exit 1
    # The kernel module for the default and for each config's REDLITE_CUDA_DEFINES, compiled here
    # (with NVRTC_LIB: the GPU machines' NVRTC 13.0 library folder; without it the GPU compiles).
    if [ -n "${NVRTC_LIB:-}" ]; then
        sets=("")
        for cfg in ${CONFIGS:-}; do
            IFS=, read -ra kvs <<<"$cfg"
            for kv in "${kvs[@]}"; do
                case $kv in REDLITE_CUDA_DEFINES=*) sets+=("${kv#REDLITE_CUDA_DEFINES=}") ;; esac
            done
        done
        LD_LIBRARY_PATH="$NVRTC_LIB:${LD_LIBRARY_PATH:-}" pack_cubins "$DEV" "$(pick nvrtc_compile)" "${sets[@]}" || exit 1
        du -sh "$DEV"
    fi
    exit
fi

. bench/device_lib.sh
ab_setup "$DEV" summary.txt
# with CFG CMD...: CMD with config CFG's variables set ("default": none).
with() {
    local cfg=$1
    shift
    if [ "$cfg" = default ]; then "$@"; else (IFS=,; for kv in $cfg; do export "$kv"; done; "$@"); fi
}
ALL="default ${CONFIGS:-}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | keep
FULLSIZE=1
[ "${ROUNDS:-3}" = 0 ] && [ -z "${CONFIGS:-}" ] && FULLSIZE=0
mm=
if [ $FULLSIZE = 1 ]; then
    [ -f $FULL ] || ($R make-model $FULL --vocab $W/vocab.gguf --force >"$LOGS/make_model.log" 2>&1) &
    mm=$!
fi
i=0
for cfg in ${CHECK_CONFIGS:-$ALL}; do
    step "self-test + parity [$cfg]"
    with "$cfg" timeout 200 $R selftest --backend cuda --fixtures "$FX" --step >"$LOGS/selftest$i.log" 2>&1
    grep -h "^selftest:\|^kernels:\|FAIL\|^error\|panicked" "$LOGS/selftest$i.log" | head -20 | keep
    sed -n '/^fixture parity/,/^$/p' "$LOGS/selftest$i.log" | keep
    step "verify_gpu + expert_cache_gpu [$cfg]"
    for t in verify_gpu expert_cache_gpu; do
        [ -x "$W/$t" ] || { echo "$t: not in this pack, skipped" | keep; continue; }
        with "$cfg" env REDLITE_TEST_MODELS="$FX/models" timeout 120 $W/$t --ignored --nocapture 2>&1 |
            grep -h -A1 "test result\|panicked" | tail -4 | keep
    done
    if [ $i = 0 ] && [ -n "${SPEC:-}" ]; then
        step "mtp_gpu (GPU MTP drafts against the oracle)"
        REDLITE_TEST_MODELS="$FX/models" REDLITE_DEMO_MODEL=models/redlite-demo.gguf \
            timeout 200 $W/mtp_gpu --ignored --nocapture 2>&1 | grep -h -A1 "test result\|panicked\|drafts equal\|plain decoding" | keep
        head -60 "$(python3 -c 'import colorsys; print(colorsys.__file__)')" >$W/colorsys_60.py
        step "demo file rewrite on the GPU"
        timeout 300 $R spec-bench rewrite --backend cuda -m models/redlite-demo.gguf -f $W/colorsys_60.py \
            --modes lookup,mtp,both --rounds "${SPEC_ROUNDS:-3}" >"$LOGS/rewrite.log" 2>&1
        grep -v "^round" "$LOGS/rewrite.log" | tail -12 | keep
        # SPEC_CONFIGS: MTP rewrites alternating the default with each config (SPEC_ROUNDS each).
        for round in $(seq "${SPEC_ROUNDS:-3}"); do
            for sc in ${SPEC_CONFIGS:+default ${SPEC_CONFIGS}}; do
                step "demo MTP rewrite round $round [$sc]"
                with "$sc" timeout 200 $R spec-bench rewrite --backend cuda -m models/redlite-demo.gguf \
                    -f $W/colorsys_60.py --modes mtp --rounds 1 2>&1 | grep -i "mtp\|plain\|off " | tail -3 | keep
            done
        done
        step "sampled generation with and without speculation (demo)"
        spec_sampled_check $R models/redlite-demo.gguf | keep
        for sc in default ${SPEC_CONFIGS:-}; do
            step "demo verify cost on the GPU [$sc]"
            with "$sc" timeout 120 $R spec-bench verify --backend cuda -m models/redlite-demo.gguf --ks 1,2,3,7 --reps 20 \
                --context 900 2>&1 | tail -6 | keep
        done
        if [ -n "${SPEC_TRACE:-}" ]; then
            step "demo verify phase trace (REDLITE_TRACE build)"
            REDLITE_CUDA_DEFINES=REDLITE_TRACE timeout 200 $R spec-bench verify --backend cuda -m models/redlite-demo.gguf \
                --ks 1,3 --reps 20 --context 900 >"$LOGS/spec_trace.log" 2>&1
            grep "^trace\|rows\|rror\|panick" "$LOGS/spec_trace.log" | head -60 | keep
        fi
    fi
    i=$((i + 1))
done
[ $FULLSIZE = 1 ] || { step "done"; exit; }
wait $mm
IDS=9707,11,1879,374,264,1273,315,279,13,576,3974,13876,38835,34208,916,279,15678,5562,13,1597,1052,374,2494,1008,11,2441,0
step "full-size logits of 27 steps, each config against the default"
i=0
for cfg in $ALL; do
    # 300 s: a config's first call may compile the kernel module (a minute), as the default's
    # did in session 27's run 4 when only a define's config had been checked before.
    with "$cfg" timeout 300 $R logits --backend cuda --mode step -m $FULL --ids $IDS --out $W/lg$i.bin >/dev/null 2>"$LOGS/logits$i.err"
    if [ $i -gt 0 ] && cmp -s $W/lg0.bin $W/lg$i.bin; then
        echo "[$cfg] bit-identical to the default ($(stat -c %s $W/lg$i.bin) bytes)" | keep
    elif [ $i -gt 0 ]; then
        python3 - $W/lg0.bin $W/lg$i.bin "$cfg" <<'PY' | keep
import sys, numpy as np
a, b = (np.fromfile(f, dtype=np.float32).reshape(-1, 151936).astype(np.float64) for f in sys.argv[1:3])
lsm = lambda x: (x - x.max(1, keepdims=True)) - np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True))
pa, pb = lsm(a), lsm(b)
kl = (np.exp(pa) * (pa - pb)).sum(1)
print(f"[{sys.argv[3]}] differs: KL per step " + " ".join(f"{v:.1e}" for v in kl)
      + f"; argmax equal {(a.argmax(1) == b.argmax(1)).sum()}/{len(kl)}")
PY
    fi
    i=$((i + 1))
done
# medians HEADER LABEL: the medians of the `cuda` lines after each "== HEADER [config]" step line of
# the summary (HEADER a regular expression), per config, against the default's.
medians() {
    python3 - "$LOGS/summary.txt" "$1" "$2" <<'PY' | keep
import re, statistics, sys
cur, runs = None, {}
for line in open(sys.argv[1]):
    m = re.match(r"== " + sys.argv[2] + r" \[(.*)\]", line)
    if m:
        cur = m.group(1)
    elif cur and line.startswith("cuda "):
        runs.setdefault(cur, []).append(float(line.split()[3]))
        cur = None
base = statistics.median(runs.get("default", [0])) or 1
for cfg, v in runs.items():
    print(f"{sys.argv[3]}median {cfg}: {statistics.median(v):.2f} tok/s ({100 * (statistics.median(v) / base - 1):+.1f} %), runs {' / '.join(f'{x:.2f}' for x in v)}")
PY
}
dec() { with "$1" timeout 120 $R bench decode --backend cuda -m $FULL -p 8 -n 128 "${@:2}" 2>&1 | grep "^cuda \|launches\|rror\|panick"; }
for round in $(seq "${ROUNDS:-3}"); do
    for cfg in $ALL; do
        step "round $round [$cfg]"
        dec "$cfg" | keep
    done
done
medians "round \\d+" ""
if [ -n "${TRACE:-}" ]; then
    step "trace (default)"
    REDLITE_CUDA_DEFINES=REDLITE_TRACE timeout 200 $R bench decode --backend cuda -m $FULL -p 8 -n 128 >"$LOGS/trace.log" 2>&1
    grep "^trace" "$LOGS/trace.log" | keep
fi
if [ -n "${VERIFY:-}" ]; then
    for cfg in $ALL; do
        step "full-size verify cost [$cfg]"
        with "$cfg" timeout 150 $R spec-bench verify --backend cuda -m $FULL --ks 1,3,7,15 --reps 5 --context 16 2>&1 |
            tail -6 | keep
    done
fi
if [ -n "${VKNOCK:-}" ]; then
    # Knock-outs of the default's 8-row verify pass on the graphed chain (REDLITE_CUDA_SKIP leaves a
    # launch and its work out; timing only): the routed experts, every q8x product (in-projections,
    # shared expert, head), the DeltaNet rows, the output projections (session 59's figures:
    # docs/speculative.md "Where the 8-row verify goes").
    for skip in none moe_gate_up_tab_q8q,moe_gate_up_tok_q8q,moe_down_combine_tok matvec_q8x dn_fused_cols_rows \
        matvec_res_xr_q4_k; do
        step "8-row verify, REDLITE_CUDA_SKIP=$skip"
        [ "$skip" = none ] && skip=
        REDLITE_CUDA_SKIP=$skip timeout 100 $R spec-bench verify --backend cuda -m $FULL --ks 7 --reps 5 \
            --context 16 2>&1 | tail -1 | keep
    done
fi
if [ -n "${POS:-}" ]; then
    for round in $(seq "${POS_ROUNDS:-1}"); do
        for cfg in $ALL; do
            step "position $POS round $round [$cfg]"
            with "$cfg" timeout 150 $R bench decode --backend cuda -m $FULL -p 8 -n 64 --position "$POS" 2>&1 | grep "^cuda\|rror" | keep
        done
    done
    medians "position \\d+ round \\d+" "position "
fi
if [ -n "${KSWEEP:-}" ]; then
    # bench kernel over row splits (--split LANE_ITERS:ROWS) of decode's dense shapes.
    for ts in Q6_K:151936x2048 Q4_K:12288x2048 Q4_K:2048x4096; do
        step "bench kernel $ts over splits"
        for sp in ${KSPLITS:-1:1 2:1 4:1 8:1 1:2 2:2 4:2 8:2 1:4 2:4 4:4 8:4 4:8}; do
            timeout 60 $R bench kernel --backend cuda --type ${ts%%:*} --shape ${ts#*:} --split $sp 2>&1 |
                grep "^Q\|^read bandwidth" | sed "s/^/split $sp: /" | keep
        done
    done
fi
if [ -n "${KNCU:-}" ]; then
    # ncu's speed of light, memory and warp-state sections of the dense decode kernel on the kernel
    # bench's random matrices (one launch after ten, serialised, caches flushed).
    for ts in Q6_K:151936x2048 Q4_K:12288x2048; do
        step "ncu of bench kernel ${ts}"
        timeout 200 ncu --kernel-name regex:matvec_q8x --launch-skip 10 --launch-count 1 --section SpeedOfLight \
            --section MemoryWorkloadAnalysis --section WarpStateStats --section ComputeWorkloadAnalysis \
            $R bench kernel --backend cuda --type ${ts%%:*} --shape ${ts#*:} >"$LOGS/kncu_${ts%%:*}.txt" 2>&1
        grep -E "Duration|Throughput|Busy|Bandwidth|Hit Rate|Stall|Issued|Eligible|Active Warps|Mem Pipes|wavefront|Registers" \
            "$LOGS/kncu_${ts%%:*}.txt" | head -40 | keep
    done
fi
step "done"
pack_logs
