//! x86-64 SIMD row kernels for the float types (F32, F16, BF16 · f32, AVX2 and AVX-512) and the
//! 32-element quants (Q8_0 · Q8_0 with AVX2 and AVX-512 VNNI, Q4_0 · Q8_0 with AVX2).
//!
//! All of them are bit-identical to the scalar kernels of [`super::simple`]: float rows keep the
//! scalar's 16 partial sums in vector lanes (multiply, then add: no FMA) and reduce them in the
//! same order; Q8_0/Q4_0 compute each block's exact i32 sum with the sign trick (`|w|` as
//! unsigned × `y·sign(w)`, `vpmaddubsw` or VNNI `vpdpbusd`), reduce it, and accumulate
//! `(d_w · d_y) · isum` in block order like the scalar code.
//!
//! Safety: as in [`super::kquants_x86`], the `#[target_feature]` functions are reachable only
//! through [`kernel`], which checks the CPU features first.

use super::q8::BlockQ8_0;
use super::simple::reduce16;
use super::x86_util::{f16_hw, hsum256_epi32, prefetch_ahead, prefetch_distance, read_u16};
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

/// 16 elements of kind `KIND` at `p` as f32.
#[inline(always)]
unsafe fn load16<const KIND: u8>(p: *const u8) -> __m512 {
    match KIND {
        F32 => _mm512_loadu_ps(p as *const f32),
        F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
        _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256(p as *const __m256i),
        ))),
    }
}

/// Float row · f32 activations, AVX-512: lane `k` of the one accumulator is partial sum `k`
/// of the scalar order (products rounded, then added: no FMA); the tail and the final
/// reduction run in scalar code on the stored lanes.
#[inline(always)]
unsafe fn float_512<const KIND: u8>(w: &[u8], x: &[f32]) -> f32 {
    let eb = elem_bytes(KIND);
    let n = (w.len() / eb).min(x.len());
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let pf = prefetch_distance();
    let mut acc = _mm512_setzero_ps();
    let mut i = 0;
    while i + 64 <= n {
        prefetch_ahead(wp.add(i * eb), pf, 64 * eb);
        // The four products are independent; only the additions form the chain.
        let p: [__m512; 4] = std::array::from_fn(|k| {
            let j = i + 16 * k;
            _mm512_mul_ps(load16::<KIND>(wp.add(j * eb)), _mm512_loadu_ps(xp.add(j)))
        });
        acc = _mm512_add_ps(
            _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc, p[0]), p[1]), p[2]),
            p[3],
        );
        i += 64;
    }
    while i + 16 <= n {
        let p = _mm512_mul_ps(load16::<KIND>(wp.add(i * eb)), _mm512_loadu_ps(xp.add(i)));
        acc = _mm512_add_ps(acc, p);
        i += 16;
    }
    let mut s = [0.0f32; 16];
    _mm512_storeu_ps(s.as_mut_ptr(), acc);
    while i < n {
        s[i % 16] += load1::<KIND>(wp.add(i * eb)) * *xp.add(i);
        i += 1;
    }
    reduce16(s)
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

/// Float row · f32 activations, AVX2: two 8-lane accumulators hold partial sums 0-7 and
/// 8-15 of the scalar order (no FMA); tail and reduction in scalar code.
#[inline(always)]
unsafe fn float_256<const KIND: u8>(w: &[u8], x: &[f32]) -> f32 {
    let eb = elem_bytes(KIND);
    let n = (w.len() / eb).min(x.len());
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let pf = prefetch_distance();
    let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i + 16 <= n {
        if i % 64 == 0 {
            prefetch_ahead(wp.add(i * eb), pf, 64 * eb);
        }
        let p0 = _mm256_mul_ps(load8::<KIND>(wp.add(i * eb)), _mm256_loadu_ps(xp.add(i)));
        let p1 = _mm256_mul_ps(
            load8::<KIND>(wp.add((i + 8) * eb)),
            _mm256_loadu_ps(xp.add(i + 8)),
        );
        lo = _mm256_add_ps(lo, p0);
        hi = _mm256_add_ps(hi, p1);
        i += 16;
    }
    let mut s = [0.0f32; 16];
    _mm256_storeu_ps(s.as_mut_ptr(), lo);
    _mm256_storeu_ps(s.as_mut_ptr().add(8), hi);
    while i < n {
        s[i % 16] += load1::<KIND>(wp.add(i * eb)) * *xp.add(i);
        i += 1;
    }
    reduce16(s)
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

/// `d_w · d_y` as f32, both f16 converted in one `vcvtph2ps` on a register written whole (the
/// one-value form gets compiled to a `vpinsrw` into a live register: a false dependency).
#[inline(always)]
unsafe fn dd(dw: u16, dy: u16) -> f32 {
    let both = _mm_cvtph_ps(_mm_cvtsi32_si128(
        (u32::from(dw) | (u32::from(dy) << 16)) as i32,
    ));
    _mm_cvtss_f32(_mm_mul_ss(both, _mm_movehdup_ps(both)))
}

/// Q8_0 · Q8_0 (34-byte weight blocks). Each block's integer sum is reduced exactly and added
/// as `(d_w · d_y) · isum` in block order, as in the scalar kernel.
#[inline(always)]
unsafe fn q8_0_simd<const VNNI: bool>(w: &[u8], x: &[BlockQ8_0]) -> f32 {
    let nb = (w.len() / 34).min(x.len());
    let pf = prefetch_distance();
    let mut acc = 0.0f32;
    for (i, y) in x.iter().enumerate().take(nb) {
        let b = w.as_ptr().add(34 * i);
        prefetch_ahead(b, pf, 34);
        let wv = _mm256_loadu_si256(b.add(2) as *const __m256i);
        let yv = _mm256_loadu_si256(y.qs.as_ptr() as *const __m256i);
        let isum = hsum256_epi32(sdot32::<VNNI>(wv, yv));
        acc += dd(read_u16(b), y.d) * isum as f32;
    }
    acc
}

/// Q4_0 · Q8_0 (18-byte weight blocks; nibble − 8, low nibbles first), accumulated like Q8_0.
#[inline(always)]
unsafe fn q4_0_simd<const VNNI: bool>(w: &[u8], x: &[BlockQ8_0]) -> f32 {
    let nb = (w.len() / 18).min(x.len());
    let pf = prefetch_distance();
    let m4 = _mm_set1_epi8(0x0F);
    let mut acc = 0.0f32;
    for (i, y) in x.iter().enumerate().take(nb) {
        let b = w.as_ptr().add(18 * i);
        prefetch_ahead(b, pf, 18);
        let q = _mm_loadu_si128(b.add(2) as *const __m128i);
        let lo = _mm_and_si128(q, m4);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(q), m4);
        let wv = _mm256_sub_epi8(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(8));
        let yv = _mm256_loadu_si256(y.qs.as_ptr() as *const __m256i);
        let isum = hsum256_epi32(sdot32::<VNNI>(wv, yv));
        acc += dd(read_u16(b), y.d) * isum as f32;
    }
    acc
}

/// A Q8_0 weight row against up to [`Q8_0_MULTI_ROWS`] Q8_0 activation rows (one result per row
/// in `out`): each weight block is loaded and sign-split once for every row. Each row's result is
/// bit-identical to the single-row kernel: the same exact block sums, the same `(d_w · d_y) ·
/// isum` accumulated in block order; the rows only interleave independent accumulation chains.
pub(crate) type Q8_0MultiDot = fn(w: &[u8], xs: &[&[BlockQ8_0]], out: &mut [f32]);

/// The most activation rows a [`Q8_0MultiDot`] takes per call.
pub(crate) const Q8_0_MULTI_ROWS: usize = 4;

/// The multi-row Q8_0 kernel matching what [`super::lookup`] returns for Q8_0 at level `isa`
/// (this module's VNNI kernel at AVX-512 with VNNI, else its AVX2 kernel), if there is one.
pub(crate) fn q8_0_multi_kernel(isa: Isa) -> Option<Q8_0MultiDot> {
    let top = isa.min(Isa::best());
    if top >= Isa::Avx512 && Isa::Avx512.supported() && has_vnni() {
        return Some(q8_0_multi_avx512_vnni);
    }
    if top >= Isa::Avx2 && Isa::Avx2.supported() {
        return Some(q8_0_multi_avx2);
    }
    None
}

fn q8_0_multi_avx512_vnni(w: &[u8], xs: &[&[BlockQ8_0]], out: &mut [f32]) {
    // SAFETY: only handed out by `q8_0_multi_kernel` after the CPU features were checked.
    unsafe { q8_0_multi_avx512_vnni_i(w, xs, out) }
}

fn q8_0_multi_avx2(w: &[u8], xs: &[&[BlockQ8_0]], out: &mut [f32]) {
    // SAFETY: as above, for AVX2.
    unsafe { q8_0_multi_avx2_i(w, xs, out) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_0_multi_avx512_vnni_i(w: &[u8], xs: &[&[BlockQ8_0]], out: &mut [f32]) {
    q8_0_multi_dispatch::<true>(w, xs, out)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_multi_avx2_i(w: &[u8], xs: &[&[BlockQ8_0]], out: &mut [f32]) {
    q8_0_multi_dispatch::<false>(w, xs, out)
}

#[inline(always)]
unsafe fn q8_0_multi_dispatch<const VNNI: bool>(w: &[u8], xs: &[&[BlockQ8_0]], out: &mut [f32]) {
    match xs.len().min(out.len()) {
        0 => {}
        1 => out[0] = q8_0_simd::<VNNI>(w, xs[0]),
        2 => q8_0_multi_simd::<VNNI, 2>(w, xs, out),
        3 => q8_0_multi_simd::<VNNI, 3>(w, xs, out),
        _ => q8_0_multi_simd::<VNNI, 4>(w, xs, out),
    }
}

/// [`q8_0_simd`] for `M` activation rows at once. Blocks go in groups of four: the four exact
/// block sums of a row come out of one `vphaddd` tree, their scales `d_w · d_y` and products
/// with the sums are computed four lanes at a time (the same IEEE operations as the scalar
/// path), and the four products are then added to the row's accumulator one by one, in block
/// order. Leftover blocks take the one-block path.
#[inline(always)]
unsafe fn q8_0_multi_simd<const VNNI: bool, const M: usize>(
    w: &[u8],
    xs: &[&[BlockQ8_0]],
    out: &mut [f32],
) {
    let nb = xs[..M].iter().fold(w.len() / 34, |n, x| n.min(x.len()));
    let pf = prefetch_distance();
    let mut acc = [0.0f32; M];
    let sdot = |aw: __m256i, wv: __m256i, y: &BlockQ8_0| {
        let yv = _mm256_loadu_si256(y.qs.as_ptr() as *const __m256i);
        let sy = _mm256_sign_epi8(yv, wv);
        if VNNI {
            _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, sy)
        } else {
            _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sy), _mm256_set1_epi16(1))
        }
    };
    let groups = nb / 4;
    for g in 0..groups {
        let i0 = 4 * g;
        let mut wv = [_mm256_setzero_si256(); 4];
        let mut aw = [_mm256_setzero_si256(); 4];
        let mut dws = [0u16; 8];
        for k in 0..4 {
            let b = w.as_ptr().add(34 * (i0 + k));
            prefetch_ahead(b, pf, 34);
            wv[k] = _mm256_loadu_si256(b.add(2) as *const __m256i);
            aw[k] = _mm256_sign_epi8(wv[k], wv[k]);
            dws[k] = read_u16(b);
        }
        let dwv = _mm_cvtph_ps(_mm_loadu_si128(dws.as_ptr() as *const __m128i));
        for j in 0..M {
            let ys = xs.get_unchecked(j).get_unchecked(i0..i0 + 4);
            let p0 = sdot(aw[0], wv[0], &ys[0]);
            let p1 = sdot(aw[1], wv[1], &ys[1]);
            let p2 = sdot(aw[2], wv[2], &ys[2]);
            let p3 = sdot(aw[3], wv[3], &ys[3]);
            // [Σp0, Σp1, Σp2, Σp3], exact: pairwise sums within each 128-bit half, then the halves.
            let h = _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));
            let isum = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
            let dys = [ys[0].d, ys[1].d, ys[2].d, ys[3].d, 0, 0, 0, 0];
            let dyv = _mm_cvtph_ps(_mm_loadu_si128(dys.as_ptr() as *const __m128i));
            let prod = _mm_mul_ps(_mm_mul_ps(dwv, dyv), _mm_cvtepi32_ps(isum));
            let mut terms = [0.0f32; 4];
            _mm_storeu_ps(terms.as_mut_ptr(), prod);
            let a = acc.get_unchecked_mut(j);
            for t in terms {
                *a += t;
            }
        }
    }
    for i in 4 * groups..nb {
        let b = w.as_ptr().add(34 * i);
        let wv = _mm256_loadu_si256(b.add(2) as *const __m256i);
        let aw = _mm256_sign_epi8(wv, wv);
        let dw = read_u16(b);
        for (a, x) in acc.iter_mut().zip(&xs[..M]) {
            let y = x.get_unchecked(i);
            *a += dd(dw, y.d) * hsum256_epi32(sdot(aw, wv, y)) as f32;
        }
    }
    out[..M].copy_from_slice(&acc);
}

/// A float (F32, F16, BF16) weight row against up to [`FLOAT_MULTI_ROWS`] f32 activation rows
/// of equal length (one result per row in `out`).
pub(crate) type FloatMultiDot = fn(w: &[u8], xs: &[&[f32]], out: &mut [f32]);

/// The most activation rows a [`FloatMultiDot`] takes per call.
pub(crate) const FLOAT_MULTI_ROWS: usize = 4;

/// The multi-row float kernel matching this module's AVX-512 kernel for `ty`, when `lookup(ty,
/// isa)` hands that one out (level AVX-512 available), else `None`.
pub(crate) fn float_multi_kernel(ty: GgmlType, isa: Isa) -> Option<FloatMultiDot> {
    if isa.min(Isa::best()) != Isa::Avx512 || !Isa::Avx512.supported() {
        return None;
    }
    match ty {
        GgmlType::F32 => Some(f32_multi_avx512),
        GgmlType::F16 => Some(f16_multi_avx512),
        GgmlType::BF16 => Some(bf16_multi_avx512),
        _ => None,
    }
}

fn f32_multi_avx512(w: &[u8], xs: &[&[f32]], out: &mut [f32]) {
    // SAFETY: only handed out by `float_multi_kernel` after the CPU features were checked.
    unsafe { float_multi_512_i::<F32>(w, xs, out) }
}

fn f16_multi_avx512(w: &[u8], xs: &[&[f32]], out: &mut [f32]) {
    // SAFETY: as above.
    unsafe { float_multi_512_i::<F16>(w, xs, out) }
}

fn bf16_multi_avx512(w: &[u8], xs: &[&[f32]], out: &mut [f32]) {
    // SAFETY: as above.
    unsafe { float_multi_512_i::<BF16>(w, xs, out) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn float_multi_512_i<const KIND: u8>(w: &[u8], xs: &[&[f32]], out: &mut [f32]) {
    /// The first `R` rows of `xs`.
    fn rows<'a, const R: usize>(xs: &[&'a [f32]]) -> [&'a [f32]; R] {
        core::array::from_fn(|r| xs[r])
    }
    let same_len = xs.iter().all(|x| x.len() == xs[0].len());
    match xs.len() {
        2 if same_len => out[..2].copy_from_slice(&float_rows_512::<KIND, 2>(w, rows(xs))),
        3 if same_len => out[..3].copy_from_slice(&float_rows_512::<KIND, 3>(w, rows(xs))),
        4 if same_len => out[..4].copy_from_slice(&float_rows_512::<KIND, 4>(w, rows(xs))),
        _ => {
            for (o, x) in out.iter_mut().zip(xs) {
                *o = float_512::<KIND>(w, x);
            }
        }
    }
}

/// [`float_512`] for `R` activation rows of equal length at once: each weight vector is loaded
/// (and converted) once for all rows, and the rows' accumulation chains interleave (one chain
/// alone is bound by the latency of its additions). Per row the same lanes, products and
/// additions in the same order, the same tail and reduction: bit-identical to [`float_512`].
#[inline(always)]
unsafe fn float_rows_512<const KIND: u8, const R: usize>(w: &[u8], xs: [&[f32]; R]) -> [f32; R] {
    let eb = elem_bytes(KIND);
    let n = (w.len() / eb).min(xs[0].len());
    let wp = w.as_ptr();
    let xp: [*const f32; R] = core::array::from_fn(|r| xs[r].as_ptr());
    let mut acc = [_mm512_setzero_ps(); R];
    let mut i = 0;
    while i + 64 <= n {
        let wv = [
            load16::<KIND>(wp.add(i * eb)),
            load16::<KIND>(wp.add((i + 16) * eb)),
            load16::<KIND>(wp.add((i + 32) * eb)),
            load16::<KIND>(wp.add((i + 48) * eb)),
        ];
        for (a, &x) in acc.iter_mut().zip(&xp) {
            let p0 = _mm512_mul_ps(wv[0], _mm512_loadu_ps(x.add(i)));
            let p1 = _mm512_mul_ps(wv[1], _mm512_loadu_ps(x.add(i + 16)));
            let p2 = _mm512_mul_ps(wv[2], _mm512_loadu_ps(x.add(i + 32)));
            let p3 = _mm512_mul_ps(wv[3], _mm512_loadu_ps(x.add(i + 48)));
            *a = _mm512_add_ps(
                _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(*a, p0), p1), p2),
                p3,
            );
        }
        i += 64;
    }
    while i + 16 <= n {
        let wv = load16::<KIND>(wp.add(i * eb));
        for (a, &x) in acc.iter_mut().zip(&xp) {
            *a = _mm512_add_ps(*a, _mm512_mul_ps(wv, _mm512_loadu_ps(x.add(i))));
        }
        i += 16;
    }
    let mut out = [0.0f32; R];
    for r in 0..R {
        let mut s = [0.0f32; 16];
        _mm512_storeu_ps(s.as_mut_ptr(), acc[r]);
        let mut j = i;
        while j < n {
            s[j % 16] += load1::<KIND>(wp.add(j * eb)) * *xp[r].add(j);
            j += 1;
        }
        out[r] = reduce16(s);
    }
    out
}
