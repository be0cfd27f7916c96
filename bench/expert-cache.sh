#!/usr/bin/env bash
# Decode speed and expert-cache hit rate against the cache size, on one GGUF file: a table
# (markdown) and a PNG plot (tok/s and hit rate vs cache size, one line per eviction policy).
#
#   bench/expert-cache.sh MODEL [OUT_DIR]
#
# Environment:
#   FRACTIONS  cache sizes as fractions of all routed-expert bytes (default
#              "min 0.05 0.1 0.2 0.35 0.5 0.75 all"; "min" is one expert per layer, "all" is every
#              expert resident, read in place from the memory map)
#   POLICIES   eviction policies to sweep (default "lru"; also lfu, layer-quota)
#   PREFETCH   cross-layer prefetch settings to sweep (default "on"; "on off" compares)
#   STEPS      timed decode steps (default 64)
#   PROMPT     prompt tokens before them (default 64: the prompt's pass warms the cache, so the
#              timed steps see a warm cache rather than its compulsory misses)
#   THREADS    threads (default 0: physical cores)
#   IO         "direct" (default: O_DIRECT, misses really hit the disk) or "buffered"
#   REPORT_ONLY=1  only rebuild the table and plot from OUT_DIR/runs
# Misses are read with O_DIRECT unless IO=buffered, so the page cache does not hide them; the
# unbounded point ("all") reads the memory map and so depends on what the page cache holds (the
# script does not drop caches). Timings are measurements, not pass/fail checks.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${1:?usage: bench/expert-cache.sh MODEL [OUT_DIR]}
OUT=${2:-bench/out/expert-cache}
FRACTIONS=${FRACTIONS:-"min 0.05 0.1 0.2 0.35 0.5 0.75 all"}
POLICIES=${POLICIES:-lru}
PREFETCH=${PREFETCH:-on}
STEPS=${STEPS:-64}
PROMPT=${PROMPT:-64}
THREADS=${THREADS:-0}
IO=${IO:-direct}
REDLITE=${REDLITE:-target/release/redlite}

if [ ! -x "$REDLITE" ]; then
    echo "building $REDLITE ..." >&2
    cargo build --release -p redlite >&2
fi
python3 -c 'import matplotlib' 2>/dev/null || pip install --quiet matplotlib >&2
mkdir -p "$OUT/runs"

EXPERT_BYTES=$("$REDLITE" inspect "$MODEL" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["expert_bytes"])')
IO_FLAG=""
[ "$IO" = buffered ] && IO_FLAG="--buffered-io"

for policy in $POLICIES; do
  for pf in $PREFETCH; do
    [ "${REPORT_ONLY:-0}" = 1 ] && break
    for f in $FRACTIONS; do
        case "$f" in
            min) size=min ;;
            all) size="" ;;
            *) size=$(python3 -c "print(int($EXPERT_BYTES * $f))") ;;
        esac
        echo "policy $policy, prefetch $pf, cache $f ${size:+($size)} ..." >&2
        args=(bench decode -m "$MODEL" -t "$THREADS" -n "$STEPS" -p "$PROMPT" --bw-mib 256 --bw-runs 1
              --cache-policy "$policy" --json)
        [ -n "$size" ] && args+=(--expert-cache "$size")
        [ -n "$IO_FLAG" ] && args+=("$IO_FLAG")
        [ "$pf" = off ] && args+=(--no-prefetch)
        "$REDLITE" "${args[@]}" > "$OUT/runs/$policy-$pf-$f.json"
    done
  done
done

python3 - "$OUT" "$MODEL" "$EXPERT_BYTES" "$FRACTIONS" "$POLICIES" "$STEPS" "$IO" "$PROMPT" "$PREFETCH" <<'PY'
import json, os, sys
out, model, expert_bytes, fractions, policies, steps, io, prompt, prefetch = sys.argv[1:10]
expert_bytes = int(expert_bytes)
rows = []
for policy, pf in [(p, q) for p in policies.split() for q in prefetch.split()]:
    for f in fractions.split():
        d = json.load(open(os.path.join(out, "runs", f"{policy}-{pf}-{f}.json")))
        c = d["expert_cache"]["cache"] or {}
        r = d["expert_cache"]["routing"] or {}
        slots, slot = c.get("slots", 0), c.get("slot_bytes", 0)
        size = slots * slot if slots else expert_bytes
        rows.append(dict(policy=f"{policy}, prefetch {pf}", fraction=f,
                         ahead=c.get("prefetched_per_token", 0.0),
                         ahead_used=c.get("prefetch_hits_per_token", 0.0), size_gib=size / 2**30,
                         pct=100 * size / expert_bytes, tok_s=d["tok_per_s"],
                         median_tok_s=1e3 / max(d["median_step_ms"], 1e-9),
                         hit=100 * c.get("hit_rate", 1.0),
                         misses=c.get("misses_per_token", 0.0),
                         mb=c.get("bytes_read_per_token", 0.0) / 1e6,
                         stall=c.get("stall_ms_per_token", 0.0),
                         direct=c.get("direct_io", False), routing=r, threads=d["threads"]))
r0 = rows[0]["routing"]
lines = [f"# Expert cache sweep: {os.path.basename(model)}", "",
         f"model `{model}`, routed experts {expert_bytes / 2**30:.2f} GiB, {steps} decode steps after "
         f"a {prompt}-token prompt, {rows[0]['threads']} threads, misses read {'with O_DIRECT' if io == 'direct' else 'buffered'}.", ""]
if r0:
    lines += [f"routing over {r0['tokens']} tokens: {r0['distinct_mean']:.1f} distinct experts per layer "
              f"(of {r0['experts_per_layer']}), entropy {r0['entropy_bits']:.2f} bits, reuse distance median "
              f"{r0['reuse_tokens_median']} / p90 {r0['reuse_tokens_p90']} tokens, LRU stack distance median "
              f"{r0['stack_distance_median']} / p90 {r0['stack_distance_p90']}, first uses "
              f"{100 * r0['first_use_fraction']:.1f}%", ""]
lines += ["| policy | cache | GiB | % of experts | tok/s (mean) | tok/s (median step) | hit rate | misses/token | MB read/token | stall ms/token | prefetched/token (used) |",
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
for x in rows:
    lines.append(f"| {x['policy']} | {x['fraction']} | {x['size_gib']:.2f} | {x['pct']:.1f} | {x['tok_s']:.2f} | "
                 f"{x['median_tok_s']:.2f} | {x['hit']:.1f}% | {x['misses']:.1f} | {x['mb']:.1f} | {x['stall']:.1f} | "
                 f"{x['ahead']:.1f} ({x['ahead_used']:.1f}) |")
table = "\n".join(lines) + "\n"
open(os.path.join(out, "expert-cache.md"), "w").write(table)
print(table)

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
fig, ax = plt.subplots(figsize=(8, 4.5))
ax2 = ax.twinx()
for policy in dict.fromkeys(x["policy"] for x in rows):
    pts = [x for x in rows if x["policy"] == policy]
    xs = [x["size_gib"] for x in pts]
    ax.plot(xs, [x["tok_s"] for x in pts], "o-", label=f"tok/s ({policy})")
    ax2.plot(xs, [x["hit"] for x in pts], "s--", label=f"hit rate ({policy})")
ax.set_xlabel("expert cache size (GiB)")
ax.set_ylabel("decode tok/s")
ax2.set_ylabel("hit rate (%)")
ax2.set_ylim(0, 100)
ax.set_title(os.path.basename(model))
h1, l1 = ax.get_legend_handles_labels()
h2, l2 = ax2.get_legend_handles_labels()
ax.legend(h1 + h2, l1 + l2, loc="lower right", fontsize=8)
fig.tight_layout()
fig.savefig(os.path.join(out, "expert-cache.png"), dpi=120)
print(f"wrote {out}/expert-cache.md and {out}/expert-cache.png")
PY
