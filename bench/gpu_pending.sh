#!/usr/bin/env bash
# The checks and A/Bs of the changes built without a GPU and waiting for a device run (session 53:
# IQ2_NIB; session 52: REDLITE_CUDA_Z_SIDE and the flat verify token tiles), in one call, most
# important first; every step logs to $OUT/summary.txt as it ends, so a cut run keeps what it did.
#
# Here (fills the git-ignored .device/pending/, ≈ 26.6 MB: inside the 64 MiB a run carries with the
# ≈ 38.3 MB of tracked files only because the fixtures and the kernel cubins travel xz-compressed and
# the P3 logits stay home):
#   CARGO_TARGET_DIR=/work/target-cuda cargo build --release -p redlite --features cuda
#   CARGO_TARGET_DIR=/work/target-cuda cargo test --release -p redlite-cuda --features cuda --no-run
#   LD_LIBRARY_PATH=<NVRTC 13.0 lib> T=/work/target-cuda/release bench/gpu_pending.sh prepare
# `prepare` compiles the kernel module here for each define set in CUBIN_DEFINES (with NVRTC 13.0, as
# the GPU machines have: the cubins' cache keys then match there, and no run spends a minute a
# config compiling), ≈ 2 minutes each.
# There (`run` with `carry: [".device/pending"]`):
#   OUT=$OUT bash bench/gpu_pending.sh            # ≈ 9–10 minutes
#   QUICK=1 NO_DEFAULT_CHECK=1 ROUNDS=2 VROUNDS=1 OUT=$OUT bash bench/gpu_pending.sh   # IQ2_NIB only
#   ULTRA=1 OUT=$OUT bash bench/gpu_pending.sh    # IQ2_NIB's exactness and first numbers (≈ 4 minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
PK=${PK:-.device/pending}
F="REDLITE_CUDA_DEFINES=DOWN_TOK_FLAT=1;GU_TOK_FLAT=1"
Z=REDLITE_CUDA_Z_SIDE=1
N=REDLITE_CUDA_DEFINES=IQ2_NIB=1

if [ "${1:-}" = "prepare" ]; then
    T=${T:-target/release}
    pick() { ls -t "$T"/deps/"$1"-* | grep -v '\.d$' | head -1; }
    . bench/device_lib.sh
    pack_device "$PK" "redlite:$T/redlite" "verify_gpu:$(pick verify_gpu)" "expert_cache_gpu:$(pick expert_cache_gpu)" || exit 1
    rm -f "$PK"/fixtures/logits/*P3__exact.bin
    for f in "$PK"/fixtures/logits/*.bin "$PK"/fixtures/models/*.gguf; do xz -9 -T2 "$f" || exit 1; done
    cache=$(mktemp -d)
    mkdir -p "$PK/cubin"
    for defs in "" "IQ2_NIB=1" "DOWN_TOK_FLAT=1;GU_TOK_FLAT=1"; do
        REDLITE_CUDA_DEFINES="$defs" REDLITE_CUDA_CACHE=$cache "$(pick nvrtc_compile)" warm_module_cache --ignored \
            --nocapture 2>&1 | grep "cubin" || { echo "compiling the module with '$defs' failed"; exit 1; }
    done
    for c in "$cache"/*.cubin; do xz -9 -T2 -c "$c" >"$PK/cubin/$(basename "$c").xz"; done
    rm -rf "$cache"
    du -sb "$PK"
    exit
fi

# There: the pack's cubins into the kernel cache and its fixtures into a DEV folder of
# bench/device_lib.sh's shape (the binaries linked), then ab_setup.
. bench/device_lib.sh
W=/tmp/redlite-ab
mkdir -p $W/cache $W/dev/fixtures/logits $W/dev/fixtures/models
for c in "$PK"/cubin/*.xz; do
    [ -f "$W/cache/$(basename "${c%.xz}")" ] || unxz_py "$c" "$W/cache/$(basename "${c%.xz}")"
done
for f in "$PK"/*.xz; do ln -sf "$PWD/$f" $W/dev/; done
cp "$PK"/fixtures/logits/index.json $W/dev/fixtures/logits/
for f in "$PK"/fixtures/logits/*.xz "$PK"/fixtures/models/*.xz; do
    d=${f#"$PK"/fixtures/}
    [ -f "$W/dev/fixtures/${d%.xz}" ] || unxz_py "$f" "$W/dev/fixtures/${d%.xz}"
done
DEV=$W/dev
ab_setup "$DEV" summary.txt
FX=$DEV/fixtures
with() { local cfg=$1; shift; if [ "$cfg" = default ]; then "$@"; else (IFS=,; for kv in $cfg; do export "$kv"; done; "$@"); fi; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | keep
($R make-model $FULL --vocab $W/vocab.gguf --force >"$LOGS/make_model.log" 2>&1) &
mm=$!
tests() { # CFG TEST...: the GPU test binaries, each test's line and the verify rows' messages
    local cfg=$1 t
    shift
    for t in "$@"; do
        step "$t [$cfg]"
        with "$cfg" env REDLITE_TEST_MODELS="$FX/models" timeout 150 $W/$t --ignored --nocapture 2>&1 |
            grep -h -A1 "verify rows = \|^test .* \.\.\. \|test result\|panicked" | grep -v "^--" | tail -24 | keep
    done
}
check() { # CFG TEST...: the self-test with fixture parity, then the tests
    local cfg=$1 log
    log="$LOGS/selftest-$(echo "$cfg" | tr -c 'A-Za-z0-9' _).log"
    step "self-test + parity [$cfg]"
    with "$cfg" timeout 200 $R selftest --backend cuda --fixtures "$FX" --step >"$log" 2>&1
    grep -h "^selftest:\|^kernels:\|FAIL\|^error\|panicked\|compiling" "$log" | head -12 | keep
    sed -n '/^fixture parity/,/^$/p' "$log" | keep
    tests "$@"
}
IDS=9707,11,1879,374,264,1273,315,279,13,576,3974,13876,38835,34208,916,279,15678,5562,13,1597,1052,374,2494,1008,11,2441,0
lg() { # CFG I: full-size logits of 27 steps, compared with the default's (I = 0)
    with "$1" timeout 300 $R logits --backend cuda --mode step -m $FULL --ids $IDS --out $W/lg$2.bin >/dev/null 2>"$LOGS/logits$2.err"
    [ "$2" = 0 ] && return
    if cmp -s $W/lg0.bin $W/lg$2.bin; then
        echo "[$1] full-size logits bit-identical to the default's ($(stat -c %s $W/lg$2.bin) bytes)" | keep
    else
        echo "[$1] full-size logits DIFFER ($(stat -c %s $W/lg0.bin) / $(stat -c %s $W/lg$2.bin) bytes); $(tail -2 $LOGS/logits$2.err)" | keep
    fi
}
dec() { with "$1" timeout 120 $R bench decode --backend cuda -m $FULL -p 8 -n 128 "${@:2}" 2>&1 | grep "^cuda \|launches\|rror\|panick"; }
ver() { with "$1" timeout 150 $R spec-bench verify --backend cuda -m $FULL --ks "${2:-1,3,7,15}" --reps 5 --context 16 2>&1 | grep "^|\|rror\|panick"; }
expert() { with "$1" timeout 100 $R bench expert --backend cuda -m $FULL --layer 0 --distinct 512 --per-call $2 -n 20 2>&1 |
    grep -v "^GPU 0\|^model on\|^device:\|^experts in" | tail -4; }

if [ -n "${ULTRA:-}" ]; then
    tests $N verify_gpu
    wait $mm
    tail -1 "$LOGS/make_model.log" | keep
    step "full-size logits [$N]"
    lg default 0
    lg $N 1
    for cfg in default $N; do step "bench expert 512 a call [$cfg]"; expert $cfg 512 | keep; done
    for cfg in default $N default $N; do
        step "round [$cfg]"; dec $cfg | keep
        step "verify [$cfg]"; ver $cfg 1,7 | keep
    done
    step done
    exit
fi
[ -n "${NO_DEFAULT_CHECK:-}" ] || check default
check $N verify_gpu
wait $mm
tail -1 "$LOGS/make_model.log" | keep
step "full-size logits against the default"
lg default 0
lg $N 1
for round in $(seq "${ROUNDS:-3}"); do
    for cfg in default $N $Z; do step "round $round [$cfg]"; dec "$cfg" | keep; done
done
for round in $(seq "${VROUNDS:-2}"); do
    for cfg in default $N "$F,REDLITE_CUDA_MOE_TOK=4:8" "$F"; do step "verify round $round [$cfg]"; ver "$cfg" | keep; done
done
for k in 10 512; do
    for cfg in default $N; do step "bench expert $k a call [$cfg]"; expert $cfg $k | keep; done
done
if [ -z "${QUICK:-}" ]; then
    lg $Z 2
    check $Z verify_gpu expert_cache_gpu
    check "$F,REDLITE_CUDA_MOE_TOK=4:8" verify_gpu
    for round in 1 2; do
        for cfg in default $Z REDLITE_CUDA_SKIP=dn:z_side; do step "round b$round [$cfg]"; dec "$cfg" | keep; done
    done
    for cfg in default $N $Z; do
        step "position 32768 [$cfg]"
        with "$cfg" timeout 150 $R bench decode --backend cuda -m $FULL -p 8 -n 64 --position 32768 2>&1 | grep "^cuda\|rror" | keep
    done
fi
python3 - "$LOG" <<'PY' | keep
import re, statistics, sys
cur, runs = None, {}
for line in open(sys.argv[1]):
    m = re.match(r"== (round b?\d+|position \d+) \[(.*)\]", line)
    if m:
        cur = ("position 32768 " if m.group(1).startswith("position") else "") + m.group(2)
    elif cur and line.startswith("cuda "):
        runs.setdefault(cur, []).append(float(line.split()[3]))
        cur = None
for k, v in runs.items():
    print(f"median {k}: {statistics.median(v):.2f} tok/s, runs {' / '.join(f'{x:.2f}' for x in v)}")
PY
step done
pack_logs
