#!/usr/bin/env python3
"""Turn the training checkpoint pieces (bf16 `ckpt-NN.safetensors`) into a Hugging Face
`Qwen3NextForCausalLM` folder in the layout of the Qwen3-Next release: per-expert
`mlp.experts.{e}.{gate,up,down}_proj.weight`, the MTP block as `mtp.*`, config.json with
`num_nextn_predict_layers`, and the tokenizer files. Values stay bf16 (as trained)."""
import argparse
import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo_model import demo_config  # noqa: E402
from train import load_pieces  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def to_release_layout(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            p = k[: -len("gate_up_proj")]
            e, two_i, _ = v.shape
            for x in range(e):
                out[f"{p}{x}.gate_proj.weight"] = v[x, : two_i // 2].clone()
                out[f"{p}{x}.up_proj.weight"] = v[x, two_i // 2 :].clone()
        elif k.endswith("mlp.experts.down_proj"):
            p = k[: -len("down_proj")]
            for x in range(v.shape[0]):
                out[f"{p}{x}.down_proj.weight"] = v[x].clone()
        else:
            out[k] = v.contiguous()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    sd = to_release_layout(load_pieces(args.ckpt))
    tok_dir = os.path.join(HERE, "tokenizer")
    tc = json.load(open(os.path.join(tok_dir, "tokenizer_config.json")))
    tj = json.load(open(os.path.join(tok_dir, "tokenizer.json")))
    ids = {t["content"]: t["id"] for t in tj["added_tokens"]}
    vocab = sd["model.embed_tokens.weight"].shape[0]
    cfg = demo_config(vocab).to_dict()
    cfg["architectures"] = ["Qwen3NextForCausalLM"]
    cfg["num_nextn_predict_layers"] = 1
    cfg["bos_token_id"] = ids["<|endoftext|>"]
    cfg["eos_token_id"] = ids["<|im_end|>"]
    cfg["pad_token_id"] = ids["<|endoftext|>"]
    cfg["dtype"] = "bfloat16"
    json.dump(cfg, open(os.path.join(args.out, "config.json"), "w"), indent=2, default=str)
    names = sorted(sd)
    half = len(names) // 2
    for i, part in enumerate([names[:half], names[half:]]):
        save_file({k: sd[k] for k in part}, os.path.join(args.out, f"model-{i + 1:05d}-of-00002.safetensors"))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tok_dir, f), os.path.join(args.out, f))
    assert tc["eos_token"] == "<|im_end|>"
    print(f"wrote {len(sd)} tensors to {args.out}")


if __name__ == "__main__":
    main()
