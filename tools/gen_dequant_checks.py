#!/usr/bin/env python3
"""Record gguf-py's dequantization of the reference model files, for redlite's bit-exactness test.

For every `*.gguf` under shared/reference/models/ this dequantizes every tensor with gguf-py
(`gguf.quants.dequantize`) and writes, to crates/gguf/tests/data/dequant_checks.json:
  * a SHA-256 over the little-endian f32 values of all tensors, concatenated in file order;
  * the non-finite value count of every tensor that has any (expected: none);
  * samples: for each ggml type in the file, its first and its largest tensor, each with name, type,
    dims (ne0 first), absolute file offset, byte length, element count and the SHA-256 of its f32 values.
The Rust test (crates/gguf/tests/dequant_models.rs) recomputes all of it with redlite's dequantizers.

Usage (from the repository root; needs `pip install gguf numpy`, gguf 0.19.0 was used):
    python3 tools/gen_dequant_checks.py [--reference ../shared/reference] [--out PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_REFERENCE = ROOT.parent / "shared" / "reference"
DEFAULT_OUT = ROOT / "crates" / "gguf" / "tests" / "data" / "dequant_checks.json"


def f32_bytes(tensor) -> bytes:
    """gguf-py's dequantization of `tensor` as little-endian f32 bytes, in file (row-major) order."""
    values = dequantize(tensor.data, tensor.tensor_type)
    return np.ascontiguousarray(values, dtype="<f4").tobytes()


def check_file(path: Path, reference: Path) -> dict:
    reader = GGUFReader(path)
    whole = hashlib.sha256()
    n_values = 0
    nonfinite: dict[str, int] = {}
    per_type: dict[str, list[dict]] = {}
    for t in reader.tensors:
        data = f32_bytes(t)
        whole.update(data)
        values = np.frombuffer(data, dtype="<f4")
        n_values += values.size
        bad = int(values.size - np.count_nonzero(np.isfinite(values)))
        if bad:
            nonfinite[t.name] = bad
        per_type.setdefault(t.tensor_type.name, []).append(
            {
                "name": t.name,
                "type": t.tensor_type.name,
                "dims": [int(d) for d in t.shape],
                "offset": int(t.data_offset),
                "n_bytes": int(t.n_bytes),
                "n_elements": int(t.n_elements),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )
    samples = []
    for ty in sorted(per_type):
        entries = per_type[ty]
        first = entries[0]
        largest = max(entries, key=lambda e: e["n_elements"])
        samples.append(first)
        if largest is not first:
            samples.append(largest)
    return {
        "file": path.relative_to(reference).as_posix(),
        "size": path.stat().st_size,
        "n_tensors": len(reader.tensors),
        "type_counts": {ty: len(v) for ty, v in sorted(per_type.items())},
        "n_values": n_values,
        "all_sha256": whole.hexdigest(),
        "nonfinite": nonfinite,
        "samples": samples,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", type=Path, default=DEFAULT_REFERENCE)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()

    reference = args.reference.resolve()
    files = sorted((reference / "models").glob("*.gguf"))
    if not files:
        raise SystemExit(f"no .gguf files under {reference / 'models'}")
    checks = {
        "generator": "tools/gen_dequant_checks.py",
        "gguf_py_version": importlib.metadata.version("gguf"),
        "note": "sha256 of little-endian f32 values from gguf.quants.dequantize; offsets are absolute file offsets",
        "files": [check_file(f, reference) for f in files],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(checks, indent=1) + "\n")
    total = sum(len(f["samples"]) for f in checks["files"])
    print(f"wrote {args.out}: {len(files)} files, {total} sampled tensors")


if __name__ == "__main__":
    main()
