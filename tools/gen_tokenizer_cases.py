#!/usr/bin/env python3
"""Generate tokenizer test cases for the small BPE of the reference models.

Reads the Hugging Face tokenizer of the small vocabulary shared by every
`shared/reference/models/tiny-*.gguf` (`models/small_bpe/tokenizer.json`) and writes one JSON
object per line:

* `text`: the input string,
* `ids`: `tokenizer.encode(text, add_special_tokens=False).ids` (added tokens recognised),
* `ids_plain`: the same with `encode_special_tokens = True` (tokens flagged special, i.e.
  `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, are tokenized as text; `<think>` and the
  other non-special added tokens are still matched),
* `decoded`: `tokenizer.decode(ids, skip_special_tokens=False)`.

The texts are fixed strings (code, prose, whitespace runs, CRLF, unicode, non-NFC input,
special tokens inside text) plus seeded random concatenations of them, so the output is
reproducible. Usage (needs `pip install tokenizers`):

    python3 tools/gen_tokenizer_cases.py \
        --tokenizer ../shared/reference/models/small_bpe/tokenizer.json \
        --out crates/tokenizer/tests/data/small_bpe_cases.jsonl
"""

import argparse
import json
import random
from pathlib import Path

from tokenizers import Tokenizer

BASE_TEXTS = [
    # Prose
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Rust's ownership rules make memory safety a compile-time property.",
    "It's a test; they're fine, we've done it, I'm sure you'll see what he'd say.",
    "IT'S LOUD. THEY'RE SHOUTING, WE'VE HEARD, I'M DEAF, YOU'LL SEE, HE'D KNOW.",
    "Permission is hereby granted, free of charge, to any person obtaining a copy",
    "This program is distributed in the hope that it will be useful, but WITHOUT ANY WARRANTY.",
    "In 1969, Apollo 11 landed on the Moon; 3.14159 and 2,718,281 are numbers.",
    "Version 0.1.0-beta+build.42 released on 2024-05-17T12:34:56Z.",
    "e-mail: someone@example.com, URL: https://www.example.org/path?q=1&r=two#frag",
    # Code
    "import os\n\ndef read_lines(path):\n    with open(path) as f:\n        return [line.strip() for line in f]\n",
    "class Foo(Base):\n    \"\"\"Docstring.\"\"\"\n\n    def __init__(self, x: int = 0) -> None:\n        self._x = x\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!(\"{:?}\", v);\n}\n",
    "impl<'a, T: Clone + 'a> Iterator for Iter<'a, T> {\n    type Item = &'a T;\n}",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); return 0; }",
    "const f = async (a, b) => { await g(a ?? b); return a?.b ?? [...c]; };",
    "if (x != y && z >= 10 || !flag) { y <<= 2; x >>= 1; } // comment",
    "SELECT id, name FROM users WHERE age > 30 ORDER BY name DESC;",
    "$ cargo build --release 2>&1 | tee build.log",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null, \"b\": true}}",
    "x=1;y=2;z=x+y*3/4-5%6**7",
    # Whitespace runs
    "a  b   c    d     e",
    "  leading spaces and trailing spaces   ",
    "\t\ttabs\tin\t\ttext\t",
    "\n\n\nthree newlines then text\n\n",
    "          ",
    " ",
    "\n",
    "line one\n    indented line\n\tTabbed line\n  \n",
    "word \n\n  word2  \n",
    "spaces before newline   \nnext",
    "x" + " " * 40 + "y",
    "-" * 80,
    "=" * 64,
    # CRLF
    "first line\r\nsecond line\r\n",
    "\r\n\r\n",
    "mixed\r\nline\nendings\rhere",
    "   \r\n   indented after CRLF\r\n",
    "a\r\n\r\n\r\nb",
    # Unicode
    "naïve café résumé — déjà vu",
    "Grüße aus München, Straße",
    "中文分词测试：你好，世界！",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 텍스트입니다",
    "Привет, мир! Это тест.",
    "مرحبا بالعالم",
    "שלום עולם",
    "Ελληνικά γράμματα αβγ",
    "emoji: 🦙🦀🐍 and 👍🏽 and 👨‍👩‍👧‍👦 and 🇩🇪🇯🇵",
    "math: ∀x ∈ ℝ, x² ≥ 0; ∑ᵢ aᵢ ≠ ∞",
    "fullwidth １２３ ＡＢＣ",
    "no-break\u00a0space and\u200bzero width and soft\u00adhyphen",
    "control chars \x00\x01\x07\x1b[0m\x7f end",
    "❤️ ✓ ✗ → ← ↑ ↓ • … ©®™",
    # Non-NFC input (decomposed; NFC composes it)
    "e\u0301",
    "cafe\u0301 na\u0131\u0308ve",
    "A\u030a vs \u00c5 vs \u212b",
    "a\u0308o\u0308u\u0308",
    "\u1100\u1161\u11a8",
    "n\u0303 in man\u0303ana",
    "\u1e9b\u0323 (long s with dots)",
    # Special and added tokens in text
    "<|endoftext|>",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more text<|endoftext|>",
    "<think>\nLet me think.\n</think>\n\nThe answer is 42.",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
    "<|im_start|><|im_end|><think></think>",
    "not special: <|im_start, <im_end|>, <|endoftext |>, < think>",
    "<<|im_end|>>",
    "[PAD4103] is padding",
    "<|im_start|>user\n<think>nested</think><|im_end|>",
    # Long words, digits
    "supercalifragilisticexpialidocious pneumonoultramicroscopicsilicovolcanoconiosis",
    "1234567890 00000 3.0e-10 0x1F 0b1010 1_000_000",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
]


def build_texts(seed: int, n_random: int) -> list[str]:
    """The base texts, then `n_random` concatenations of 2–4 of them with random joiners."""
    rng = random.Random(seed)
    texts = list(BASE_TEXTS)
    joiners = ["", " ", "\n", "\r\n", "\t", "  ", "\n\n"]
    for _ in range(n_random):
        parts = rng.sample(BASE_TEXTS, rng.randint(2, 4))
        text = parts[0]
        for part in parts[1:]:
            text += rng.choice(joiners) + part
        texts.append(text)
    return texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", required=True, type=Path, help="small_bpe/tokenizer.json")
    ap.add_argument("--out", required=True, type=Path, help="output JSONL")
    ap.add_argument("--seed", type=int, default=20240517)
    ap.add_argument("--random", type=int, default=60, help="number of random concatenations")
    args = ap.parse_args()

    plain = Tokenizer.from_file(str(args.tokenizer))
    special = Tokenizer.from_file(str(args.tokenizer))
    plain.encode_special_tokens = True

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as f:
        for text in build_texts(args.seed, args.random):
            ids = special.encode(text, add_special_tokens=False).ids
            case = {
                "text": text,
                "ids": ids,
                "ids_plain": plain.encode(text, add_special_tokens=False).ids,
                "decoded": special.decode(ids, skip_special_tokens=False),
            }
            f.write(json.dumps(case, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
