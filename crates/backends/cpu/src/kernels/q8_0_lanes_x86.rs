//! Q8_0 weights against up to 16 Q8_0 activation rows held one row per i32 lane (AVX-512 VNNI):
//! the multi-row product of the speculative verify pass (and prefill) on Q8_0 models.
//!
//! The one-row kernels ([`super::simple`], [`super::simple_x86`]) compute, for one weight row
//! and one activation row, `acc += (d_w · d_y) · isum` block after block, where `isum` is the
//! block's exact i32 dot. Here lane `r` of one f32 vector is row `r`'s `acc`, and each block adds
//! one vector of terms to it: per lane the same IEEE operations in the same order, so each row is
//! bit-identical to the one-row kernel. The block sums come out of `vpdpbusd` directly in their
//! lanes, with no horizontal reductions:
//!
//! * the activations are repacked once per product ([`lane_blocks`]): for block `b` and
//!   `k = 0..8`, one 64-byte vector holds bytes `4k..4k+4` of every row's block `b`, row `r` in
//!   lane `r`, with their top bit flipped (`y ^ 0x80 = y + 128`, unsigned);
//! * the weight's four bytes `4k..4k+4` (signed) are broadcast to every lane straight from
//!   memory (a `{1to16}` operand), so `vpdpbusd` adds `Σ (y + 128) · w = isum + 128 · Σ w`;
//! * the lanes start from `−128 · Σ w` of the weight block (one `vpsadbw` per block), which
//!   leaves exactly `isum` (integer arithmetic: the order does not matter).
//!
//! A block costs eight `vpdpbusd` for up to 16 rows, against one per row (plus a horizontal
//! reduction and a serial f32 add chain) in the one-row kernel. (Flipping the weights instead of
//! the activations needs a `vpxor` and a register broadcast per four weight bytes: 1.6× slower.)
//!
//! Safety: the `#[target_feature]` functions are reachable only through [`kernel`], which checks
//! the CPU features first.

use super::q8::BlockQ8_0;
use super::x86_util::{f16_hw, read_u16, read_u32};
use super::{has_vnni, Isa};
use core::arch::x86_64::*;

/// i32 lanes of a 512-bit vector: a lane group's width.
pub(crate) const LANES: usize = 16;
/// Activation rows of a wide group.
pub(crate) const WIDE_ROWS: usize = LANES;
/// Activation rows of a narrow group (256-bit vectors).
pub(crate) const NARROW_ROWS: usize = LANES / 2;

/// One Q8_0 block of a lane group, repacked for [`kernel`].
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct LaneBlock {
    /// `qs[k]`: bytes `4k..4k+4` of the block of every row, `^ 0x80`, row `r` at bytes
    /// `4r..4r+4`; lanes without a row hold `0x80` (y = 0, giving 0).
    qs: [[u8; 4 * LANES]; 8],
    /// Each row's block scale `d_y`, as f32 (exact from f16); 0 in lanes without a row.
    d: [f32; LANES],
}

impl LaneBlock {
    const EMPTY: LaneBlock = LaneBlock {
        qs: [[0x80; 4 * LANES]; 8],
        d: [0.0; LANES],
    };
}

/// Activation rows `first..first + rows` in one lane group, wide (≤ 16 rows) or narrow (≤ 8).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LaneGroup {
    pub first: usize,
    pub rows: usize,
    pub narrow: bool,
}

/// The lane groups for the first rows of an `n`-row product: wide groups while more than 8 rows
/// remain, then a narrow group if at least `min` rows remain. The rows after the last group
/// (fewer than `min`) are left to another kernel.
pub(crate) fn plan(n: usize, min: usize) -> Vec<LaneGroup> {
    let mut groups = Vec::new();
    let mut first = 0;
    while n - first > NARROW_ROWS {
        let rows = (n - first).min(WIDE_ROWS);
        groups.push(LaneGroup {
            first,
            rows,
            narrow: false,
        });
        first += rows;
    }
    if n - first >= min.max(1) {
        groups.push(LaneGroup {
            first,
            rows: n - first,
            narrow: true,
        });
    }
    groups
}

/// The activation rows of a product (`q`: rows of `per` Q8_0 blocks each) repacked for the lane
/// groups `groups`: group `g` at `[g · per, (g + 1) · per)`.
pub(crate) fn lane_blocks(q: &[BlockQ8_0], per: usize, groups: &[LaneGroup]) -> Vec<LaneBlock> {
    let mut out = vec![LaneBlock::EMPTY; groups.len() * per];
    for (g, group) in groups.iter().enumerate() {
        let dst = &mut out[g * per..(g + 1) * per];
        for lane in 0..group.rows {
            let row = &q[(group.first + lane) * per..(group.first + lane + 1) * per];
            for (lb, y) in dst.iter_mut().zip(row) {
                for (qk, yk) in lb.qs.iter_mut().zip(y.qs.chunks_exact(4)) {
                    // Four bytes at once: each byte's top bit flipped.
                    let v =
                        u32::from_le_bytes([yk[0] as u8, yk[1] as u8, yk[2] as u8, yk[3] as u8]);
                    qk[4 * lane..4 * lane + 4].copy_from_slice(&(v ^ 0x8080_8080).to_le_bytes());
                }
                lb.d[lane] = half::f16::from_bits(y.d).to_f32();
            }
        }
    }
    out
}

/// Rows of Q8_0 weights (`w`: whole rows of `row_bytes`) against one lane group `ys` (`per`
/// blocks): `out[i][r]` = weight row `i` · the group's activation row `r`, bit-identical to the
/// one-row kernel. With `narrow` (a narrow group), only lanes 0..8 are written. `out` needs one
/// entry per weight row.
pub(crate) type LanesDot =
    fn(w: &[u8], row_bytes: usize, ys: &[LaneBlock], narrow: bool, out: &mut [[f32; LANES]]);

/// The lane kernel, where level `isa` has the one-row VNNI Q8_0 kernel (AVX-512 with VNNI).
pub(crate) fn kernel(isa: Isa) -> Option<LanesDot> {
    let top = isa.min(Isa::best());
    (top >= Isa::Avx512 && Isa::Avx512.supported() && has_vnni()).then_some(lanes_avx512_vnni)
}

fn lanes_avx512_vnni(
    w: &[u8],
    row_bytes: usize,
    ys: &[LaneBlock],
    narrow: bool,
    out: &mut [[f32; LANES]],
) {
    // SAFETY: only handed out by `kernel` after the CPU features were checked.
    unsafe {
        if narrow {
            lanes8_i(w, row_bytes, ys, out)
        } else {
            lanes16_i(w, row_bytes, ys, out)
        }
    }
}

/// `−128 · Σ w` over the 32 quants of the Q8_0 weight block at `b`: `vpsadbw` sums the bytes
/// made unsigned (`w ^ 0x80 = w + 128`), which is `Σ w + 32 · 128`.
#[inline(always)]
unsafe fn neg_sum_w(b: *const u8) -> i32 {
    let w = _mm256_loadu_si256(b.add(2) as *const __m256i);
    let s = _mm256_sad_epu8(
        _mm256_xor_si256(w, _mm256_set1_epi8(i8::MIN)),
        _mm256_setzero_si256(),
    );
    let s = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
    let s = _mm_add_epi64(s, _mm_unpackhi_epi64(s, s));
    -128 * (_mm_cvtsi128_si32(s) - 32 * 128)
}

/// A wide group: 16 lanes in 512-bit vectors.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn lanes16_i(w: &[u8], row_bytes: usize, ys: &[LaneBlock], out: &mut [[f32; LANES]]) {
    let nb = (row_bytes / 34).min(ys.len());
    for (wr, o) in w.chunks_exact(row_bytes.max(1)).zip(out.iter_mut()) {
        let mut acc = _mm512_setzero_ps();
        for (i, y) in ys[..nb].iter().enumerate() {
            let b = wr.as_ptr().add(34 * i);
            let wk = |k: usize| _mm512_set1_epi32(read_u32(b.add(2 + 4 * k)) as i32);
            let yk = |k: usize| _mm512_load_si512(y.qs[k].as_ptr() as *const _);
            // Two independent chains of four `vpdpbusd` (k even / odd), joined exactly.
            let (mut even, mut odd) = (_mm512_set1_epi32(neg_sum_w(b)), _mm512_setzero_si512());
            for k in (0..8).step_by(2) {
                even = _mm512_dpbusd_epi32(even, yk(k), wk(k));
                odd = _mm512_dpbusd_epi32(odd, yk(k + 1), wk(k + 1));
            }
            let isum = _mm512_add_epi32(even, odd);
            // (d_w · d_y) · isum, then added to the running sum: the one-row kernel's order.
            let dw = _mm512_set1_ps(f16_hw(read_u16(b)));
            let dd = _mm512_mul_ps(dw, _mm512_load_ps(y.d.as_ptr()));
            acc = _mm512_add_ps(acc, _mm512_mul_ps(dd, _mm512_cvtepi32_ps(isum)));
        }
        _mm512_storeu_ps(o.as_mut_ptr(), acc);
    }
}

/// Two wide groups `ys0`, `ys1` against the same weight rows: each weight block's broadcasts,
/// `−128 · Σ w` and `d_w` once for 32 rows, and each group's lanes through the same operations as
/// [`lanes16_i`] (so bit-identical to it, hence to the one-row kernel).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn lanes32_i(
    w: &[u8],
    row_bytes: usize,
    ys0: &[LaneBlock],
    ys1: &[LaneBlock],
    out0: &mut [[f32; LANES]],
    out1: &mut [[f32; LANES]],
) {
    let nb = (row_bytes / 34).min(ys0.len()).min(ys1.len());
    for ((wr, o0), o1) in w
        .chunks_exact(row_bytes.max(1))
        .zip(out0.iter_mut())
        .zip(out1.iter_mut())
    {
        let mut acc0 = _mm512_setzero_ps();
        let mut acc1 = _mm512_setzero_ps();
        for (i, (y0, y1)) in ys0[..nb].iter().zip(&ys1[..nb]).enumerate() {
            let b = wr.as_ptr().add(34 * i);
            let wk = |k: usize| _mm512_set1_epi32(read_u32(b.add(2 + 4 * k)) as i32);
            let y0k = |k: usize| _mm512_load_si512(y0.qs[k].as_ptr() as *const _);
            let y1k = |k: usize| _mm512_load_si512(y1.qs[k].as_ptr() as *const _);
            let start = _mm512_set1_epi32(neg_sum_w(b));
            let (mut e0, mut o0_) = (start, _mm512_setzero_si512());
            let (mut e1, mut o1_) = (start, _mm512_setzero_si512());
            for k in (0..8).step_by(2) {
                let (we, wo) = (wk(k), wk(k + 1));
                e0 = _mm512_dpbusd_epi32(e0, y0k(k), we);
                e1 = _mm512_dpbusd_epi32(e1, y1k(k), we);
                o0_ = _mm512_dpbusd_epi32(o0_, y0k(k + 1), wo);
                o1_ = _mm512_dpbusd_epi32(o1_, y1k(k + 1), wo);
            }
            let dw = _mm512_set1_ps(f16_hw(read_u16(b)));
            let dd0 = _mm512_mul_ps(dw, _mm512_load_ps(y0.d.as_ptr()));
            let dd1 = _mm512_mul_ps(dw, _mm512_load_ps(y1.d.as_ptr()));
            let is0 = _mm512_cvtepi32_ps(_mm512_add_epi32(e0, o0_));
            let is1 = _mm512_cvtepi32_ps(_mm512_add_epi32(e1, o1_));
            acc0 = _mm512_add_ps(acc0, _mm512_mul_ps(dd0, is0));
            acc1 = _mm512_add_ps(acc1, _mm512_mul_ps(dd1, is1));
        }
        _mm512_storeu_ps(o0.as_mut_ptr(), acc0);
        _mm512_storeu_ps(o1.as_mut_ptr(), acc1);
    }
}

/// Two wide lane groups at once (see [`lanes32_i`]): `ys0` into `out0`, `ys1` into `out1`.
pub(crate) type LanesPairDot = fn(
    w: &[u8],
    row_bytes: usize,
    ys0: &[LaneBlock],
    ys1: &[LaneBlock],
    out0: &mut [[f32; LANES]],
    out1: &mut [[f32; LANES]],
);

/// The two-group lane kernel, where [`kernel`] gives the one-group kernel.
pub(crate) fn pair_kernel(isa: Isa) -> Option<LanesPairDot> {
    kernel(isa).map(|_| lanes_pair_avx512_vnni as LanesPairDot)
}

fn lanes_pair_avx512_vnni(
    w: &[u8],
    row_bytes: usize,
    ys0: &[LaneBlock],
    ys1: &[LaneBlock],
    out0: &mut [[f32; LANES]],
    out1: &mut [[f32; LANES]],
) {
    // SAFETY: only handed out by `pair_kernel` after `kernel` checked the CPU features.
    unsafe { lanes32_i(w, row_bytes, ys0, ys1, out0, out1) }
}

/// A narrow group: lanes 0..8 in 256-bit vectors (the same operations per lane as
/// [`lanes16_i`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn lanes8_i(w: &[u8], row_bytes: usize, ys: &[LaneBlock], out: &mut [[f32; LANES]]) {
    let nb = (row_bytes / 34).min(ys.len());
    for (wr, o) in w.chunks_exact(row_bytes.max(1)).zip(out.iter_mut()) {
        let mut acc = _mm256_setzero_ps();
        for (i, y) in ys[..nb].iter().enumerate() {
            let b = wr.as_ptr().add(34 * i);
            let wk = |k: usize| _mm256_set1_epi32(read_u32(b.add(2 + 4 * k)) as i32);
            let yk = |k: usize| _mm256_load_si256(y.qs[k].as_ptr() as *const _);
            let (mut even, mut odd) = (_mm256_set1_epi32(neg_sum_w(b)), _mm256_setzero_si256());
            for k in (0..8).step_by(2) {
                even = _mm256_dpbusd_epi32(even, yk(k), wk(k));
                odd = _mm256_dpbusd_epi32(odd, yk(k + 1), wk(k + 1));
            }
            let isum = _mm256_add_epi32(even, odd);
            let dw = _mm256_set1_ps(f16_hw(read_u16(b)));
            let dd = _mm256_mul_ps(dw, _mm256_load_ps(y.d.as_ptr()));
            acc = _mm256_add_ps(acc, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(isum)));
        }
        _mm256_storeu_ps(o.as_mut_ptr(), acc);
    }
}
