//! Float types and the 32-element block types (Q4_0, Q8_0, IQ4_NL).
//!
//! Every block function has the shape `fn(&[u8; BLOCK_BYTES], &mut [f32; BLOCK_ELEMS])`; the float
//! types are "blocks" of one element so they fit the same mould.

use super::grids::KVALUES_IQ4NL;

/// Converts IEEE half bits to f32. Every finite value and infinity converts exactly; a NaN keeps
/// its sign and payload bit for bit (mantissa shifted up by 13), signalling NaNs included, as
/// numpy / gguf-py do. (`half`'s own conversion quiets signalling NaNs, and whether it uses the
/// CPU's F16C instructions depends on the machine, so NaNs are handled here explicitly.)
#[inline]
pub fn f16_bits_to_f32(bits: u16) -> f32 {
    let mantissa = u32::from(bits & 0x03FF);
    if bits & 0x7C00 == 0x7C00 && mantissa != 0 {
        let sign = u32::from(bits & 0x8000) << 16;
        f32::from_bits(sign | 0x7F80_0000 | (mantissa << 13))
    } else {
        half::f16::from_bits(bits).to_f32()
    }
}

/// Reads the little-endian f16 at `bytes[at..at + 2]` as f32 (see [`f16_bits_to_f32`]).
#[inline]
pub(crate) fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16_bits_to_f32(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
}

/// F32: `[f32 LE]`.
pub fn dequantize_block_f32(block: &[u8; 4], out: &mut [f32; 1]) {
    out[0] = f32::from_le_bytes(*block);
}

/// F16: `[f16 LE]` → IEEE half to single conversion (NaN payloads kept, see [`f16_bits_to_f32`]).
pub fn dequantize_block_f16(block: &[u8; 2], out: &mut [f32; 1]) {
    out[0] = f16_at(block, 0);
}

/// BF16: `[bf16 LE]`, the top 16 bits of an f32; decoding shifts them back (payloads kept as is).
pub fn dequantize_block_bf16(block: &[u8; 2], out: &mut [f32; 1]) {
    out[0] = f32::from_bits(u32::from(u16::from_le_bytes(*block)) << 16);
}

/// Q4_0, 32 elements in 18 bytes:
/// ```text
/// d: f16 | qs: [u8; 16]
/// x[j] = d * ((qs[j] & 15) - 8),  x[j + 16] = d * ((qs[j] >> 4) - 8)   (j < 16)
/// ```
pub fn dequantize_block_q4_0(block: &[u8; 18], out: &mut [f32; 32]) {
    let d = f16_at(block, 0);
    let qs = &block[2..18];
    for (j, &q) in qs.iter().enumerate() {
        out[j] = d * ((q & 0x0F) as i32 - 8) as f32;
        out[j + 16] = d * ((q >> 4) as i32 - 8) as f32;
    }
}

/// Q8_0, 32 elements in 34 bytes:
/// ```text
/// d: f16 | qs: [i8; 32]
/// x[j] = d * qs[j]
/// ```
pub fn dequantize_block_q8_0(block: &[u8; 34], out: &mut [f32; 32]) {
    let d = f16_at(block, 0);
    for (o, &q) in out.iter_mut().zip(&block[2..34]) {
        *o = d * f32::from(q as i8);
    }
}

/// IQ4_NL, 32 elements in 18 bytes; like Q4_0 with a non-linear value table:
/// ```text
/// d: f16 | qs: [u8; 16]
/// x[j] = d * KV[qs[j] & 15],  x[j + 16] = d * KV[qs[j] >> 4]   (j < 16)
/// KV = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113}
/// ```
pub fn dequantize_block_iq4_nl(block: &[u8; 18], out: &mut [f32; 32]) {
    let d = f16_at(block, 0);
    for (j, &q) in block[2..18].iter().enumerate() {
        out[j] = d * f32::from(KVALUES_IQ4NL[usize::from(q & 0x0F)]);
        out[j + 16] = d * f32::from(KVALUES_IQ4NL[usize::from(q >> 4)]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_conversion_keeps_nan_payloads_like_numpy() {
        // Expected bits from numpy: np.uint16(b).view(np.float16).astype(np.float32).
        for (h, f) in [
            (0x7c01u16, 0x7f80_2000u32), // signalling NaN stays signalling
            (0xfd55, 0xffaa_a000),
            (0x7e00, 0x7fc0_0000),
            (0x7fff, 0x7fff_e000),
            (0x7c00, 0x7f80_0000), // +inf
            (0xfc00, 0xff80_0000), // -inf
            (0x0001, 0x3380_0000), // smallest subnormal, 2^-24
            (0x8000, 0x8000_0000), // -0
            (0x7bff, 0x477f_e000), // 65504
        ] {
            assert_eq!(f16_bits_to_f32(h).to_bits(), f, "{h:#06x}");
        }
        // Every non-NaN half agrees with the `half` crate.
        for h in 0..=u16::MAX {
            let x = half::f16::from_bits(h);
            if !x.is_nan() {
                assert_eq!(
                    f16_bits_to_f32(h).to_bits(),
                    x.to_f32().to_bits(),
                    "{h:#06x}"
                );
            }
        }
    }
}
