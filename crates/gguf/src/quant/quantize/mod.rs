//! Quantizers: f32 rows → ggml blocks, bit-exact with ggml's `ggml_quantize_chunk` (same f32
//! operations in the same order, so the bytes match `../shared/reference/quant/*.quant`).
//!
//! One file per family; each exposes `quantize_row_<type>(row, imatrix, out)` where `row` is one
//! tensor row (a multiple of the block size), `imatrix` the optional per-column importance
//! (length = row length) and `out` exactly that row's bytes.

mod common;
mod iq1_m;
mod iq2_xxs;
mod iq4_xs;
mod iq_grid;
mod kquants;
mod q8_0;

use super::types::GgmlType;

/// Why a quantization could not be done.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QuantizeError {
    #[error("quantizing to {0:?} is not supported (supported: {supported})", supported = supported_names())]
    Unsupported(GgmlType),
    #[error("{ty:?} needs an importance matrix (imatrix) to quantize")]
    NeedsImatrix { ty: GgmlType },
    #[error("row length {n_per_row} is not a multiple of {ty:?}'s block size {block}")]
    RowNotBlockMultiple {
        ty: GgmlType,
        n_per_row: usize,
        block: usize,
    },
    #[error("{len} values is not a whole number of rows of {n_per_row}")]
    NotWholeRows { len: usize, n_per_row: usize },
    #[error("imatrix has {got} values, the row length is {n_per_row}")]
    ImatrixLength { got: usize, n_per_row: usize },
}

/// The types [`quantize`] can produce.
pub const QUANTIZE_TYPES: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::IQ4XS,
    GgmlType::IQ2XXS,
    GgmlType::IQ1M,
];

fn supported_names() -> String {
    QUANTIZE_TYPES
        .iter()
        .map(|t| t.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether ggml refuses to quantize `ty` without an importance matrix
/// (`ggml_quantize_requires_imatrix`).
pub fn requires_imatrix(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::IQ2XXS | GgmlType::IQ2XS | GgmlType::IQ1S)
}

/// Quantize `src` (rows of `n_per_row` values) to `ty`, as `ggml_quantize_chunk` does.
pub fn quantize(
    ty: GgmlType,
    src: &[f32],
    n_per_row: usize,
    imatrix: Option<&[f32]>,
) -> Result<Vec<u8>, QuantizeError> {
    if !QUANTIZE_TYPES.contains(&ty) {
        return Err(QuantizeError::Unsupported(ty));
    }
    let block = ty.block_elems();
    if n_per_row == 0 || !n_per_row.is_multiple_of(block) {
        return Err(QuantizeError::RowNotBlockMultiple {
            ty,
            n_per_row,
            block,
        });
    }
    if !src.len().is_multiple_of(n_per_row) {
        return Err(QuantizeError::NotWholeRows {
            len: src.len(),
            n_per_row,
        });
    }
    if let Some(im) = imatrix {
        if im.len() != n_per_row {
            return Err(QuantizeError::ImatrixLength {
                got: im.len(),
                n_per_row,
            });
        }
    } else if requires_imatrix(ty) {
        return Err(QuantizeError::NeedsImatrix { ty });
    }
    let row_bytes = n_per_row / block * ty.block_bytes();
    let mut out = vec![0u8; src.len() / n_per_row * row_bytes];
    for (row, dst) in src
        .chunks_exact(n_per_row)
        .zip(out.chunks_exact_mut(row_bytes))
    {
        match ty {
            GgmlType::F32 => {
                for (v, d) in row.iter().zip(dst.chunks_exact_mut(4)) {
                    d.copy_from_slice(&v.to_le_bytes());
                }
            }
            GgmlType::F16 => {
                for (v, d) in row.iter().zip(dst.chunks_exact_mut(2)) {
                    d.copy_from_slice(&half::f16::from_f32(*v).to_bits().to_le_bytes());
                }
            }
            GgmlType::BF16 => {
                for (v, d) in row.iter().zip(dst.chunks_exact_mut(2)) {
                    d.copy_from_slice(&f32_to_bf16_bits(*v).to_le_bytes());
                }
            }
            GgmlType::Q8_0 => q8_0::quantize_row_q8_0(row, imatrix, dst),
            GgmlType::Q4K => kquants::quantize_row_q4_k(row, imatrix, dst),
            GgmlType::Q5K => kquants::quantize_row_q5_k(row, imatrix, dst),
            GgmlType::Q6K => kquants::quantize_row_q6_k(row, imatrix, dst),
            GgmlType::IQ4XS => iq4_xs::quantize_row_iq4_xs(row, imatrix, dst),
            GgmlType::IQ2XXS => iq2_xxs::quantize_row_iq2_xxs(row, imatrix, dst),
            GgmlType::IQ1M => iq1_m::quantize_row_iq1_m(row, imatrix, dst),
            _ => unreachable!("checked against QUANTIZE_TYPES above"),
        }
    }
    Ok(out)
}

/// ggml's `GGML_FP32_TO_BF16`: round to nearest even, NaN kept quiet.
fn f32_to_bf16_bits(v: f32) -> u16 {
    let u = v.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    ((u + (0x7fff + ((u >> 16) & 1))) >> 16) as u16
}
