//! Bit-exactness of the IQ2_XXS and IQ1_M quantizers against ggml's `ggml_quantize_chunk`:
//! the shared fixtures (`shared/reference/quant/<T>.src.f32` → `<T>.quant`, 16 × 512 values;
//! IQ2_XXS with its all-ones imatrix, IQ1_M without) and the harder local set in
//! `tests/data/quant_iq/` (f16-rounded weights, ties, outliers, zeros, a non-uniform imatrix;
//! made by `tools/gen_quant_iq_fixtures.py`).

use std::path::{Path, PathBuf};

use redlite_gguf::quant::{quantize, GgmlType};

const N_PER_ROW: usize = 512;

fn reference_dir() -> PathBuf {
    Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/reference/quant"
    ))
    .to_path_buf()
}

fn local_dir() -> PathBuf {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/quant_iq")).to_path_buf()
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn read_f32(path: &Path) -> Vec<f32> {
    read(path)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

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
    assert_eq!(got.len(), expected.len(), "{what}: output size");
    let bb = ty.block_bytes();
    let differing = got
        .chunks_exact(bb)
        .zip(expected.chunks_exact(bb))
        .filter(|(g, e)| g != e)
        .count();
    if let Some(pos) = got.iter().zip(expected).position(|(g, e)| g != e) {
        let block = pos / bb;
        panic!(
            "{what}: {differing} of {} blocks differ; first: block {block} (row {}), byte {} \
             (got {:#04x}, want {:#04x})\n got  {:02x?}\n want {:02x?}",
            got.len() / bb,
            block * ty.block_elems() / N_PER_ROW,
            pos % bb,
            got[pos],
            expected[pos],
            &got[block * bb..(block + 1) * bb],
            &expected[block * bb..(block + 1) * bb],
        );
    }
}

#[test]
fn iq2_xxs_matches_reference_fixture() {
    let dir = reference_dir();
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
    let dir = reference_dir();
    let src = read_f32(&dir.join("IQ1_M.src.f32"));
    assert_eq!(src.len(), 16 * N_PER_ROW);
    // Made without imatrix (index.json: requires_imatrix false, no imatrix_file).
    assert!(!dir.join("IQ1_M.imatrix.f32").exists());
    let expected = read(&dir.join("IQ1_M.quant"));
    assert_bit_exact("IQ1_M reference", GgmlType::IQ1M, &src, None, &expected);
}

#[test]
fn iq2_xxs_matches_ggml_with_non_uniform_imatrix() {
    let dir = local_dir();
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
    let dir = local_dir();
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
