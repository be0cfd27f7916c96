//! Quantizer for IQ1_M (1.75 bits per weight), bit-exact with ggml's `quantize_row_iq1_m_impl`.
//!
//! Block layout (56 bytes per 256 values): `qs[32]` (low 8 bits of one 11-bit grid index per
//! group of 8 values), `qh[16]` (per 16-value sub-block: the index high bits, 3 per group, and a
//! "shift" bit per group choosing delta +0.125 or −0.125), `scales[8]` read as four
//! little-endian u16: 3-bit sub-block scales in bits 0..12, and the 16-bit f16 super-block
//! scale spread over the top nibbles.
//!
//! All f32 arithmetic below is written in ggml's operation order (no fused multiply-add), so the
//! bytes match `ggml_quantize_chunk`.

use std::sync::OnceLock;

use super::common::{c_max, for_each_super_block, nearest_int, QK_K};
use super::iq_grid::{IqGrid, Lookup};
use crate::quant::grids::IQ1S_GRID;

const BLOCK_BYTES: usize = 56;
const SUB: usize = 16;
const N_SUB: usize = QK_K / SUB;
const GROUP_MAX_EPS_IQ1_M: f32 = 1e-7;
const IQ1M_DELTA: f32 = 0.125;
/// Level values with a positive / negative shift.
const X_P: [f32; 3] = [-1.0 + IQ1M_DELTA, IQ1M_DELTA, 1.0 + IQ1M_DELTA];
const X_M: [f32; 3] = [-1.0 - IQ1M_DELTA, -IQ1M_DELTA, 1.0 - IQ1M_DELTA];
/// qh bits marking a negative shift for (first group, second group), by shift code.
const SHIFT_MASKS: [u8; 4] = [0x00, 0x80, 0x08, 0x88];

fn iq1_grid() -> &'static IqGrid {
    static GRID: OnceLock<IqGrid> = OnceLock::new();
    GRID.get_or_init(|| IqGrid::build(&IQ1S_GRID, [0xff, 0x00, 0x01], 3))
}

/// The level values of group `k` (0 or 1) of a sub-block with shift code `shift`
/// (bit 1: first group negative, bit 0: second group negative).
fn group_levels(shift: usize, k: usize) -> &'static [f32; 3] {
    let negative = if k == 0 { shift >= 2 } else { shift % 2 == 1 };
    if negative {
        &X_M
    } else {
        &X_P
    }
}

/// Quantizes one row (a multiple of 256 values) into `out`; without an importance matrix the
/// weights are x² (as in ggml).
pub(crate) fn quantize_row_iq1_m(row: &[f32], imatrix: Option<&[f32]>, out: &mut [u8]) {
    let grid = iq1_grid();
    for_each_super_block(row, imatrix, out, BLOCK_BYTES, |x, qw, y| {
        quantize_block(grid, x, qw, y)
    });
}

/// Importance weights of sub-block `ib`: `qw·sqrt(sigma2 + x²)`, or x² without imatrix.
fn sub_block_weights(xb: &[f32], qw: Option<&[f32]>, ib: usize, sigma2: f32) -> [f32; SUB] {
    match qw {
        Some(qw) => {
            let qwb = &qw[SUB * ib..SUB * ib + SUB];
            std::array::from_fn(|i| qwb[i] * (sigma2 + xb[i] * xb[i]).sqrt())
        }
        None => std::array::from_fn(|i| xb[i] * xb[i]),
    }
}

/// One super-block of 256 values → 56 bytes.
fn quantize_block(grid: &IqGrid, xbl: &[f32], qw: Option<&[f32]>, out: &mut [u8]) {
    let mut qs = [0u8; QK_K / 8];
    let mut qh = [0u8; N_SUB];
    let mut sc = [0u16; 4];
    let mut scales = [0f32; N_SUB];
    let mut shifts = [0usize; N_SUB];
    let mut max_scale = 0f32;

    let mut sumx2 = 0f32;
    for &x in xbl {
        sumx2 += x * x;
    }
    let sigma2 = 2.0 * sumx2 / QK_K as f32;

    for ib in 0..N_SUB {
        let xb = &xbl[SUB * ib..SUB * ib + SUB];
        let weight = sub_block_weights(xb, qw, ib, sigma2);
        let max = xb[1..].iter().fold(xb[0].abs(), |m, &v| c_max(m, v.abs()));
        if max < GROUP_MAX_EPS_IQ1_M {
            continue;
        }
        let Some((mut scale, mut levels, mut shift)) = best_split(xb, &weight, max) else {
            continue;
        };
        if scale < 0.0 {
            for l in &mut levels {
                *l = 2 - *l;
            }
            scale = -scale;
            shift = 3 - shift;
        }
        let mut index = [0usize; 2];
        let mut all_on_grid = true;
        for (k, idx) in index.iter_mut().enumerate() {
            let xx = group_levels(shift, k);
            *idx = match grid.lookup(&levels[8 * k..8 * k + 8]) {
                Lookup::OnGrid(i) => i,
                Lookup::Neighbours(list) => {
                    all_on_grid = false;
                    let r = 8 * k..8 * k + 8;
                    best_neighbour(grid, list, &xb[r.clone()], &weight[r], scale, xx)
                }
            };
        }
        if !all_on_grid {
            let mut sumqx = 0f32;
            let mut sumq2 = 0f32;
            for (k, &idx) in index.iter().enumerate() {
                let xx = group_levels(shift, k);
                for (j, &c) in grid.point(idx).iter().enumerate() {
                    let w = weight[8 * k + j];
                    let q = xx[((c - 1) / 2) as usize];
                    sumqx += w * q * xb[8 * k + j];
                    sumq2 += w * q * q;
                }
            }
            if sumqx > 0.0 && sumq2 > 0.0 {
                scale = sumqx / sumq2;
            }
        }
        qs[2 * ib] = index[0] as u8;
        qs[2 * ib + 1] = index[1] as u8;
        qh[ib] = ((index[0] >> 8) | ((index[1] >> 8) << 4)) as u8;
        scales[ib] = scale;
        shifts[ib] = shift;
        max_scale = c_max(max_scale, scale);
    }

    if max_scale != 0.0 {
        // 3-bit sub-block scales, then the super-block scale refit to them.
        let mut d = max_scale / 15.0;
        let id = 1.0 / d;
        let mut sumqx = 0f32;
        let mut sumq2 = 0f32;
        for ib in 0..N_SUB {
            let l = nearest_int(0.5 * (id * scales[ib] - 1.0)).clamp(0, 7);
            sc[ib / 4] |= (l as u16) << (3 * (ib % 4));
            qh[ib] |= SHIFT_MASKS[shifts[ib]];
            let xb = &xbl[SUB * ib..SUB * ib + SUB];
            let weight = sub_block_weights(xb, qw, ib, sigma2);
            let mult = (2 * l + 1) as f32;
            for k in 0..2 {
                let xx = group_levels(shifts[ib], k);
                let gi = qs[2 * ib + k] as usize | ((qh[ib] as usize) << (8 - 4 * k)) & 0x700;
                for (j, &c) in grid.point(gi).iter().enumerate() {
                    let w = weight[8 * k + j];
                    let q = xx[((c - 1) / 2) as usize] * mult;
                    sumqx += w * q * xb[8 * k + j];
                    sumq2 += w * q * q;
                }
            }
        }
        if sumq2 > 0.0 {
            d = sumqx / sumq2;
        }
        let s = half::f16::from_f32(d * 1.1125).to_bits();
        sc[0] |= (s & 0x000f) << 12;
        sc[1] |= (s & 0x00f0) << 8;
        sc[2] |= (s & 0x0f00) << 4;
        sc[3] |= s & 0xf000;
    }

    out[..32].copy_from_slice(&qs);
    out[32..48].copy_from_slice(&qh);
    for (dst, v) in out[48..].chunks_exact_mut(2).zip(sc) {
        dst.copy_from_slice(&v.to_le_bytes());
    }
}

/// The exhaustive search of ggml's IQ1_M: sort the 16 values, and over every pair of split
/// points (i1 ≤ i2: below i1 → level 0, below i2 → 1, else 2) and every shift code, keep the
/// split with the best weighted least-squares fit. Returns (scale, levels, shift code), or `None`
/// when no split has a positive Σ w·q².
fn best_split(xb: &[f32], weight: &[f32; SUB], max: f32) -> Option<(f32, [i8; SUB], usize)> {
    let order = sort_order(xb);
    // Prefix sums of w·x and w in sorted order, kept per half (values 0..8 / 8..16), since the
    // two groups of 8 may use different shifts.
    let mut px = [[0f32; SUB + 1]; 2];
    let mut pw = [[0f32; SUB + 1]; 2];
    for (j, &i) in order.iter().enumerate() {
        let h = usize::from(i >= SUB / 2);
        px[h][j + 1] = px[h][j] + weight[i] * xb[i];
        px[1 - h][j + 1] = px[1 - h][j];
        pw[h][j + 1] = pw[h][j] + weight[i];
        pw[1 - h][j + 1] = pw[1 - h][j];
    }
    let txs = [px[0][SUB], px[1][SUB]];
    let tws = [pw[0][SUB], pw[1][SUB]];
    let (p2, m2) = (X_P[2], X_M[2]);
    let cp1 = X_P[0] * X_P[0] - X_P[1] * X_P[1];
    let cp2 = X_P[1] * X_P[1] - X_P[2] * X_P[2];
    let cm1 = X_M[0] * X_M[0] - X_M[1] * X_M[1];
    let cm2 = X_M[1] * X_M[1] - X_M[2] * X_M[2];

    let mut best_score = f32::MIN;
    let mut scale = max;
    let mut best: Option<(usize, usize, usize)> = None;
    for i1 in 0..=SUB {
        for i2 in i1..=SUB {
            let mut qx_p = [0f32; 2];
            let mut qx_m = [0f32; 2];
            let mut q2_p = [0f32; 2];
            let mut q2_m = [0f32; 2];
            for h in 0..2 {
                let sx = px[h][i1] + px[h][i2];
                qx_p[h] = txs[h] * p2 - sx;
                qx_m[h] = txs[h] * m2 - sx;
                q2_p[h] = tws[h] * p2 * p2 + pw[h][i1] * cp1 + pw[h][i2] * cp2;
                q2_m[h] = tws[h] * m2 * m2 + pw[h][i1] * cm1 + pw[h][i2] * cm2;
            }
            let sumqx = [
                qx_p[0] + qx_p[1],
                qx_p[0] + qx_m[1],
                qx_m[0] + qx_p[1],
                qx_m[0] + qx_m[1],
            ];
            let sumq2 = [
                q2_p[0] + q2_p[1],
                q2_p[0] + q2_m[1],
                q2_m[0] + q2_p[1],
                q2_m[0] + q2_m[1],
            ];
            for k in 0..4 {
                if sumq2[k] > 0.0 && sumqx[k] * sumqx[k] > best_score * sumq2[k] {
                    scale = sumqx[k] / sumq2[k];
                    best_score = scale * sumqx[k];
                    best = Some((i1, i2, k));
                }
            }
        }
    }
    let (i1, i2, shift) = best?;
    let mut levels = [0i8; SUB];
    for (j, &i) in order.iter().enumerate() {
        levels[i] = if j < i1 {
            0
        } else if j < i2 {
            1
        } else {
            2
        };
    }
    Some((scale, levels, shift))
}

/// Indices of `xb` in ascending value order, equal values in index order. ggml sorts
/// (value, index) pairs with glibc's qsort comparing values only; glibc's qsort is a stable
/// merge sort, so equal values keep their index order. A stable insertion sort reproduces that
/// (and, unlike `sort_by`, cannot panic on NaN).
fn sort_order(xb: &[f32]) -> [usize; SUB] {
    let mut order: [usize; SUB] = std::array::from_fn(|i| i);
    for n in 1..SUB {
        let cur = order[n];
        let mut j = n;
        while j > 0 && xb[order[j - 1]] > xb[cur] {
            order[j] = order[j - 1];
            j -= 1;
        }
        order[j] = cur;
    }
    order
}

/// ggml's `iq1_find_best_neighbour2`: the candidate minimising Σ w·(scale·xx[l] − x)², first wins
/// ties. When no candidate has a distance below `f32::MAX` ggml scans the whole grid (reading
/// past its input, a bug); we then take the first candidate.
fn best_neighbour(
    grid: &IqGrid,
    list: &[u16],
    xval: &[f32],
    weight: &[f32],
    scale: f32,
    xx: &[f32; 3],
) -> usize {
    // The 24 possible terms w·diff·diff, the same f32 values ggml computes per candidate.
    let terms: [[f32; 3]; 8] = std::array::from_fn(|i| {
        std::array::from_fn(|l| {
            let diff = scale * xx[l] - xval[i];
            weight[i] * diff * diff
        })
    });
    grid.closest(list, &terms)
}
