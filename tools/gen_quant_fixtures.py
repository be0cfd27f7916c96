#!/usr/bin/env python3
"""Record ggml's quantizer output (with and without an importance matrix) for redlite's tests.

The shared reference fixtures (shared/reference/quant/<T>.quant) cover Q8_0, Q4_K, Q5_K, Q6_K and
IQ4_XS without an imatrix only, on plain normal data. This script calls libggml's
`ggml_quantize_chunk` through ctypes (the libggml-base.so vendored in llama-cpp-python 0.3.36,
i.e. llama.cpp commit 0c1e570, the same build as the reference fixtures) on harder inputs and a
strongly non-uniform imatrix, and writes to crates/gguf/tests/data/quant/:
  * src.f32      : ROWS x N_PER_ROW float32, one kind of data per row (see `make_rows`);
  * imatrix.f32  : N_PER_ROW float32 importances (log-normal, spanning ~6 decades, some zeros);
  * <T>.quant    : ggml_quantize_chunk(T, src, ..., imatrix=NULL);
  * <T>.im.quant : ggml_quantize_chunk(T, src, ..., imatrix);
  * index.json   : shapes, seed, type list, library path and version.
The Rust test crates/gguf/tests/quantize.rs compares redlite's quantizers with these bytes.

Usage (from the repository root; needs numpy and llama-cpp-python 0.3.36):
    python3 tools/gen_quant_fixtures.py [--rows 12] [--seed 7] [--out DIR]
A larger --rows/--seed set written elsewhere can be checked with
    REDLITE_QUANT_FIXTURES=DIR cargo test --release -p redlite-gguf --test quantize -- --ignored
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "crates" / "gguf" / "tests" / "data" / "quant"
N_PER_ROW = 512
TYPES = {"Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_XS": 23}


def load_ggml() -> tuple[ctypes.CDLL, str]:
    import llama_cpp  # noqa: PLC0415 (only needed for its directory)

    path = Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"
    lib = ctypes.CDLL(str(path))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
    ]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    return lib, str(path)


def make_rows(rng: np.random.Generator, rows: int) -> np.ndarray:
    """Each row a different kind of data: the kinds cycle if rows > number of kinds."""
    n = N_PER_ROW
    kinds = [
        lambda: rng.standard_normal(n),
        lambda: rng.standard_t(2.0, n),  # heavy tails: outliers set the scales
        lambda: rng.uniform(0.0, 1.0, n),  # all positive: the K-quant min is 0
        lambda: -rng.uniform(0.5, 2.0, n),  # all negative
        lambda: rng.standard_normal(n) * 1e3,
        lambda: rng.standard_normal(n) * 1e-5,
        lambda: np.where(rng.uniform(size=n) < 0.7, 0.0, rng.standard_normal(n)),  # sparse
        lambda: np.concatenate([np.zeros(32), rng.standard_normal(n - 64), np.full(32, 0.25)]),
        lambda: rng.standard_normal(n) * np.repeat(rng.uniform(0.01, 3.0, n // 16), 16),
        lambda: np.round(rng.standard_normal(n) * 4) / 4,  # many exact ties
        lambda: rng.standard_normal(n) + 3.0,  # offset
        lambda: rng.laplace(0.0, 0.02, n),
        lambda: rng.standard_normal(n) * 1e-37,  # Q8_0: subnormal d, infinite 1/d
        lambda: rng.standard_normal(n) * 1e20,  # huge: x² overflows f32 to inf
    ]
    return np.stack([kinds[i % len(kinds)]() for i in range(rows)]).astype(np.float32)


def make_imatrix(rng: np.random.Generator) -> np.ndarray:
    im = np.exp(rng.normal(0.0, 2.5, N_PER_ROW))
    im[rng.choice(N_PER_ROW, 8, replace=False)] = 0.0
    im[64:96] = 0.0  # a whole sub-block without importance
    return im.astype(np.float32)


def quantize(lib: ctypes.CDLL, ty: int, src: np.ndarray, imatrix: np.ndarray | None) -> bytes:
    rows = src.shape[0]
    dst = np.zeros(lib.ggml_row_size(ty, N_PER_ROW) * rows, dtype=np.uint8)
    src = np.ascontiguousarray(src, dtype=np.float32)
    im_ptr = None if imatrix is None else imatrix.ctypes.data
    lib.ggml_quantize_chunk(ty, src.ctypes.data, dst.ctypes.data, 0, rows, N_PER_ROW, im_ptr)
    return dst.tobytes()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=14)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()

    lib, lib_path = load_ggml()
    rng = np.random.default_rng(args.seed)
    src = make_rows(rng, args.rows)
    imatrix = make_imatrix(rng)
    args.out.mkdir(parents=True, exist_ok=True)
    src.tofile(args.out / "src.f32")
    imatrix.tofile(args.out / "imatrix.f32")
    for name, ty in TYPES.items():
        lib.ggml_quantize_init(ty)
        (args.out / f"{name}.quant").write_bytes(quantize(lib, ty, src, None))
        (args.out / f"{name}.im.quant").write_bytes(quantize(lib, ty, src, imatrix))
    index = {
        "rows": args.rows,
        "n_per_row": N_PER_ROW,
        "seed": args.seed,
        "types": list(TYPES),
        "generator": "tools/gen_quant_fixtures.py",
        "ggml": f"{Path(lib_path).name} from llama-cpp-python "
        f"{importlib.metadata.version('llama_cpp_python')} (llama.cpp 0c1e570)",
    }
    (args.out / "index.json").write_text(json.dumps(index, indent=1) + "\n")


if __name__ == "__main__":
    main()
