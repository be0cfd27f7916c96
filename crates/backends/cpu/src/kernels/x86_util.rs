//! Small x86-64 helpers shared by the SIMD kernels. Every function here is `#[inline(always)]`
//! and meant to be called from a `#[target_feature]` kernel that enables at least AVX2, FMA and
//! F16C (the features the intrinsics below need); the caller's features are what make the
//! inlined intrinsics legal.

use core::arch::x86_64::*;

/// f16 bits → f32 with F16C (exact, like the software conversion).
#[inline(always)]
pub(crate) unsafe fn f16_hw(bits: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// Two f16 packed in `bits` (low half → lane 0, high half → lane 1) → f32, lanes 2-3 zero.
/// The register is written whole (`vmovd`), so there is no false dependency on an older value,
/// which the one-value form invites (LLVM turns it into `vpinsrw` into a live register).
#[inline(always)]
pub(crate) unsafe fn f16x2_hw(bits: u32) -> __m128 {
    _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32))
}

/// The little-endian u32 at `p` (unaligned).
#[inline(always)]
pub(crate) unsafe fn read_u32(p: *const u8) -> u32 {
    u32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)])
}

/// The little-endian u16 at `p` (unaligned).
#[inline(always)]
pub(crate) unsafe fn read_u16(p: *const u8) -> u16 {
    u16::from_le_bytes([*p, *p.add(1)])
}

/// Sum of the 8 i32 lanes of `v` (exact; integer addition does not depend on the order).
#[inline(always)]
pub(crate) unsafe fn hsum256_epi32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// Sum of the 16 i32 lanes of `v` (exact).
#[inline(always)]
pub(crate) unsafe fn hsum512_epi32(v: __m512i) -> i32 {
    hsum256_epi32(_mm256_add_epi32(
        _mm512_castsi512_si256(v),
        _mm512_extracti64x4_epi64::<1>(v),
    ))
}

/// The exact sums of the 16 i32 lanes of each of `v[0..4]`, as the 4 lanes of one vector (one
/// transposing reduction instead of four horizontal sums). Needs AVX-512 F.
#[inline(always)]
pub(crate) unsafe fn hsum4_512(v: [__m512i; 4]) -> __m128i {
    // Per 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3], the same for c and d.
    let ab = _mm512_add_epi32(
        _mm512_unpacklo_epi32(v[0], v[1]),
        _mm512_unpackhi_epi32(v[0], v[1]),
    );
    let cd = _mm512_add_epi32(
        _mm512_unpacklo_epi32(v[2], v[3]),
        _mm512_unpackhi_epi32(v[2], v[3]),
    );
    // Per 128-bit lane: [a, b, c, d] partial sums; then the four 128-bit lanes added.
    let abcd = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
    let s = _mm256_add_epi32(
        _mm512_castsi512_si256(abcd),
        _mm512_extracti64x4_epi64::<1>(abcd),
    );
    _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s))
}

/// How far ahead of the weight stream the kernels prefetch, in bytes (`REDLITE_PF`, default
/// [`DEFAULT_PREFETCH`]; 0 turns it off). Read once per process.
pub(crate) fn prefetch_distance() -> usize {
    prefetch_distance_or(DEFAULT_PREFETCH)
}

/// [`prefetch_distance`] for a kernel whose own default is `default` bytes: `REDLITE_PF` where
/// set, else `default`.
pub(crate) fn prefetch_distance_or(default: usize) -> usize {
    static PF: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    PF.get_or_init(|| {
        std::env::var("REDLITE_PF")
            .ok()
            .and_then(|v| v.trim().parse().ok())
    })
    .unwrap_or(default)
}

/// Default prefetch distance (bytes). Measured on a 16-core Xeon (Sapphire Rapids class): matvec
/// went from ~60 GB/s without prefetch to the speed of a plain read (~85-95 GB/s) at 2-8 KiB.
pub(crate) const DEFAULT_PREFETCH: usize = 4096;

/// Prefetches the cache lines of `bytes` bytes starting `dist` bytes after `p` (consecutive
/// blocks together cover every line). Never faults, even past the end of the data.
#[inline(always)]
pub(crate) unsafe fn prefetch_ahead(p: *const u8, dist: usize, bytes: usize) {
    if dist == 0 {
        return;
    }
    let mut off = 0;
    while off < bytes {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(dist + off) as *const i8);
        off += 64;
    }
}
