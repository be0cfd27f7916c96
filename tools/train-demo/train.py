#!/usr/bin/env python3
"""Train the redlite demo model (Qwen3-Next trunk + MTP head) on the pre-tokenized corpus.

The learning-rate schedule is driven by wall-clock time (linear warm-up, cosine decay to 10 %) so a run always
ends inside its budget whatever the throughput. Checkpoints are written as bf16 safetensors pieces of at most
~15 MiB (`ckpt-NN.safetensors`) plus `train_log.json`, overwriting the previous ones, every `--save-every`
seconds and at the end, so a run that is cut off still leaves its latest weights.

loss = CE(main, next token) + mtp_weight * CE(MTP, token t+2) + aux_coef * load-balancing(trunk routers)
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo_model import DemoModel, count_params, demo_config  # noqa: E402

PIECE_BYTES = 15 * 1024 * 1024


def save_pieces(sd: dict, out_dir: str, prefix: str = "ckpt") -> list:
    """Write `sd` as bf16 safetensors pieces of at most PIECE_BYTES (in key order); returns the file names."""
    os.makedirs(out_dir, exist_ok=True)
    pieces, cur, size = [], {}, 0
    for k in sorted(sd):
        t = sd[k].detach().to("cpu", torch.bfloat16).contiguous()
        nb = t.numel() * 2
        if cur and size + nb > PIECE_BYTES:
            pieces.append(cur)
            cur, size = {}, 0
        cur[k] = t
        size += nb
    if cur:
        pieces.append(cur)
    names = []
    for i, p in enumerate(pieces):
        name = f"{prefix}-{i:02d}.safetensors"
        tmp = os.path.join(out_dir, name + ".part")
        save_file(p, tmp)
        os.replace(tmp, os.path.join(out_dir, name))
        names.append(name)
    return names


def load_pieces(in_dir: str, prefix: str = "ckpt") -> dict:
    sd = {}
    for f in sorted(os.listdir(in_dir)):
        if f.startswith(prefix + "-") and f.endswith(".safetensors"):
            sd.update(load_file(os.path.join(in_dir, f)))
    return sd


class Batches:
    """Random windows of seq+1 tokens from a uint16 token stream."""

    def __init__(self, path: str, seq: int, seed: int):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq = seq
        self.rng = np.random.default_rng(seed)

    def get(self, batch: int, device) -> torch.Tensor:
        starts = self.rng.integers(0, len(self.data) - self.seq - 1, size=batch)
        x = np.stack([self.data[s : s + self.seq + 1] for s in starts]).astype(np.int64)
        return torch.from_numpy(x).to(device, non_blocking=True)


def losses(model: DemoModel, ids: torch.Tensor, with_aux: bool):
    logits, mtp_logits, aux = model(ids, with_router_logits=with_aux)
    v = logits.shape[-1]
    main = F.cross_entropy(logits[:, :-1].reshape(-1, v).float(), ids[:, 1:].reshape(-1))
    mtp = F.cross_entropy(mtp_logits[:, :-1].reshape(-1, v).float(), ids[:, 2:].reshape(-1))
    return main, mtp, aux


@torch.no_grad()
def evaluate(model, batches: Batches, n: int, batch: int, device, amp) -> dict:
    model.eval()
    tot_m = tot_t = 0.0
    for _ in range(n):
        ids = batches.get(batch, device)
        with amp():
            m, t, _ = losses(model, ids, False)
        tot_m += m.item()
        tot_t += t.item()
    model.train()
    return {"main": tot_m / n, "mtp": tot_t / n}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=".device/data")
    ap.add_argument("--out", default=os.environ.get("OUT", ".device/ckpt"))
    ap.add_argument("--resume", default=None, help="folder with ckpt-*.safetensors to start from")
    ap.add_argument("--budget", type=float, default=420.0, help="training wall-clock seconds")
    ap.add_argument("--save-every", type=float, default=150.0)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=float, default=0.04, help="fraction of the budget")
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--eval-batches", type=int, default=20)
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: by budget only)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fp32", action="store_true", help="no bf16 autocast, unfused AdamW (fallback settings)")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if device.type == "cuda" and not args.fp32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        amp = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    else:
        amp = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
    stats = json.load(open(os.path.join(args.data, "stats.json")))
    vocab = int(math.ceil(stats["vocab"] / 64) * 64)
    config = demo_config(vocab)
    config._attn_implementation = "sdpa"
    model = DemoModel(config)
    if args.resume:
        model.load_hf_state_dict({k: v.float() for k, v in load_pieces(args.resume).items()})
    model.to(device)
    n_params = count_params(model)
    n_mtp = count_params(model.mtp)
    print(f"params: {n_params} (trunk {n_params - n_mtp}, mtp {n_mtp}), vocab {vocab}, device {device}", flush=True)

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed" not in name else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=device.type == "cuda" and not args.fp32,
    )
    train = Batches(os.path.join(args.data, "train.bin"), args.seq, args.seed)
    held = Batches(os.path.join(args.data, "heldout.bin"), args.seq, 12345)

    log = {"args": vars(args), "params": n_params, "mtp_params": n_mtp, "vocab": vocab, "config": config.to_dict(), "steps": []}
    t0 = time.time()
    last_save = t0
    step = 0
    tokens = 0

    def save(tag):
        sd = model.hf_state_dict()
        log["pieces"] = save_pieces(sd, args.out)
        log["elapsed"] = time.time() - t0
        log["tokens"] = tokens
        log["step"] = step
        with open(os.path.join(args.out, "train_log.json"), "w") as f:
            json.dump(log, f, indent=1, default=str)
        print(f"[{tag}] saved {len(log['pieces'])} pieces at step {step}", flush=True)

    try:
        while True:
            el = time.time() - t0
            prog = el / args.budget
            if prog >= 1.0 or (args.max_steps and step >= args.max_steps):
                break
            if prog < args.warmup:
                lr = args.lr * max(prog / args.warmup, 0.01)
            else:
                q = (prog - args.warmup) / (1 - args.warmup)
                lr = args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * q)))
            for g in opt.param_groups:
                g["lr"] = lr
            ids = train.get(args.batch, device)
            with amp():
                m, t, aux = losses(model, ids, True)
                loss = m + args.mtp_weight * t + args.aux_coef * aux
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            tokens += ids.numel()
            if step % 25 == 0 or step <= 3:
                rec = {"step": step, "t": round(el, 1), "lr": lr, "main": m.item(), "mtp": t.item(), "aux": aux.item(), "gnorm": gn.item(), "tokens": tokens}
                log["steps"].append(rec)
                print(json.dumps(rec), flush=True)
            if time.time() - last_save > args.save_every:
                save("periodic")
                last_save = time.time()
    except Exception as e:  # keep what was learned even if something breaks mid-run
        log["error"] = repr(e)
        print("training stopped by", repr(e), flush=True)
    log["heldout"] = evaluate(model, held, args.eval_batches, max(1, args.batch // 2), device, amp)
    log["train_eval"] = evaluate(model, train, args.eval_batches, max(1, args.batch // 2), device, amp)
    print("heldout", log["heldout"], "train", log["train_eval"], flush=True)
    save("final")
    if "error" in log and step < 20:
        sys.exit(3)  # broke at the start: let the caller retry with other settings


if __name__ == "__main__":
    main()
