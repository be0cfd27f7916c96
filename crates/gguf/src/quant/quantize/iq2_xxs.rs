//! Quantizer for IQ2_XXS (2.0625 bits per weight), bit-exact with ggml's
//! `quantize_row_iq2_xxs_impl`.
//!
//! Block layout (66 bytes per 256 values): f16 `d`, then 8 sub-blocks of 32 values, each two
//! little-endian u32: the first holds four 8-bit grid indices (one per group of 8 values), the
//! second four 7-bit sign masks (bits 0..28) and a 4-bit scale `l` (bits 28..32); a sub-block's
//! scale is `d·(0.5 + l)·0.25` at decode time.
//!
//! All f32 arithmetic below is written in ggml's operation order (no fused multiply-add), so the
//! bytes match `ggml_quantize_chunk`.

use std::sync::OnceLock;

use super::common::{
    c_max, for_each_super_block, make_qp_quants, nearest_int, GROUP_MAX_EPS, QK_K,
};
use super::iq_grid::{IqGrid, Lookup};
use crate::quant::grids::IQ2XXS_GRID;

const BLOCK_BYTES: usize = 66;
/// Quant levels per element (grid coordinates are `2l + 1`, l in 0..3).
const K_MAX_Q: i32 = 3;

fn iq2_xxs_grid() -> &'static IqGrid {
    static GRID: OnceLock<IqGrid> = OnceLock::new();
    GRID.get_or_init(|| IqGrid::build(&IQ2XXS_GRID, [0x08, 0x19, 0x2b], 2))
}

/// Quantizes one row (a multiple of 256 values) into `out`. ggml requires an importance matrix
/// for this type (the dispatcher enforces it); without one, uniform importance is used.
pub(crate) fn quantize_row_iq2_xxs(row: &[f32], imatrix: Option<&[f32]>, out: &mut [u8]) {
    let grid = iq2_xxs_grid();
    let ones = [1.0f32; QK_K];
    for_each_super_block(row, imatrix, out, BLOCK_BYTES, |x, qw, y| {
        quantize_block(grid, x, qw.unwrap_or(&ones), y)
    });
}

/// One super-block of 256 values → 66 bytes.
fn quantize_block(grid: &IqGrid, xbl: &[f32], qw: &[f32], out: &mut [u8]) {
    let mut q2 = [0u32; 2 * QK_K / 32];
    let mut scales = [0f32; QK_K / 32];
    let mut max_scale = 0f32;

    let mut sumx2 = 0f32;
    for &x in xbl {
        sumx2 += x * x;
    }
    let sigma2 = sumx2 / QK_K as f32;

    for ib in 0..QK_K / 32 {
        let xb = &xbl[32 * ib..32 * ib + 32];
        let qwb = &qw[32 * ib..32 * ib + 32];
        let weight: [f32; 32] = std::array::from_fn(|i| qwb[i] * (sigma2 + xb[i] * xb[i]).sqrt());
        let waux: [f32; 32] = std::array::from_fn(|i| weight[i].sqrt());
        let (xval, mut signs) = fold_signs(xb, &weight);

        let max = xval[1..].iter().fold(xval[0], |m, &v| c_max(m, v));
        if max < GROUP_MAX_EPS {
            continue;
        }
        let Some((scale, levels)) = sub_block_scale(grid, &xval, &weight, &waux) else {
            continue;
        };
        let mut scale = scale;
        if scale < 0.0 {
            // ggml: "should never happen"; flip the scale and all signs.
            scale = -scale;
            for s in &mut signs {
                *s = !*s & 127;
            }
        }
        for k in 0..4 {
            // The levels are on the grid here (ggml aborts otherwise; only NaN input gets there).
            let gi = match grid.lookup(&levels[8 * k..8 * k + 8]) {
                Lookup::OnGrid(i) => i as u32,
                Lookup::Neighbours(_) => 0,
            };
            q2[2 * ib] |= gi << (8 * k);
            q2[2 * ib + 1] |= (signs[k] as u32) << (7 * k);
        }
        scales[ib] = scale;
        max_scale = c_max(max_scale, scale);
    }

    out.fill(0);
    if max_scale == 0.0 {
        return;
    }
    let d = max_scale / 31.0;
    out[..2].copy_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
    let id = 1.0 / d;
    for (ib, &s) in scales.iter().enumerate() {
        let l = nearest_int(0.5 * (id * s - 1.0)).clamp(0, 15);
        q2[2 * ib + 1] |= (l as u32) << 28;
    }
    for (dst, q) in out[2..].chunks_exact_mut(4).zip(q2) {
        dst.copy_from_slice(&q.to_le_bytes());
    }
}

/// Makes every group of 8 values non-negative with an even number of flips (the format stores
/// 7 sign bits; the 8th is implied by parity): if the count is odd, the value with the least
/// weighted square keeps its wrong sign. Returns the folded values and the 7-bit sign masks.
fn fold_signs(xb: &[f32], weight: &[f32; 32]) -> ([f32; 32], [u8; 4]) {
    let mut xval = [0f32; 32];
    let mut signs = [0u8; 4];
    for k in 0..4 {
        let mut nflip = 0;
        let mut s = 0u8;
        for i in 0..8 {
            let x = xb[8 * k + i];
            if x >= 0.0 {
                xval[8 * k + i] = x;
            } else {
                xval[8 * k + i] = -x;
                nflip += 1;
                s |= 1 << i;
            }
        }
        if nflip % 2 == 1 {
            let wx2 = |i: usize| weight[8 * k + i] * xb[8 * k + i] * xb[8 * k + i];
            let mut imin = 0;
            let mut min = wx2(0);
            for i in 1..8 {
                let ax = wx2(i);
                if ax < min {
                    min = ax;
                    imin = i;
                }
            }
            xval[8 * k + imin] = -xval[8 * k + imin];
            s ^= 1 << imin;
        }
        signs[k] = s & 127;
    }
    (xval, signs)
}

/// The scale and grid levels (0..=2 per value) of one 32-value sub-block: a first guess from
/// `make_qp_quants`, a search over 13 trial scales snapping each group of 8 to the grid, then one
/// refinement at the best scale. `None` when the sub-block quantizes to zero.
fn sub_block_scale(
    grid: &IqGrid,
    xval: &[f32; 32],
    weight: &[f32; 32],
    waux: &[f32; 32],
) -> Option<(f32, [i8; 32])> {
    let mut levels = [0i8; 32];
    let mut scale = make_qp_quants(K_MAX_Q + 1, xval, weight, &mut [0u8; 32]);
    let eff_max = scale * K_MAX_Q as f32;
    if eff_max <= 0.0 {
        return None;
    }
    // Until a trial wins, ggml's L holds make_qp_quants' levels; they can only reach the output
    // when the scale is NaN (ggml then aborts), so zeros stand in for them here.
    let mut best = 0f32;
    let mut laux = [0i8; 32];
    for is in -6..=6 {
        let id = ((2 * K_MAX_Q - 1) as f32 + is as f32 * 0.1) / eff_max;
        let this_scale = 1.0 / id;
        snap_to_grid(grid, xval, waux, id, this_scale, &mut laux);
        let (sumqx, sumq2) = weighted_sums(xval, weight, &laux);
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            scale = sumqx / sumq2;
            best = scale * sumqx;
            levels = laux;
        }
    }
    if scale > 0.0 {
        let id = 1.0 / scale;
        snap_to_grid(grid, xval, waux, id, scale, &mut levels);
        let (sumqx, sumq2) = weighted_sums(xval, weight, &levels);
        if sumq2 > 0.0 {
            scale = sumqx / sumq2;
        }
    }
    Some((scale, levels))
}

/// Rounds each group of 8 values at inverse scale `id` to levels 0..=2 and, when that pattern
/// is not on the grid, replaces it by the best neighbour at `scale` (distance weighted by `waux`).
fn snap_to_grid(
    grid: &IqGrid,
    xval: &[f32; 32],
    waux: &[f32; 32],
    id: f32,
    scale: f32,
    levels: &mut [i8; 32],
) {
    for k in 0..4 {
        let group = &mut levels[8 * k..8 * k + 8];
        for (i, l) in group.iter_mut().enumerate() {
            *l = nearest_int(0.5 * (id * xval[8 * k + i] - 1.0)).clamp(0, K_MAX_Q - 1) as i8;
        }
        match grid.lookup(group) {
            Lookup::OnGrid(_) => {}
            Lookup::Neighbours(list) => {
                let gi = best_neighbour(
                    grid,
                    list,
                    &xval[8 * k..8 * k + 8],
                    &waux[8 * k..8 * k + 8],
                    scale,
                );
                for (l, &c) in group.iter_mut().zip(grid.point(gi)) {
                    *l = (c - 1) / 2;
                }
            }
        }
    }
}

/// ggml's `iq2_find_best_neighbour`: the candidate minimising Σ w·(scale·q − x)², first wins
/// ties. (ggml aborts when every distance is NaN; we then take the first candidate.)
fn best_neighbour(grid: &IqGrid, list: &[u16], xval: &[f32], w: &[f32], scale: f32) -> usize {
    // Each element has 3 possible levels: tabulate the 24 terms w·diff·diff once (the same f32
    // values ggml computes per candidate), then every candidate's sum is 8 lookups + adds.
    let terms: [[f32; 3]; 8] = std::array::from_fn(|i| {
        std::array::from_fn(|l| {
            let diff = scale * (2 * l + 1) as f32 - xval[i];
            w[i] * diff * diff
        })
    });
    grid.closest(list, &terms)
}

/// Σ w·x·q and Σ w·q² with q = 2l + 1.
fn weighted_sums(xval: &[f32; 32], weight: &[f32; 32], levels: &[i8; 32]) -> (f32, f32) {
    let mut sumqx = 0f32;
    let mut sumq2 = 0f32;
    for i in 0..32 {
        let w = weight[i];
        let q = (2 * levels[i] as i32 + 1) as f32;
        sumqx += w * xval[i] * q;
        sumq2 += w * q * q;
    }
    (sumqx, sumq2)
}
