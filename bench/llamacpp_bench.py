#!/usr/bin/env python3
"""Decode and prefill speed of llama.cpp (through llama-cpp-python) on a GGUF file, measured the
way `redlite bench decode|prefill` measures redlite: an 8-token prompt then N greedy decode steps,
and a P-token prompt pass. Token ids are pseudo-random below 151643 (no special tokens).

Prints one JSON object: {"decode_tok_per_s", "prefill_tok_per_s", ...}: wall-clock times after an
untimed warm-up of the same shape (the greedy argmax over the logits is included in decode, as in
redlite's decode bench).

Usage: llamacpp_bench.py MODEL [--threads T] [-n N] [-p P]
"""
import argparse
import json
import random
import sys
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=32, help="decode steps")
    ap.add_argument("-p", type=int, default=512, help="prefill prompt tokens")
    ap.add_argument("--decode-prompt", type=int, default=8)
    ap.add_argument("--no-repack", action="store_true",
                    help="llama.cpp's --repack 0: weights stay in the mmap (files larger than RAM)")
    a = ap.parse_args()

    import llama_cpp
    from llama_cpp import Llama

    if a.no_repack:
        import llama_cpp.llama as llama_module
        default_params = llama_module.llama_cpp.llama_model_default_params

        def no_repack_params():
            p = default_params()
            p.use_extra_bufts = False
            return p

        llama_module.llama_cpp.llama_model_default_params = no_repack_params

    rnd = random.Random(1)
    n_ctx = max(a.p, a.decode_prompt + a.n) + 16
    llm = Llama(
        model_path=a.model,
        n_threads=a.threads,
        n_threads_batch=a.threads,
        n_ctx=n_ctx,
        # Without logits_all, llama-cpp-python keeps n_batch rows of scores, indexed by position:
        # the batch must cover the decode run's positions too.
        n_batch=max(a.p, 32, a.decode_prompt + a.n + 1),
        n_ubatch=max(a.p, 32),
        n_gpu_layers=0,
        use_mmap=True,
        verbose=False,
    )
    vocab = min(llm.n_vocab(), 151643)

    def decode_run(prompt, steps):
        """Per-step seconds of `steps` greedy decode steps after `prompt`."""
        llm.reset()
        llm.eval(prompt)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            llm.eval([tok])
            times.append(time.perf_counter() - t0)
        return times

    def prefill_run(prompt):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        return time.perf_counter() - t0

    # llama.cpp builds its compute graphs lazily: the first passes of each batch size are slow,
    # so both measurements are preceded by an untimed warm-up of the same shape.
    prompt = [rnd.randrange(vocab) for _ in range(a.decode_prompt)]
    decode_run(prompt, min(a.n, 4))
    times = decode_run(prompt, a.n)
    secs = sum(times)
    decode = {
        "decode_steps": a.n,
        "decode_s": secs,
        "decode_tok_per_s": a.n / max(secs, 1e-12),
        "decode_median_step_ms": float(np.median(times)) * 1e3,
        "decode_median_tok_per_s": 1.0 / max(float(np.median(times)), 1e-12),
    }

    prompt = [rnd.randrange(vocab) for _ in range(a.p)]
    prefill_run(prompt)
    secs = prefill_run(prompt)
    prefill = {
        "prefill_tokens": a.p,
        "prefill_s": secs,
        "prefill_tok_per_s": a.p / max(secs, 1e-12),
    }
    out = {"engine": "llama.cpp", "llama_cpp_python": llama_cpp.__version__,
           "threads": a.threads, **decode, **prefill}
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
