//! AVX2 versions of every i-quant kernel (x86-64 only), for CPUs without the AVX-512 VBMI/VNNI
//! kernels of [`super::iquants_avx512`] and for the types that have none there. They need AVX2, FMA
//! and F16C (the [`Isa::Avx2`](super::Isa::Avx2) level) and nothing else (no BMI2: `pdep` is slow
//! on AMD Zen 1/2).
//!
//! Same arithmetic as the scalar kernels, 32 elements (one sub-block) per 256-bit register:
//! grid rows are loaded from the tables and assembled with `_mm256_set_epi64x`/`_mm256_set_epi32`,
//! signs come from a 128-entry table of ±1 byte patterns derived from `KSIGNS`, and products are
//! `vpmaddubsw(|q8|, ±weight)` (the sign of `q8` moved onto the weight, so −128 is exact),
//! weighted by the sub-block scale with `vpmaddwd`.

use super::iquants::{
    IQ1_M_BYTES, IQ1_S_BYTES, IQ2_S_BYTES, IQ2_XS_BYTES, IQ2_XXS_BYTES, IQ3_S_BYTES, IQ3_XXS_BYTES,
    IQ4_NL_BYTES, IQ4_XS_BYTES,
};
use super::q8::{BlockQ8K, BlockQ8_0, QK8_0, QK_K};
use super::RowDot;
use core::arch::x86_64::*;
use redlite_gguf::quant::grids::{
    IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS,
    KVALUES_IQ4NL,
};
use redlite_gguf::quant::GgmlType;

/// The AVX2 kernel for `ty`, if there is one. Only asked for by the dispatch when the CPU
/// supports the AVX2 level (AVX2 + FMA + F16C).
pub fn kernel(ty: GgmlType) -> Option<RowDot> {
    Some(match ty {
        GgmlType::IQ2XXS => RowDot::Q8K(iq2_xxs_row),
        GgmlType::IQ3XXS => RowDot::Q8K(iq3_xxs_row),
        GgmlType::IQ4XS => RowDot::Q8K(iq4_xs_row),
        GgmlType::IQ2XS => RowDot::Q8K(iq2_xs_row),
        GgmlType::IQ2S => RowDot::Q8K(iq2_s_row),
        GgmlType::IQ3S => RowDot::Q8K(iq3_s_row),
        GgmlType::IQ1S => RowDot::Q8K(iq1_s_row),
        GgmlType::IQ1M => RowDot::Q8K(iq1_m_row),
        GgmlType::IQ4NL => RowDot::Q8_0(iq4_nl_row),
        _ => return None,
    })
}

/// `KSIGNS[i]` as 8 bytes of −1 (bit set) or +1, for `vpsignb`.
static SIGN_BYTES: [i64; 128] = {
    let mut t = [0i64; 128];
    let mut i = 0;
    while i < 128 {
        let mut v = 0u64;
        let mut j = 0;
        while j < 8 {
            let byte: u64 = if (KSIGNS_IQ2XS[i] >> j) & 1 != 0 {
                0xFF
            } else {
                0x01
            };
            v |= byte << (8 * j);
            j += 1;
        }
        t[i] = v as i64;
        i += 1;
    }
    t
};

/// Byte value `s` as 8 bytes of −1 (bit `j` of `s` set) or +1, for `vpsignb`.
static BIT_SIGNS: [i64; 256] = {
    let mut t = [0i64; 256];
    let mut i = 0;
    while i < 256 {
        let mut v = 0u64;
        let mut j = 0;
        while j < 8 {
            let byte: u64 = if (i >> j) & 1 != 0 { 0xFF } else { 0x01 };
            v |= byte << (8 * j);
            j += 1;
        }
        t[i] = v as i64;
        i += 1;
    }
    t
};

/// The sign pattern of the four 8-element groups of one IQ2_XXS / IQ3_XXS sub-block (`aux`:
/// four 7-bit sign indices).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn group_signs(aux: u32) -> __m256i {
    let s = |l: u32| SIGN_BYTES[((aux >> (7 * l)) & 127) as usize];
    _mm256_set_epi64x(s(3), s(2), s(1), s(0))
}

/// f16 bits → f32 via F16C (much faster than a portable conversion in these loops).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16_to_f32(bits: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// The f16 at `b[at..at + 2]` as f32, via F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// 32 activation bytes `32·ib..32·ib + 32` of a Q8_K block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load_q8(y: &BlockQ8K, ib: usize) -> __m256i {
    let q = &y.qs[32 * ib..32 * ib + 32];
    // SAFETY: `q` is 32 readable bytes.
    unsafe { _mm256_loadu_si256(q.as_ptr().cast()) }
}

/// 16 i16 pair sums of `w_e · s_e · q8_e` over 32 elements: `w` signed bytes (|w| ≤ 127) with
/// signs `s` (±1 bytes); `|q8|` is the unsigned operand, exact also for −128.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn signed_pairs(w: __m256i, s: __m256i, q8: __m256i) -> __m256i {
    let ws = _mm256_sign_epi8(_mm256_sign_epi8(w, s), q8);
    _mm256_maddubs_epi16(_mm256_abs_epi8(q8), ws)
}

/// The exact sum of the 8 i32 lanes of `v`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum_epi32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b01>(s)))
}

/// IQ2_XXS row · Q8_K row over `min(n / 256, w.len() / 66, x.len())` blocks.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn vec_dot_iq2_xxs_q8_k_avx2(n: usize, w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = super::iquants::block_count(n, QK_K, w.len(), IQ2_XXS_BYTES, x.len());
    let grid = |i: u8| IQ2XXS_GRID[usize::from(i)] as i64;
    let mut sumf = 0.0f32;
    for (b, y) in w.chunks_exact(IQ2_XXS_BYTES).zip(x).take(nb) {
        let d = f16_at(b, 0) * y.d;
        let mut acc = _mm256_setzero_si256();
        for ib in 0..8 {
            let g = &b[2 + 8 * ib..2 + 8 * ib + 8];
            let aux = u32::from_le_bytes([g[4], g[5], g[6], g[7]]);
            let rows = _mm256_set_epi64x(grid(g[3]), grid(g[2]), grid(g[1]), grid(g[0]));
            let pairs = signed_pairs(rows, group_signs(aux), load_q8(y, ib));
            let ls = _mm256_set1_epi16((2 * (aux >> 28) + 1) as i16);
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ls));
        }
        sumf += d * hsum_epi32(acc) as f32;
    }
    0.125 * sumf
}

fn iq2_xxs_row(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let n = (w.len() / IQ2_XXS_BYTES).min(x.len()) * QK_K;
    // SAFETY: the dispatch only asks for AVX2 kernels on CPUs with the AVX2 level.
    unsafe { vec_dot_iq2_xxs_q8_k_avx2(n, w, x) }
}

/// IQ3_XXS row · Q8_K row over `min(n / 256, w.len() / 98, x.len())` blocks.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn vec_dot_iq3_xxs_q8_k_avx2(n: usize, w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = super::iquants::block_count(n, QK_K, w.len(), IQ3_XXS_BYTES, x.len());
    let grid = |i: u8| IQ3XXS_GRID[usize::from(i)] as i32;
    let mut sumf = 0.0f32;
    for (b, y) in w.chunks_exact(IQ3_XXS_BYTES).zip(x).take(nb) {
        let d = f16_at(b, 0) * y.d;
        let mut acc = _mm256_setzero_si256();
        for ib in 0..8 {
            let g = &b[2 + 8 * ib..2 + 8 * ib + 8];
            let at = 66 + 4 * ib;
            let aux = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
            let rows = _mm256_set_epi32(
                grid(g[7]),
                grid(g[6]),
                grid(g[5]),
                grid(g[4]),
                grid(g[3]),
                grid(g[2]),
                grid(g[1]),
                grid(g[0]),
            );
            let pairs = signed_pairs(rows, group_signs(aux), load_q8(y, ib));
            let ls = _mm256_set1_epi16((2 * (aux >> 28) + 1) as i16);
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ls));
        }
        sumf += d * hsum_epi32(acc) as f32;
    }
    0.25 * sumf
}

fn iq3_xxs_row(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let n = (w.len() / IQ3_XXS_BYTES).min(x.len()) * QK_K;
    // SAFETY: the dispatch only asks for AVX2 kernels on CPUs with the AVX2 level.
    unsafe { vec_dot_iq3_xxs_q8_k_avx2(n, w, x) }
}

/// IQ4_XS row · Q8_K row over `min(n / 256, w.len() / 136, x.len())` blocks.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn vec_dot_iq4_xs_q8_k_avx2(n: usize, w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = super::iquants::block_count(n, QK_K, w.len(), IQ4_XS_BYTES, x.len());
    // SAFETY: KVALUES_IQ4NL is 16 readable bytes.
    let kv = unsafe { _mm_loadu_si128(KVALUES_IQ4NL.as_ptr().cast()) };
    let kv = _mm256_set_m128i(kv, kv);
    let low4 = _mm256_set1_epi8(0x0F);
    let mut sumf = 0.0f32;
    for (b, y) in w.chunks_exact(IQ4_XS_BYTES).zip(x).take(nb) {
        let d = f16_at(b, 0) * y.d;
        let scales_h = u16::from_le_bytes([b[2], b[3]]);
        let mut acc = _mm256_setzero_si256();
        for c in 0..4 {
            // Sub-blocks 2c (lane 0 of `packed`) and 2c + 1 (lane 1), 16 bytes each.
            let qs = &b[8 + 32 * c..8 + 32 * c + 32];
            // SAFETY: `qs` is 32 readable bytes.
            let packed = unsafe { _mm256_loadu_si256(qs.as_ptr().cast()) };
            let lo = _mm256_and_si256(packed, low4);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(packed), low4);
            for h in 0..2 {
                let ib = 2 * c + h;
                // Elements 0..16 = low nibbles, 16..32 = high nibbles of the sub-block's bytes.
                let nibbles = if h == 0 {
                    _mm256_permute2x128_si256::<0x20>(lo, hi)
                } else {
                    _mm256_permute2x128_si256::<0x31>(lo, hi)
                };
                let values = _mm256_shuffle_epi8(kv, nibbles);
                let q8 = load_q8(y, ib);
                let pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(q8), _mm256_sign_epi8(values, q8));
                let low = (b[4 + ib / 2] >> (4 * (ib % 2))) & 15;
                let high = ((scales_h >> (2 * ib)) & 3) as u8;
                let ls = _mm256_set1_epi16(i16::from(low | (high << 4)) - 32);
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ls));
            }
        }
        sumf += d * hsum_epi32(acc) as f32;
    }
    sumf
}

fn iq4_xs_row(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let n = (w.len() / IQ4_XS_BYTES).min(x.len()) * QK_K;
    // SAFETY: the dispatch only asks for AVX2 kernels on CPUs with the AVX2 level.
    unsafe { vec_dot_iq4_xs_q8_k_avx2(n, w, x) }
}

/// A 256-bit vector of 16 i16 words: words 0..8 = `a`, words 8..16 = `b` (the scales of the two
/// 16-element halves of a sub-block).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn two_scales(a: i32, b: i32) -> __m256i {
    let a = i64::from(a as u16) * 0x0001_0001_0001_0001;
    let b = i64::from(b as u16) * 0x0001_0001_0001_0001;
    _mm256_set_epi64x(b, b, a, a)
}

/// IQ2_XS row · Q8_K row over `min(n / 256, w.len() / 74, x.len())` blocks.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn vec_dot_iq2_xs_q8_k_avx2(n: usize, w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = super::iquants::block_count(n, QK_K, w.len(), IQ2_XS_BYTES, x.len());
    let mut sumf = 0.0f32;
    for (b, y) in w.chunks_exact(IQ2_XS_BYTES).zip(x).take(nb) {
        let d = f16_at(b, 0) * y.d;
        let v = |g: usize| u16::from_le_bytes([b[2 + 2 * g], b[3 + 2 * g]]);
        let row = |g: usize| IQ2XS_GRID[usize::from(v(g) & 511)] as i64;
        let sign = |g: usize| SIGN_BYTES[usize::from(v(g) >> 9)];
        let mut acc = _mm256_setzero_si256();
        for ib in 0..8 {
            let g = 4 * ib;
            let rows = _mm256_set_epi64x(row(g + 3), row(g + 2), row(g + 1), row(g));
            let signs = _mm256_set_epi64x(sign(g + 3), sign(g + 2), sign(g + 1), sign(g));
            let pairs = signed_pairs(rows, signs, load_q8(y, ib));
            let sc = b[66 + ib];
            let ls = two_scales(2 * i32::from(sc & 15) + 1, 2 * i32::from(sc >> 4) + 1);
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ls));
        }
        sumf += d * hsum_epi32(acc) as f32;
    }
    0.125 * sumf
}

fn iq2_xs_row(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let n = (w.len() / IQ2_XS_BYTES).min(x.len()) * QK_K;
    // SAFETY: the dispatch only asks for AVX2 kernels on CPUs with the AVX2 level.
    unsafe { vec_dot_iq2_xs_q8_k_avx2(n, w, x) }
}

/// IQ2_S row · Q8_K row over `min(n / 256, w.len() / 82, x.len())` blocks.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn vec_dot_iq2_s_q8_k_avx2(n: usize, w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = super::iquants::block_count(n, QK_K, w.len(), IQ2_S_BYTES, x.len());
    let mut sumf = 0.0f32;
    for (b, y) in w.chunks_exact(IQ2_S_BYTES).zip(x).take(nb) {
        let d = f16_at(b, 0) * y.d;
        let row = |g: usize| {
            let high = usize::from((b[66 + g / 4] >> (2 * (g % 4))) & 3);
            IQ2S_GRID[usize::from(b[2 + g]) | (high << 8)] as i64
        };
        let sign = |g: usize| BIT_SIGNS[usize::from(b[34 + g])];
        let mut acc = _mm256_setzero_si256();
        for ib in 0..8 {
            let g = 4 * ib;
            let rows = _mm256_set_epi64x(row(g + 3), row(g + 2), row(g + 1), row(g));
            let signs = _mm256_set_epi64x(sign(g + 3), sign(g + 2), sign(g + 1), sign(g));
            let pairs = signed_pairs(rows, signs, load_q8(y, ib));
            let sc = b[74 + ib];
            let ls = two_scales(2 * i32::from(sc & 15) + 1, 2 * i32::from(sc >> 4) + 1);
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ls));
        }
        sumf += d * hsum_epi32(acc) as f32;
    }
    0.125 * sumf
}

fn iq2_s_row(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let n = (w.len() / IQ2_S_BYTES).min(x.len()) * QK_K;
    // SAFETY: the dispatch only asks for AVX2 kernels on CPUs with the AVX2 level.
    unsafe { vec_dot_iq2_s_q8_k_avx2(n, w, x) }
}

/// IQ3_S row · Q8_K row over `min(n / 256, w.len() / 110, x.len())` blocks.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn vec_dot_iq3_s_q8_k_avx2(n: usize, w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = super::iquants::block_count(n, QK_K, w.len(), IQ3_S_BYTES, x.len());
    let mut sumf = 0.0f32;
    for (b, y) in w.chunks_exact(IQ3_S_BYTES).zip(x).take(nb) {
        let d = f16_at(b, 0) * y.d;
        let mut acc = _mm256_setzero_si256();
        for ib in 0..8 {
            let qh = b[66 + ib];
            // 4-group k of the sub-block: row qs[8ib + k] | (bit k of qh[ib]) << 8.
            let row = |k: usize| {
                let high = usize::from((qh >> k) & 1);
                IQ3S_GRID[usize::from(b[2 + 8 * ib + k]) | (high << 8)] as i32
            };
            let rows = _mm256_set_epi32(
                row(7),
                row(6),
                row(5),
                row(4),
                row(3),
                row(2),
                row(1),
                row(0),
            );
            let sign = |l: usize| BIT_SIGNS[usize::from(b[74 + 4 * ib + l])];
            let signs = _mm256_set_epi64x(sign(3), sign(2), sign(1), sign(0));
            let pairs = signed_pairs(rows, signs, load_q8(y, ib));
            let s = (b[106 + ib / 2] >> (4 * (ib % 2))) & 15;
            let ls = _mm256_set1_epi16(2 * i16::from(s) + 1);
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ls));
        }
        sumf += d * hsum_epi32(acc) as f32;
    }
    sumf
}

fn iq3_s_row(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let n = (w.len() / IQ3_S_BYTES).min(x.len()) * QK_K;
    // SAFETY: the dispatch only asks for AVX2 kernels on CPUs with the AVX2 level.
    unsafe { vec_dot_iq3_s_q8_k_avx2(n, w, x) }
}

/// `8·g + 1` for IQ1 grid bytes `g` (−1, 0, +1) plus one, as `vpshufb` indices 0, 1, 2 (both
/// 128-bit lanes).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn iq1_codes_positive() -> __m256i {
    _mm256_setr_epi8(
        -7, 1, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -7, 1, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        0, 0,
    )
}

/// IQ1 weight codes `8·g ± 1` of 32 grid bytes: `+1` everywhere, then `−2` where `minus_two`
/// holds 2.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn iq1_codes(rows: __m256i, minus_two: __m256i, table: __m256i) -> __m256i {
    let idx = _mm256_add_epi8(rows, _mm256_set1_epi8(1));
    _mm256_sub_epi8(_mm256_shuffle_epi8(table, idx), minus_two)
}

/// IQ1_S row · Q8_K row over `min(n / 256, w.len() / 50, x.len())` blocks.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn vec_dot_iq1_s_q8_k_avx2(n: usize, w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = super::iquants::block_count(n, QK_K, w.len(), IQ1_S_BYTES, x.len());
    let table = iq1_codes_positive();
    let no_signs = _mm256_set1_epi8(1);
    let mut sumf = 0.0f32;
    for (b, y) in w.chunks_exact(IQ1_S_BYTES).zip(x).take(nb) {
        let d = f16_at(b, 0) * y.d;
        let mut acc = _mm256_setzero_si256();
        for ib in 0..8 {
            let qh = u16::from_le_bytes([b[34 + 2 * ib], b[35 + 2 * ib]]);
            let row = |l: usize| {
                let high = usize::from((qh >> (3 * l)) & 7);
                IQ1S_GRID[usize::from(b[2 + 4 * ib + l]) | (high << 8)] as i64
            };
            let rows = _mm256_set_epi64x(row(3), row(2), row(1), row(0));
            let minus_two = _mm256_set1_epi8(if qh & 0x8000 != 0 { 2 } else { 0 });
            let codes = iq1_codes(rows, minus_two, table);
            let pairs = signed_pairs(codes, no_signs, load_q8(y, ib));
            let ls = _mm256_set1_epi16(2 * ((qh >> 12) & 7) as i16 + 1);
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ls));
        }
        sumf += d * hsum_epi32(acc) as f32;
    }
    0.125 * sumf
}

fn iq1_s_row(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let n = (w.len() / IQ1_S_BYTES).min(x.len()) * QK_K;
    // SAFETY: the dispatch only asks for AVX2 kernels on CPUs with the AVX2 level.
    unsafe { vec_dot_iq1_s_q8_k_avx2(n, w, x) }
}

/// IQ1_M row · Q8_K row over `min(n / 256, w.len() / 56, x.len())` blocks.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn vec_dot_iq1_m_q8_k_avx2(n: usize, w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = super::iquants::block_count(n, QK_K, w.len(), IQ1_M_BYTES, x.len());
    let table = iq1_codes_positive();
    let no_signs = _mm256_set1_epi8(1);
    let mut sumf = 0.0f32;
    for (b, y) in w.chunks_exact(IQ1_M_BYTES).zip(x).take(nb) {
        // d's f16 bits are the top nibbles of the four scale u16s.
        let sc = |k: usize| u16::from_le_bytes([b[48 + 2 * k], b[49 + 2 * k]]) >> 12;
        let d = f16_to_f32(sc(0) | sc(1) << 4 | sc(2) << 8 | sc(3) << 12) * y.d;
        let mut acc = _mm256_setzero_si256();
        for ib in 0..8 {
            // Groups k = 4ib..4ib + 4; nibble k of qh: low 3 bits = high row bits, bit 3 = sign
            // of the delta.
            let nibble = |k: usize| (b[32 + k / 2] >> (4 * (k % 2))) & 15;
            let row =
                |k: usize| IQ1S_GRID[usize::from(b[k]) | (usize::from(nibble(k) & 7) << 8)] as i64;
            let two = |k: usize| i64::from(nibble(k) >> 3) * 0x0202_0202_0202_0202;
            let k = 4 * ib;
            let rows = _mm256_set_epi64x(row(k + 3), row(k + 2), row(k + 1), row(k));
            let minus_two = _mm256_set_epi64x(two(k + 3), two(k + 2), two(k + 1), two(k));
            let codes = iq1_codes(rows, minus_two, table);
            let pairs = signed_pairs(codes, no_signs, load_q8(y, ib));
            // 16-element scales 2ib and 2ib + 1: 3-bit fields of scale u16 ib / 2.
            let sc = u16::from_le_bytes([b[48 + 2 * (ib / 2)], b[49 + 2 * (ib / 2)]]);
            let s = |i: usize| 2 * i32::from((sc >> (3 * (i % 4))) & 7) + 1;
            let ls = two_scales(s(2 * ib), s(2 * ib + 1));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ls));
        }
        sumf += d * hsum_epi32(acc) as f32;
    }
    0.125 * sumf
}

fn iq1_m_row(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let n = (w.len() / IQ1_M_BYTES).min(x.len()) * QK_K;
    // SAFETY: the dispatch only asks for AVX2 kernels on CPUs with the AVX2 level.
    unsafe { vec_dot_iq1_m_q8_k_avx2(n, w, x) }
}

/// IQ4_NL row · Q8_0 row over `min(n / 32, w.len() / 18, x.len())` blocks.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn vec_dot_iq4_nl_q8_0_avx2(n: usize, w: &[u8], x: &[BlockQ8_0]) -> f32 {
    let nb = super::iquants::block_count(n, QK8_0, w.len(), IQ4_NL_BYTES, x.len());
    // SAFETY: KVALUES_IQ4NL is 16 readable bytes.
    let kv = unsafe { _mm_loadu_si128(KVALUES_IQ4NL.as_ptr().cast()) };
    let kv = _mm256_set_m128i(kv, kv);
    let low4 = _mm_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let mut sumf = 0.0f32;
    for (b, y) in w.chunks_exact(IQ4_NL_BYTES).zip(x).take(nb) {
        // Both f16 scales through F16C at once.
        let ds = _mm_cvtph_ps(_mm_cvtsi32_si128(
            i32::from(u16::from_le_bytes([b[0], b[1]])) | (i32::from(y.d) << 16),
        ));
        let d = _mm_cvtss_f32(_mm_mul_ss(ds, _mm_movehdup_ps(ds)));
        // SAFETY: bytes 2..18 of the block and the 32 activation bytes are readable.
        let (packed, q8) = unsafe {
            (
                _mm_loadu_si128(b[2..18].as_ptr().cast()),
                _mm256_loadu_si256(y.qs.as_ptr().cast()),
            )
        };
        let nibbles = _mm256_set_m128i(
            _mm_and_si128(_mm_srli_epi16::<4>(packed), low4),
            _mm_and_si128(packed, low4),
        );
        let values = _mm256_shuffle_epi8(kv, nibbles);
        let pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(q8), _mm256_sign_epi8(values, q8));
        let sums = _mm256_madd_epi16(pairs, ones);
        sumf += d * hsum_epi32(sums) as f32;
    }
    sumf
}

fn iq4_nl_row(w: &[u8], x: &[BlockQ8_0]) -> f32 {
    let n = (w.len() / IQ4_NL_BYTES).min(x.len()) * QK8_0;
    // SAFETY: the dispatch only asks for AVX2 kernels on CPUs with the AVX2 level.
    unsafe { vec_dot_iq4_nl_q8_0_avx2(n, w, x) }
}
