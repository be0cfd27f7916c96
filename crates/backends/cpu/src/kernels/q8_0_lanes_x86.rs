//! Q8_0 weights against up to 16 Q8_0 activation rows held one row per i32 lane (AVX-512 VNNI):
//! the multi-row product of the speculative verify pass on Q8_0 models.
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
//!   lane `r`;
//! * the weight's four bytes `4k..4k+4` are broadcast to every lane and made unsigned by
//!   flipping their top bit (`w ^ 0x80 = w + 128`), so `vpdpbusd` adds
//!   `Σ (w + 128) · y = isum + 128 · Σ y` to each lane;
//! * the lanes start from `−128 · Σ y` of their block (stored with the repacked rows), which
//!   leaves exactly `isum` (integer arithmetic: the order does not matter).
//!
//! A block costs eight `vpdpbusd` for all 16 rows, against one per row (plus a horizontal
//! reduction and a serial f32 add chain) in the one-row kernel.
//!
//! Safety: the `#[target_feature]` function is reachable only through [`kernel`], which checks
//! the CPU features first.

use super::q8::BlockQ8_0;
use super::x86_util::{f16_hw, read_u16, read_u32};
use super::{has_vnni, Isa};
use core::arch::x86_64::*;

/// Activation rows per lane group (i32 lanes of a 512-bit vector).
pub(crate) const LANES: usize = 16;

/// One Q8_0 block of up to [`LANES`] activation rows, repacked for [`kernel`].
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct LaneBlock {
    /// `qs[k]`: bytes `4k..4k+4` of the block of every row, row `r` at bytes `4r..4r+4`.
    qs: [[i8; 4 * LANES]; 8],
    /// `−128 · Σ y` over each row's block (cancels the `+128` of the flipped weights).
    bias: [i32; LANES],
    /// Each row's block scale `d_y`, as f32 (exact from f16).
    d: [f32; LANES],
}

impl LaneBlock {
    const ZERO: LaneBlock = LaneBlock {
        qs: [[0; 4 * LANES]; 8],
        bias: [0; LANES],
        d: [0.0; LANES],
    };
}

/// The activation rows of a product, `rows` rows of `per` Q8_0 blocks each (`q`), repacked into
/// `ceil(rows / 16)` lane groups of `per` [`LaneBlock`]s (group `g` holds rows `16g..`; lanes
/// past the last row are zero and give zero).
pub(crate) fn lane_blocks(q: &[BlockQ8_0], per: usize, rows: usize) -> Vec<LaneBlock> {
    let groups = rows.div_ceil(LANES);
    let mut out = vec![LaneBlock::ZERO; groups * per];
    for (j, row) in q.chunks_exact(per.max(1)).take(rows).enumerate() {
        let (g, lane) = (j / LANES, j % LANES);
        for (lb, y) in out[g * per..(g + 1) * per].iter_mut().zip(row) {
            for (k, qk) in lb.qs.iter_mut().enumerate() {
                qk[4 * lane..4 * lane + 4].copy_from_slice(&y.qs[4 * k..4 * k + 4]);
            }
            lb.bias[lane] = -128 * y.qs.iter().map(|&v| i32::from(v)).sum::<i32>();
            lb.d[lane] = half::f16::from_bits(y.d).to_f32();
        }
    }
    out
}

/// Rows of Q8_0 weights (`w`: whole rows of `row_bytes`) against one lane group `ys` (`per`
/// blocks): `out[i][r]` = weight row `i` · activation row `r`, bit-identical to the one-row
/// kernel. With `narrow`, only lanes 0..8 are computed (a group of ≤ 8 rows: half the work,
/// in 256-bit vectors) and `out[i][8..]` is left as it was. `out` needs one entry per weight row.
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

/// All 16 lanes, in 512-bit vectors.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn lanes16_i(w: &[u8], row_bytes: usize, ys: &[LaneBlock], out: &mut [[f32; LANES]]) {
    let nb = (row_bytes / 34).min(ys.len());
    let flip = _mm512_set1_epi8(i8::MIN);
    // Weight bytes 4k..4k+4 of the block at `b`, top bits flipped, in every lane.
    let wk = |b: *const u8, k: usize| {
        _mm512_xor_si512(_mm512_set1_epi32(read_u32(b.add(2 + 4 * k)) as i32), flip)
    };
    for (wr, o) in w.chunks_exact(row_bytes.max(1)).zip(out.iter_mut()) {
        let mut acc = _mm512_setzero_ps();
        for (i, y) in ys[..nb].iter().enumerate() {
            let b = wr.as_ptr().add(34 * i);
            let yk = |k: usize| _mm512_load_si512(y.qs[k].as_ptr() as *const _);
            // Two independent chains of four `vpdpbusd` (k even / odd), joined exactly.
            let mut even = _mm512_load_si512(y.bias.as_ptr() as *const _);
            let mut odd = _mm512_setzero_si512();
            for k in (0..8).step_by(2) {
                even = _mm512_dpbusd_epi32(even, wk(b, k), yk(k));
                odd = _mm512_dpbusd_epi32(odd, wk(b, k + 1), yk(k + 1));
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

/// Lanes 0..8 only, in 256-bit vectors (the same operations per lane as [`lanes16_i`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn lanes8_i(w: &[u8], row_bytes: usize, ys: &[LaneBlock], out: &mut [[f32; LANES]]) {
    let nb = (row_bytes / 34).min(ys.len());
    let flip = _mm256_set1_epi8(i8::MIN);
    let wk = |b: *const u8, k: usize| {
        _mm256_xor_si256(_mm256_set1_epi32(read_u32(b.add(2 + 4 * k)) as i32), flip)
    };
    for (wr, o) in w.chunks_exact(row_bytes.max(1)).zip(out.iter_mut()) {
        let mut acc = _mm256_setzero_ps();
        for (i, y) in ys[..nb].iter().enumerate() {
            let b = wr.as_ptr().add(34 * i);
            let yk = |k: usize| _mm256_load_si256(y.qs[k].as_ptr() as *const _);
            let mut even = _mm256_load_si256(y.bias.as_ptr() as *const _);
            let mut odd = _mm256_setzero_si256();
            for k in (0..8).step_by(2) {
                even = _mm256_dpbusd_epi32(even, wk(b, k), yk(k));
                odd = _mm256_dpbusd_epi32(odd, wk(b, k + 1), yk(k + 1));
            }
            let isum = _mm256_add_epi32(even, odd);
            let dw = _mm256_set1_ps(f16_hw(read_u16(b)));
            let dd = _mm256_mul_ps(dw, _mm256_load_ps(y.d.as_ptr()));
            acc = _mm256_add_ps(acc, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(isum)));
        }
        _mm256_storeu_ps(o.as_mut_ptr(), acc);
    }
}
