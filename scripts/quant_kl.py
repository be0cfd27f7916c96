#!/usr/bin/env python3
"""Mean KL of quantized files from the F16 file's exact logits, on prompts P1-P3 (redlite's oracle).

    quant_kl.py FILE.gguf [FILE.gguf ...] [--reference ../shared/reference] [--redlite target/release/redlite]

For each file: `redlite logits --backend oracle` on P1, P2 and P3 (`logits/prompts.json`), then
KL(exact F16 || file) over the stored rows (`logits/F16__P*__exact.bin`), averaged over all rows
of the three prompts (the measure of the CF2 acceptance test). Prints one line per file:
name, mean KL, max KL, argmax agreement with exact, file size.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--reference", default="../shared/reference")
    ap.add_argument("--redlite", default="target/release/redlite")
    args = ap.parse_args()
    with open(os.path.join(args.reference, "logits", "prompts.json"), encoding="utf-8") as f:
        prompts = json.load(f)
    exact = {}
    for name in ("P1", "P2", "P3"):
        raw = np.fromfile(os.path.join(args.reference, "logits", f"F16__{name}__exact.bin"), dtype="<f4")
        exact[name] = raw.reshape(len(prompts[name]["positions"]), -1)
    print(f"{'file':44} {'mean KL':>9} {'max KL':>9} {'top-1':>7} {'MB':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for path in args.files:
            kls, agree = [], []
            for name, want in exact.items():
                p = prompts[name]
                out = os.path.join(tmp, f"{name}.bin")
                subprocess.run(
                    [args.redlite, "logits", "-m", path, "--backend", "oracle",
                     "--ids", ",".join(map(str, p["ids"])), "--out", out],
                    check=True,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                got = np.fromfile(out, dtype="<f4").reshape(len(p["ids"]), -1)[p["positions"]]
                lp, lq = log_softmax(want), log_softmax(got)
                kls.extend((np.exp(lp) * (lp - lq)).sum(axis=-1))
                agree.extend(want.argmax(axis=-1) == got.argmax(axis=-1))
            kls = np.array(kls)
            print(f"{os.path.basename(path):44} {kls.mean():9.5f} {kls.max():9.5f} "
                  f"{100 * np.mean(agree):6.1f}% {os.path.getsize(path) / 1e6:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
