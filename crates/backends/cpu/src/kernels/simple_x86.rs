//! x86-64 SIMD row kernels for the float types (F32, F16, BF16 · f32, AVX2 and AVX-512) and the
//! 32-element quants (Q8_0 · Q8_0 with AVX2 and AVX-512 VNNI, Q4_0 · Q8_0 with AVX2).
//!
//! Float rows: products accumulated with FMA into four vector accumulators (the last partial
//! vector with masked loads on AVX-512, scalar on AVX2). Q8_0/Q4_0: the exact i32 block sum via
//! the sign trick (`|w|` as unsigned × `y·sign(w)`, `vpmaddubsw` or VNNI `vpdpbusd`), then one
//! FMA per block with `d_w · d_y`. Results differ from [`super::simple`] by f32 rounding only.
//!
//! Safety: as in [`super::kquants_x86`], the `#[target_feature]` functions are reachable only
//! through [`kernel`], which checks the CPU features first.

use super::q8::BlockQ8_0;
use super::x86_util::{
    f16_hw, hsum256_ps, hsum512_ps, prefetch_ahead, prefetch_distance, read_u16,
};
use super::{has_vnni, Isa, RowDot};
use core::arch::x86_64::*;
use redlite_gguf::quant::GgmlType;

/// The SIMD kernels of this module for exactly level `isa`.
pub(crate) fn kernel(ty: GgmlType, isa: Isa) -> Option<RowDot> {
    if !isa.supported() {
        return None;
    }
    Some(match (isa, ty) {
        (Isa::Avx512, GgmlType::F32) => RowDot::F32(f32_avx512),
        (Isa::Avx512, GgmlType::F16) => RowDot::F32(f16_avx512),
        (Isa::Avx512, GgmlType::BF16) => RowDot::F32(bf16_avx512),
        (Isa::Avx512, GgmlType::Q8_0) if has_vnni() => RowDot::Q8_0(q8_0_avx512_vnni),
        (Isa::Avx2, GgmlType::F32) => RowDot::F32(f32_avx2),
        (Isa::Avx2, GgmlType::F16) => RowDot::F32(f16_avx2),
        (Isa::Avx2, GgmlType::BF16) => RowDot::F32(bf16_avx2),
        (Isa::Avx2, GgmlType::Q8_0) => RowDot::Q8_0(q8_0_avx2),
        (Isa::Avx2, GgmlType::Q4_0) => RowDot::Q8_0(q4_0_avx2),
        _ => return None,
    })
}

/// Declares a safe wrapper `$name(w, x: &[$x])` around `$body::<$k>` compiled with `$features`.
macro_rules! simd_kernel {
    ($name:ident, $inner:ident, $body:ident, $k:expr, $x:ty, $features:literal) => {
        #[target_feature(enable = $features)]
        unsafe fn $inner(w: &[u8], x: &[$x]) -> f32 {
            $body::<$k>(w, x)
        }
        fn $name(w: &[u8], x: &[$x]) -> f32 {
            // SAFETY: only reachable through `kernel`, after the CPU features were checked.
            unsafe { $inner(w, x) }
        }
    };
}

/// Float element kinds.
const F32: u8 = 0;
const F16: u8 = 1;
const BF16: u8 = 2;

simd_kernel!(
    f32_avx512,
    f32_avx512_i,
    float_512,
    F32,
    f32,
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
);
simd_kernel!(
    f16_avx512,
    f16_avx512_i,
    float_512,
    F16,
    f32,
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
);
simd_kernel!(
    bf16_avx512,
    bf16_avx512_i,
    float_512,
    BF16,
    f32,
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
);
simd_kernel!(f32_avx2, f32_avx2_i, float_256, F32, f32, "avx2,fma,f16c");
simd_kernel!(f16_avx2, f16_avx2_i, float_256, F16, f32, "avx2,fma,f16c");
simd_kernel!(
    bf16_avx2,
    bf16_avx2_i,
    float_256,
    BF16,
    f32,
    "avx2,fma,f16c"
);
simd_kernel!(
    q8_0_avx512_vnni,
    q8_0_avx512_vnni_i,
    q8_0_simd,
    true,
    BlockQ8_0,
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"
);
simd_kernel!(
    q8_0_avx2,
    q8_0_avx2_i,
    q8_0_simd,
    false,
    BlockQ8_0,
    "avx2,fma,f16c"
);
simd_kernel!(
    q4_0_avx2,
    q4_0_avx2_i,
    q4_0_simd,
    false,
    BlockQ8_0,
    "avx2,fma,f16c"
);

/// Bytes per element of a float kind.
const fn elem_bytes(kind: u8) -> usize {
    if kind == F32 {
        4
    } else {
        2
    }
}

/// 16 elements of kind `KIND` at `p` as f32, the lanes outside `mask` zero (not read).
#[inline(always)]
unsafe fn load16<const KIND: u8>(p: *const u8, mask: u16) -> __m512 {
    match KIND {
        F32 => _mm512_maskz_loadu_ps(mask, p as *const f32),
        F16 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p as *const i16)),
        _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
            _mm256_maskz_loadu_epi16(mask, p as *const i16),
        ))),
    }
}

/// Float row · f32 activations, AVX-512.
#[inline(always)]
unsafe fn float_512<const KIND: u8>(w: &[u8], x: &[f32]) -> f32 {
    let eb = elem_bytes(KIND);
    let n = (w.len() / eb).min(x.len());
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut acc = [_mm512_setzero_ps(); 4];
    let pf = prefetch_distance();
    let mut i = 0;
    while i + 64 <= n {
        prefetch_ahead(wp.add(i * eb), pf, 64 * eb);
        for (k, a) in acc.iter_mut().enumerate() {
            let j = i + 16 * k;
            let wv = load16::<KIND>(wp.add(j * eb), u16::MAX);
            *a = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xp.add(j)), *a);
        }
        i += 64;
    }
    while i < n {
        let left = n - i;
        let mask = if left >= 16 {
            u16::MAX
        } else {
            (1u16 << left) - 1
        };
        let wv = load16::<KIND>(wp.add(i * eb), mask);
        let xv = _mm512_maskz_loadu_ps(mask, xp.add(i));
        acc[0] = _mm512_fmadd_ps(wv, xv, acc[0]);
        i += 16;
    }
    let s = _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3]));
    hsum512_ps(s)
}

/// 8 elements of kind `KIND` at `p` as f32.
#[inline(always)]
unsafe fn load8<const KIND: u8>(p: *const u8) -> __m256 {
    match KIND {
        F32 => _mm256_loadu_ps(p as *const f32),
        F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
        _ => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
            _mm_loadu_si128(p as *const __m128i),
        ))),
    }
}

/// One element of kind `KIND` at `p` as f32.
#[inline(always)]
unsafe fn load1<const KIND: u8>(p: *const u8) -> f32 {
    match KIND {
        F32 => f32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)]),
        F16 => f16_hw(read_u16(p)),
        _ => f32::from_bits(u32::from(read_u16(p)) << 16),
    }
}

/// Float row · f32 activations, AVX2 (the last < 8 elements in scalar).
#[inline(always)]
unsafe fn float_256<const KIND: u8>(w: &[u8], x: &[f32]) -> f32 {
    let eb = elem_bytes(KIND);
    let n = (w.len() / eb).min(x.len());
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let pf = prefetch_distance();
    let mut i = 0;
    while i + 32 <= n {
        prefetch_ahead(wp.add(i * eb), pf, 32 * eb);
        for (k, a) in acc.iter_mut().enumerate() {
            let j = i + 8 * k;
            *a = _mm256_fmadd_ps(
                load8::<KIND>(wp.add(j * eb)),
                _mm256_loadu_ps(xp.add(j)),
                *a,
            );
        }
        i += 32;
    }
    while i + 8 <= n {
        acc[0] = _mm256_fmadd_ps(
            load8::<KIND>(wp.add(i * eb)),
            _mm256_loadu_ps(xp.add(i)),
            acc[0],
        );
        i += 8;
    }
    let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]));
    let mut tail = 0.0f32;
    while i < n {
        tail += load1::<KIND>(wp.add(i * eb)) * *xp.add(i);
        i += 1;
    }
    hsum256_ps(s) + tail
}

/// Σ w·y over 32 signed bytes, exact in i32 lanes: `|w|` (unsigned) × `y·sign(w)`.
#[inline(always)]
unsafe fn sdot32<const VNNI: bool>(wv: __m256i, yv: __m256i) -> __m256i {
    let aw = _mm256_sign_epi8(wv, wv);
    let sy = _mm256_sign_epi8(yv, wv);
    if VNNI {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, sy)
    } else {
        _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sy), _mm256_set1_epi16(1))
    }
}

/// `d_w · d_y` broadcast to 8 lanes, from two f16 bit patterns converted together (one
/// `vcvtph2ps` on a register written whole, which avoids a false dependency on an old value).
#[inline(always)]
unsafe fn dd8(dw: u16, dy: u16) -> __m256 {
    let both = _mm_cvtph_ps(_mm_cvtsi32_si128(
        (u32::from(dw) | (u32::from(dy) << 16)) as i32,
    ));
    _mm256_broadcastss_ps(_mm_mul_ss(both, _mm_movehdup_ps(both)))
}

/// One Q8_0/Q4_0 block term `(d_w · d_y) · Σ w·y` added to `acc`; `wv` holds the 32 signed
/// weight values.
#[inline(always)]
unsafe fn block_fma<const VNNI: bool>(acc: __m256, wv: __m256i, dw: u16, y: &BlockQ8_0) -> __m256 {
    let yv = _mm256_loadu_si256(y.qs.as_ptr() as *const __m256i);
    let s = _mm256_cvtepi32_ps(sdot32::<VNNI>(wv, yv));
    _mm256_fmadd_ps(dd8(dw, y.d), s, acc)
}

/// Q8_0 · Q8_0 (34-byte weight blocks): even blocks into one accumulator, odd into another.
#[inline(always)]
unsafe fn q8_0_simd<const VNNI: bool>(w: &[u8], x: &[BlockQ8_0]) -> f32 {
    let nb = (w.len() / 34).min(x.len());
    let pf = prefetch_distance();
    let load = |i: usize| {
        let b = w.as_ptr().add(34 * i);
        prefetch_ahead(b, pf, 34);
        (_mm256_loadu_si256(b.add(2) as *const __m256i), read_u16(b))
    };
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i + 2 <= nb {
        let (w0, d0) = load(i);
        let (w1, d1) = load(i + 1);
        acc0 = block_fma::<VNNI>(acc0, w0, d0, &x[i]);
        acc1 = block_fma::<VNNI>(acc1, w1, d1, &x[i + 1]);
        i += 2;
    }
    if i < nb {
        let (w0, d0) = load(i);
        acc0 = block_fma::<VNNI>(acc0, w0, d0, &x[i]);
    }
    hsum256_ps(_mm256_add_ps(acc0, acc1))
}

/// Q4_0 · Q8_0 (18-byte weight blocks; nibble − 8, low nibbles first), even/odd accumulators.
#[inline(always)]
unsafe fn q4_0_simd<const VNNI: bool>(w: &[u8], x: &[BlockQ8_0]) -> f32 {
    let nb = (w.len() / 18).min(x.len());
    let pf = prefetch_distance();
    let load = |i: usize| {
        let b = w.as_ptr().add(18 * i);
        prefetch_ahead(b, pf, 18);
        let m4 = _mm_set1_epi8(0x0F);
        let q = _mm_loadu_si128(b.add(2) as *const __m128i);
        let lo = _mm_and_si128(q, m4);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(q), m4);
        let wv = _mm256_sub_epi8(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(8));
        (wv, read_u16(b))
    };
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i + 2 <= nb {
        let (w0, d0) = load(i);
        let (w1, d1) = load(i + 1);
        acc0 = block_fma::<VNNI>(acc0, w0, d0, &x[i]);
        acc1 = block_fma::<VNNI>(acc1, w1, d1, &x[i + 1]);
        i += 2;
    }
    if i < nb {
        let (w0, d0) = load(i);
        acc0 = block_fma::<VNNI>(acc0, w0, d0, &x[i]);
    }
    hsum256_ps(_mm256_add_ps(acc0, acc1))
}
