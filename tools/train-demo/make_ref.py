#!/usr/bin/env python3
"""Reference logits for `models/redlite-demo.gguf`, computed by the PyTorch demo model (transformers'
Qwen3NextForCausalLM + the MTP head of demo_model.py) in f32 on the *rounded* weights: every tensor is
read back from the GGUF (Q8_0 dequantized) and the converter's transforms are inverted (norm − 1,
A_log = log(−ssm_a), attn_qkv/attn_gate regrouped into in_proj_qkvz, experts re-fused).

Writes `--out/ref.json` (prompts, token ids, which rows are stored) and `--out/logits.bin` (the stored
rows, f32 little-endian, in the order listed: per prompt the trunk rows, then the MTP rows).
"""
import argparse
import json
import os
import sys

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from tokenizers import Tokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo_model import DemoModel, demo_config  # noqa: E402

PROMPTS = [
    "def fibonacci(n):",
    'import os\nimport sys\n\n\nclass Config:\n    """Settings read from the environment."""\n\n    def __init__(self',
    "<|im_start|>user\nWrite a Python function `is_prime`: Return True if n is prime.<|im_end|>\n<|im_start|>assistant\n",
]


def gguf_tensors(path):
    r = GGUFReader(path)
    out = {}
    for t in r.tensors:
        shape = [int(x) for x in reversed(t.shape)]  # row-major (PyTorch order)
        a = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        out[t.name] = torch.from_numpy(np.ascontiguousarray(a))
    return r, out


def invert(g, cfg):
    """GGUF tensors -> HF state dict (fused experts, as transformers 5 holds them)."""
    sd = {}
    h = cfg.hidden_size
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = nv // nk
    sd["model.embed_tokens.weight"] = g["token_embd.weight"]
    sd["lm_head.weight"] = g["output.weight"]
    sd["model.norm.weight"] = g["output_norm.weight"] - 1
    n = cfg.num_hidden_layers
    blocks = [(f"model.layers.{i}.", f"blk.{i}.", cfg.layer_types[i] == "full_attention") for i in range(n)]
    blocks.append(("mtp.layers.0.", f"blk.{n}.", True))
    for p, b, attn in blocks:
        sd[p + "input_layernorm.weight"] = g[b + "attn_norm.weight"] - 1
        sd[p + "post_attention_layernorm.weight"] = g[b + "post_attention_norm.weight"] - 1
        if attn:
            for hf_n, gg in [("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")]:
                sd[f"{p}self_attn.{hf_n}.weight"] = g[f"{b}{gg}.weight"]
            sd[p + "self_attn.q_norm.weight"] = g[b + "attn_q_norm.weight"] - 1
            sd[p + "self_attn.k_norm.weight"] = g[b + "attn_k_norm.weight"] - 1
        else:
            qkv, z = g[b + "attn_qkv.weight"], g[b + "attn_gate.weight"]
            q, k, v = qkv[: nk * dk], qkv[nk * dk : 2 * nk * dk], qkv[2 * nk * dk :]
            groups = []
            for i in range(nk):
                groups += [q[i * dk : (i + 1) * dk], k[i * dk : (i + 1) * dk], v[i * r * dv : (i + 1) * r * dv], z[i * r * dv : (i + 1) * r * dv]]
            sd[p + "linear_attn.in_proj_qkvz.weight"] = torch.cat(groups, 0)
            sd[p + "linear_attn.in_proj_ba.weight"] = g[b + "ssm_ba.weight"]
            sd[p + "linear_attn.conv1d.weight"] = g[b + "ssm_conv1d.weight"].unsqueeze(1)
            sd[p + "linear_attn.dt_bias"] = g[b + "ssm_dt.bias"]
            sd[p + "linear_attn.A_log"] = torch.log(-g[b + "ssm_a"])
            sd[p + "linear_attn.norm.weight"] = g[b + "ssm_norm.weight"]
            sd[p + "linear_attn.out_proj.weight"] = g[b + "ssm_out.weight"]
        sd[p + "mlp.gate.weight"] = g[b + "ffn_gate_inp.weight"]
        sd[p + "mlp.experts.gate_up_proj"] = torch.cat([g[b + "ffn_gate_exps.weight"], g[b + "ffn_up_exps.weight"]], 1)
        sd[p + "mlp.experts.down_proj"] = g[b + "ffn_down_exps.weight"]
        for x in ("gate", "up", "down"):
            sd[f"{p}mlp.shared_expert.{x}_proj.weight"] = g[f"{b}ffn_{x}_shexp.weight"]
        sd[p + "mlp.shared_expert_gate.weight"] = g[b + "ffn_gate_inp_shexp.weight"]
    sd["mtp.fc.weight"] = g[f"blk.{n}.nextn.eh_proj.weight"]
    sd["mtp.pre_fc_norm_embedding.weight"] = g[f"blk.{n}.nextn.enorm.weight"] - 1
    sd["mtp.pre_fc_norm_hidden.weight"] = g[f"blk.{n}.nextn.hnorm.weight"] - 1
    sd["mtp.norm.weight"] = g[f"blk.{n}.nextn.shared_head_norm.weight"] - 1
    return sd


def load_rounded_model(gguf_path):
    _, g = gguf_tensors(gguf_path)
    cfg = demo_config(g["token_embd.weight"].shape[0])
    cfg._attn_implementation = "eager"
    model = DemoModel(cfg)
    model.load_hf_state_dict(invert(g, cfg))
    return model.float().eval()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default="models/redlite-demo.gguf")
    ap.add_argument("--tokenizer", default="tools/train-demo/tokenizer/tokenizer.json")
    ap.add_argument("--out", default="models/redlite-demo.ref")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    model = load_rounded_model(args.gguf)
    tok = Tokenizer.from_file(args.tokenizer)
    os.makedirs(args.out, exist_ok=True)
    rows, index = [], []
    for text in PROMPTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        x = torch.tensor([ids])
        logits, mtp_logits, _ = model(x)
        n = len(ids)
        trunk_rows = sorted({0, n // 2, n - 1})
        # MTP slot t takes h_t and token t+1 (slots 0..n-2 exist).
        mtp_rows = sorted({0, (n - 2) // 2, n - 2})
        for t in trunk_rows:
            rows.append(logits[0, t].double().numpy())
        for t in mtp_rows:
            rows.append(mtp_logits[0, t].double().numpy())
        index.append({
            "text": text,
            "ids": ids,
            "rows": trunk_rows,
            "mtp_rows": mtp_rows,
            "greedy_next": int(logits[0, -1].argmax()),
        })
    data = np.stack(rows).astype("<f4")
    data.tofile(os.path.join(args.out, "logits.bin"))
    meta = {
        "model": os.path.basename(args.gguf),
        "vocab": int(data.shape[1]),
        "what": "f32 PyTorch (transformers Qwen3NextForCausalLM + demo MTP head) on the GGUF's dequantized weights",
        "layout": "per prompt: rows (trunk logits at those positions), then mtp_rows (MTP logits of those slots); f32 LE",
        "prompts": index,
    }
    json.dump(meta, open(os.path.join(args.out, "ref.json"), "w"), indent=1)
    print(f"{data.shape[0]} rows x {data.shape[1]} -> {args.out}")


if __name__ == "__main__":
    main()
