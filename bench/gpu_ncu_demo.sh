#!/usr/bin/env bash
# ncu kernel times of the demo model's decode step and verify passes on the GPU machine (after
# gpu_ab.sh, whose unpacked binaries in /tmp/redlite-ab it reuses): one table per pass, kernels
# by name, heaviest first. Where a verify row's time goes (docs/speculative.md).
#   (gpu_ab.sh ...); OUT=$OUT bash bench/gpu_ncu_demo.sh
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/device_lib.sh
W=/tmp/redlite-ab
device_env $W
R=$W/redlite
LOGS=${OUT:-/tmp}
command -v ncu >/dev/null || { echo "no ncu"; exit 1; }
M=models/redlite-demo.gguf
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
