#!/usr/bin/env bash
# The demo model's MTP passes on the GPU machine (after gpu_ab.sh, whose unpacked binaries in
# /tmp/redlite-ab it reuses). DRAFTS="2 3 4": the file rewrite with each MTP draft length
# (--spec-mtp-draft), ROUNDS rounds alternating; NCU=1: ncu kernel times of a decode step, a 4-
# and an 8-row verify pass and an MTP draft, kernels by name, heaviest first (where a verify row
# and a draft go: docs/speculative.md).
#   (gpu_ab.sh ...); DRAFTS="3 4 5" NCU=1 OUT=$OUT bash bench/gpu_demo_spec.sh
# FULL=1: the profiles on the full-size layout instead (made here if gpu_ab.sh has not; no MTP
# draft profile: the layout has no MTP block), e.g. where an 8-row verify's time goes:
#   FULL=1 NCU=1 NCU_ROWS=30 bash bench/gpu_demo_spec.sh   (after `gpu_ab.sh prepare` here)
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/device_lib.sh
W=/tmp/redlite-ab
[ -x $W/redlite ] || unpack_ab .device/ab $W
device_env $W
R=$W/redlite
LOGS=$W  # the csv files stay here: the run returns a limited number of files
M=models/redlite-demo.gguf
if [ -n "${FULL:-}" ]; then
    M=$W/full.gguf
    [ -f $M ] || timeout 300 $R make-model $M --vocab $W/vocab.gguf --force >/dev/null 2>&1
fi
head -60 "$(python3 -c 'import colorsys; print(colorsys.__file__)')" >$W/colorsys_60.py
for round in $(seq "${ROUNDS:-3}"); do
    for k in ${DRAFTS:-}; do
        echo "== MTP rewrite, $k drafts a pass, round $round"
        timeout 100 $R spec-bench rewrite --backend cuda -m $M -f $W/colorsys_60.py --modes mtp --rounds 1 \
            --spec-mtp-draft $k 2>&1 | grep "| Off\|| Mtp"
    done
done
[ -n "${NCU:-}" ] || exit 0
command -v ncu >/dev/null || { echo "no ncu"; exit 1; }
prof() {
    local name=$1
    shift
    timeout 200 ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv "$@" \
        >"$LOGS/ncu_$name.csv" 2>"$LOGS/ncu_$name.err"
    echo "== ncu: $name"
    ncu_summary "$LOGS/ncu_$name.csv" "${NCU_ROWS:-16}"
}
prof decode $R bench decode --backend cuda --no-graphs --profile-step 3 -m $M -p 900 -n 6
for k in 3 7; do
    REDLITE_CUDA_SMALL_GRAPHS=0 REDLITE_CUDA_PROFILE_VERIFY=2 prof verify$((k + 1)) \
        $R spec-bench verify --backend cuda -m $M --ks $k --reps 2 --context 900
done
# The 20th MTP draft of the demo's file rewrite (eager: the profiled draft skips its graph).
[ -z "${FULL:-}" ] || exit 0
REDLITE_CUDA_PROFILE_DRAFT=20 prof draft $R spec-bench rewrite --backend cuda -m $M -f $W/colorsys_60.py --modes mtp --rounds 1
