//! `e^x` over a slice of f32, 16 lanes at a time on AVX-512, **bit-identical to `f32::exp`** (glibc's
//! `expf`), and the SiLU and sigmoid the model layer builds on it.
//!
//! The model computes SiLU / sigmoid one element at a time through libm (`expf` was 4–6 % of a
//! verify pass on the demo model, perf). glibc's `expf` (the Arm optimized-routines algorithm)
//! works in double precision: `k = round(x · 32 / ln 2)`, `r = x · 32 / ln 2 − k`, `2^(k/32)` from a
//! 32-entry table and a cubic in `r`; its FMA build (`__expf_fma`, disassembled) fuses exactly
//! `kd = InvLn2N · x + SHIFT`, `r = InvLn2N · x − kd`, `z = C0 · r + C1`, `y = C2 · r + 1`,
//! `y = z · r² + y`, then `y · s` and one rounding to f32. The same operations on 8 doubles per
//! vector give the same bits; inputs off the main path (|x| ≥ 88, NaN, ±∞: the top-12-bit test of
//! the scalar code) take `f32::exp` lane by lane. The tests compare every 97th f32 bit pattern
//! (and, ignored, all of them) with `f32::exp`.
//!
//! Constants: the published `__exp2f_data` table and coefficients (`EXP2F_TABLE_BITS` = 5).

#[cfg(target_arch = "x86_64")]
use crate::kernels::Isa;

/// `tab[i] = bits(2^(i/32)) − (i << 47)`.
#[cfg(target_arch = "x86_64")]
const TAB: [u64; 32] = [
    0x3ff0000000000000,
    0x3fefd9b0d3158574,
    0x3fefb5586cf9890f,
    0x3fef9301d0125b51,
    0x3fef72b83c7d517b,
    0x3fef54873168b9aa,
    0x3fef387a6e756238,
    0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715,
    0x3feef1a7373aa9cb,
    0x3feedea64c123422,
    0x3feece086061892d,
    0x3feebfdad5362a27,
    0x3feeb42b569d4f82,
    0x3feeab07dd485429,
    0x3feea47eb03a5585,
    0x3feea09e667f3bcd,
    0x3fee9f75e8ec5f74,
    0x3feea11473eb0187,
    0x3feea589994cce13,
    0x3feeace5422aa0db,
    0x3feeb737b0cdc5e5,
    0x3feec49182a3f090,
    0x3feed503b23e255d,
    0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47,
    0x3fef199bdd85529c,
    0x3fef3720dcef9069,
    0x3fef5818dcfba487,
    0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da,
    0x3fefd0765b6e4540,
];
/// 32 / ln 2.
#[cfg(target_arch = "x86_64")]
const INV_LN2_N: u64 = 0x40471547652b82fe;
/// 1.5 · 2^52: adding it rounds to an integer in the low bits.
#[cfg(target_arch = "x86_64")]
const SHIFT: u64 = 0x4338000000000000;
/// The cubic's coefficients, scaled by 1/32³, 1/32², 1/32.
#[cfg(target_arch = "x86_64")]
const C: [u64; 3] = [0x3ebc6af84b912394, 0x3f2ebfce50fac4f3, 0x3f962e42ff0c52d6];

/// What [`map`] computes from `x`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Exp,
    Sigmoid,
    Silu,
}

/// `x ← e^x` for every element (bit-identical to `f32::exp`).
pub fn exp_in_place(xs: &mut [f32]) {
    map::<{ Kind::Exp as u8 }>(xs);
}

/// `x ← 1 / (1 + e^(−x))` ([`redlite_model::ops::sigmoid`] bit for bit).
pub fn sigmoid_in_place(xs: &mut [f32]) {
    map::<{ Kind::Sigmoid as u8 }>(xs);
}

/// `x ← x · sigmoid(x)` ([`redlite_model::ops::silu`] bit for bit).
pub fn silu_in_place(xs: &mut [f32]) {
    map::<{ Kind::Silu as u8 }>(xs);
}

/// The scalar definition of `K` (libm's `expf`).
#[inline(always)]
fn scalar<const K: u8>(x: f32) -> f32 {
    if K == Kind::Exp as u8 {
        x.exp()
    } else if K == Kind::Sigmoid as u8 {
        redlite_model::ops::sigmoid(x)
    } else {
        redlite_model::ops::silu(x)
    }
}

/// `K` over `xs`, 16 elements at a time where the CPU has AVX-512, the tail in scalar code.
fn map<const K: u8>(xs: &mut [f32]) {
    let mut full = 0;
    #[cfg(target_arch = "x86_64")]
    if Isa::active() == Isa::Avx512 {
        full = xs.len() / 16 * 16;
        // SAFETY: AVX-512 is present (`Isa::active`); every call reads and writes 16 values
        // inside `xs[..full]`.
        unsafe { map_avx512::<K>(xs.as_mut_ptr(), full) };
    }
    for x in &mut xs[full..] {
        *x = scalar::<K>(*x);
    }
}

/// `K` over `n` (a multiple of 16) values at `p`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn map_avx512<const K: u8>(p: *mut f32, n: usize) {
    use core::arch::x86_64::*;
    let tab = |i: usize| _mm512_loadu_si512(TAB.as_ptr().add(8 * i) as *const __m512i);
    let (t0, t1, t2, t3) = (tab(0), tab(1), tab(2), tab(3));
    let d = |b: u64| _mm512_set1_pd(f64::from_bits(b));
    let (inv_ln2, shift, c0, c1, c2) = (d(INV_LN2_N), d(SHIFT), d(C[0]), d(C[1]), d(C[2]));
    let one_d = _mm512_set1_pd(1.0);
    let one = _mm512_set1_ps(1.0);
    // e^v for the 8 floats of `v` (the main path of `expf`, see the module docs).
    let exp8 = |v: __m256| {
        let xd = _mm512_cvtps_pd(v);
        let kd = _mm512_fmadd_pd(inv_ln2, xd, shift);
        let ki = _mm512_castpd_si512(kd);
        let kd = _mm512_sub_pd(kd, shift);
        let r = _mm512_fmsub_pd(inv_ln2, xd, kd);
        // T[ki % 32]: entries 0..16 from (t0, t1), 16..32 from (t2, t3), by bit 4.
        let idx = _mm512_and_si512(ki, _mm512_set1_epi64(31));
        let lo = _mm512_permutex2var_epi64(t0, idx, t1);
        let hi = _mm512_permutex2var_epi64(t2, idx, t3);
        let upper = _mm512_test_epi64_mask(idx, _mm512_set1_epi64(16));
        let t = _mm512_mask_blend_epi64(upper, lo, hi);
        let s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64::<47>(ki)));
        let z = _mm512_fmadd_pd(r, c0, c1);
        let r2 = _mm512_mul_pd(r, r);
        let y = _mm512_fmadd_pd(r, c2, one_d);
        let y = _mm512_fmadd_pd(z, r2, y);
        _mm512_cvtpd_ps(_mm512_mul_pd(y, s))
    };
    for i in (0..n).step_by(16) {
        let x = _mm512_loadu_ps(p.add(i));
        // The exponent's argument: x, or −x for the sigmoid.
        let a = if K == Kind::Exp as u8 {
            x
        } else {
            _mm512_castsi512_ps(_mm512_xor_si512(
                _mm512_castps_si512(x),
                _mm512_set1_epi32(i32::MIN),
            ))
        };
        // Lanes the scalar code sends off its main path: top 12 bits (sign masked) above 0x42a.
        let top = _mm512_and_si512(
            _mm512_srli_epi32::<20>(_mm512_castps_si512(a)),
            _mm512_set1_epi32(0x7ff),
        );
        let special = _mm512_cmpgt_epi32_mask(top, _mm512_set1_epi32(0x42a));
        let lo = exp8(_mm512_castps512_ps256(a));
        let hi = exp8(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
            _mm512_castps_pd(a),
        )));
        let e = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
            _mm512_castps_pd(_mm512_castps256_ps512(lo)),
            _mm256_castps_pd(hi),
        ));
        let y = if K == Kind::Exp as u8 {
            e
        } else {
            let sig = _mm512_div_ps(one, _mm512_add_ps(one, e));
            if K == Kind::Sigmoid as u8 {
                sig
            } else {
                _mm512_mul_ps(x, sig)
            }
        };
        _mm512_storeu_ps(p.add(i), y);
        if special != 0 {
            for l in 0..16 {
                if special & (1 << l) != 0 {
                    // `y` was stored over `x`: recompute from the input, which is `±a`.
                    let al = *(&a as *const __m512 as *const f32).add(l);
                    let xl = if K == Kind::Exp as u8 { al } else { -al };
                    *p.add(i + l) = scalar::<K>(xl);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `stride`-th f32 bit pattern (and the specials) through `exp_in_place` against
    /// `f32::exp`, bit for bit; SiLU and sigmoid against the model's scalar ones. In chunks.
    fn check(stride: u64) {
        let specials = [
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            88.0,
            -88.0,
            88.72283,
            -103.97,
            -103.28,
            1e-30,
        ];
        let chunk = 1u64 << 20;
        let mut start = 0u64;
        while start < 1u64 << 32 {
            let end = (start + chunk * stride).min(1 << 32);
            let mut xs: Vec<f32> = (start..end)
                .step_by(stride as usize)
                .map(|b| f32::from_bits(b as u32))
                .collect();
            if start == 0 {
                xs.extend(specials);
            }
            check_values(&xs);
            start = end;
        }
    }

    fn check_values(xs: &[f32]) {
        let mut got = xs.to_vec();
        exp_in_place(&mut got);
        for (x, g) in xs.iter().zip(&got) {
            let want = x.exp();
            assert!(
                g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                "exp({x:e}) = {g:e}, libm {want:e}"
            );
        }
        let finite: Vec<f32> = xs.iter().copied().filter(|x| x.abs() < 1e6).collect();
        let (mut s, mut l) = (finite.clone(), finite.clone());
        sigmoid_in_place(&mut s);
        silu_in_place(&mut l);
        for ((x, s), l) in finite.iter().zip(&s).zip(&l) {
            assert_eq!(
                s.to_bits(),
                redlite_model::ops::sigmoid(*x).to_bits(),
                "sigmoid({x})"
            );
            assert_eq!(
                l.to_bits(),
                redlite_model::ops::silu(*x).to_bits(),
                "silu({x})"
            );
        }
    }

    #[test]
    fn exp_matches_libm_on_a_sample_of_all_floats() {
        check(997);
    }

    #[test]
    #[ignore]
    fn exp_matches_libm_on_every_float() {
        check(1);
    }
}

#[cfg(test)]
mod bench {
    /// `cargo test --release -p redlite-cpu --lib vexp_speed -- --ignored --nocapture`: ns per
    /// element of SiLU over 1,024-element rows (the model's sizes), vector against scalar.
    #[test]
    #[ignore]
    fn vexp_speed() {
        let xs: Vec<f32> = (0..1024).map(|i| (i as f32 - 512.0) / 37.0).collect();
        for round in 0..3 {
            let mut v = xs.clone();
            let t = std::time::Instant::now();
            for _ in 0..2000 {
                v.copy_from_slice(&xs);
                super::silu_in_place(&mut v);
            }
            let vec_ns = t.elapsed().as_nanos() as f64 / 2000.0 / 1024.0;
            let t = std::time::Instant::now();
            for _ in 0..2000 {
                v.copy_from_slice(&xs);
                v.iter_mut().for_each(|x| *x = redlite_model::ops::silu(*x));
                std::hint::black_box(&v);
            }
            let scalar_ns = t.elapsed().as_nanos() as f64 / 2000.0 / 1024.0;
            println!("round {round}: vector {vec_ns:.2} ns, scalar {scalar_ns:.2} ns per element");
        }
    }
}
