#!/usr/bin/env python3
"""Evaluate the shipped demo model (f32 PyTorch on the GGUF's dequantized weights, as make_ref.py loads it):

* held-out perplexity: mean next-token cross-entropy over non-overlapping windows of the held-out token
  stream (documents never trained on), and the same for the MTP head (token t+2);
* MTP greedy draft acceptance on one held-out code file, two ways:
  - teacher-forced on the file: the draft argmax MTP(h_t, x_{t+1}) equals the trunk's greedy choice at t+1;
  - on the model's own greedy continuation of the file's first `--prompt-tokens` tokens (what a greedy
    speculative decoder with one draft token sees): the draft equals the next greedy token.
"""
import argparse
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_ref import load_rounded_model  # noqa: E402

PYROOT = "/root/.pyenv/versions/3.11.7/lib/python3.11"


@torch.no_grad()
def greedy(model, ids, n):
    """Greedy continuation by full recomputation (exact, no cache subtleties)."""
    ids = list(ids)
    for _ in range(n):
        logits, _, _ = model(torch.tensor([ids]))
        ids.append(int(logits[0, -1].argmax()))
    return ids


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default="models/redlite-demo.gguf")
    ap.add_argument("--heldout", default="/tmp/demo-data/heldout.bin")
    ap.add_argument("--windows", type=int, default=24)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--file", default="contextlib.py", help="held-out code file (relative to the stdlib)")
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--gen-tokens", type=int, default=160)
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    model = load_rounded_model(args.gguf)
    tok = Tokenizer.from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenizer", "tokenizer.json"))
    res = {}

    data = np.fromfile(args.heldout, dtype=np.uint16).astype(np.int64)
    n_win = min(args.windows, len(data) // (args.seq + 1))
    step = len(data) // n_win
    tot_m = tot_t = 0.0
    cnt_m = cnt_t = 0
    for w in range(n_win):
        x = torch.from_numpy(data[w * step : w * step + args.seq + 1]).unsqueeze(0)
        logits, mtp, _ = model(x)
        tot_m += F.cross_entropy(logits[0, :-1], x[0, 1:], reduction="sum").item()
        tot_t += F.cross_entropy(mtp[0, :-1], x[0, 2:], reduction="sum").item()
        cnt_m += x.shape[1] - 1
        cnt_t += x.shape[1] - 2
    res["heldout_tokens"] = cnt_m
    res["heldout_ce"] = tot_m / cnt_m
    res["heldout_ppl"] = math.exp(tot_m / cnt_m)
    res["heldout_mtp_ce"] = tot_t / cnt_t
    res["heldout_mtp_ppl"] = math.exp(tot_t / cnt_t)
    print(json.dumps(res), flush=True)

    text = open(os.path.join(PYROOT, args.file), encoding="utf-8").read()
    ids = tok.encode(text, add_special_tokens=False).ids[: args.seq]
    x = torch.tensor([ids])
    logits, mtp, _ = model(x)
    main_greedy = logits[0].argmax(-1)  # trunk's choice for position t+1 at row t
    draft = mtp[0].argmax(-1)  # slot t drafts token t+2
    # slot t (t = 0..n-3) drafts t+2; the trunk's greedy choice for t+2 is main_greedy[t+1]
    agree = (draft[:-1] == main_greedy[1:-1]).float().mean().item()
    correct = (draft[:-1] == x[0, 2:]).float().mean().item()
    res["mtp_file"] = args.file
    res["mtp_teacher_forced_tokens"] = len(ids) - 2
    res["mtp_accept_teacher_forced"] = agree
    res["mtp_draft_matches_text"] = correct
    res["trunk_top1_matches_text"] = (main_greedy[:-1] == x[0, 1:]).float().mean().item()

    prompt = ids[: args.prompt_tokens]
    seq = greedy(model, prompt, args.gen_tokens)
    x = torch.tensor([seq])
    logits, mtp, _ = model(x)
    draft = mtp[0].argmax(-1)
    p = len(prompt)
    # drafts for generated tokens p+1 .. end come from slots p-1 .. len-3 (slot t drafts t+2)
    acc = (draft[p - 1 : len(seq) - 2] == x[0, p + 1 :]).float().mean().item()
    res["mtp_accept_greedy"] = acc
    res["mtp_greedy_drafts"] = len(seq) - p - 1
    res["greedy_sample"] = tok.decode(seq[p:], skip_special_tokens=False)[:400]
    print(json.dumps(res, indent=1), flush=True)
    if args.out:
        json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
