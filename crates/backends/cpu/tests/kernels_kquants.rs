//! Kernel tests against the ggml fixtures in `shared/reference/quant` (four levels up: this crate sits
//! at `crates/backends/cpu`) and the scalar reference
//! dequantizers of `redlite-gguf`.

use redlite_cpu::kernels::q8::{quantize_row_q8_0, quantize_row_q8_k, BlockQ8K, BlockQ8_0};
use std::path::PathBuf;

fn fixture_dir() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../../shared/reference/quant"
    ))
}

fn read_fixture(name: &str) -> Vec<u8> {
    let path = fixture_dir().join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("reading fixture {}: {e}", path.display()))
}

fn read_f32(name: &str) -> Vec<f32> {
    read_fixture(name)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// `Q8_K.src.f32` → `quantize_row_q8_K_ref` → `Q8_K.quant`, byte for byte (bsums included).
#[test]
fn q8_k_quantizer_matches_ggml_bitwise() {
    let src = read_f32("Q8_K.src.f32");
    let want = read_fixture("Q8_K.quant");
    assert_eq!(src.len(), 16 * 512);
    assert_eq!(want.len(), src.len() / 256 * 292);
    let mut blocks = vec![BlockQ8K::ZERO; src.len() / 256];
    quantize_row_q8_k(&src, &mut blocks);
    for (i, (b, w)) in blocks.iter().zip(want.chunks_exact(292)).enumerate() {
        assert_eq!(&b.to_bytes()[..], w, "Q8_K block {i} differs from ggml");
    }
}

/// `Q8_0.src.f32` → `quantize_row_q8_0_ref` → `Q8_0.quant`, byte for byte.
#[test]
fn q8_0_quantizer_matches_ggml_bitwise() {
    let src = read_f32("Q8_0.src.f32");
    let want = read_fixture("Q8_0.quant");
    assert_eq!(want.len(), src.len() / 32 * 34);
    let mut blocks = vec![BlockQ8_0::ZERO; src.len() / 32];
    quantize_row_q8_0(&src, &mut blocks);
    for (i, (b, w)) in blocks.iter().zip(want.chunks_exact(34)).enumerate() {
        assert_eq!(&b.to_bytes()[..], w, "Q8_0 block {i} differs from ggml");
    }
}

/// The built-in self-test: every kernel at every supported ISA level against the reference
/// dequantizers, SIMD vs scalar, and matmul rows bit-identical to matvec.
#[test]
fn selftest_passes() {
    let results = redlite_cpu::kernels::selftest::selftest_all();
    let mut failed = 0;
    for r in &results {
        println!("{r}");
        if !r.passed {
            failed += 1;
        }
    }
    assert!(!results.is_empty());
    assert_eq!(
        failed, 0,
        "{failed} self-test comparisons failed (see the output)"
    );
}
