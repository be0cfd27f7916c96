//! Whole-buffer dequantization: validates lengths, then runs the per-type block function over
//! every block. The block functions themselves live in `simple`, `kquants` and `iquants`.

use super::iquants::*;
use super::kquants::*;
use super::simple::*;
use super::types::GgmlType;

/// Why a buffer could not be dequantized.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DequantError {
    /// The input is not a whole number of blocks.
    #[error("{ty}: {len} bytes of data is not a whole number of {block_bytes}-byte blocks")]
    PartialBlock {
        ty: GgmlType,
        len: usize,
        block_bytes: usize,
    },
    /// The output slice does not have exactly one value per element of the input.
    #[error("{ty}: {blocks} blocks decode to {expected} values, but the output holds {got}")]
    OutputLength {
        ty: GgmlType,
        blocks: usize,
        expected: usize,
        got: usize,
    },
}

/// Decodes `data` (a whole number of `ty` blocks, as stored in a GGUF tensor) into `out`, which must
/// hold exactly `blocks × block_elems` values. Bit-exact with ggml's `to_float` / gguf-py's
/// `quants.dequantize` (same f32 operations in the same order, no fused multiply-add).
pub fn dequantize(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<(), DequantError> {
    let blocks = check_lengths(ty, data.len(), out.len())?;
    debug_assert_eq!(blocks * ty.block_elems(), out.len());
    match ty {
        GgmlType::F32 => run(ty, data, out, dequantize_block_f32),
        GgmlType::F16 => run(ty, data, out, dequantize_block_f16),
        GgmlType::BF16 => run(ty, data, out, dequantize_block_bf16),
        GgmlType::Q4_0 => run(ty, data, out, dequantize_block_q4_0),
        GgmlType::Q8_0 => run(ty, data, out, dequantize_block_q8_0),
        GgmlType::IQ4NL => run(ty, data, out, dequantize_block_iq4_nl),
        GgmlType::Q2K => run(ty, data, out, dequantize_block_q2_k),
        GgmlType::Q3K => run(ty, data, out, dequantize_block_q3_k),
        GgmlType::Q4K => run(ty, data, out, dequantize_block_q4_k),
        GgmlType::Q5K => run(ty, data, out, dequantize_block_q5_k),
        GgmlType::Q6K => run(ty, data, out, dequantize_block_q6_k),
        GgmlType::Q8K => run(ty, data, out, dequantize_block_q8_k),
        GgmlType::IQ4XS => run(ty, data, out, dequantize_block_iq4_xs),
        GgmlType::IQ3XXS => run(ty, data, out, dequantize_block_iq3_xxs),
        GgmlType::IQ3S => run(ty, data, out, dequantize_block_iq3_s),
        GgmlType::IQ2XXS => run(ty, data, out, dequantize_block_iq2_xxs),
        GgmlType::IQ2XS => run(ty, data, out, dequantize_block_iq2_xs),
        GgmlType::IQ2S => run(ty, data, out, dequantize_block_iq2_s),
        GgmlType::IQ1S => run(ty, data, out, dequantize_block_iq1_s),
        GgmlType::IQ1M => run(ty, data, out, dequantize_block_iq1_m),
    }
    Ok(())
}

/// Like [`dequantize`], allocating the output.
pub fn dequantize_to_vec(ty: GgmlType, data: &[u8]) -> Result<Vec<f32>, DequantError> {
    let block_bytes = ty.block_bytes();
    if !data.len().is_multiple_of(block_bytes) {
        return Err(DequantError::PartialBlock {
            ty,
            len: data.len(),
            block_bytes,
        });
    }
    let mut out = vec![0.0f32; data.len() / block_bytes * ty.block_elems()];
    dequantize(ty, data, &mut out)?;
    Ok(out)
}

/// Returns the block count after checking that `data_len` is whole blocks and `out_len` matches.
fn check_lengths(ty: GgmlType, data_len: usize, out_len: usize) -> Result<usize, DequantError> {
    let block_bytes = ty.block_bytes();
    if !data_len.is_multiple_of(block_bytes) {
        return Err(DequantError::PartialBlock {
            ty,
            len: data_len,
            block_bytes,
        });
    }
    let blocks = data_len / block_bytes;
    // `blocks * block_elems` cannot overflow for real data (block_elems <= 8 * block_bytes);
    // saturate anyway so a bad table cannot wrap around into a false match.
    let expected = blocks.saturating_mul(ty.block_elems());
    if out_len != expected {
        return Err(DequantError::OutputLength {
            ty,
            blocks,
            expected,
            got: out_len,
        });
    }
    Ok(blocks)
}

/// Runs `block_fn` over every `B`-byte block of `data`, writing `N` values per block into `out`.
/// Lengths were checked by the caller.
fn run<const B: usize, const N: usize>(
    ty: GgmlType,
    data: &[u8],
    out: &mut [f32],
    block_fn: fn(&[u8; B], &mut [f32; N]),
) {
    debug_assert_eq!((B, N), (ty.block_bytes(), ty.block_elems()), "{ty}");
    for (src, dst) in data.chunks_exact(B).zip(out.chunks_exact_mut(N)) {
        let src: &[u8; B] = src.try_into().expect("chunks_exact yields B bytes");
        let dst: &mut [f32; N] = dst.try_into().expect("chunks_exact_mut yields N values");
        block_fn(src, dst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::types::TYPE_TRAITS;

    #[test]
    fn every_type_decodes_one_block_of_zeros() {
        for t in TYPE_TRAITS {
            let data = vec![0u8; t.block_bytes * 2];
            let out = dequantize_to_vec(t.ty, &data).unwrap();
            assert_eq!(out.len(), t.block_elems * 2, "{}", t.name);
            // Zero scale → every value is (±)0 for every format.
            assert!(out.iter().all(|v| *v == 0.0), "{}", t.name);
        }
    }

    #[test]
    fn wrong_lengths_are_errors() {
        let err = dequantize_to_vec(GgmlType::Q4K, &[0u8; 145]).unwrap_err();
        assert_eq!(
            err,
            DequantError::PartialBlock {
                ty: GgmlType::Q4K,
                len: 145,
                block_bytes: 144
            }
        );
        assert!(err.to_string().contains("Q4_K"), "{err}");
        let mut out = vec![0.0; 255];
        let err = dequantize(GgmlType::Q4K, &[0u8; 144], &mut out).unwrap_err();
        assert_eq!(
            err,
            DequantError::OutputLength {
                ty: GgmlType::Q4K,
                blocks: 1,
                expected: 256,
                got: 255
            }
        );
        assert!(dequantize(GgmlType::F16, &[0u8; 3], &mut [0.0; 1]).is_err());
        assert_eq!(
            dequantize_to_vec(GgmlType::IQ1M, &[]).unwrap(),
            Vec::<f32>::new()
        );
    }
}
