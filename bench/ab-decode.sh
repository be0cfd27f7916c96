#!/usr/bin/env bash
# A/B of `redlite bench decode` between binaries, alternating, on a shared (noisy) machine.
#
#   bench/ab-decode.sh ROUNDS LABEL=BINARY [LABEL=BINARY ...]
#
# Each round runs every binary once, in the order given (A B A B ...), and prints per run: decode
# tok/s (mean over the steps), the median step in ms, the process's user and sys CPU seconds
# (the whole run: load, prompt and decode), wall seconds and the 1-minute load average. A final
# line per label gives the medians. Copy the old binary aside before rebuilding (binaries under
# target/ are overwritten by the next build). Environment: ARGS (default: 8-layer file, 2
# threads, 96 steps), e.g. ARGS="-m FILE -t 2 -n 96 -p 8 --bw-mib 64 --bw-runs 1".
set -euo pipefail
ROUNDS=${1:?usage: bench/ab-decode.sh ROUNDS LABEL=BINARY [LABEL=BINARY ...]}
shift
ARGS=${ARGS:-"-m /work/l8.gguf -t 2 -n 96 -p 8 --bw-mib 64 --bw-runs 1"}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
for _ in $(seq "$ROUNDS"); do
    for spec in "$@"; do
        label=${spec%%=*}
        bin=${spec#*=}
        # shellcheck disable=SC2086
        /usr/bin/time -f "%U %S %e" -o "$TMP/time" "$bin" bench decode $ARGS --json > "$TMP/out.json"
        python3 - "$label" "$TMP/out.json" "$TMP/time" "$TMP/all.tsv" <<'PY'
import json, os, sys
label, out, tm, tsv = sys.argv[1:]
d = json.load(open(out))
user, sys_, wall = open(tm).read().split()[-3:]
load = os.getloadavg()[0]
row = [label, f"{d['tok_per_s']:.2f}", f"{d['median_step_ms']:.2f}", user, sys_, wall, f"{load:.2f}"]
print("{:8} tok/s {:>8}  median step {:>8} ms  user {:>6} s  sys {:>5} s  wall {:>6} s  load {}".format(*row))
open(tsv, "a").write("\t".join(row) + "\n")
PY
    done
done
python3 - "$TMP/all.tsv" <<'PY'
import statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])]
for label in dict.fromkeys(r[0] for r in rows):
    rs = [r for r in rows if r[0] == label]
    med = lambda i: statistics.median(float(r[i]) for r in rs)
    print(f"median {label:8} tok/s {med(1):.2f}  step {med(2):.2f} ms  user {med(3):.2f} s  sys {med(4):.2f} s  ({len(rs)} runs)")
PY
