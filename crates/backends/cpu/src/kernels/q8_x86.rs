//! AVX2 versions of the activation quantizers of [`super::q8`], bit-identical to the scalar
//! ones for every input (NaN and infinities included): the same f32 operations per element, the
//! same first-largest-magnitude pick, and the same integer conversions (`as i8` wraps for Q8_K's
//! `nearest_int`, saturates with NaN → 0 for Q8_0's rounding).
//!
//! Safety: the `#[target_feature]` functions are only called by [`super::q8`] after
//! [`Isa::Avx2`](super::Isa::Avx2) was found supported.

use super::q8::{BlockQ8K, BlockQ8_0, QK8_0, QK_K};
use core::arch::x86_64::*;

/// Lane-wise `|v|`.
#[inline(always)]
unsafe fn abs_ps(v: __m256) -> __m256 {
    _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff)))
}

/// Largest lane (exact: max does not round). NaN lanes never win: `vmaxps` returns its second
/// operand when either is NaN, and the running maximum is always the second operand.
#[inline(always)]
unsafe fn max_abs(x: &[f32]) -> f32 {
    let mut m = _mm256_setzero_ps();
    for c in x.chunks_exact(8) {
        m = _mm256_max_ps(abs_ps(_mm256_loadu_ps(c.as_ptr())), m);
    }
    // `m` holds no NaN, and max is exact, so the reduction order does not matter.
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let m = _mm_max_ss(m, _mm_movehdup_ps(m));
    _mm_cvtss_f32(m)
}

/// The low byte of each i32 lane of `q0..q3` (32 lanes in order), like `as i8`.
#[inline(always)]
unsafe fn low_bytes(q: [__m256i; 4], out: *mut i8) {
    // Within each 128-bit lane, bytes 0, 4, 8, 12 to the lane's first 4 bytes.
    let pick = _mm256_setr_epi8(
        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1,
        -1, -1, -1, -1, -1, -1, -1, -1,
    );
    for (k, v) in q.iter().enumerate() {
        let b = _mm256_shuffle_epi8(*v, pick);
        // Lane 0 holds elements 0-3 in its low 4 bytes, lane 1 elements 4-7.
        let lo = _mm_cvtsi128_si32(_mm256_castsi256_si128(b)) as u32;
        let hi = _mm_cvtsi128_si32(_mm256_extracti128_si256::<1>(b)) as u32;
        let v8 = u64::from(lo) | (u64::from(hi) << 32);
        std::ptr::write_unaligned(out.add(8 * k) as *mut u64, v8);
    }
}

/// Q8_K quantization of `x` (a multiple of 256 values) into `out`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_row_q8_k_avx2(x: &[f32], out: &mut [BlockQ8K]) {
    let magic = _mm256_set1_ps(12_582_912.0);
    let mant = _mm256_set1_epi32(0x007f_ffff);
    let bias = _mm256_set1_epi32(0x0040_0000);
    let cap = _mm256_set1_epi32(127);
    for (xb, yb) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let amax = max_abs(xb);
        if amax == 0.0 {
            *yb = BlockQ8K::ZERO;
            continue;
        }
        // The first element of largest magnitude (scalar: strictly greater replaces).
        let target = _mm256_set1_ps(amax);
        let mut max = 0.0f32;
        for (k, c) in xb.chunks_exact(8).enumerate() {
            let eq = _mm256_cmp_ps::<_CMP_EQ_OQ>(abs_ps(_mm256_loadu_ps(c.as_ptr())), target);
            let mask = _mm256_movemask_ps(eq);
            if mask != 0 {
                max = xb[8 * k + mask.trailing_zeros() as usize];
                break;
            }
        }
        let iscale = -127.0f32 / max;
        let vs = _mm256_set1_ps(iscale);
        let qp = yb.qs.as_mut_ptr();
        for g in 0..8 {
            let q: [__m256i; 4] = std::array::from_fn(|k| {
                let v = _mm256_loadu_ps(xb.as_ptr().add(32 * g + 8 * k));
                let t = _mm256_add_ps(_mm256_mul_ps(vs, v), magic);
                let n = _mm256_sub_epi32(_mm256_and_si256(_mm256_castps_si256(t), mant), bias);
                _mm256_min_epi32(n, cap)
            });
            // bsums of groups 2g and 2g + 1 (16 values each), from the wrapped i8 values.
            let wrap = |v: __m256i| _mm256_srai_epi32::<24>(_mm256_slli_epi32::<24>(v));
            let s0 = _mm256_add_epi32(wrap(q[0]), wrap(q[1]));
            let s1 = _mm256_add_epi32(wrap(q[2]), wrap(q[3]));
            yb.bsums[2 * g] = hsum_i32(s0) as i16;
            yb.bsums[2 * g + 1] = hsum_i32(s1) as i16;
            low_bytes(q, qp.add(32 * g));
        }
        yb.d = 1.0 / iscale;
    }
}

/// Sum of the 8 i32 lanes.
#[inline(always)]
unsafe fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// Q8_0 quantization of `x` (a multiple of 32 values) into `out`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_row_q8_0_avx2(x: &[f32], out: &mut [BlockQ8_0]) {
    let half = _mm256_set1_ps(0.5);
    let sign = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN));
    let lo = _mm256_set1_ps(-128.0);
    let hi = _mm256_set1_ps(127.0);
    for (xb, yb) in x.chunks_exact(QK8_0).zip(out.iter_mut()) {
        let amax = max_abs(xb);
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        // f32 → f16 rounding to nearest even, as `half::f16::from_f32` (d is never NaN).
        let dh = _mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(d));
        yb.d = _mm_extract_epi16::<0>(dh) as u16;
        let vid = _mm256_set1_ps(id);
        let q: [__m256i; 4] = std::array::from_fn(|k| {
            let t = _mm256_mul_ps(_mm256_loadu_ps(xb.as_ptr().add(8 * k)), vid);
            // round(t), halves away from zero: trunc(t) + sign(t) where |t − trunc(t)| ≥ 0.5
            // (the difference is exact).
            let r = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(t);
            let frac = abs_ps(_mm256_sub_ps(t, r));
            let one = _mm256_or_ps(_mm256_set1_ps(1.0), _mm256_and_ps(t, sign));
            let bump = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(frac, half), one);
            let r = _mm256_add_ps(r, bump);
            // `as i8`: saturate to −128..=127, NaN → 0.
            let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(t, t);
            let r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
            _mm256_cvttps_epi32(_mm256_andnot_ps(nan, r))
        });
        low_bytes(q, yb.qs.as_mut_ptr());
    }
}

/// [`quantize_row_q8_0_avx2`] in 512-bit vectors (a block's 32 values in two): per element the
/// same f32 operations, the same rounding and saturation, so the same blocks (the AVX2 version
/// spends ≈ 90 vector operations a block, a fifth of a verify pass's quantize-and-product time
/// on the demo model).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn quantize_row_q8_0_avx512(x: &[f32], out: &mut [BlockQ8_0]) {
    // Bitwise f32 operations through the integer forms (`vandps`/`vorps` on zmm need
    // AVX-512 DQ, which this level does not assume).
    let and =
        |a: __m512, m: __m512i| _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), m));
    let half = _mm512_set1_ps(0.5);
    let sign = _mm512_set1_epi32(i32::MIN);
    let absm = _mm512_set1_epi32(0x7fff_ffff);
    let one = _mm512_set1_epi32(1.0f32.to_bits() as i32);
    let lo = _mm512_set1_ps(-128.0);
    let hi = _mm512_set1_ps(127.0);
    for (xb, yb) in x.chunks_exact(QK8_0).zip(out.iter_mut()) {
        let a = _mm512_loadu_ps(xb.as_ptr());
        let b = _mm512_loadu_ps(xb.as_ptr().add(16));
        // NaN lanes never win: `vmaxps` returns its second operand (the running maximum, never
        // NaN) when either is NaN, as in `max_abs`.
        let m = _mm512_max_ps(and(a, absm), _mm512_setzero_ps());
        let m = _mm512_max_ps(and(b, absm), m);
        // Exact and NaN-free: any reduction order gives the scalar fold's maximum.
        let m = _mm256_max_ps(
            _mm512_castps512_ps256(m),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(m))),
        );
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_movehdup_ps(m));
        let amax = _mm_cvtss_f32(m);
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let dh = _mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(d));
        yb.d = _mm_extract_epi16::<0>(dh) as u16;
        let vid = _mm512_set1_ps(id);
        for (k, v) in [a, b].into_iter().enumerate() {
            let t = _mm512_mul_ps(v, vid);
            // round(t), halves away from zero, as the AVX2 version.
            let r = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(t);
            let frac = and(_mm512_sub_ps(t, r), absm);
            let step = _mm512_castsi512_ps(_mm512_or_si512(
                one,
                _mm512_and_si512(_mm512_castps_si512(t), sign),
            ));
            let ge = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(frac, half);
            let r = _mm512_mask_add_ps(r, ge, r, step);
            // `as i8`: saturate to −128..=127, NaN → 0.
            let num = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(t, t);
            let r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
            let i = _mm512_maskz_cvttps_epi32(num, r);
            _mm_storeu_si128(
                yb.qs.as_mut_ptr().add(16 * k) as *mut __m128i,
                _mm512_cvtepi32_epi8(i),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::q8::quantize_row_q8_0_scalar;
    use crate::kernels::Isa;

    #[test]
    fn q8_0_simd_versions_match_scalar() {
        let specials = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            0.5,
            -0.5,
            1.5,
            -2.5,
            1e-30,
            f32::MIN_POSITIVE / 4.0,
            3.0e38,
            -3.0e38,
        ];
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut rows: Vec<Vec<f32>> = Vec::new();
        for case in 0..400 {
            let scale = [1.0f32, 1e-3, 1e3, 127.0, 1e-20][case % 5];
            let mut r: Vec<f32> = (0..96)
                .map(|_| ((next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale)
                .collect();
            if case % 3 == 0 {
                for _ in 0..(next() % 6) {
                    let at = (next() % 96) as usize;
                    r[at] = specials[(next() % specials.len() as u64) as usize];
                }
            }
            if case % 7 == 0 {
                // Exact halves after scaling: amax 127 makes id = 1.
                r[0] = 127.0;
                for (i, v) in r.iter_mut().enumerate().skip(1).take(31) {
                    *v = i as f32 - 16.5;
                }
            }
            rows.push(r);
        }
        rows.push(vec![0.0; 96]);
        rows.push(vec![f32::NAN; 96]);
        for (i, x) in rows.iter().enumerate() {
            let mut want = vec![BlockQ8_0::ZERO; 3];
            quantize_row_q8_0_scalar(x, &mut want);
            if Isa::Avx2.supported() {
                let mut got = vec![BlockQ8_0::ZERO; 3];
                // SAFETY: AVX2/FMA/F16C checked.
                unsafe { quantize_row_q8_0_avx2(x, &mut got) };
                assert_eq!(got, want, "avx2 row {i}");
            }
            if Isa::Avx512.supported() {
                let mut got = vec![BlockQ8_0::ZERO; 3];
                // SAFETY: AVX-512 F/BW/VL checked.
                unsafe { quantize_row_q8_0_avx512(x, &mut got) };
                assert_eq!(got, want, "avx512 row {i}");
            }
        }
    }
}
