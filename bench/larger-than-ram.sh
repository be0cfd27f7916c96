#!/usr/bin/env bash
# redlite (bounded expert cache, misses read with O_DIRECT) against llama.cpp `--repack 0` (weights
# in the mmap) on a GGUF file larger than RAM, same file and threads, one after the other. Before
# each run the file's pages are dropped from the page cache (posix_fadvise DONTNEED), so every run
# starts cold; the load average and available RAM are printed around each run.
#
#   bench/larger-than-ram.sh MODEL
#
# Environment:
#   ORDER    runs in order (default "red llama rednp"): red = redlite, rednp = redlite
#            --no-prefetch, llama = llama.cpp through bench/llamacpp_bench.py --no-repack
#   N        timed decode steps after an 8-token prompt (default 32)
#   MEMORY   redlite's --memory budget (default 18GiB; the plan's remainder is the expert cache)
#   THREADS  threads for both (default 2)
#   REDLITE  the redlite binary (default target/release/redlite)
set -euo pipefail
cd "$(dirname "$0")/.."
F=${1:?usage: bench/larger-than-ram.sh MODEL}
N=${N:-32}
MEMORY=${MEMORY:-18GiB}
THREADS=${THREADS:-2}
REDLITE=${REDLITE:-target/release/redlite}

evict() {
    python3 -c "import os,sys; fd=os.open(sys.argv[1], os.O_RDONLY); os.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED); os.close(fd)" "$F"
}
state() {
    echo "   $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg) | RAM available $(free -m | awk '/Mem/{print $7}') MiB"
}
redlite() {
    evict
    echo "== redlite --memory $MEMORY $*"
    state
    "$REDLITE" bench decode -m "$F" -t "$THREADS" -n "$N" -p 8 --bw-mib 64 --bw-runs 1 --memory "$MEMORY" "$@" 2>&1 \
        | grep -E "^cpu|^backend|expert cache:|^routing"
    state
}
llama() {
    evict
    echo "== llama.cpp --repack 0"
    state
    python3 bench/llamacpp_bench.py "$F" --threads "$THREADS" -n "$N" -p 8 --decode-prompt 8 --no-repack \
        | grep -E "decode_tok|median_tok"
    state
}
for run in ${ORDER:-red llama rednp}; do
    case $run in
        red) redlite ;;
        rednp) redlite --no-prefetch ;;
        llama) llama ;;
        *) echo "unknown run '$run' (red, rednp, llama)" >&2; exit 2 ;;
    esac
done
