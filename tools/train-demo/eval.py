#!/usr/bin/env python3
"""Evaluate the shipped demo model (f32 PyTorch on the GGUF's dequantized weights, as make_ref.py loads it):

* held-out perplexity: mean next-token cross-entropy over non-overlapping windows of the held-out token
  stream (documents never trained on), and the same for the MTP head (token t+2);
* MTP greedy draft acceptance on one held-out code file, two ways:
  - teacher-forced on the file: the draft argmax MTP(h_t, x_{t+1}) equals the trunk's greedy choice at t+1;
  - on the model's own greedy continuations (`--gen-tokens` each) from `--cuts` points of the file, each after
    `--prompt-tokens` tokens of the file (what a greedy speculative decoder with one draft token sees): the
    draft equals the next greedy token.
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


def heldout_ppl(model, args, res):
    """Cross-entropy of the trunk (next token) and the MTP head (token t+2) over windows of the held-out stream."""
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default="models/redlite-demo.gguf")
    ap.add_argument("--heldout", default="/tmp/demo-data/heldout.bin")
    ap.add_argument("--windows", type=int, default=24)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--file", default="contextlib.py", help="held-out code file (relative to the stdlib)")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--cuts", type=int, default=8)
    ap.add_argument("--skip-ppl", action="store_true")
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    model = load_rounded_model(args.gguf)
    tok = Tokenizer.from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenizer", "tokenizer.json"))
    res = {}

    if not args.skip_ppl:
        heldout_ppl(model, args, res)
    text = open(os.path.join(PYROOT, args.file), encoding="utf-8").read()
    all_ids = tok.encode(text, add_special_tokens=False).ids
    agree = correct = top1 = 0
    count = 0
    for start in range(0, len(all_ids) - 3, args.seq):
        x = torch.tensor([all_ids[start : start + args.seq]])
        logits, mtp, _ = model(x)
        main_greedy = logits[0].argmax(-1)  # row t: the trunk's choice for token t+1
        draft = mtp[0].argmax(-1)  # slot t drafts token t+2
        agree += (draft[:-1] == main_greedy[1:-1]).sum().item()
        correct += (draft[:-1] == x[0, 2:]).sum().item()
        top1 += (main_greedy[:-1] == x[0, 1:]).sum().item()
        count += x.shape[1] - 2
    res["mtp_file"] = args.file
    res["mtp_file_tokens"] = len(all_ids)
    res["mtp_accept_teacher_forced"] = agree / count
    res["mtp_draft_matches_text"] = correct / count
    res["trunk_top1_matches_text"] = top1 / count
    print(json.dumps(res), flush=True)

    # Greedy continuations from several cut points of the file (each --gen-tokens long).
    acc_n = acc_ok = 0
    cuts = [int(len(all_ids) * k / (args.cuts + 1)) for k in range(1, args.cuts + 1)]
    samples = []
    for c in cuts:
        prompt = all_ids[max(0, c - args.prompt_tokens) : c]
        out = model.lm.generate(torch.tensor([prompt]), max_new_tokens=args.gen_tokens, do_sample=False, use_cache=True)
        seq = out[0].tolist()
        x = torch.tensor([seq])
        logits, mtp, _ = model(x)
        # sanity: the cached generation is the greedy one of the full forward
        p = len(prompt)
        assert torch.equal(logits[0, p - 1 : -1].argmax(-1), x[0, p:]), "cached generation differs from greedy"
        draft = mtp[0].argmax(-1)
        # generated tokens p+1.. are drafted by slots p-1 .. len-3
        acc_ok += (draft[p - 1 : len(seq) - 2] == x[0, p + 1 :]).sum().item()
        acc_n += len(seq) - p - 1
        samples.append(tok.decode(seq[p:]))
    res["mtp_accept_greedy"] = acc_ok / acc_n
    res["mtp_greedy_drafts"] = acc_n
    res["greedy_samples"] = samples[:2]
    print(json.dumps(res, indent=1), flush=True)
    if args.out:
        json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
