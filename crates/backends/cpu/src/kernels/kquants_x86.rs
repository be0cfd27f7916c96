//! x86-64 SIMD row kernels for Q4_K, Q5_K and Q6_K · Q8_K activations: AVX2 and AVX-512
//! (F/BW/VL, with VNNI's `vpdpwssd` where present).
//!
//! They compute the same exact integer block sums as the scalar kernels in [`super::kquants`]
//! (see there), with `vpmaddubsw` (unsigned weight codes × signed activations, pairs summed to
//! i16, which cannot saturate for these code ranges) and `vpmaddwd`/`vpdpwssd` against the
//! broadcast sub-block scales, reduce them to one i32 per block, and accumulate the block terms
//! with the scalar kernels' f32 expression in block order: results are bit-identical to the
//! scalar kernels.
//!
//! Safety: the `#[target_feature]` functions may only run on CPUs with those features. They are
//! reachable only through [`kernel`], which hands them out only when [`Isa::supported`] (and
//! [`has_vnni`](super::has_vnni) for the VNNI variants) says so.

use super::kquants::{unpack_scales_k4, Q4K_BYTES, Q5K_BYTES, Q6K_BYTES};
use super::q8::BlockQ8K;
use super::x86_util::{
    f16x2_hw, hsum256_epi32, hsum512_epi32, prefetch_ahead, prefetch_distance,
    prefetch_distance_or, read_u32,
};
use super::{has_vnni, Isa, RowDot};
use core::arch::x86_64::*;
use redlite_gguf::quant::GgmlType;

/// The SIMD kernels of this module for exactly level `isa`.
pub(crate) fn kernel(ty: GgmlType, isa: Isa) -> Option<RowDot> {
    variant(ty, isa, has_vnni())
}

/// The AVX-512 kernels that [`kernel`] does not pick because the CPU has VNNI (the plain
/// AVX-512BW versions), so that tests can check them too; `None` without VNNI.
pub(crate) fn alternate(ty: GgmlType, isa: Isa) -> Option<RowDot> {
    if isa == Isa::Avx512 && has_vnni() {
        variant(ty, isa, false)
    } else {
        None
    }
}

/// The kernel for `ty` at level `isa`, with or without VNNI (`vnni` must only be true when the
/// CPU has it).
fn variant(ty: GgmlType, isa: Isa, vnni: bool) -> Option<RowDot> {
    if !isa.supported() {
        return None;
    }
    let f: fn(&[u8], &[BlockQ8K]) -> f32 = match (isa, ty, vnni) {
        (Isa::Avx512, GgmlType::Q4K, true) => q4k_avx512_vnni,
        (Isa::Avx512, GgmlType::Q4K, false) => q4k_avx512,
        (Isa::Avx512, GgmlType::Q5K, true) => q5k_avx512_vnni,
        (Isa::Avx512, GgmlType::Q5K, false) => q5k_avx512,
        (Isa::Avx512, GgmlType::Q6K, true) => q6k_avx512_vnni,
        (Isa::Avx512, GgmlType::Q6K, false) => q6k_avx512,
        (Isa::Avx2, GgmlType::Q4K, _) => q4k_avx2,
        (Isa::Avx2, GgmlType::Q5K, _) => q5k_avx2,
        (Isa::Avx2, GgmlType::Q6K, _) => q6k_avx2,
        _ => return None,
    };
    Some(RowDot::Q8K(f))
}

/// Declares a safe wrapper `$name` around `$body::<$vnni>` compiled with `$features`.
macro_rules! simd_kernel {
    ($name:ident, $inner:ident, $body:ident, $vnni:expr, $features:literal) => {
        #[target_feature(enable = $features)]
        unsafe fn $inner(w: &[u8], x: &[BlockQ8K]) -> f32 {
            $body::<$vnni>(w, x)
        }
        fn $name(w: &[u8], x: &[BlockQ8K]) -> f32 {
            // SAFETY: only reachable through `kernel`, after the CPU features were checked.
            unsafe { $inner(w, x) }
        }
    };
}

simd_kernel!(
    q4k_avx512,
    q4k_avx512_i,
    q4k_512,
    false,
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
);
simd_kernel!(
    q4k_avx512_vnni,
    q4k_avx512_vnni_i,
    q4k_vl_vnni,
    false,
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"
);
simd_kernel!(
    q5k_avx512,
    q5k_avx512_i,
    q5k_512,
    false,
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
);
simd_kernel!(
    q5k_avx512_vnni,
    q5k_avx512_vnni_i,
    q5k_512,
    true,
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"
);
simd_kernel!(
    q6k_avx512,
    q6k_avx512_i,
    q6k_512,
    false,
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
);
simd_kernel!(
    q6k_avx512_vnni,
    q6k_avx512_vnni_i,
    q6k_512,
    true,
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"
);
simd_kernel!(
    q4k_avx512_vnni_paired,
    q4k_avx512_vnni_paired_i,
    q4k_vl_vnni,
    true,
    "avx512f,avx512bw,avx512vl,avx512vnni,gfni,avx2,fma,f16c"
);
/// [`q4k_vl_rows`] for the VNNI CPUs whose row kernel is [`q4k_avx512_vnni`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4k_avx512_vnni_rows_i(w: &[u8], row_bytes: usize, x: &[BlockQ8K], out: &mut [f32]) {
    q4k_vl_rows::<false>(w, row_bytes, x, out)
}

/// [`q4k_vl_rows`] on paired activations, for the CPUs of [`q4k_avx512_vnni_paired`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,gfni,avx2,fma,f16c")]
unsafe fn q4k_avx512_vnni_paired_rows_i(
    w: &[u8],
    row_bytes: usize,
    x: &[BlockQ8K],
    out: &mut [f32],
) {
    q4k_vl_rows::<true>(w, row_bytes, x, out)
}

fn q4k_avx512_vnni_rows(w: &[u8], row_bytes: usize, x: &[BlockQ8K], out: &mut [f32]) {
    assert!(row_bytes.is_multiple_of(Q4K_BYTES) && w.len() >= out.len() * row_bytes);
    // SAFETY: only reachable through `rows_kernel`, after the CPU features were checked; the
    // rows read lie inside `w` (checked above).
    unsafe { q4k_avx512_vnni_rows_i(w, row_bytes, x, out) }
}

fn q4k_avx512_vnni_paired_rows(w: &[u8], row_bytes: usize, x: &[BlockQ8K], out: &mut [f32]) {
    assert!(row_bytes.is_multiple_of(Q4K_BYTES) && w.len() >= out.len() * row_bytes);
    // SAFETY: only reachable through `q4k_paired_rows_kernel`, after the CPU features were
    // checked; the rows read lie inside `w` (checked above).
    unsafe { q4k_avx512_vnni_paired_rows_i(w, row_bytes, x, out) }
}

/// Whether the paired-activation kernels can run: AVX-512 with VNNI and GFNI.
fn paired_supported() -> bool {
    Isa::Avx512.supported() && has_vnni() && is_x86_feature_detected!("gfni")
}

/// The Q4_K row kernel of the AVX-512 VNNI level on activations reordered by
/// [`q4k_paired_q8k`] (one 64-byte load per product instead of two halves); the same value as
/// [`kernel`]'s on the activations in their usual order. `None` without AVX-512 VNNI.
pub fn q4k_paired_kernel() -> Option<super::iquants_avx512::Q8KRowDot> {
    paired_supported().then_some(q4k_avx512_vnni_paired as _)
}

/// [`rows_kernel`]'s Q4_K kernel on activations reordered by [`q4k_paired_q8k`] (same values).
pub fn q4k_paired_rows_kernel() -> Option<super::RowsDot> {
    paired_supported().then_some(q4k_avx512_vnni_paired_rows as _)
}

/// A kernel over several weight rows against one Q8_K row: `out[r]` = row `r` of `w` (rows of
/// `row_bytes` bytes) · `x`, each bit-identical to [`kernel`]'s row kernel for the same type
/// and level; `None` where there is no such kernel.
pub(crate) fn rows_kernel(ty: GgmlType, isa: Isa) -> Option<super::RowsDot> {
    match ty {
        GgmlType::Q4K if isa == Isa::Avx512 && isa.supported() && has_vnni() => {
            Some(q4k_avx512_vnni_rows)
        }
        _ => None,
    }
}

simd_kernel!(q4k_avx2, q4k_avx2_i, q4k_256, false, "avx2,fma,f16c");
simd_kernel!(q5k_avx2, q5k_avx2_i, q5k_256, false, "avx2,fma,f16c");
simd_kernel!(q6k_avx2, q6k_avx2_i, q6k_256, false, "avx2,fma,f16c");

/// `acc + Σ pairs(p · s)` in i32 lanes: `vpdpwssd` with VNNI, else `vpmaddwd` + `vpaddd`.
#[inline(always)]
unsafe fn dot16_acc<const VNNI: bool>(acc: __m512i, p: __m512i, s: __m512i) -> __m512i {
    if VNNI {
        _mm512_dpwssd_epi32(acc, p, s)
    } else {
        _mm512_add_epi32(acc, _mm512_madd_epi16(p, s))
    }
}

/// `vpshufb` indices that broadcast byte `i` of each 128-bit lane into the low byte of every
/// i16 (high byte zero): `i = lo_sel` in the low 256 bits, `hi_sel` in the high 256 bits.
#[inline(always)]
unsafe fn bcast16_index512(lo_sel: u8, hi_sel: u8) -> __m512i {
    let lo = i16::from(lo_sel) | (0x80u8 as i8 as i16) << 8;
    let hi = i16::from(hi_sel) | (0x80u8 as i8 as i16) << 8;
    _mm512_inserti64x4::<1>(
        _mm512_castsi256_si512(_mm256_set1_epi16(lo)),
        _mm256_set1_epi16(hi),
    )
}

/// The 8 six-bit minimums (one u64, byte j = sub-block j) as 16 i16 `[m0, m0, m1, m1, …]`,
/// matching the 16 `bsums` of the activation block.
#[inline(always)]
unsafe fn mins_pairs(m: u64) -> __m256i {
    let v = _mm_cvtsi64_si128(m as i64);
    _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v))
}

/// The 32 weight bytes at `q` as a 64-byte vector: low nibbles in the low half, high nibbles in
/// the high half (i.e. sub-blocks `2c` and `2c + 1` of a Q4_K/Q5_K chunk).
#[inline(always)]
unsafe fn nibbles512(q: *const u8) -> __m512i {
    let v = _mm256_loadu_si256(q as *const __m256i);
    let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(v), _mm256_srli_epi16::<4>(v));
    _mm512_and_si512(both, _mm512_set1_epi8(0x0F))
}

/// Q4_K · Q8_K, AVX-512: per 32-byte chunk `c`, one 64-lane vector holds sub-blocks `2c` and
/// `2c + 1`, lined up with activation bytes `64c .. 64c + 64`.
#[inline(always)]
unsafe fn q4k_512<const VNNI: bool>(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = (w.len() / Q4K_BYTES).min(x.len());
    let idx = [
        bcast16_index512(0, 1),
        bcast16_index512(2, 3),
        bcast16_index512(4, 5),
        bcast16_index512(6, 7),
    ];
    let mut acc = 0.0f32;
    let pf = prefetch_distance();
    for (i, y) in x.iter().enumerate().take(nb) {
        let b = w.as_ptr().add(i * Q4K_BYTES);
        prefetch_ahead(b, pf, Q4K_BYTES);
        // [y.d · d, y.d · dmin] (d and dmin are the block's first two f16).
        let dh = f16x2_hw(read_u32(b));
        let (d, dmin) = (_mm_cvtss_f32(dh), _mm_cvtss_f32(_mm_movehdup_ps(dh)));
        let (sc, m) = unpack_scales_k4(std::slice::from_raw_parts(b.add(4), 12));
        let scb = _mm512_set1_epi64(sc as i64);
        let q = b.add(16);
        let yq = y.qs.as_ptr();
        let mut isum = _mm512_setzero_si512();
        for (c, ix) in idx.iter().enumerate() {
            let wv = nibbles512(q.add(32 * c));
            let yv = _mm512_loadu_si512(yq.add(64 * c) as *const _);
            let p = _mm512_maddubs_epi16(wv, yv);
            isum = dot16_acc::<VNNI>(isum, p, _mm512_shuffle_epi8(scb, *ix));
        }
        let bs = _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i);
        let pm = _mm256_madd_epi16(bs, mins_pairs(m));
        let (isum, isumm) = (hsum512_epi32(isum), hsum256_epi32(pm));
        acc += (y.d * d) * isum as f32 - (y.d * dmin) * isumm as f32;
    }
    acc
}

/// Q4_K · Q8_K with AVX-512 VNNI, the kernel of the AVX-512 level on VNNI CPUs: per block
/// [`q4k_zmm_block`] (4 `vpdpbusd` + 2 `vpdpwssd` on 512-bit vectors; activations in their usual
/// order, `PAIRED = false`, or reordered by [`q4k_paired_q8k`], `PAIRED = true`). Two blocks per
/// iteration share one reduction of their four sums (scale and minimum parts). Same exact block
/// sums and f32 expression, in block order, as the other Q4_K kernels. (The 512-bit kernel
/// [`q4k_512`] is slower on Zen 4, whose per-chunk `vinserti64x4` + `vpshufb` of the weights and
/// 8 scale multiplies per block load the pipes that run 512-bit operations as two halves.)
#[inline(always)]
unsafe fn q4k_vl_vnni<const PAIRED: bool>(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = (w.len() / Q4K_BYTES).min(x.len());
    let pf = prefetch_distance_or(Q4K_ZMM_PREFETCH);
    let idx = q4k_zmm_consts();
    let mut acc = 0.0f32;
    let mut i = 0;
    // Four blocks per iteration: one reduction of their eight sums and their f32 terms computed
    // in the lanes of one vector (each lane the scalar expression), added to `acc` in order.
    while i + 4 <= nb {
        let b = |k: usize| w.as_ptr().add((i + k) * Q4K_BYTES);
        let (t0, u0) = q4k_zmm_block::<PAIRED>(b(0), &x[i], pf, &idx);
        let (t1, u1) = q4k_zmm_block::<PAIRED>(b(1), &x[i + 1], pf, &idx);
        let (t2, u2) = q4k_zmm_block::<PAIRED>(b(2), &x[i + 2], pf, &idx);
        let (t3, u3) = q4k_zmm_block::<PAIRED>(b(3), &x[i + 3], pf, &idx);
        let sums = reduce_quads([t0, u0, t1, u1, t2, u2, t3, u3]);
        let v = q4k_quad_values(b, &x[i..i + 4], sums);
        let hi = _mm256_extractf128_ps::<1>(v);
        let lo = _mm256_castps256_ps128(v);
        acc += _mm_cvtss_f32(lo);
        acc += _mm_cvtss_f32(_mm_movehdup_ps(lo));
        acc += _mm_cvtss_f32(hi);
        acc += _mm_cvtss_f32(_mm_movehdup_ps(hi));
        i += 4;
    }
    while i < nb {
        // An odd last block is paired with itself; its second result is dropped.
        let i1 = if i + 1 < nb { i + 1 } else { i };
        let (t0, u0) = q4k_zmm_block::<PAIRED>(w.as_ptr().add(i * Q4K_BYTES), &x[i], pf, &idx);
        if i1 == i {
            // The odd last block alone (a one-block row is just this).
            let sums = reduce_pairs(t0, u0, _mm256_setzero_si256(), _mm256_setzero_si256());
            acc += q4k_block_value(w.as_ptr().add(i * Q4K_BYTES), &x[i], sums[0], sums[1]);
            break;
        }
        let (t1, u1) = q4k_zmm_block::<PAIRED>(w.as_ptr().add(i1 * Q4K_BYTES), &x[i1], pf, &idx);
        let sums = reduce_pairs(t0, u0, t1, u1);
        acc += q4k_block_value(w.as_ptr().add(i * Q4K_BYTES), &x[i], sums[0], sums[1]);
        acc += q4k_block_value(w.as_ptr().add(i1 * Q4K_BYTES), &x[i1], sums[2], sums[3]);
        i += 2;
    }
    acc
}

/// The exact i32 sums of the 8 lanes of each of `t[0..8]`, in that order.
#[inline(always)]
unsafe fn reduce_quads(t: [__m256i; 8]) -> __m256i {
    // Per 128-bit half: [Σ t0, Σ t1, Σ t2, Σ t3] of that half's lanes, then the halves added.
    let ab = _mm256_hadd_epi32(_mm256_hadd_epi32(t[0], t[1]), _mm256_hadd_epi32(t[2], t[3]));
    let cd = _mm256_hadd_epi32(_mm256_hadd_epi32(t[4], t[5]), _mm256_hadd_epi32(t[6], t[7]));
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(ab, cd),
        _mm256_permute2x128_si256::<0x31>(ab, cd),
    )
}

/// The f32 terms of four Q4_K blocks `b(0..4)` against `y[0..4]` from their sums `[isum0,
/// isumm0, isum1, …]`: lanes 0, 1, 4, 5 hold the four values, each computed with
/// [`q4k_block_value`]'s operations (`(y.d · d) · isum − (y.d · dmin) · isumm`).
#[inline(always)]
unsafe fn q4k_quad_values(b: impl Fn(usize) -> *const u8, y: &[BlockQ8K], sums: __m256i) -> __m256 {
    // [d, dmin] of each block (its first two f16).
    let dd = _mm256_cvtph_ps(_mm_set_epi32(
        read_u32(b(3)) as i32,
        read_u32(b(2)) as i32,
        read_u32(b(1)) as i32,
        read_u32(b(0)) as i32,
    ));
    let yd = _mm256_set_ps(
        y[3].d, y[3].d, y[2].d, y[2].d, y[1].d, y[1].d, y[0].d, y[0].d,
    );
    let p = _mm256_mul_ps(_mm256_mul_ps(yd, dd), _mm256_cvtepi32_ps(sums));
    // Lane 2k minus lane 2k + 1 (within each 128-bit half).
    _mm256_hsub_ps(p, p)
}

/// `[Σ t0, Σ u0, Σ t1, Σ u1]`: the exact i32 sums of the 8 lanes of each.
#[inline(always)]
unsafe fn reduce_pairs(t0: __m256i, u0: __m256i, t1: __m256i, u1: __m256i) -> [i32; 4] {
    let h = _mm256_hadd_epi32(_mm256_hadd_epi32(t0, u0), _mm256_hadd_epi32(t1, u1));
    let sums = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
    std::mem::transmute(sums)
}

/// A Q4_K block's f32 term from its exact integer sums (scaled products `isum`, `Σ bsums ·
/// mins` `isumm`): the scalar kernel's expression.
#[inline(always)]
unsafe fn q4k_block_value(b: *const u8, y: &BlockQ8K, isum: i32, isumm: i32) -> f32 {
    let dh = f16x2_hw(read_u32(b));
    let (d, dmin) = (_mm_cvtss_f32(dh), _mm_cvtss_f32(_mm_movehdup_ps(dh)));
    (y.d * d) * isum as f32 - (y.d * dmin) * isumm as f32
}

/// Rows of Q4_K · one Q8_K row, two rows at a time: block `i` of both rows shares one
/// reduction (on the tiny models' one-block rows, the per-row reduction and call were most of
/// the time). Each row's value is [`q4k_vl_vnni`]'s (same block sums, same f32 expression in
/// block order). `w` holds `out.len()` rows of `row_bytes` bytes.
#[inline(always)]
unsafe fn q4k_vl_rows<const PAIRED: bool>(
    w: &[u8],
    row_bytes: usize,
    x: &[BlockQ8K],
    out: &mut [f32],
) {
    let nb = (row_bytes / Q4K_BYTES).min(x.len());
    let pf = prefetch_distance_or(Q4K_ZMM_PREFETCH);
    let idx = q4k_zmm_consts();
    let mut pairs = out.chunks_exact_mut(2);
    let mut row = w.as_ptr();
    for pair in &mut pairs {
        let (a, b) = (row, row.add(row_bytes));
        let (mut acc_a, mut acc_b) = (0.0f32, 0.0f32);
        for (i, y) in x.iter().enumerate().take(nb) {
            let (ba, bb) = (a.add(i * Q4K_BYTES), b.add(i * Q4K_BYTES));
            let (t0, u0) = q4k_zmm_block::<PAIRED>(ba, y, pf, &idx);
            let (t1, u1) = q4k_zmm_block::<PAIRED>(bb, y, pf, &idx);
            let sums = reduce_pairs(t0, u0, t1, u1);
            acc_a += q4k_block_value(ba, y, sums[0], sums[1]);
            acc_b += q4k_block_value(bb, y, sums[2], sums[3]);
        }
        pair[0] = acc_a;
        pair[1] = acc_b;
        row = row.add(2 * row_bytes);
    }
    if let [last] = pairs.into_remainder() {
        let start = row.offset_from(w.as_ptr()) as usize;
        *last = q4k_vl_vnni::<PAIRED>(&w[start..start + row_bytes], x);
    }
}

/// `vpshufb` indices that put, in 128-bit lanes 0 and 1, scale byte `a` in words 0..4 and `b` in
/// words 4..8, and in lanes 2 and 3 bytes `a + 2` and `b + 2` (high bytes zero): the layout of
/// `vpackssdw` of two [`q4k_zmm_block`] product vectors.
#[inline(always)]
unsafe fn pack_scale_index(a: i16, b: i16) -> __m512i {
    let z = 0x80u8 as i8 as i16;
    let w = |i: i16| i | z << 8;
    let lane = |i: i16, j: i16| _mm_set_epi16(w(j), w(j), w(j), w(j), w(i), w(i), w(i), w(i));
    let lo = _mm256_set_m128i(lane(a, b), lane(a, b));
    let hi = _mm256_set_m128i(lane(a + 2, b + 2), lane(a + 2, b + 2));
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// The [`pack_scale_index`] pair of [`q4k_zmm_block`].
#[inline(always)]
unsafe fn q4k_zmm_consts() -> [__m512i; 2] {
    [pack_scale_index(0, 1), pack_scale_index(4, 5)]
}

/// Prefetch distance (bytes) of the [`q4k_zmm_block`] kernels unless `REDLITE_PF` says otherwise.
/// They run ~25 % faster than the kernels the shared default was measured with, so the weights
/// must be requested further ahead: 1 thread, 64 MiB streamed, paired row kernel, ns per block at
/// 4096 / 8192 / 12288 bytes: 2048 columns 4.6 / 3.9 / 3.55, 4096 columns 4.8 / 3.8 / 3.6
/// (16384: 4.0; the old kernel ran 4.6–4.9 at 4096).
const Q4K_ZMM_PREFETCH: usize = 12288;

/// Sub-block `PAIRED_ORDER[k]` of a Q8_K block's quants sits at 32-byte slot `k` of the same block
/// reordered by [`q4k_paired_q8k`]: every 64-byte piece then holds the activations of one
/// [`q4k_zmm_block`] product (sub-blocks `4h + l` | `4h + l + 2`).
const PAIRED_ORDER: [usize; 8] = [0, 2, 1, 3, 4, 6, 5, 7];

/// Q8_K activations reordered for [`q4k_paired_kernel`] (`d` and `bsums` as they are, the 32-byte
/// sub-blocks of the quants in [`PAIRED_ORDER`]).
pub fn q4k_paired_q8k(x: &[BlockQ8K]) -> Vec<BlockQ8K> {
    x.iter()
        .map(|b| {
            let mut o = *b;
            for (k, &j) in PAIRED_ORDER.iter().enumerate() {
                o.qs[32 * k..32 * k + 32].copy_from_slice(&b.qs[32 * j..32 * j + 32]);
            }
            o
        })
        .collect()
}

/// One Q4_K block `b` against `y` on 512-bit vectors with VNNI, for [`q4k_vl_vnni`]: the 8 i32
/// lanes of the scaled products and the 8 lanes of `Σ bsums · mins`.
/// The 64 weight bytes of chunks `2h`, `2h + 1` are one load: its low nibbles are sub-blocks
/// `4h` | `4h + 2`, its high nibbles `4h + 1` | `4h + 3`, each multiplied by the matching
/// activations with `vpdpbusd` into unscaled 4-product sums (|·| ≤ 4 · 15 · 128, exact in i16).
/// `vpackssdw` of the two (exact, no saturation) puts two sub-blocks side by side in every
/// 128-bit lane, and one `vpdpwssd` against per-word scales applies them: 2 instead of 8 scale
/// multiplies per block, no per-chunk scale shuffles. The activations are `y` in its usual order
/// (`PAIRED = false`: two 32-byte halves per product) or reordered by [`q4k_paired_q8k`]
/// (`PAIRED = true`: one 64-byte load, the operand of `vpdpbusd`).
#[inline(always)]
unsafe fn q4k_zmm_block<const PAIRED: bool>(
    b: *const u8,
    y: &BlockQ8K,
    pf: usize,
    idx: &[__m512i; 2],
) -> (__m256i, __m256i) {
    prefetch_ahead(b, pf, Q4K_BYTES);
    let m4 = _mm512_set1_epi8(0x0F);
    let (sc, m) = unpack_scales_k4(std::slice::from_raw_parts(b.add(4), 12));
    let q = b.add(16);
    let yq = y.qs.as_ptr();
    // Activations of sub-blocks `a` (low half) and `a + 2` (high half), at slot pair `a` in the
    // paired order.
    let acts = |a: usize| {
        if PAIRED {
            let k = PAIRED_ORDER.iter().position(|&j| j == a).unwrap_or(0);
            _mm512_loadu_si512(yq.add(32 * k) as *const _)
        } else {
            _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_loadu_si256(yq.add(32 * a) as *const __m256i)),
                _mm256_loadu_si256(yq.add(32 * a + 64) as *const __m256i),
            )
        }
    };
    let z = _mm512_setzero_si512();
    let mut packed = [z; 2];
    for (h, pk) in packed.iter_mut().enumerate() {
        let v = _mm512_loadu_si512(q.add(64 * h) as *const _);
        let lo = _mm512_and_si512(v, m4);
        let hi = if PAIRED {
            // GFNI: each byte's bits 4..8 moved to 0..4 (the rest zero) in one operation.
            _mm512_gf2p8affine_epi64_epi8::<0>(v, _mm512_set1_epi64(0x1020_4080_0000_0000))
        } else {
            _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4)
        };
        let p0 = _mm512_dpbusd_epi32(z, lo, acts(4 * h));
        let p1 = _mm512_dpbusd_epi32(z, hi, acts(4 * h + 1));
        *pk = _mm512_packs_epi32(p0, p1);
    }
    let scb = _mm512_set1_epi64(sc as i64);
    let t = _mm512_madd_epi16(packed[0], _mm512_shuffle_epi8(scb, idx[0]));
    let t = _mm512_dpwssd_epi32(t, packed[1], _mm512_shuffle_epi8(scb, idx[1]));
    let bs = _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i);
    (
        _mm256_add_epi32(_mm512_castsi512_si256(t), _mm512_extracti64x4_epi64::<1>(t)),
        _mm256_madd_epi16(bs, mins_pairs(m)),
    )
}

/// Q5_K · Q8_K, AVX-512: as Q4_K, plus the fifth bit: `qh` broadcast to both halves, tested
/// against bit `2c` (low half) / `2c + 1` (high half), adding 16 where set.
#[inline(always)]
unsafe fn q5k_512<const VNNI: bool>(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = (w.len() / Q5K_BYTES).min(x.len());
    let idx = [
        bcast16_index512(0, 1),
        bcast16_index512(2, 3),
        bcast16_index512(4, 5),
        bcast16_index512(6, 7),
    ];
    let bit = |c: i32| {
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_set1_epi8((1u8 << (2 * c)) as i8)),
            _mm256_set1_epi8((1u8 << (2 * c + 1)) as i8),
        )
    };
    let bits = [bit(0), bit(1), bit(2), bit(3)];
    let sixteen = _mm512_set1_epi8(16);
    let mut acc = 0.0f32;
    let pf = prefetch_distance();
    for (i, y) in x.iter().enumerate().take(nb) {
        let b = w.as_ptr().add(i * Q5K_BYTES);
        prefetch_ahead(b, pf, Q5K_BYTES);
        // [y.d · d, y.d · dmin] (d and dmin are the block's first two f16).
        let dh = f16x2_hw(read_u32(b));
        let (d, dmin) = (_mm_cvtss_f32(dh), _mm_cvtss_f32(_mm_movehdup_ps(dh)));
        let (sc, m) = unpack_scales_k4(std::slice::from_raw_parts(b.add(4), 12));
        let scb = _mm512_set1_epi64(sc as i64);
        let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(b.add(16) as *const __m256i));
        let q = b.add(48);
        let yq = y.qs.as_ptr();
        let mut isum = _mm512_setzero_si512();
        for c in 0..4 {
            let wv = nibbles512(q.add(32 * c));
            let high = _mm512_test_epi8_mask(qh, bits[c]);
            let wv = _mm512_mask_add_epi8(wv, high, wv, sixteen);
            let yv = _mm512_loadu_si512(yq.add(64 * c) as *const _);
            let p = _mm512_maddubs_epi16(wv, yv);
            isum = dot16_acc::<VNNI>(isum, p, _mm512_shuffle_epi8(scb, idx[c]));
        }
        let bs = _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i);
        let pm = _mm256_madd_epi16(bs, mins_pairs(m));
        let (isum, isumm) = (hsum512_epi32(isum), hsum256_epi32(pm));
        acc += (y.d * d) * isum as f32 - (y.d * dmin) * isumm as f32;
    }
    acc
}

/// `vpermw` indices giving, in 128-bit lane `k`, the i16 scale `g0 + k` (4 groups of 16 elements).
#[inline(always)]
pub(super) unsafe fn group_index512(g0: i16) -> __m512i {
    _mm512_inserti64x4::<1>(
        _mm512_castsi256_si512(_mm256_set_m128i(_mm_set1_epi16(g0 + 1), _mm_set1_epi16(g0))),
        _mm256_set_m128i(_mm_set1_epi16(g0 + 3), _mm_set1_epi16(g0 + 2)),
    )
}

/// The f16 scale `d` of a Q6_K block (its last two bytes) as f32. It is converted together with
/// the 7 f16-sized words before it and then extracted: the one-value forms get compiled to a
/// `vpinsrw` into a live register, a false dependency across loop iterations.
#[inline(always)]
pub(super) unsafe fn q6k_d(b: *const u8) -> f32 {
    let h = _mm256_cvtph_ps(_mm_loadu_si128(b.add(Q6K_BYTES - 16) as *const __m128i));
    _mm256_cvtss_f32(_mm256_permutevar8x32_ps(h, _mm256_set1_epi32(7)))
}

/// Q6_K · Q8_K, AVX-512. Per half `c`: vector A = elements 0..64 (low nibbles of `ql[64c..]`,
/// high-bit pairs 0/1 of `qh`), B = elements 64..128 (high nibbles, pairs 2/3). The codes are
/// used unsigned (0..63); the `−32` offset is applied once per block as `32 · Σ scale_g · bsum_g`.
#[inline(always)]
unsafe fn q6k_512<const VNNI: bool>(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = (w.len() / Q6K_BYTES).min(x.len());
    let idx = [
        group_index512(0),
        group_index512(4),
        group_index512(8),
        group_index512(12),
    ];
    let m4 = _mm512_set1_epi8(0x0F);
    let m30 = _mm512_set1_epi8(0x30);
    let mut acc = 0.0f32;
    let pf = prefetch_distance();
    for (i, y) in x.iter().enumerate().take(nb) {
        let b = w.as_ptr().add(i * Q6K_BYTES);
        prefetch_ahead(b, pf, Q6K_BYTES);
        let d = q6k_d(b);
        let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(192) as *const __m128i));
        let scz = _mm512_castsi256_si512(sc16);
        let yq = y.qs.as_ptr();
        let mut isum = _mm512_setzero_si512();
        for c in 0..2 {
            let l = _mm512_loadu_si512(b.add(64 * c) as *const _);
            let h = _mm256_loadu_si256(b.add(128 + 32 * c) as *const __m256i);
            let hz = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(h), _mm256_srli_epi16::<2>(h));
            let va = _mm512_or_si512(
                _mm512_and_si512(l, m4),
                _mm512_and_si512(_mm512_slli_epi16::<4>(hz), m30),
            );
            let vb = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16::<4>(l), m4),
                _mm512_and_si512(hz, m30),
            );
            let pa = _mm512_maddubs_epi16(va, _mm512_loadu_si512(yq.add(128 * c) as *const _));
            let pb = _mm512_maddubs_epi16(vb, _mm512_loadu_si512(yq.add(128 * c + 64) as *const _));
            isum = dot16_acc::<VNNI>(isum, pa, _mm512_permutexvar_epi16(idx[2 * c], scz));
            isum = dot16_acc::<VNNI>(isum, pb, _mm512_permutexvar_epi16(idx[2 * c + 1], scz));
        }
        let bs = _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i);
        let corr = _mm256_slli_epi32::<5>(_mm256_madd_epi16(bs, sc16));
        isum = _mm512_sub_epi32(isum, _mm512_zextsi256_si512(corr));
        acc += (y.d * d) * hsum512_epi32(isum) as f32;
    }
    acc
}

/// `vpshufb` indices broadcasting byte `i` of each 128-bit lane to every i16 (high byte zero).
#[inline(always)]
unsafe fn bcast16_index256(i: u8) -> __m256i {
    _mm256_set1_epi16(i16::from(i) | (0x80u8 as i8 as i16) << 8)
}

/// Q4_K · Q8_K, AVX2: per chunk, low and high nibbles in two 32-lane vectors.
#[inline(always)]
unsafe fn q4k_256<const VNNI: bool>(w: &[u8], x: &[BlockQ8K]) -> f32 {
    q45k_256::<false>(w, x)
}

/// Q5_K · Q8_K, AVX2.
#[inline(always)]
unsafe fn q5k_256<const VNNI: bool>(w: &[u8], x: &[BlockQ8K]) -> f32 {
    q45k_256::<true>(w, x)
}

/// Q4_K (`Q5 = false`) or Q5_K (`Q5 = true`) · Q8_K with AVX2. The fifth bits are shifted down
/// one bit per sub-block from a copy of `qh`.
#[inline(always)]
unsafe fn q45k_256<const Q5: bool>(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let bytes = if Q5 { Q5K_BYTES } else { Q4K_BYTES };
    let nb = (w.len() / bytes).min(x.len());
    let idx: [__m256i; 8] = std::array::from_fn(|j| bcast16_index256(j as u8));
    let m4 = _mm256_set1_epi8(0x0F);
    let m16 = _mm256_set1_epi8(0x10);
    let mut acc = 0.0f32;
    let pf = prefetch_distance();
    for (i, y) in x.iter().enumerate().take(nb) {
        let b = w.as_ptr().add(i * bytes);
        prefetch_ahead(b, pf, bytes);
        // [y.d · d, y.d · dmin] (d and dmin are the block's first two f16).
        let dh = f16x2_hw(read_u32(b));
        let (d, dmin) = (_mm_cvtss_f32(dh), _mm_cvtss_f32(_mm_movehdup_ps(dh)));
        let (sc, m) = unpack_scales_k4(std::slice::from_raw_parts(b.add(4), 12));
        let scb = _mm256_set1_epi64x(sc as i64);
        let q = b.add(if Q5 { 48 } else { 16 });
        let mut qh = if Q5 {
            _mm256_loadu_si256(b.add(16) as *const __m256i)
        } else {
            _mm256_setzero_si256()
        };
        let yq = y.qs.as_ptr();
        let mut isum = _mm256_setzero_si256();
        for c in 0..4 {
            let v = _mm256_loadu_si256(q.add(32 * c) as *const __m256i);
            let mut lo = _mm256_and_si256(v, m4);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
            if Q5 {
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16::<4>(qh), m16));
                qh = _mm256_srli_epi16::<1>(qh);
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16::<4>(qh), m16));
                qh = _mm256_srli_epi16::<1>(qh);
            }
            let p0 = _mm256_maddubs_epi16(lo, _mm256_loadu_si256(yq.add(64 * c) as *const __m256i));
            let p1 = _mm256_maddubs_epi16(
                hi,
                _mm256_loadu_si256(yq.add(64 * c + 32) as *const __m256i),
            );
            let s0 = _mm256_shuffle_epi8(scb, idx[2 * c]);
            let s1 = _mm256_shuffle_epi8(scb, idx[2 * c + 1]);
            isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p0, s0));
            isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p1, s1));
        }
        let bs = _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i);
        let pm = _mm256_madd_epi16(bs, mins_pairs(m));
        let (isum, isumm) = (hsum256_epi32(isum), hsum256_epi32(pm));
        acc += (y.d * d) * isum as f32 - (y.d * dmin) * isumm as f32;
    }
    acc
}

/// Q6_K · Q8_K, AVX2: four 32-element vectors per half; scale bytes are broadcast per 128-bit
/// lane with `vpshufb` (into both bytes of each i16) and sign-extended by an arithmetic shift.
#[inline(always)]
unsafe fn q6k_256<const VNNI: bool>(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = (w.len() / Q6K_BYTES).min(x.len());
    // Group pair (2k, 2k + 1) → lanes: low lane all bytes 2k, high lane all bytes 2k + 1.
    let idx: [__m256i; 8] = std::array::from_fn(|k| {
        _mm256_set_m128i(
            _mm_set1_epi8((2 * k + 1) as i8),
            _mm_set1_epi8((2 * k) as i8),
        )
    });
    let m4 = _mm256_set1_epi8(0x0F);
    let m30 = _mm256_set1_epi8(0x30);
    let mut acc = 0.0f32;
    let pf = prefetch_distance();
    for (i, y) in x.iter().enumerate().take(nb) {
        let b = w.as_ptr().add(i * Q6K_BYTES);
        prefetch_ahead(b, pf, Q6K_BYTES);
        let d = q6k_d(b);
        let sc = _mm_loadu_si128(b.add(192) as *const __m128i);
        let scb = _mm256_broadcastsi128_si256(sc);
        let yq = y.qs.as_ptr();
        let mut isum = _mm256_setzero_si256();
        for c in 0..2 {
            let l0 = _mm256_loadu_si256(b.add(64 * c) as *const __m256i);
            let l1 = _mm256_loadu_si256(b.add(64 * c + 32) as *const __m256i);
            let h = _mm256_loadu_si256(b.add(128 + 32 * c) as *const __m256i);
            let e = [
                _mm256_or_si256(
                    _mm256_and_si256(l0, m4),
                    _mm256_and_si256(_mm256_slli_epi16::<4>(h), m30),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(l1, m4),
                    _mm256_and_si256(_mm256_slli_epi16::<2>(h), m30),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(l0), m4),
                    _mm256_and_si256(h, m30),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(l1), m4),
                    _mm256_and_si256(_mm256_srli_epi16::<2>(h), m30),
                ),
            ];
            for (k, ek) in e.iter().enumerate() {
                let yv = _mm256_loadu_si256(yq.add(128 * c + 32 * k) as *const __m256i);
                let p = _mm256_maddubs_epi16(*ek, yv);
                let s = _mm256_srai_epi16::<8>(_mm256_shuffle_epi8(scb, idx[4 * c + k]));
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, s));
            }
        }
        let bs = _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i);
        let corr = _mm256_madd_epi16(bs, _mm256_cvtepi8_epi16(sc));
        isum = _mm256_sub_epi32(isum, _mm256_slli_epi32::<5>(corr));
        acc += (y.d * d) * hsum256_epi32(isum) as f32;
    }
    acc
}
