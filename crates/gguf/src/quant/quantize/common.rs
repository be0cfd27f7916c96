//! Small helpers shared by the quantizers, each matching one ggml primitive bit for bit.

/// ggml's `nearest_int`: round to nearest, ties to even, by adding 1.5·2²³ so that the f32
/// addition itself does the rounding (valid for |x| ≤ 2²²; larger inputs give garbage, as in ggml).
#[inline]
pub(crate) fn nearest_int(x: f32) -> i32 {
    let biased = x + 12_582_912.0;
    (biased.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// `GGML_FP32_TO_FP16`: round to nearest even (as the F16C instruction and ggml's software
/// fallback do), returned as the raw bits.
#[inline]
pub(crate) fn f32_to_f16_bits(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

/// C's float → int conversion as x86 compilers emit it (`cvttss2si`): truncation toward zero,
/// and the "integer indefinite" `i32::MIN` for NaN and out-of-range values (where Rust's `as`
/// would saturate). ggml relies on it when a tiny block's inverse scale overflows to infinity.
#[inline]
pub(crate) fn c_f32_to_i32(v: f32) -> i32 {
    if (-2_147_483_648.0..2_147_483_648.0).contains(&v) {
        v as i32
    } else {
        i32::MIN
    }
}

/// Writes `bits` little-endian at `out[at..at + 2]`.
#[inline]
pub(crate) fn put_u16(out: &mut [u8], at: usize, bits: u16) {
    out[at..at + 2].copy_from_slice(&bits.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_rounds_half_to_even() {
        assert_eq!(nearest_int(0.5), 0);
        assert_eq!(nearest_int(1.5), 2);
        assert_eq!(nearest_int(2.5), 2);
        assert_eq!(nearest_int(-0.5), 0);
        assert_eq!(nearest_int(-1.5), -2);
        assert_eq!(nearest_int(-3.7), -4);
        assert_eq!(nearest_int(63.49), 63);
    }

    #[test]
    fn f16_rounding_is_nearest_even() {
        // 1 + 2^-11 lies exactly between 1 and the next f16 (1 + 2^-10): ties go to even (1.0).
        assert_eq!(f32_to_f16_bits(1.0 + 1.0 / 2048.0), 0x3c00);
        // 1 + 3·2^-11 lies between 1 + 2^-10 (odd mantissa) and 1 + 2^-9: goes up to even.
        assert_eq!(f32_to_f16_bits(1.0 + 3.0 / 2048.0), 0x3c02);
        assert_eq!(f32_to_f16_bits(65504.0), 0x7bff);
        assert_eq!(f32_to_f16_bits(1e-8), 0x0000);
    }

    #[test]
    fn float_to_int_follows_x86() {
        assert_eq!(c_f32_to_i32(-3.9), -3);
        assert_eq!(c_f32_to_i32(f32::INFINITY), i32::MIN);
        assert_eq!(c_f32_to_i32(f32::NAN), i32::MIN);
        assert_eq!(c_f32_to_i32(3e9), i32::MIN);
        assert_eq!(c_f32_to_i32(128.0) as i8, -128);
    }
}
