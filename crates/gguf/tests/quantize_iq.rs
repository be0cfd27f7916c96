//! Bit-exactness of the IQ2_XXS and IQ1_M quantizers against ggml's `ggml_quantize_chunk`:
//! the shared fixtures (`shared/reference/quant/<T>.src.f32` → `<T>.quant`, 16 × 512 values;
//! IQ2_XXS with its all-ones imatrix, IQ1_M without) and the harder local set in
//! `tests/data/quant_iq/` (f16-rounded weights, ties, outliers, zeros, a non-uniform imatrix;
//! made by `tools/gen_quant_iq_fixtures.py`).

mod common;

use std::path::PathBuf;

use common::{compare, local_data, read, read_f32, reference, N_PER_ROW};
use redlite_gguf::quant::{quantize, GgmlType};

/// Quantizes `src` and compares with `expected`, naming the first differing block and byte.
fn assert_bit_exact(
    what: &str,
    ty: GgmlType,
    src: &[f32],
    imatrix: Option<&[f32]>,
    expected: &[u8],
) {
    let got = quantize(ty, src, N_PER_ROW, imatrix)
        .unwrap_or_else(|e| panic!("{what}: quantize failed: {e}"));
    if let Err(e) = compare(ty, what, &got, expected) {
        panic!("{e}");
    }
}

#[test]
fn iq2_xxs_matches_reference_fixture() {
    let dir = reference("quant");
    let src = read_f32(&dir.join("IQ2_XXS.src.f32"));
    let imatrix = read_f32(&dir.join("IQ2_XXS.imatrix.f32"));
    assert_eq!(src.len(), 16 * N_PER_ROW);
    assert_eq!(imatrix.len(), N_PER_ROW);
    let expected = read(&dir.join("IQ2_XXS.quant"));
    assert_bit_exact(
        "IQ2_XXS reference",
        GgmlType::IQ2XXS,
        &src,
        Some(&imatrix),
        &expected,
    );
}

#[test]
fn iq1_m_matches_reference_fixture() {
    let dir = reference("quant");
    let src = read_f32(&dir.join("IQ1_M.src.f32"));
    assert_eq!(src.len(), 16 * N_PER_ROW);
    // Made without imatrix (index.json: requires_imatrix false, no imatrix_file).
    assert!(!dir.join("IQ1_M.imatrix.f32").exists());
    let expected = read(&dir.join("IQ1_M.quant"));
    assert_bit_exact("IQ1_M reference", GgmlType::IQ1M, &src, None, &expected);
}

#[test]
fn iq2_xxs_matches_ggml_with_non_uniform_imatrix() {
    let dir = local_data("quant_iq");
    let src = read_f32(&dir.join("src.f32"));
    let imatrix = read_f32(&dir.join("imatrix.f32"));
    let expected = read(&dir.join("IQ2_XXS.im.quant"));
    assert_bit_exact(
        "IQ2_XXS local, imatrix",
        GgmlType::IQ2XXS,
        &src,
        Some(&imatrix),
        &expected,
    );
}

#[test]
fn iq1_m_matches_ggml_with_and_without_imatrix() {
    let dir = local_data("quant_iq");
    let src = read_f32(&dir.join("src.f32"));
    let imatrix = read_f32(&dir.join("imatrix.f32"));
    let plain = read(&dir.join("IQ1_M.quant"));
    assert_bit_exact("IQ1_M local", GgmlType::IQ1M, &src, None, &plain);
    let weighted = read(&dir.join("IQ1_M.im.quant"));
    assert_bit_exact(
        "IQ1_M local, imatrix",
        GgmlType::IQ1M,
        &src,
        Some(&imatrix),
        &weighted,
    );
}

#[test]
fn iq2_xxs_without_imatrix_is_refused() {
    let src = vec![0.5f32; N_PER_ROW];
    assert!(quantize(GgmlType::IQ2XXS, &src, N_PER_ROW, None).is_err());
}

#[test]
fn all_zero_rows_quantize_to_zero_bytes() {
    let src = vec![0f32; N_PER_ROW];
    let ones = vec![1f32; N_PER_ROW];
    for (ty, im) in [
        (GgmlType::IQ2XXS, Some(&ones[..])),
        (GgmlType::IQ1M, None),
        (GgmlType::IQ1M, Some(&ones[..])),
    ] {
        let out = quantize(ty, &src, N_PER_ROW, im).unwrap();
        assert!(out.iter().all(|&b| b == 0), "{ty:?}");
    }
}

#[test]
fn non_finite_input_does_not_panic() {
    // ggml aborts on some of these (IQ2_XXS asserts); we only promise no panic and full output.
    let mut src: Vec<f32> = (0..N_PER_ROW).map(|i| (i as f32 * 0.37).sin()).collect();
    src[3] = f32::NAN;
    src[40] = f32::INFINITY;
    src[300] = f32::NEG_INFINITY;
    src[400] = f32::MAX;
    let ones = vec![1f32; N_PER_ROW];
    for (ty, im) in [
        (GgmlType::IQ2XXS, Some(&ones[..])),
        (GgmlType::IQ1M, None),
        (GgmlType::IQ1M, Some(&ones[..])),
    ] {
        let out = quantize(ty, &src, N_PER_ROW, im).unwrap();
        assert_eq!(out.len(), N_PER_ROW / 256 * ty.block_bytes(), "{ty:?}");
    }
}

/// A larger set from `tools/gen_quant_iq_fixtures.py --repeat R --out DIR`, checked with
/// `REDLITE_QUANT_IQ_FIXTURES=DIR cargo test --release -p redlite-gguf --test quantize_iq -- --ignored`.
#[test]
#[ignore = "needs REDLITE_QUANT_IQ_FIXTURES=DIR made by tools/gen_quant_iq_fixtures.py"]
fn larger_generated_set_matches_ggml() {
    let dir = PathBuf::from(
        std::env::var("REDLITE_QUANT_IQ_FIXTURES").expect("set REDLITE_QUANT_IQ_FIXTURES=DIR"),
    );
    let src = read_f32(&dir.join("src.f32"));
    let imatrix = read_f32(&dir.join("imatrix.f32"));
    for (file, ty, im) in [
        ("IQ2_XXS.im.quant", GgmlType::IQ2XXS, Some(&imatrix[..])),
        ("IQ1_M.quant", GgmlType::IQ1M, None),
        ("IQ1_M.im.quant", GgmlType::IQ1M, Some(&imatrix[..])),
    ] {
        let t = std::time::Instant::now();
        assert_bit_exact(file, ty, &src, im, &read(&dir.join(file)));
        eprintln!(
            "{file}: {} values bit-exact in {:?}",
            src.len(),
            t.elapsed()
        );
    }
}

/// Single-thread throughput on 512 rows × 2048 normal values with a log-normal imatrix (tables
/// built before timing), extrapolated to one 80B routed-expert tensor (512 × 2048 × 512 values):
/// `cargo test --release -p redlite-gguf --test quantize_iq -- --ignored throughput --nocapture`.
#[test]
#[ignore = "timing, not a check"]
fn throughput() {
    let n_per_row = 2048;
    let rows = 512;
    // Deterministic normal-ish data (sum of uniforms) and importances spanning decades.
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut uniform = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32
    };
    let src: Vec<f32> = (0..rows * n_per_row)
        .map(|_| ((0..4).map(|_| uniform()).sum::<f32>() - 2.0) * 0.05)
        .collect();
    let imatrix: Vec<f32> = (0..n_per_row)
        .map(|_| (uniform() * 8.0 - 4.0).exp())
        .collect();
    let expert_values = 512.0 * 2048.0 * 512.0;
    for (ty, im) in [
        (GgmlType::IQ2XXS, Some(&imatrix[..])),
        (GgmlType::IQ1M, Some(&imatrix[..])),
        (GgmlType::IQ1M, None),
    ] {
        quantize(ty, &src[..n_per_row], n_per_row, im).unwrap(); // build the tables
        let t = std::time::Instant::now();
        quantize(ty, &src, n_per_row, im).unwrap();
        let secs = t.elapsed().as_secs_f64();
        let rate = src.len() as f64 / secs;
        eprintln!(
            "{ty:?} imatrix={}: {:.2} M values/s, one 80B expert tensor ≈ {:.0} s single-threaded",
            im.is_some(),
            rate / 1e6,
            expert_values / rate
        );
    }
}
