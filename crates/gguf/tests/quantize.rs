//! Bit-exactness of the quantizers (f32 → ggml blocks) against ggml's `ggml_quantize_chunk`.
//!
//! * `../shared/reference/quant/<T>.quant`: 16 × 512 normal values, no imatrix.
//! * `tests/data/quant/`: harder rows (heavy tails, all-positive, zeros, 1e3 / 1e-5 scales,
//!   ties, …) with and without a strongly non-uniform imatrix, recorded from libggml by
//!   `tools/gen_quant_fixtures.py`. A larger set made by the same script can be checked with
//!   `REDLITE_QUANT_FIXTURES=DIR cargo test -p redlite-gguf --test quantize -- --ignored`.

mod common;

use std::path::Path;

use common::{compare, local_data, read, read_f32, reference, N_PER_ROW};
use redlite_gguf::quant::{dequantize_to_vec, quantize, GgmlType, QuantizeError};

/// The types this file covers (the IQ2_XXS / IQ1_M quantizers have their own tests).
const TYPES: [GgmlType; 5] = [
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::IQ4XS,
];
#[test]
fn reference_fixtures_without_imatrix_are_bit_exact() {
    let dir = reference("quant");
    let mut failures = Vec::new();
    for ty in TYPES {
        let name = ty.name();
        let src = read_f32(&dir.join(format!("{name}.src.f32")));
        let want = read(&dir.join(format!("{name}.quant")));
        let got = quantize(ty, &src, N_PER_ROW, None).expect("quantize");
        if let Err(e) = compare(ty, name, &got, &want) {
            failures.push(e);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Checks every type in a directory written by `tools/gen_quant_fixtures.py`.
fn check_local_set(dir: &Path) {
    let src = read_f32(&dir.join("src.f32"));
    let imatrix = read_f32(&dir.join("imatrix.f32"));
    assert_eq!(imatrix.len(), N_PER_ROW);
    let mut failures = Vec::new();
    for ty in TYPES {
        let name = ty.name();
        for (suffix, im) in [("quant", None), ("im.quant", Some(&imatrix[..]))] {
            let want = read(&dir.join(format!("{name}.{suffix}")));
            let got = quantize(ty, &src, N_PER_ROW, im).expect("quantize");
            if let Err(e) = compare(ty, &format!("{name}.{suffix}"), &got, &want) {
                failures.push(e);
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn hard_rows_with_and_without_imatrix_are_bit_exact() {
    check_local_set(&local_data("quant"));
}

#[test]
#[ignore = "needs REDLITE_QUANT_FIXTURES=DIR made by tools/gen_quant_fixtures.py"]
fn external_fixture_set_is_bit_exact() {
    let dir = std::env::var("REDLITE_QUANT_FIXTURES").expect("set REDLITE_QUANT_FIXTURES");
    check_local_set(Path::new(&dir));
}

/// Σ w·(x − x̂)² / Σ w over all rows (w = the imatrix, per column).
fn weighted_mse(ty: GgmlType, src: &[f32], q: &[u8], w: &[f32]) -> f64 {
    let back = dequantize_to_vec(ty, q).expect("dequantize");
    let (mut num, mut den) = (0f64, 0f64);
    for (i, (a, b)) in src.iter().zip(&back).enumerate() {
        let wi = f64::from(w[i % N_PER_ROW]);
        num += wi * f64::from(a - b).powi(2);
        den += wi;
    }
    num / den
}

/// The imatrix path must spend its precision where the importance is: on a strongly
/// non-uniform imatrix its weighted error is below the plain quantizer's (Q8_0 ignores it).
#[test]
fn imatrix_lowers_the_weighted_error() {
    let src = read_f32(&reference("quant").join("Q4_K.src.f32"));
    // Importance varies over 4 decades along the row, in a pattern unrelated to the data.
    let imatrix: Vec<f32> = (0..N_PER_ROW)
        .map(|i| 10f32.powf(2.0 * ((i as f32 * 0.37).sin() + (i as f32 * 0.011).cos()) / 2.0))
        .collect();
    for ty in TYPES {
        let plain = quantize(ty, &src, N_PER_ROW, None).unwrap();
        let weighted = quantize(ty, &src, N_PER_ROW, Some(&imatrix)).unwrap();
        let (e0, e1) = (
            weighted_mse(ty, &src, &plain, &imatrix),
            weighted_mse(ty, &src, &weighted, &imatrix),
        );
        if ty == GgmlType::Q8_0 {
            assert_eq!(plain, weighted, "Q8_0 ignores the imatrix, as ggml does");
        } else {
            assert!(
                e1 < e0,
                "{}: weighted MSE with imatrix {e1:.3e} is not below without {e0:.3e}",
                ty.name()
            );
        }
    }
}

#[test]
fn bad_shapes_and_types_are_errors() {
    let src = vec![0.5f32; 1024];
    for ty in TYPES {
        let block = ty.block_elems();
        assert_eq!(
            quantize(ty, &src[..block + 1], block + 1, None),
            Err(QuantizeError::RowNotBlockMultiple {
                ty,
                n_per_row: block + 1,
                block
            })
        );
        assert_eq!(
            quantize(ty, &src, 0, None),
            Err(QuantizeError::RowNotBlockMultiple {
                ty,
                n_per_row: 0,
                block
            })
        );
        assert_eq!(
            quantize(ty, &src[..768], 512, None),
            Err(QuantizeError::NotWholeRows {
                len: 768,
                n_per_row: 512
            })
        );
        assert_eq!(
            quantize(ty, &src, 512, Some(&src[..256])),
            Err(QuantizeError::ImatrixLength {
                got: 256,
                n_per_row: 512
            })
        );
    }
    for ty in [GgmlType::Q4_0, GgmlType::Q2K, GgmlType::IQ3S, GgmlType::Q8K] {
        let err = quantize(ty, &src, 512, None).unwrap_err();
        assert_eq!(err, QuantizeError::Unsupported(ty));
        assert!(err.to_string().contains("Q4_K"), "{err}");
    }
}

#[test]
fn output_has_the_row_size_of_each_type() {
    let src: Vec<f32> = (0..2048).map(|i| (i as f32 * 0.1).sin()).collect();
    for ty in TYPES {
        let q = quantize(ty, &src, 1024, None).unwrap();
        assert_eq!(
            q.len(),
            2 * 1024 / ty.block_elems() * ty.block_bytes(),
            "{}",
            ty.name()
        );
    }
}

/// Throughput of each quantizer on one thread (`-- --ignored --nocapture throughput`).
#[test]
#[ignore = "timing only"]
fn throughput() {
    let n = 4096 * 1024;
    let src: Vec<f32> = (0..n)
        .map(|i| ((i as f32 * 0.618).sin() * 1.7 + (i as f32 * 0.0137).cos()) * 0.02)
        .collect();
    let imatrix: Vec<f32> = (0..4096).map(|i| 1.0 + (i % 7) as f32).collect();
    for ty in TYPES {
        for im in [None, Some(&imatrix[..])] {
            let t = std::time::Instant::now();
            let q = quantize(ty, &src, 4096, im).unwrap();
            let s = t.elapsed().as_secs_f64();
            println!(
                "{:>6} imatrix={:<5} {:6.1} M values/s ({} bytes)",
                ty.name(),
                im.is_some(),
                n as f64 / s / 1e6,
                q.len()
            );
        }
    }
}
