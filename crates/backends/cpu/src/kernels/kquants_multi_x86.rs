//! Multi-row Q4_K and Q6_K kernels (x86-64, AVX-512 with VNNI): one weight row against up to
//! `MULTI_ROWS_WIDE` (8) Q8_K activation rows, for batched products (prefill, speculative
//! verify).
//!
//! The weight block is decoded once (nibbles split into 64-lane vectors, the six-bit scales and
//! minimums unpacked and broadcast) and then met by every activation row. Per row the arithmetic
//! is exactly the one of the single-row AVX-512 VNNI kernel in `kquants_x86` (and so of the
//! scalar kernel): an exact i32 block sum from `vpmaddubsw` + `vpdpwssd`, an exact i32 sum of
//! `bsums · mins`, and the same f32 expression per block in block order. Results are therefore
//! bit-identical to that kernel, which is what lets `matmul` rows equal `matvec` rows. The same
//! holds for Q6_K against `kquants_x86`'s `q6k_512::<true>`.

use super::kquants::{unpack_scales_k4, Q4K_BYTES, Q6K_BYTES};
use super::kquants_x86::{group_index512, q6k_d};
use super::q8::BlockQ8K;
use super::x86_util::{f16x2_hw, hsum256_epi32, hsum4_512, hsum512_epi32, read_u32};
use super::{has_vnni, Isa};
use core::arch::x86_64::*;
use redlite_gguf::quant::GgmlType;

/// The multi-row kernel for `ty` when the single-row kernel at the AVX-512 level is
/// `kquants_x86`'s VNNI kernel for it (AVX-512 supported and VNNI present), else `None`.
pub(crate) fn multi_kernel(ty: GgmlType) -> Option<super::iquants_avx512::MultiRowDot> {
    if !(Isa::Avx512.supported() && has_vnni()) {
        return None;
    }
    match ty {
        GgmlType::Q4K => Some(q4k_multi_row),
        GgmlType::Q6K => Some(q6k_multi_row),
        _ => None,
    }
}

fn q4k_multi_row(w: &[u8], xs: &[&[BlockQ8K]], out: &mut [f32]) {
    /// The first `R` rows of `xs`.
    fn rows<'a, const R: usize>(xs: &[&'a [BlockQ8K]]) -> [&'a [BlockQ8K]; R] {
        core::array::from_fn(|r| xs[r])
    }
    // SAFETY: handed out by `multi_kernel` only when AVX-512 F/BW/VL and VNNI are present.
    unsafe {
        match xs.len() {
            0 => {}
            1 => out[..1].copy_from_slice(&q4k_rows(w, rows::<1>(xs))),
            2 => out[..2].copy_from_slice(&q4k_rows(w, rows::<2>(xs))),
            3 => out[..3].copy_from_slice(&q4k_rows(w, rows::<3>(xs))),
            4 => out[..4].copy_from_slice(&q4k_rows_wide(w, rows::<4>(xs))),
            5 => out[..5].copy_from_slice(&q4k_rows_wide(w, rows::<5>(xs))),
            6 => out[..6].copy_from_slice(&q4k_rows_wide(w, rows::<6>(xs))),
            7 => out[..7].copy_from_slice(&q4k_rows_wide(w, rows::<7>(xs))),
            8 => out[..8].copy_from_slice(&q4k_rows_wide(w, rows::<8>(xs))),
            // The driver never passes more than MULTI_ROWS_WIDE rows.
            _ => out.fill(f32::NAN),
        }
    }
}

/// `vpshufb` indices that broadcast byte `lo_sel` (low 256 bits) / `hi_sel` (high 256 bits) of
/// each 128-bit lane into the low byte of every i16, high byte zero.
#[inline(always)]
unsafe fn bcast16_index(lo_sel: u8, hi_sel: u8) -> __m512i {
    let lo = i16::from(lo_sel) | (0x80u8 as i8 as i16) << 8;
    let hi = i16::from(hi_sel) | (0x80u8 as i8 as i16) << 8;
    _mm512_inserti64x4::<1>(
        _mm512_castsi256_si512(_mm256_set1_epi16(lo)),
        _mm256_set1_epi16(hi),
    )
}

/// Q4_K · Q8_K for `R` activation rows over `min(w blocks, every xs[r] blocks)` blocks.
#[allow(clippy::needless_range_loop)] // block `i` of the weights and of every activation row
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4k_rows<const R: usize>(w: &[u8], xs: [&[BlockQ8K]; R]) -> [f32; R] {
    let nb = xs
        .iter()
        .map(|x| x.len())
        .fold(w.len() / Q4K_BYTES, usize::min);
    let idx = [
        bcast16_index(0, 1),
        bcast16_index(2, 3),
        bcast16_index(4, 5),
        bcast16_index(6, 7),
    ];
    let low4 = _mm512_set1_epi8(0x0F);
    let mut acc = [0.0f32; R];
    for i in 0..nb {
        let b = w.as_ptr().add(i * Q4K_BYTES);
        let dh = f16x2_hw(read_u32(b));
        let (d, dmin) = (_mm_cvtss_f32(dh), _mm_cvtss_f32(_mm_movehdup_ps(dh)));
        let (sc, m) = unpack_scales_k4(std::slice::from_raw_parts(b.add(4), 12));
        let scb = _mm512_set1_epi64(sc as i64);
        // Mins as 16 i16 [m0, m0, m1, m1, …], lined up with the 16 bsums.
        let mv = _mm_cvtsi64_si128(m as i64);
        let mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mv, mv));
        let q = b.add(16);
        // Chunk c: sub-blocks 2c (low nibbles) and 2c + 1 (high nibbles) of 32 weight bytes.
        let wv: [__m512i; 4] = core::array::from_fn(|c| {
            let v = _mm256_loadu_si256(q.add(32 * c) as *const __m256i);
            let both =
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(v), _mm256_srli_epi16::<4>(v));
            _mm512_and_si512(both, low4)
        });
        let ls: [__m512i; 4] = core::array::from_fn(|c| _mm512_shuffle_epi8(scb, idx[c]));
        for r in 0..R {
            let y = &xs[r][i];
            let yq = y.qs.as_ptr();
            let mut isum = _mm512_setzero_si512();
            for c in 0..4 {
                let yv = _mm512_loadu_si512(yq.add(64 * c) as *const _);
                let p = _mm512_maddubs_epi16(wv[c], yv);
                isum = _mm512_dpwssd_epi32(isum, p, ls[c]);
            }
            let bs = _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i);
            let pm = _mm256_madd_epi16(bs, mins);
            let (isum, isumm) = (hsum512_epi32(isum), hsum256_epi32(pm));
            acc[r] += (y.d * d) * isum as f32 - (y.d * dmin) * isumm as f32;
        }
    }
    acc
}

/// The exact sums of the 8 i32 lanes of each of `v[0..4]`, as the 4 lanes of one vector.
#[inline(always)]
unsafe fn hsum4_256(v: [__m256i; 4]) -> __m128i {
    let ab = _mm256_add_epi32(
        _mm256_unpacklo_epi32(v[0], v[1]),
        _mm256_unpackhi_epi32(v[0], v[1]),
    );
    let cd = _mm256_add_epi32(
        _mm256_unpacklo_epi32(v[2], v[3]),
        _mm256_unpackhi_epi32(v[2], v[3]),
    );
    let abcd = _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
    _mm_add_epi32(
        _mm256_castsi256_si128(abcd),
        _mm256_extracti128_si256::<1>(abcd),
    )
}

/// [`q4k_rows`] for `R` ≤ 8 activation rows, the block decoded before the rows meet it (the live
/// registers do not grow with `R`), the per-block reductions of four rows done together (two
/// transposing reductions instead of eight horizontal sums) and their f32 block updates in the
/// lanes of one vector: per lane the same operations as the scalar expression (`(y.d·d)·isum −
/// (y.d·dmin)·isumm`, then added), so bit-identical.
#[allow(clippy::needless_range_loop)] // block `i` of the weights and of every activation row
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4k_rows_wide<const R: usize>(w: &[u8], xs: [&[BlockQ8K]; R]) -> [f32; R] {
    let nb = xs
        .iter()
        .map(|x| x.len())
        .fold(w.len() / Q4K_BYTES, usize::min);
    let idx = [
        bcast16_index(0, 1),
        bcast16_index(2, 3),
        bcast16_index(4, 5),
        bcast16_index(6, 7),
    ];
    let low4 = _mm512_set1_epi8(0x0F);
    let mut acc = [0.0f32; R];
    let mut acc4 = [_mm_setzero_ps(); 2];
    for i in 0..nb {
        let b = w.as_ptr().add(i * Q4K_BYTES);
        let dh = f16x2_hw(read_u32(b));
        let (sc, m) = unpack_scales_k4(std::slice::from_raw_parts(b.add(4), 12));
        let scb = _mm512_set1_epi64(sc as i64);
        let mv = _mm_cvtsi64_si128(m as i64);
        let mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mv, mv));
        let q = b.add(16);
        let wv: [__m512i; 4] = core::array::from_fn(|c| {
            let v = _mm256_loadu_si256(q.add(32 * c) as *const __m256i);
            let both =
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(v), _mm256_srli_epi16::<4>(v));
            _mm512_and_si512(both, low4)
        });
        let ls: [__m512i; 4] = core::array::from_fn(|c| _mm512_shuffle_epi8(scb, idx[c]));
        // Row r's exact block sum (16 lanes) and bsums·mins (8 lanes).
        let sums = |r: usize| {
            let y = &xs[r][i];
            let yq = y.qs.as_ptr();
            let mut isum = _mm512_setzero_si512();
            for c in 0..4 {
                let yv = _mm512_loadu_si512(yq.add(64 * c) as *const _);
                isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(wv[c], yv), ls[c]);
            }
            let bs = _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i);
            (isum, _mm256_madd_epi16(bs, mins))
        };
        let d = _mm_broadcastss_ps(dh);
        let dmin = _mm_broadcastss_ps(_mm_movehdup_ps(dh));
        for (g, a4) in acc4.iter_mut().enumerate().take(R / 4) {
            let r0 = 4 * g;
            let s: [(__m512i, __m256i); 4] = core::array::from_fn(|k| sums(r0 + k));
            let isum = _mm_cvtepi32_ps(hsum4_512(s.map(|p| p.0)));
            let isumm = _mm_cvtepi32_ps(hsum4_256(s.map(|p| p.1)));
            let yd = _mm_setr_ps(
                xs[r0][i].d,
                xs[r0 + 1][i].d,
                xs[r0 + 2][i].d,
                xs[r0 + 3][i].d,
            );
            let t = _mm_sub_ps(
                _mm_mul_ps(_mm_mul_ps(yd, d), isum),
                _mm_mul_ps(_mm_mul_ps(yd, dmin), isumm),
            );
            *a4 = _mm_add_ps(*a4, t);
        }
        let (d, dmin) = (_mm_cvtss_f32(dh), _mm_cvtss_f32(_mm_movehdup_ps(dh)));
        for r in R / 4 * 4..R {
            let yd = xs[r][i].d;
            let (isum, pm) = sums(r);
            let (isum, isumm) = (hsum512_epi32(isum), hsum256_epi32(pm));
            acc[r] += (yd * d) * isum as f32 - (yd * dmin) * isumm as f32;
        }
    }
    for (g, a4) in acc4.iter().enumerate().take(R / 4) {
        let mut four = [0.0f32; 4];
        _mm_storeu_ps(four.as_mut_ptr(), *a4);
        acc[4 * g..4 * g + 4].copy_from_slice(&four);
    }
    acc
}

fn q6k_multi_row(w: &[u8], xs: &[&[BlockQ8K]], out: &mut [f32]) {
    /// The first `R` rows of `xs`.
    fn rows<'a, const R: usize>(xs: &[&'a [BlockQ8K]]) -> [&'a [BlockQ8K]; R] {
        core::array::from_fn(|r| xs[r])
    }
    // SAFETY: handed out by `multi_kernel` only when AVX-512 F/BW/VL and VNNI are present.
    unsafe {
        match xs.len() {
            0 => {}
            1 => out[..1].copy_from_slice(&q6k_rows(w, rows::<1>(xs))),
            2 => out[..2].copy_from_slice(&q6k_rows(w, rows::<2>(xs))),
            3 => out[..3].copy_from_slice(&q6k_rows(w, rows::<3>(xs))),
            4 => out[..4].copy_from_slice(&q6k_rows(w, rows::<4>(xs))),
            5 => out[..5].copy_from_slice(&q6k_rows(w, rows::<5>(xs))),
            6 => out[..6].copy_from_slice(&q6k_rows(w, rows::<6>(xs))),
            7 => out[..7].copy_from_slice(&q6k_rows(w, rows::<7>(xs))),
            8 => out[..8].copy_from_slice(&q6k_rows(w, rows::<8>(xs))),
            // The driver never passes more than MULTI_ROWS_WIDE rows.
            _ => out.fill(f32::NAN),
        }
    }
}

/// Q6_K · Q8_K for `R` ≤ 8 activation rows over `min(w blocks, every xs[r] blocks)` blocks.
///
/// Per block the four 64-element code vectors (six-bit codes used unsigned, 0..63) and the four
/// per-16-element scale vectors are built once, as in the single-row AVX-512 kernel; each row then
/// takes its exact i32 block sum (`vpmaddubsw` + `vpdpwssd`, minus `32 · Σ scale_g · bsum_g` for
/// the codes' −32 offset). Groups of four rows are reduced together and updated in the lanes of
/// one xmm (`acc += (y.d · d) · isum`, per lane the scalar expression); the rest one by one.
/// Bit-identical to the single-row kernel per row.
#[allow(clippy::needless_range_loop)] // block `i` of the weights and of every activation row
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q6k_rows<const R: usize>(w: &[u8], xs: [&[BlockQ8K]; R]) -> [f32; R] {
    let nb = xs
        .iter()
        .map(|x| x.len())
        .fold(w.len() / Q6K_BYTES, usize::min);
    let idx = [
        group_index512(0),
        group_index512(4),
        group_index512(8),
        group_index512(12),
    ];
    let m4 = _mm512_set1_epi8(0x0F);
    let m30 = _mm512_set1_epi8(0x30);
    let mut acc = [0.0f32; R];
    let mut acc4 = [_mm_setzero_ps(); 2];
    for i in 0..nb {
        // Block: ql[128] (low nibbles), qh[64] (high bit pairs), scales[16] (i8), d (f16).
        let b = w.as_ptr().add(i * Q6K_BYTES);
        let d = q6k_d(b);
        let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(192) as *const __m128i));
        let scz = _mm512_castsi256_si512(sc16);
        // Code vector 2c + k: elements 128c + 64k .. +64 (k = 0: low nibbles and qh bit pairs
        // 0/1, k = 1: high nibbles and pairs 2/3); its scales, one i16 per 16 elements.
        let mut wv = [_mm512_setzero_si512(); 4];
        for c in 0..2 {
            let l = _mm512_loadu_si512(b.add(64 * c) as *const _);
            let h = _mm256_loadu_si256(b.add(128 + 32 * c) as *const __m256i);
            let hz = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(h), _mm256_srli_epi16::<2>(h));
            wv[2 * c] = _mm512_or_si512(
                _mm512_and_si512(l, m4),
                _mm512_and_si512(_mm512_slli_epi16::<4>(hz), m30),
            );
            wv[2 * c + 1] = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16::<4>(l), m4),
                _mm512_and_si512(hz, m30),
            );
        }
        let ls = [
            _mm512_permutexvar_epi16(idx[0], scz),
            _mm512_permutexvar_epi16(idx[1], scz),
            _mm512_permutexvar_epi16(idx[2], scz),
            _mm512_permutexvar_epi16(idx[3], scz),
        ];
        let d4 = _mm_set1_ps(d);
        for (g, a4) in acc4.iter_mut().enumerate().take(R / 4) {
            let r0 = 4 * g;
            let s = [
                q6k_block_sum(&wv, &ls, sc16, &xs[r0][i]),
                q6k_block_sum(&wv, &ls, sc16, &xs[r0 + 1][i]),
                q6k_block_sum(&wv, &ls, sc16, &xs[r0 + 2][i]),
                q6k_block_sum(&wv, &ls, sc16, &xs[r0 + 3][i]),
            ];
            let isum = _mm_cvtepi32_ps(hsum4_512(s));
            let yd = _mm_setr_ps(
                xs[r0][i].d,
                xs[r0 + 1][i].d,
                xs[r0 + 2][i].d,
                xs[r0 + 3][i].d,
            );
            *a4 = _mm_add_ps(*a4, _mm_mul_ps(_mm_mul_ps(yd, d4), isum));
        }
        for r in R / 4 * 4..R {
            acc[r] +=
                (xs[r][i].d * d) * hsum512_epi32(q6k_block_sum(&wv, &ls, sc16, &xs[r][i])) as f32;
        }
    }
    for (g, a4) in acc4.iter().enumerate().take(R / 4) {
        let mut four = [0.0f32; 4];
        _mm_storeu_ps(four.as_mut_ptr(), *a4);
        acc[4 * g..4 * g + 4].copy_from_slice(&four);
    }
    acc
}

/// One activation block's exact Q6_K block sum against the decoded weight block (`wv`: code
/// vectors, `ls`: their scales, `sc16`: the 16 scales as i16), spread over 16 i32 lanes.
#[inline(always)]
unsafe fn q6k_block_sum(
    wv: &[__m512i; 4],
    ls: &[__m512i; 4],
    sc16: __m256i,
    y: &BlockQ8K,
) -> __m512i {
    let yq = y.qs.as_ptr();
    let mut isum = _mm512_setzero_si512();
    for k in 0..4 {
        let yv = _mm512_loadu_si512(yq.add(64 * k) as *const _);
        isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(wv[k], yv), ls[k]);
    }
    let bs = _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i);
    let corr = _mm256_slli_epi32::<5>(_mm256_madd_epi16(bs, sc16));
    _mm512_sub_epi32(isum, _mm512_zextsi256_si512(corr))
}

// ---------------------------------------------------------------------------------------------
// Grouped activations: `vpdpbusd` over sub-block-aligned lanes
// ---------------------------------------------------------------------------------------------

/// Q8_K activation blocks in grouped form: byte `8s + j` of 64-byte chunk `k` is quant
/// `32s + 8k + j` of the plain block (qword `s` of chunk `k` = quants `8k..8k + 8` of sub-block
/// `s`), so i32 lane `l` of every chunk belongs to sub-block `l / 2`. With `offset`, each quant is
/// stored as `q8 ^ 0x80` (the byte q8 + 128, as `iquants_avx512::offset_activations`). `d` and
/// `bsums` are unchanged.
pub(crate) fn grouped_activations(q: &[BlockQ8K], offset: bool) -> Vec<BlockQ8K> {
    let flip = if offset { 0x80u8 } else { 0 };
    q.iter()
        .map(|b| {
            let mut g = *b;
            for k in 0..4 {
                for s in 0..8 {
                    for j in 0..8 {
                        g.qs[64 * k + 8 * s + j] = (b.qs[32 * s + 8 * k + j] as u8 ^ flip) as i8;
                    }
                }
            }
            g
        })
        .collect()
}

/// The most activation rows the grouped multi-row kernels take per call.
pub(crate) const GROUPED_ROWS: usize = 8;

/// The multi-row Q4_K kernel on grouped activations ([`grouped_activations`] without offset),
/// under the same conditions as [`multi_kernel`]; up to [`GROUPED_ROWS`] rows per call.
pub(crate) fn grouped_kernel(ty: GgmlType) -> Option<super::iquants_avx512::MultiRowDot> {
    match ty {
        GgmlType::Q4K if Isa::Avx512.supported() && has_vnni() => Some(q4k_multi_row_grouped),
        _ => None,
    }
}

/// Calls `$f::<R>(w, rows)` for `R = xs.len()` (1..=16), writing the results to `out`.
macro_rules! dispatch_rows {
    ($f:ident, $w:expr, $xs:expr, $out:expr, $($r:literal)*) => {
        match $xs.len() {
            $($r => {
                let rows: [&[BlockQ8K]; $r] = core::array::from_fn(|i| $xs[i]);
                $out[..$r].copy_from_slice(&$f::<$r>($w, rows));
            })*
            0 => {}
            // The driver never passes more than GROUPED_ROWS rows.
            _ => $out.fill(f32::NAN),
        }
    };
}

fn q4k_multi_row_grouped(w: &[u8], xs: &[&[BlockQ8K]], out: &mut [f32]) {
    // SAFETY: handed out by `grouped_kernel` only when AVX-512 F/BW/VL and VNNI are present.
    unsafe { dispatch_rows!(q4k_rows_grouped, w, xs, out, 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16) }
}

/// `vpermt2d` indices of grouped weight chunk `k`: lane `4c + j` takes qs word
/// `8c + 2k + (j & 1)` (its low nibbles for `j < 2`: sub-block `2c`; its high nibbles for
/// `j ≥ 2`: sub-block `2c + 1`), i.e. elements `8k + 4(j & 1) ..` of that sub-block.
#[inline(always)]
unsafe fn q4k_group_index(k: i32) -> __m512i {
    let l = |c: i32, j: i32| 8 * c + 2 * k + (j & 1);
    _mm512_setr_epi32(
        l(0, 0),
        l(0, 1),
        l(0, 2),
        l(0, 3),
        l(1, 0),
        l(1, 1),
        l(1, 2),
        l(1, 3),
        l(2, 0),
        l(2, 1),
        l(2, 2),
        l(2, 3),
        l(3, 0),
        l(3, 1),
        l(3, 2),
        l(3, 3),
    )
}

/// Q4_K · grouped Q8_K for `R` ≤ 16 activation rows.
///
/// Per block the four weight chunks are built in the grouped order (lane `l` of every chunk in
/// sub-block `l / 2`), so one row's four `vpdpbusd` (unsigned nibbles × signed quants) leave in
/// each lane the sum of 16 products of one sub-block (|·| ≤ 16 · 15 · 127 < 2¹⁵, so it is also a
/// valid i16); one `vpmaddwd` with the lane's six-bit scale gives the scaled sums. That is 5
/// multiplies per block and row instead of 8, and the same exact i32 block sum as the
/// single-row kernel; the mins term and the f32 updates are those of [`q4k_rows_wide`], so the
/// results are bit-identical.
#[allow(clippy::needless_range_loop)] // block `i` of the weights and of every activation row
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4k_rows_grouped<const R: usize>(w: &[u8], xs: [&[BlockQ8K]; R]) -> [f32; R] {
    let nb = xs
        .iter()
        .map(|x| x.len())
        .fold(w.len() / Q4K_BYTES, usize::min);
    let idx = [
        q4k_group_index(0),
        q4k_group_index(1),
        q4k_group_index(2),
        q4k_group_index(3),
    ];
    let shift = _mm512_setr_epi32(0, 0, 4, 4, 0, 0, 4, 4, 0, 0, 4, 4, 0, 0, 4, 4);
    let low4 = _mm512_set1_epi8(0x0F);
    let mut acc = [0.0f32; R];
    let mut acc4 = [_mm_setzero_ps(); 4];
    for i in 0..nb {
        let b = w.as_ptr().add(i * Q4K_BYTES);
        let dh = f16x2_hw(read_u32(b));
        let (sc, m) = unpack_scales_k4(std::slice::from_raw_parts(b.add(4), 12));
        // Lane l: the scale of sub-block l / 2 (i32, so also the i16 pair [scale, 0]).
        let scv = _mm_cvtsi64_si128(sc as i64);
        let s32 = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(scv, scv));
        let mv = _mm_cvtsi64_si128(m as i64);
        let mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mv, mv));
        let q0 = _mm512_loadu_si512(b.add(16) as *const _);
        let q1 = _mm512_loadu_si512(b.add(80) as *const _);
        let mut wv = [_mm512_setzero_si512(); 4];
        for (wk, &ik) in wv.iter_mut().zip(&idx) {
            let words = _mm512_permutex2var_epi32(q0, ik, q1);
            *wk = _mm512_and_si512(_mm512_srlv_epi32(words, shift), low4);
        }
        let d = _mm_broadcastss_ps(dh);
        let dmin = _mm_broadcastss_ps(_mm_movehdup_ps(dh));
        // Block `i` of every row, without bounds checks in the loop. SAFETY: `i < nb`, and `nb`
        // is at most every row's block count.
        let ys: [&BlockQ8K; R] = core::array::from_fn(|r| xs[r].get_unchecked(i));
        for (g, a4) in acc4.iter_mut().enumerate().take(R / 4) {
            let r0 = 4 * g;
            let s = [
                q4k_grouped_sums(&wv, s32, mins, ys[r0]),
                q4k_grouped_sums(&wv, s32, mins, ys[r0 + 1]),
                q4k_grouped_sums(&wv, s32, mins, ys[r0 + 2]),
                q4k_grouped_sums(&wv, s32, mins, ys[r0 + 3]),
            ];
            let isum = _mm_cvtepi32_ps(hsum4_512([s[0].0, s[1].0, s[2].0, s[3].0]));
            let isumm = _mm_cvtepi32_ps(hsum4_256([s[0].1, s[1].1, s[2].1, s[3].1]));
            let yd = _mm_setr_ps(ys[r0].d, ys[r0 + 1].d, ys[r0 + 2].d, ys[r0 + 3].d);
            let t = _mm_sub_ps(
                _mm_mul_ps(_mm_mul_ps(yd, d), isum),
                _mm_mul_ps(_mm_mul_ps(yd, dmin), isumm),
            );
            *a4 = _mm_add_ps(*a4, t);
        }
        let (d, dmin) = (_mm_cvtss_f32(dh), _mm_cvtss_f32(_mm_movehdup_ps(dh)));
        for r in R / 4 * 4..R {
            let yd = ys[r].d;
            let (isum, pm) = q4k_grouped_sums(&wv, s32, mins, ys[r]);
            let (isum, isumm) = (hsum512_epi32(isum), hsum256_epi32(pm));
            acc[r] += (yd * d) * isum as f32 - (yd * dmin) * isumm as f32;
        }
    }
    for (g, a4) in acc4.iter().enumerate().take(R / 4) {
        let mut four = [0.0f32; 4];
        _mm_storeu_ps(four.as_mut_ptr(), *a4);
        acc[4 * g..4 * g + 4].copy_from_slice(&four);
    }
    acc
}

/// One grouped activation block against the grouped weight chunks `wv` (scales `s32`, mins as
/// 16 i16 `mins`): the exact scaled block sum spread over 16 i32 lanes, and `bsums · mins` over 8.
#[inline(always)]
unsafe fn q4k_grouped_sums(
    wv: &[__m512i; 4],
    s32: __m512i,
    mins: __m256i,
    y: &BlockQ8K,
) -> (__m512i, __m256i) {
    let yq = y.qs.as_ptr();
    let mut t = _mm512_setzero_si512();
    for (k, &wk) in wv.iter().enumerate() {
        let yv = _mm512_loadu_si512(yq.add(64 * k) as *const _);
        t = _mm512_dpbusd_epi32(t, wk, yv);
    }
    let bs = _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i);
    (_mm512_madd_epi16(t, s32), _mm256_madd_epi16(bs, mins))
}

// ---------------------------------------------------------------------------------------------
// Tile GEMM: 16 weight rows interleaved per lane, for prompt-sized batches
// ---------------------------------------------------------------------------------------------

/// Weight rows per tile of the Q4_K tile GEMM (one per i32 lane).
pub(crate) const TILE_ROWS: usize = 16;

/// One Q4_K block of 16 weight rows, repacked so that lane `r` of every vector is weight row `r`:
/// the quants as bytes, four per lane (`q[g]`: elements `4g..4g + 4`), the six-bit scales per
/// sub-block, the mins as i16 pairs (`mins[k]`: sub-blocks `2k`, `2k + 1`), `d` and `dmin`.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct Q4kTileBlock {
    q: [[u8; 64]; 64],
    scales: [[i32; 16]; 8],
    mins: [[i32; 16]; 4],
    d: [f32; 16],
    dmin: [f32; 16],
}

impl Q4kTileBlock {
    const ZERO: Q4kTileBlock = Q4kTileBlock {
        q: [[0; 64]; 64],
        scales: [[0; 16]; 8],
        mins: [[0; 16]; 4],
        d: [0.0; 16],
        dmin: [0.0; 16],
    };
}

/// Whether the Q4_K tile GEMM can run here (AVX-512 with VNNI, like [`multi_kernel`]).
pub(crate) fn tile_gemm_supported() -> bool {
    Isa::Avx512.supported() && has_vnni()
}

/// Repacks up to 16 Q4_K weight rows (`w`: `rows_here` rows of `rb` bytes, `nb` blocks each) into
/// `out` (one [`Q4kTileBlock`] per block); missing rows are zero.
pub(crate) fn q4k_tile_repack(
    w: &[u8],
    rows_here: usize,
    rb: usize,
    nb: usize,
    out: &mut Vec<Q4kTileBlock>,
) {
    out.clear();
    out.resize(nb, Q4kTileBlock::ZERO);
    for (i, t) in out.iter_mut().enumerate() {
        for r in 0..rows_here.min(TILE_ROWS) {
            let b = &w[r * rb + i * Q4K_BYTES..][..Q4K_BYTES];
            t.d[r] = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
            t.dmin[r] = half::f16::from_le_bytes([b[2], b[3]]).to_f32();
            let (sc, m) = unpack_scales_k4(&b[4..16]);
            for s in 0..8 {
                t.scales[s][r] = ((sc >> (8 * s)) & 0xFF) as i32;
            }
            for k in 0..4 {
                let (m0, m1) = ((m >> (16 * k)) & 0xFF, (m >> (16 * k + 8)) & 0xFF);
                t.mins[k][r] = (m0 | m1 << 16) as i32;
            }
            // Word k of chunk c: low nibbles = elements 64c + 4k.. (group 16c + k), high
            // nibbles = elements 64c + 32 + 4k.. (group 16c + 8 + k).
            for (c, chunk) in b[16..].chunks_exact(32).enumerate() {
                for (k, word) in chunk.chunks_exact(4).enumerate() {
                    let v = u32::from_le_bytes([word[0], word[1], word[2], word[3]]);
                    let lo = v & 0x0F0F_0F0F;
                    let hi = (v >> 4) & 0x0F0F_0F0F;
                    t.q[16 * c + k][4 * r..4 * r + 4].copy_from_slice(&lo.to_le_bytes());
                    t.q[16 * c + 8 + k][4 * r..4 * r + 4].copy_from_slice(&hi.to_le_bytes());
                }
            }
        }
    }
}

/// The sub-block quant sums of an activation block as i16 pairs: word `k` holds sub-blocks
/// `2k` (low half) and `2k + 1` (high half), from `bsums`.
pub(crate) fn q8k_pair_sums(y: &BlockQ8K) -> [i32; 4] {
    core::array::from_fn(|k| {
        let lo = y.bsums[4 * k] as i32 + y.bsums[4 * k + 1] as i32;
        let hi = y.bsums[4 * k + 2] as i32 + y.bsums[4 * k + 3] as i32;
        (lo & 0xFFFF) | (hi << 16)
    })
}

/// The tile GEMM micro-kernel: the 16 weight rows of `tile` against `ys.len()` ≤ 4 activation
/// rows (`ys[j]`: its Q8_K blocks, `pairs[j]`: their [`q8k_pair_sums`]); `out[j][r]` gets
/// weight row `r` · activation row `j`.
///
/// Per block, lane `r` holds weight row `r`: per sub-block eight `vpdpbusd` (four quants of the
/// activation broadcast) give its exact sum of 32 products, `vpmulld` scales it; the mins term
/// is four `vpdpwssd` of the min pairs with the sub-block sums. These are the exact i32 block sums
/// of the single-row kernel, and per lane the f32 update is its expression `(y.d · d) · isum −
/// (y.d · dmin) · isumm`, added in block order: bit-identical results.
pub(crate) fn q4k_tile_rows(
    tile: &[Q4kTileBlock],
    ys: &[&[BlockQ8K]],
    pairs: &[&[[i32; 4]]],
    out: &mut [[f32; TILE_ROWS]],
) {
    /// The first `J` entries of `v`.
    fn first<T: Copy, const J: usize>(v: &[T]) -> [T; J] {
        core::array::from_fn(|j| v[j])
    }
    // SAFETY: only called by the driver when `tile_gemm_supported()`.
    unsafe {
        match ys.len() {
            1 => out[..1].copy_from_slice(&q4k_tile_j::<1>(tile, first(ys), first(pairs))),
            2 => out[..2].copy_from_slice(&q4k_tile_j::<2>(tile, first(ys), first(pairs))),
            3 => out[..3].copy_from_slice(&q4k_tile_j::<3>(tile, first(ys), first(pairs))),
            4 => out[..4].copy_from_slice(&q4k_tile_j::<4>(tile, first(ys), first(pairs))),
            _ => {}
        }
    }
}

#[allow(clippy::needless_range_loop)] // block `i` of the tile and of every activation row
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4k_tile_j<const J: usize>(
    tile: &[Q4kTileBlock],
    ys: [&[BlockQ8K]; J],
    pairs: [&[[i32; 4]]; J],
) -> [[f32; TILE_ROWS]; J] {
    let nb = ys.iter().map(|y| y.len()).fold(tile.len(), usize::min);
    let mut facc = [_mm512_setzero_ps(); J];
    for i in 0..nb {
        let tb = &tile[i];
        let mut isum = [_mm512_setzero_si512(); J];
        for s in 0..8 {
            let mut t = [_mm512_setzero_si512(); J];
            for g in 0..8 {
                let wv = _mm512_load_si512(tb.q[8 * s + g].as_ptr() as *const _);
                for j in 0..J {
                    let p = ys[j][i].qs.as_ptr().add(32 * s + 4 * g) as *const i32;
                    let a = _mm512_set1_epi32(p.read_unaligned());
                    t[j] = _mm512_dpbusd_epi32(t[j], wv, a);
                }
            }
            let sc = _mm512_load_si512(tb.scales[s].as_ptr() as *const _);
            for j in 0..J {
                isum[j] = _mm512_add_epi32(isum[j], _mm512_mullo_epi32(t[j], sc));
            }
        }
        let mut isumm = [_mm512_setzero_si512(); J];
        for k in 0..4 {
            let mv = _mm512_load_si512(tb.mins[k].as_ptr() as *const _);
            for j in 0..J {
                let a = _mm512_set1_epi32(pairs[j][i][k]);
                isumm[j] = _mm512_dpwssd_epi32(isumm[j], mv, a);
            }
        }
        let d = _mm512_load_ps(tb.d.as_ptr());
        let dmin = _mm512_load_ps(tb.dmin.as_ptr());
        for j in 0..J {
            let yd = _mm512_set1_ps(ys[j][i].d);
            let a = _mm512_mul_ps(_mm512_mul_ps(yd, d), _mm512_cvtepi32_ps(isum[j]));
            let b = _mm512_mul_ps(_mm512_mul_ps(yd, dmin), _mm512_cvtepi32_ps(isumm[j]));
            facc[j] = _mm512_add_ps(facc[j], _mm512_sub_ps(a, b));
        }
    }
    let mut out = [[0.0f32; TILE_ROWS]; J];
    for j in 0..J {
        _mm512_storeu_ps(out[j].as_mut_ptr(), facc[j]);
    }
    out
}
