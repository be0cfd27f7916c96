# Shell functions the GPU-machine scripts share (bench/gpu.sh, gpu_cache.sh, gpu_check.sh);
# source it from the repository root.

# libnvrtc (13.x) on LD_LIBRARY_PATH: the toolkit's, else the pip package's (nvidia/cu13/lib).
use_nvrtc() {
    local d
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
        "$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))' 2>/dev/null)"; do
        if [ -n "$d" ] && ls "$d"/libnvrtc.so* >/dev/null 2>&1; then
            export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
            return 0
        fi
    done
    return 1
}

# ncu_summary CSV [ROWS]: ncu's gpu__time_duration.sum per kernel name of one profiled step, as
# a Markdown table, heaviest first.
ncu_summary() {
    python3 - "$1" "${2:-18}" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows:
    sys.exit("ncu wrote no kernel rows")
head, rows = rows[0], rows[1:]
ki, mi, vi, ui = (head.index(c) for c in ("Kernel Name", "Metric Name", "Metric Value", "Metric Unit"))
tot, cnt = collections.Counter(), collections.Counter()
unit = "?"
for r in rows:
    if r[mi] == "gpu__time_duration.sum":
        name = r[ki].split("(")[0]
        tot[name] += float(r[vi].replace(",", "")); cnt[name] += 1; unit = r[ui]
s = sum(tot.values())
print(f"one decode step: {sum(cnt.values())} kernels, {s:.0f} {unit} of kernel time")
print("| kernel | launches | total | share |")
print("|---|---|---|---|")
for k, v in tot.most_common(int(sys.argv[2])):
    print(f"| {k} | {cnt[k]} | {v:.0f} {unit} | {100*v/s:.1f}% |")
PY
}

# device_env W: libnvrtc on the path, work folder W, the kernel cache inside it.
device_env() {
    use_nvrtc || echo "warning: no libnvrtc found"
    mkdir -p "$1"
    export REDLITE_CUDA_CACHE="$1/cache"
}

# unxz_py SRC DST: xz-decompress with Python's lzma (the GPU machines have no xz tool).
unxz_py() { python3 -c 'import lzma, sys; open(sys.argv[2], "wb").write(lzma.open(sys.argv[1]).read())' "$1" "$2"; }

# pack_device DIR NAME:PATH...: fill DIR (git-ignored, under .device/) for a GPU run: each binary
# PATH stripped and xz-compressed as DIR/NAME.xz, the Qwen3 vocabulary (xz), and the parity
# fixtures (tiny Q4_K_M, IQ2_XXS, CF2 models and their exact logits of prompts 1 and 2), also
# xz-compressed (the P3 logits, 1 MB each, stay home: the parity reads what the pack holds), so
# that a pack with the test binaries and a few kernel cubins stays inside the 64 MiB a run carries
# beside the tracked files. Run here, from the repository root, with ../shared beside it.
pack_device() {
    local dir=$1 ref=../shared/reference pair m f
    shift
    rm -rf "$dir" && mkdir -p "$dir/fixtures/logits" "$dir/fixtures/models" || return 1
    for pair in "$@"; do
        cp "${pair#*:}" "$dir/${pair%%:*}" && strip "$dir/${pair%%:*}" && xz -9 -T2 "$dir/${pair%%:*}" || return 1
    done
    xz -9 -c "$ref/tokenizer/qwen3-vocab.gguf" >"$dir/qwen3-vocab.gguf.xz" || return 1
    cp "$ref/logits/index.json" "$dir/fixtures/logits/" || return 1
    # FIXTURES=0: no fixture models or logits (≈ 14 MB), for a pack of many kernel cubins.
    for m in Q4_K_M IQ2_XXS CF2; do
        [ "${FIXTURES:-1}" = 0 ] && break
        xz -9 -T2 -c "$ref/models/tiny-$m.gguf" >"$dir/fixtures/models/tiny-$m.gguf.xz" || return 1
        for f in "$ref"/logits/"$m"__P[12]__exact.bin; do
            xz -9 -T2 -c "$f" >"$dir/fixtures/logits/$(basename "$f").xz" || return 1
        done
    done
    du -sh "$dir"
}

# pack_cubins DIR NVRTC_COMPILE [DEFINES...]: the kernel module compiled here for each define set
# (REDLITE_CUDA_DEFINES syntax; "" for the default) by the nvrtc_compile test binary's
# warm_module_cache, each cubin xz-compressed into DIR/cubin/, so that the GPU machine does not
# spend a minute of device time a set compiling. The cache key holds NVRTC's version: compile with
# the GPU machines' (13.0: `pip download nvidia-cuda-nvrtc==13.0.88`, its nvidia/cu13/lib on
# LD_LIBRARY_PATH). Modules already in CUBIN_CACHE (default /tmp/redlite-cubins) are not compiled
# again.
pack_cubins() {
    local dir=$1 nc=$2 cache=${CUBIN_CACHE:-/tmp/redlite-cubins} defs line c
    shift 2
    mkdir -p "$dir/cubin" "$cache" || return 1
    for defs in "$@"; do
        line=$(REDLITE_CUDA_DEFINES="$defs" REDLITE_CUDA_CACHE=$cache "$nc" warm_module_cache --ignored --nocapture 2>&1 |
            grep "\.cubin (")
        c=${line%% (*}
        [ -f "$c" ] || { echo "compiling the kernel module with '$defs' failed"; return 1; }
        xz -9 -T2 -c "$c" >"$dir/cubin/$(basename "$c").xz" || return 1
        echo "cubin for '$defs': $(basename "$c") (${line#* (}"
    done
}

# unpack_ab DEV W: gpu_ab.sh's packed binaries (redlite and the GPU test binaries) and the Qwen3
# vocabulary from DEV into the work folder W, with device_env's setup.
unpack_ab() {
    local dev=$1 w=$2 b
    device_env "$w"
    unpack_fixtures "$dev" "$w"
    for b in redlite expert_cache_gpu verify_gpu mtp_gpu; do
        # A pack may leave the test binaries out (the 64 MiB a run carries); their steps then say so.
        [ -f "$dev/$b.xz" ] || continue
        unxz_py "$dev/$b.xz" "$w/$b" && chmod +x "$w/$b"
    done
    [ -f "$w/vocab.gguf" ] || unxz_py "$dev/qwen3-vocab.gguf.xz" "$w/vocab.gguf"
}

# unpack_fixtures DEV W: the pack's kernel cubins (pack_cubins) into W's module cache, and its
# fixtures into W/fixtures when they travel xz-compressed (pack_device); sets FX to the fixtures'
# folder (DEV/fixtures for a pack of plain files).
unpack_fixtures() {
    local dev=$1 w=$2 f d
    mkdir -p "$w/cache"
    for f in "$dev"/cubin/*.xz; do
        [ -f "$f" ] || continue
        d="$w/cache/$(basename "${f%.xz}")"
        [ -f "$d" ] || unxz_py "$f" "$d"
    done
    FX=$dev/fixtures
    ls "$dev"/fixtures/models/*.xz >/dev/null 2>&1 || return 0
    FX=$w/fixtures
    mkdir -p "$FX/logits" "$FX/models"
    cp "$dev/fixtures/logits/index.json" "$FX/logits/"
    for f in "$dev"/fixtures/logits/*.xz "$dev"/fixtures/models/*.xz; do
        d="$FX/${f#"$dev"/fixtures/}"
        d=${d%.xz}
        [ -f "$d" ] || unxz_py "$f" "$d"
    done
}

# ab_setup DEV LOGNAME: the GPU scripts' common start: unpack_ab into W=/tmp/redlite-ab, R (the
# binary), FULL (the full-size layout's path), LOGS (OUT or DEV/out), and step / keep appending to
# LOGS/LOGNAME.
ab_setup() {
    W=/tmp/redlite-ab
    unpack_ab "$1" $W
    LOGS=${OUT:-$1/out}
    mkdir -p "$LOGS"
    R=$W/redlite
    FULL=$W/full.gguf
    LOG="$LOGS/$2"
}
step() { echo "== $* ($(date -u +%T))" | tee -a "$LOG"; }
# pack_logs: every file in $LOGS but the summary $LOG into one logs.tar.gz there (the device tool
# brings back at most 8 files from $OUT, so a run with many logs lost its summary).
pack_logs() {
    local d=$LOGS f
    f=$(basename "$LOG")
    (cd "$d" && find . -maxdepth 1 -type f ! -name "$f" ! -name logs.tar.gz -printf '%f\n' | tar czf logs.tar.gz -T - &&
        find . -maxdepth 1 -type f ! -name "$f" ! -name logs.tar.gz -delete)
}
keep() { tee -a "$LOG"; }

# spec_sampled_check R MODEL: `generate --backend cuda` with sampling (on the GPU's sampler, then
# with a repeat penalty: the host's) under --spec off / lookup / mtp / both, same seed: the ids
# of each mode must equal --spec off's (speculative sampling draws as plain generation does).
spec_sampled_check() {
    local r=$1 model=$2 pen sp base out
    for pen in 1.0 1.1; do
        base=
        for sp in off lookup mtp both; do
            out=$(timeout 120 "$r" generate --backend cuda -m "$model" -p "def rgb_to_hsv(r, g, b):" -n 200 \
                --temp 0.8 --top-k 40 --seed 7 --repeat-penalty $pen --ignore-eos --print-ids --spec $sp 2>&1 |
                grep "^\[[0-9,]*\]$")
            [ -n "$out" ] || { echo "sampled, repeat penalty $pen, --spec $sp: FAILED (no ids)"; continue; }
            [ -z "$base" ] && base=$out
            if [ "$out" = "$base" ]; then echo "sampled, repeat penalty $pen, --spec $sp: same as off"; else echo "sampled, repeat penalty $pen, --spec $sp: DIFFERS from off"; fi
        done
    done
}
