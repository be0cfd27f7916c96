#!/usr/bin/env python3
"""Record ggml's IQ2_XXS and IQ1_M quantizer output on harder data, with a non-uniform imatrix.

The shared fixtures (shared/reference/quant/IQ2_XXS.quant, IQ1_M.quant) use normal data with a
uniform imatrix (IQ2_XXS) or none (IQ1_M). The recipes quantize real, f16-rounded weights with a
real importance matrix, so this script calls `ggml_quantize_chunk` of the libggml-base.so vendored
in llama-cpp-python 0.3.36 (llama.cpp 0c1e570, the build of the shared fixtures) through ctypes and
writes to crates/gguf/tests/data/quant_iq/:
  * src.f32           ROWS x 512 float32, one kind of data per row (`rows` below);
  * imatrix.f32       512 float32 importances (log-normal over ~5 decades, some zeros);
  * IQ2_XXS.im.quant  with the imatrix (ggml refuses IQ2_XXS without one);
  * IQ1_M.quant       without imatrix;  IQ1_M.im.quant  with it;
  * index.json        shapes, seed and library.
crates/gguf/tests/quantize_iq.rs compares redlite's quantizers with these bytes.

Usage (repository root; needs numpy and llama-cpp-python 0.3.36):
    python3 tools/gen_quant_iq_fixtures.py [--repeat R] [--seed S] [--out DIR]
A larger set (--repeat: each kind of row R times) written elsewhere is checked with
    REDLITE_QUANT_IQ_FIXTURES=DIR cargo test --release -p redlite-gguf --test quantize_iq -- --ignored
"""

import argparse
import ctypes
import importlib.metadata
import json
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent.parent / "crates" / "gguf" / "tests" / "data" / "quant_iq"
N = 512
SEED = 2911
TYPES = {"IQ2_XXS": (16, 66), "IQ1_M": (29, 56)}


def rows(rng, repeat):
    f16 = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731 (real weights are f16)
    zero_sub = rng.standard_normal(N)
    zero_sub[32:64] = 0.0  # one all-zero sub-block for both types
    kinds = [
        f16(rng.standard_normal(N) * 0.02),
        f16(rng.laplace(0.0, 0.01, N)),  # peaked: ties after f16 rounding
        np.round(rng.standard_normal(N) * 3) / 3,  # many exact ties in every sort
        rng.standard_t(2.5, N),  # outliers
        rng.uniform(0.0, 1.0, N),  # all positive
        -rng.uniform(0.2, 1.0, N),  # all negative
        np.where(rng.uniform(size=N) < 0.8, 0.0, rng.standard_normal(N)),  # sparse
        zero_sub,
        rng.standard_normal(N) * np.repeat(np.exp(rng.normal(0, 1.5, N // 32)), 32),
        rng.standard_normal(N) * 1e3,
        rng.standard_normal(N) * 1e-4,
        rng.standard_normal(N) + 2.0,
        rng.standard_normal(N) * 3e-7,  # near IQ1_M's 1e-7 group threshold
        rng.standard_normal(N) * 2e-14,  # sums of squares underflow
        np.where(rng.uniform(size=N) < 0.02, 1.0, rng.standard_normal(N) * 1e-18),  # tiny + spikes
    ]
    more = [rows(rng, 1) for _ in range(repeat - 1)]
    return np.concatenate([np.stack(kinds).astype(np.float32), *more])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    import llama_cpp  # noqa: PLC0415 (for its lib directory)

    lib_path = Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"
    lib = ctypes.CDLL(str(lib_path))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]

    rng = np.random.default_rng(args.seed)
    src = np.ascontiguousarray(rows(rng, args.repeat))
    imatrix = np.exp(rng.normal(0.0, 2.0, N)).astype(np.float32)
    imatrix[rng.choice(N, 6, replace=False)] = 0.0
    args.out.mkdir(parents=True, exist_ok=True)
    src.tofile(args.out / "src.f32")
    imatrix.tofile(args.out / "imatrix.f32")

    def run(ty, block_bytes, im):
        dst = np.zeros(src.shape[0] * N // 256 * block_bytes, dtype=np.uint8)
        lib.ggml_quantize_init(ty)
        lib.ggml_quantize_chunk(ty, src.ctypes.data, dst.ctypes.data, 0, src.shape[0], N,
                                None if im is None else im.ctypes.data)
        return dst.tobytes()

    (args.out / "IQ2_XXS.im.quant").write_bytes(run(*TYPES["IQ2_XXS"], imatrix))
    (args.out / "IQ1_M.quant").write_bytes(run(*TYPES["IQ1_M"], None))
    (args.out / "IQ1_M.im.quant").write_bytes(run(*TYPES["IQ1_M"], imatrix))
    index = {
        "rows": int(src.shape[0]), "n_per_row": N, "seed": args.seed,
        "files": ["IQ2_XXS.im.quant", "IQ1_M.quant", "IQ1_M.im.quant"],
        "generator": "tools/gen_quant_iq_fixtures.py",
        "ggml": f"libggml-base.so from llama-cpp-python {importlib.metadata.version('llama_cpp_python')}"
                " (llama.cpp 0c1e570)",
    }
    (args.out / "index.json").write_text(json.dumps(index, indent=1) + "\n")


if __name__ == "__main__":
    main()
