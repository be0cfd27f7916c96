#!/usr/bin/env python3
"""Check that llama.cpp loads a file written by `redlite quantize` and that its logits are sane.

    check_quantized_llamacpp.py OUT.gguf [--reference ../shared/reference] [--against tiny-CF2.gguf]

Loads OUT.gguf with llama-cpp-python (the reference fixtures used 0.3.36), runs prompts P1-P3
(`logits/prompts.json`) in one batch each, and prints for every prompt the mean KL of llama.cpp's
logits from the F16 file's exact logits (`logits/F16__P*__exact.bin`, the stored rows only).
With --against, the same for that file (e.g. llama-quantize's `tiny-CF2.gguf`), so the two
quantizations can be compared through llama.cpp's own arithmetic. Exits non-zero when llama.cpp
cannot load the file or a logit is not finite.
"""

import argparse
import json
import os
import sys


def log_softmax(np, x):
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def mean_kl(np, llama_cpp, model, ref, threads):
    with open(os.path.join(ref, "logits", "prompts.json"), encoding="utf-8") as f:
        prompts = json.load(f)
    llm = llama_cpp.Llama(
        model_path=model,
        n_ctx=1024,
        n_batch=512,
        n_ubatch=512,
        logits_all=True,
        n_threads=threads,
        verbose=False,
    )
    n_vocab = llm.n_vocab()
    out = {}
    for name in ("P1", "P2", "P3"):
        p = prompts[name]
        llm.reset()
        llm.eval(p["ids"])
        got = np.array(llm.scores[: len(p["ids"])], dtype=np.float32)
        if not np.isfinite(got).all():
            raise RuntimeError(f"{model}: non-finite logits on {name}")
        exact = np.fromfile(
            os.path.join(ref, "logits", f"F16__{name}__exact.bin"), dtype="<f4"
        ).reshape(-1, n_vocab)
        rows = got[p["positions"]]
        lp, lq = log_softmax(np, exact), log_softmax(np, rows)
        kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
        out[name] = float(kl.mean())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--reference", default="../shared/reference")
    ap.add_argument("--against", help="a second file to measure the same way")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    try:
        import numpy as np
        import llama_cpp
    except ImportError as e:
        print(f"check_quantized_llamacpp.py: {e} (pip install llama-cpp-python numpy)", file=sys.stderr)
        return 3
    status = 0
    for path in [args.model] + ([args.against] if args.against else []):
        try:
            kls = mean_kl(np, llama_cpp, path, args.reference, args.threads)
        except Exception as e:  # llama.cpp raises ValueError when it cannot load a model
            print(f"FAIL {path}: {e}")
            status = 1
            continue
        mean = sum(kls.values()) / len(kls)
        per = " ".join(f"{k} {v:.5f}" for k, v in kls.items())
        print(f"ok   {path}: llama.cpp loads it; mean KL from F16 exact: {per} (mean of prompts {mean:.5f})")
    return status


if __name__ == "__main__":
    sys.exit(main())
