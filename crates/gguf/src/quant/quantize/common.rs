//! Small helpers shared by the quantizers, each matching one ggml primitive bit for bit.

/// Values per super-block of the k- and i-quants (ggml's `QK_K`).
pub(crate) const QK_K: usize = 256;

/// Quantizes one row super-block by super-block: `quantize_block(x, qw, y)` gets 256 values,
/// their importances (when there is an imatrix) and the block's `block_bytes` output bytes.
pub(crate) fn for_each_super_block(
    row: &[f32],
    imatrix: Option<&[f32]>,
    out: &mut [u8],
    block_bytes: usize,
    mut quantize_block: impl FnMut(&[f32], Option<&[f32]>, &mut [u8]),
) {
    for (ib, (x, y)) in row
        .chunks_exact(QK_K)
        .zip(out.chunks_exact_mut(block_bytes))
        .enumerate()
    {
        let qw = imatrix.map(|w| &w[ib * QK_K..(ib + 1) * QK_K]);
        quantize_block(x, qw, y);
    }
}

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

/// ggml's `GROUP_MAX_EPS`: a group whose largest value is below this counts as all zero.
pub(crate) const GROUP_MAX_EPS: f32 = 1e-15;

/// C's `MAX(a, b)`: `a > b ? a : b` (differs from `f32::max` for NaN and signed zeros).
#[inline]
pub(crate) fn c_max(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

/// The value of largest magnitude (the first one on ties) as `(|v|, v)`; `(0, 0)` when every
/// value is zero (or NaN).
pub(crate) fn signed_absmax(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    (amax, max)
}

/// ggml's `make_qp_quants`: quantizes the non-negative `x` to levels `0..=nmax` (written to `l`,
/// as u8 like ggml's, so a negative level wraps) with one scale minimising the `w`-weighted
/// squared error: 9 trial scales, then up to 5 rounds of coordinate descent. Returns the scale.
pub(crate) fn make_qp_quants(nmax: i32, x: &[f32], w: &[f32], l: &mut [u8]) -> f32 {
    let n = x.len();
    assert!(w.len() == n && l.len() == n);
    let max = x.iter().fold(0f32, |m, &v| c_max(m, v));
    if max < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let nmaxf = nmax as f32;
    let mut iscale = nmaxf / max;
    for i in 0..n {
        l[i] = nearest_int(iscale * x[i]) as u8;
    }
    let scale = 1.0 / iscale;
    let mut best_mse = 0f32;
    for i in 0..n {
        let diff = x[i] - scale * f32::from(l[i]);
        best_mse += w[i] * diff * diff;
    }
    for is in (-4..=4).filter(|&is| is != 0) {
        let iscale_is = (0.1 * is as f32 + nmaxf) / max;
        let scale_is = 1.0 / iscale_is;
        let mut mse = 0f32;
        for i in 0..n {
            let q = nearest_int(iscale_is * x[i]).min(nmax);
            let diff = x[i] - scale_is * q as f32;
            mse += w[i] * diff * diff;
        }
        if mse < best_mse {
            best_mse = mse;
            iscale = iscale_is;
        }
    }
    let mut sumlx = 0f32;
    let mut suml2 = 0f32;
    for i in 0..n {
        let q = nearest_int(iscale * x[i]).min(nmax);
        l[i] = q as u8;
        let qf = q as f32;
        sumlx += w[i] * x[i] * qf;
        suml2 += w[i] * qf * qf;
    }
    for _ in 0..5 {
        let mut changed = false;
        for i in 0..n {
            let li = f32::from(l[i]);
            let mut slx = sumlx - w[i] * x[i] * li;
            let mut sl2 = suml2 - w[i] * li * li;
            if slx > 0.0 && sl2 > 0.0 {
                let new_l = nearest_int(x[i] * sl2 / slx).min(nmax);
                if new_l != i32::from(l[i]) {
                    let nl = new_l as f32;
                    slx += w[i] * x[i] * nl;
                    sl2 += w[i] * nl * nl;
                    if slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l[i] = new_l as u8;
                        sumlx = slx;
                        suml2 = sl2;
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
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
