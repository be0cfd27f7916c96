#!/usr/bin/env python3
"""Build the demo model's corpus, train its byte-level BPE and pre-tokenize the corpus.

Data (all offline, present on the build machine):
  * CPython 3.11.7 standard-library sources (``lib/python3.11/**/*.py``, site-packages excluded);
  * third-party ``site-packages/**/*.py`` of the same interpreter that were installed before the
    cut-off time (so packages installed for this tool itself, e.g. torch, do not leak in);
  * synthetic ChatML conversations made from documented functions of the training files
    ("Write a Python function `name` ..." -> the function's source), so the model sees the chat format.

A document is held out when sha1(relative path) % 50 == 0. Held-out documents are never seen by the
tokenizer trainer or the model.

Outputs (``--out``, default ``.device/data``): ``train.bin`` / ``heldout.bin`` (uint16 token ids,
documents separated by ``<|endoftext|>``), ``heldout_files.txt``, ``stats.json``; the tokenizer
(``tokenizer.json``, ``tokenizer_config.json``) goes to ``--tok-out``.
"""
import argparse
import ast
import hashlib
import json
import os
import random
import sys
import time
import unicodedata

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import AddedToken

PYROOT = "/root/.pyenv/versions/3.11.7/lib/python3.11"
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def collect(cutoff: float, max_bytes: int):
    """Return [(relpath, text)] for stdlib first, then site-packages (sorted, deterministic)."""
    stdlib, site = [], []
    for root, dirs, files in os.walk(PYROOT):
        dirs.sort()
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            p = os.path.join(root, f)
            rel = os.path.relpath(p, PYROOT)
            try:
                st = os.stat(p)
            except OSError:
                continue
            if st.st_size < 200 or st.st_size > 400_000:
                continue
            if rel.startswith("site-packages"):
                if st.st_ctime > cutoff:
                    continue
                site.append(rel)
            else:
                stdlib.append(rel)
    out, seen, total = [], set(), 0
    for rel in stdlib + site:
        try:
            text = open(os.path.join(PYROOT, rel), encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            continue
        h = hashlib.sha1(text.encode()).digest()
        if h in seen:
            continue
        seen.add(h)
        out.append((rel, text))
        total += len(text)
        if total >= max_bytes:
            break
    return out


def held_out(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 50 == 0


def chat_examples(docs, n, rng):
    """Synthetic ChatML conversations: a request naming a documented function, answered by its source."""
    cands = []
    for rel, text in docs:
        if not rel.endswith(".py") or len(cands) > 3 * n:
            continue
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node):
                src = "\n".join(lines[node.lineno - 1 : node.end_lineno])
                doc_lines = ast.get_docstring(node).strip().splitlines()
                if 80 < len(src) < 1500 and doc_lines and len(doc_lines[0]) > 10:
                    cands.append((node.name, doc_lines[0], src))
    rng.shuffle(cands)
    asks = [
        "Write a Python function `{name}`: {doc}",
        "Implement `{name}` in Python. {doc}",
        "Can you show me a Python function called {name}? It should do this: {doc}",
        "{doc} Please write it as a Python function named `{name}`.",
    ]
    out = []
    for name, doc, src in cands[:n]:
        q = rng.choice(asks).format(name=name, doc=doc)
        a = f"Here is `{name}`:\n\n```python\n{src}\n```"
        sys_msg = "<|im_start|>system\nYou are a helpful coding assistant.<|im_end|>\n" if rng.random() < 0.5 else ""
        out.append(f"{sys_msg}<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n")
    return out


def train_tokenizer(texts, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    return tok


def tokenizer_config(tok: Tokenizer, max_len: int) -> dict:
    dec = {}
    for t in SPECIAL + ADDED:
        dec[str(tok.token_to_id(t))] = {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL,
        }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": dec,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": max_len,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "chat_template": CHAT_TEMPLATE,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".device/data")
    ap.add_argument("--tok-out", default="tools/train-demo/tokenizer")
    ap.add_argument("--cutoff", default="2026-11-30T10:05:00", help="site-packages files changed later are skipped")
    ap.add_argument("--max-bytes", type=int, default=110_000_000)
    ap.add_argument("--bpe-vocab", type=int, default=10176, help="BPE entries (bytes + merges); 7 added tokens follow")
    ap.add_argument("--tok-train-bytes", type=int, default=40_000_000)
    ap.add_argument("--chats", type=int, default=6000)
    ap.add_argument("--heldout-only", action="store_true", help="reuse the tokenizer in --tok-out; write only the held-out set")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.tok_out, exist_ok=True)
    cutoff = time.mktime(time.strptime(args.cutoff, "%Y-%m-%dT%H:%M:%S")) - time.timezone
    t0 = time.time()
    docs = collect(cutoff, args.max_bytes)
    train = [(r, t) for r, t in docs if not held_out(r)]
    held = [(r, t) for r, t in docs if held_out(r)]
    if args.heldout_only:
        tok = Tokenizer.from_file(os.path.join(args.tok_out, "tokenizer.json"))
        eot = tok.token_to_id("<|endoftext|>")
        ids = []
        for enc in tok.encode_batch([t for _, t in held], add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eot)
        np.asarray(ids, dtype=np.uint16).tofile(os.path.join(args.out, "heldout.bin"))
        with open(os.path.join(args.out, "heldout_files.txt"), "w") as f:
            f.write("\n".join(r for r, _ in held) + "\n")
        print(f"held out: {len(held)} files, {len(ids)} tokens")
        return
    rng = random.Random(1234)
    chats = chat_examples(train, args.chats, rng)
    print(f"{len(docs)} files ({sum(len(t) for _, t in docs)/1e6:.1f} MB), train {len(train)}, held out {len(held)}, chats {len(chats)}")

    # Tokenizer: trained on a deterministic sample of training text only.
    sample, n = [], 0
    order = list(range(len(train)))
    rng.shuffle(order)
    for i in order:
        sample.append(unicodedata.normalize("NFC", train[i][1]))
        n += len(train[i][1])
        if n >= args.tok_train_bytes:
            break
    sample += chats[:1000]
    tok = train_tokenizer(sample, args.bpe_vocab)
    tok.save(os.path.join(args.tok_out, "tokenizer.json"))
    with open(os.path.join(args.tok_out, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(tok, 4096), f, indent=2)
    print(f"tokenizer: {tok.get_vocab_size()} entries ({time.time()-t0:.0f}s)")

    eot = tok.token_to_id("<|endoftext|>")

    def encode(texts):
        ids = []
        for enc in tok.encode_batch(texts, add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eot)
        return np.asarray(ids, dtype=np.uint16)

    # Interleave chats with the code files so each shard of the stream holds some.
    train_texts = [t for _, t in train]
    rng.shuffle(train_texts)
    step = max(1, len(train_texts) // max(1, len(chats)))
    mixed = []
    ci = 0
    for i, t in enumerate(train_texts):
        mixed.append(t)
        if i % step == 0 and ci < len(chats):
            mixed.append(chats[ci])
            ci += 1
    mixed += chats[ci:]
    tr = encode(mixed)
    ho = encode([t for _, t in held])
    tr.tofile(os.path.join(args.out, "train.bin"))
    ho.tofile(os.path.join(args.out, "heldout.bin"))
    with open(os.path.join(args.out, "heldout_files.txt"), "w") as f:
        f.write("\n".join(r for r, _ in held) + "\n")
    stats = {
        "files": len(docs),
        "train_files": len(train),
        "heldout_files": len(held),
        "chats": len(chats),
        "train_bytes": sum(len(t) for t in mixed),
        "train_tokens": int(tr.size),
        "heldout_bytes": sum(len(t) for _, t in held),
        "heldout_tokens": int(ho.size),
        "vocab": tok.get_vocab_size(),
    }
    json.dump(stats, open(os.path.join(args.out, "stats.json"), "w"), indent=2)
    print(json.dumps(stats), f"({time.time()-t0:.0f}s)")


if __name__ == "__main__":
    main()
