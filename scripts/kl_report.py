#!/usr/bin/env python3
"""The KL report of docs/quality.md: redlite against the stored reference logits.

For every shipped model file: mean/max KL(exact ‖ redlite) over the stored rows, top-1 agreement
and greedy agreement with `greedy_exact`; for the files with stored llama.cpp logits, mean KL
between redlite and llama.cpp beside llama.cpp's own distance from exact (`stats.kl_mean` in
logits/index.json, row-weighted over the prompts). Prints Markdown tables.

    scripts/kl_report.py [--redlite target/release/redlite] [--fixtures ../shared/reference]
                         [--backend oracle] [--mode prefill]
"""

import argparse
import json
import os
import subprocess
import sys


def parity(redlite, model, reference, fixtures, backend, mode):
    cmd = [redlite, "parity", "-m", model, "--reference", reference, "--fixtures", fixtures,
           "--backend", backend, "--mode", mode, "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def greedy_summary(report):
    parts = []
    for p in report["prompts"]:
        d = p["greedy_first_divergence"]
        if d is None:
            parts.append(f"{p['prompt']}:=")
        else:
            parts.append(f"{p['prompt']}:div@{d} (gap {p['greedy_divergence_top2_gap']:.1e})")
    return " ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--redlite", default="target/release/redlite")
    ap.add_argument("--fixtures", default="../shared/reference")
    ap.add_argument("--backend", default="oracle")
    ap.add_argument("--mode", default="prefill")
    args = ap.parse_args()

    index = json.load(open(os.path.join(args.fixtures, "logits", "index.json"), encoding="utf-8"))
    models = []
    llama_kl = {}
    for e in index["entries"]:
        if e.get("omitted_model") or e.get("exact_path") is None:
            continue
        if e["model"] not in models:
            models.append(e["model"])
        rows = len(e["positions"])
        acc = llama_kl.setdefault(e["model"], [0.0, 0, e.get("llamacpp_path") is not None])
        acc[0] += e["stats"]["kl_mean"] * rows
        acc[1] += rows

    print(f"redlite {args.backend} backend, {args.mode} path; KL in nats per row over the stored rows.\n")
    print("| file | rows | mean KL(exact ‖ redlite) | max KL | max abs Δ | max rel Δ | top-1 agree | greedy 64 vs greedy_exact |")
    print("|---|---|---|---|---|---|---|---|")
    with_llama = []
    for m in models:
        path = os.path.join(args.fixtures, "models", f"tiny-{m}.gguf")
        r = parity(args.redlite, path, "exact", args.fixtures, args.backend, args.mode)
        print(f"| {m} | {r['rows']} | {r['kl_mean']:.2e} | {r['kl_max']:.2e} | {r['max_abs_diff']:.2e} "
              f"| {r['max_rel_diff']:.2e} | {100 * r['top1_agree']:.1f} % | {greedy_summary(r)} |")
        if llama_kl[m][2]:
            with_llama.append((m, path))
        sys.stdout.flush()

    print()
    print("| file | mean KL(redlite ‖ llama.cpp) | mean KL(llama.cpp ‖ redlite) | max KL(llama.cpp ‖ redlite) "
          "| llama.cpp's own mean KL(exact ‖ llama.cpp) | top-1 agree | greedy 64 vs greedy_llamacpp |")
    print("|---|---|---|---|---|---|---|")
    for m, path in with_llama:
        r = parity(args.redlite, path, "llamacpp", args.fixtures, args.backend, args.mode)
        own = llama_kl[m][0] / llama_kl[m][1]
        print(f"| {m} | {r['kl_reverse_mean']:.2e} | {r['kl_mean']:.2e} | {r['kl_max']:.2e} | {own:.2e} "
              f"| {100 * r['top1_agree']:.1f} % | {greedy_summary(r)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
