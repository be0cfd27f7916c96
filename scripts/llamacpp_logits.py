#!/usr/bin/env python3
"""Write llama.cpp's logits (and greedy continuations) for given token ids.

Used by `redlite parity` to compare redlite with llama.cpp on the same prompts. It runs
llama.cpp through llama-cpp-python (`pip install llama-cpp-python`; the reference fixtures were
made with 0.3.36) with the settings the fixtures used: n_ctx 1024, n_batch = n_ubatch = 512,
logits for every position, the whole prompt in one `eval`, then one token per `eval` for the
greedy continuation.

    llamacpp_logits.py --model tiny-F16.gguf --request req.json --out DIR [--threads 2]

req.json: {"prompts": [{"name": "P1", "ids": [1, 2, 3], "text": "optional"}], "greedy": 64}

Writes DIR/<name>.logits.bin (row-major little-endian float32, [len(ids), n_vocab]: row i is
the prediction after ids[0..=i]) and DIR/result.json:
{"backend": "llama-cpp-python", "version": ..., "n_vocab": ..., "prompts": [{"name", "n_ids",
"logits", "greedy", "tokenized"}]} where "tokenized" is llama.cpp's tokenization of "text"
(parse_special = true, no BOS) when a text was given.
"""

import argparse
import json
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--request", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=1024)
    args = ap.parse_args()

    try:
        import numpy as np
        import llama_cpp
    except ImportError as e:
        print(
            f"llamacpp_logits.py: {e}. Install llama.cpp's Python binding with "
            "`pip install llama-cpp-python` (the fixtures used 0.3.36).",
            file=sys.stderr,
        )
        return 3

    with open(args.request, encoding="utf-8") as f:
        req = json.load(f)
    prompts = req.get("prompts", [])
    n_greedy = int(req.get("greedy", 0))
    longest = max((len(p["ids"]) for p in prompts), default=0) + n_greedy
    n_ctx = max(args.n_ctx, longest)

    llm = llama_cpp.Llama(
        model_path=args.model,
        n_ctx=n_ctx,
        n_batch=512,
        n_ubatch=512,
        logits_all=True,
        n_threads=args.threads,
        verbose=False,
    )
    n_vocab = llm.n_vocab()
    os.makedirs(args.out, exist_ok=True)
    out_prompts = []
    for p in prompts:
        name = str(p["name"])
        ids = [int(t) for t in p["ids"]]
        if not ids:
            raise SystemExit(f"prompt {name}: no ids")
        llm.reset()
        llm.eval(ids)
        logits = np.asarray(llm.scores[: len(ids)], dtype="<f4")
        fname = f"{name}.logits.bin"
        logits.tofile(os.path.join(args.out, fname))
        greedy = []
        for step in range(n_greedy):
            row = np.asarray(llm.scores[llm.n_tokens - 1])
            tok = int(np.argmax(row))  # lowest index on ties, like redlite's greedy
            greedy.append(tok)
            if step + 1 < n_greedy:
                llm.eval([tok])
        entry = {"name": name, "n_ids": len(ids), "logits": fname, "greedy": greedy}
        text = p.get("text")
        if text is not None:
            entry["tokenized"] = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        out_prompts.append(entry)

    result = {
        "backend": "llama-cpp-python",
        "version": getattr(llama_cpp, "__version__", "unknown"),
        "n_vocab": n_vocab,
        "prompts": out_prompts,
    }
    with open(os.path.join(args.out, "result.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
