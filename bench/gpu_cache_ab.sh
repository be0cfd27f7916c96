#!/usr/bin/env bash
# The #7 deciding numbers, A/B: on the full-size layout (Q4_K dense, IQ2_XXS experts, Q6_K head) at
# uniform and at skewed routing, `bench decode --backend cuda --memory 16GiB --cache-policy lfu`,
# alternating the new build with the old one (A B A B), then all experts resident (new).
# Uses the binaries packed by `bench/gpu_check.sh prepare` (`run` with `carry: [".device/check"]`):
#   OUT=$OUT bash bench/gpu_cache_ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
DEV=${DEV:-.device/check}
LOGS=${OUT:-$DEV/out}
mkdir -p "$LOGS"
. bench/device_lib.sh
W=/tmp/redlite-ab
device_env $W
for b in redlite redlite-old; do unxz_py "$DEV/$b.xz" $W/$b && chmod +x $W/$b; done
unxz_py "$DEV/qwen3-vocab.gguf.xz" $W/vocab.gguf
FULL=$W/full.gguf
keep() { tee -a "$LOGS/summary.txt"; }
dec() {
    local bin=$1
    shift
    timeout 120 $bin bench decode --backend cuda -m $FULL -p 8 -n ${STEPS:-128} "$@" 2>&1 |
        grep "^cuda \|hit rate\|GPU memory\|rror\|panick"
}
for routing in ${ROUTINGS:-skewed uniform}; do
    flags=""
    [ $routing = skewed ] && flags="--routing-skew 0.5 --routing-locality 1"
    echo "== make-model, $routing routing ($(date -u +%T))" | keep
    $W/redlite make-model $FULL --vocab $W/vocab.gguf --force $flags 2>&1 | tail -1 | keep
    for round in 1 2; do
        for side in new old; do
            bin=$W/redlite
            [ $side = old ] && bin=$W/redlite-old
            echo "-- $routing, --memory 16GiB lfu, $side, round $round" | keep
            dec $bin --memory 16GiB --cache-policy lfu | keep
        done
    done
    echo "-- $routing, all resident, new" | keep
    dec $W/redlite | keep
done
rm -f $FULL
