//! Quantizers for Q4_K, Q5_K and Q6_K, bit-exact with ggml.
//!
//! Without an imatrix ggml uses the `quantize_row_q?_K_ref` algorithms (per-sub-block
//! `make_qkx2_quants` / `make_qx_quants`, scales quantized against the largest one); with an
//! imatrix the `_impl` ones (weights `imatrix · sqrt(σ² + x²)`, `make_qkx3_quants`, scales fitted
//! by `make_qp_quants`). Every f32 operation below follows ggml's order, with no fused
//! multiply-add, so the bytes match.
//!
//! Super-block of 256 values (`QK_K`):
//! * Q4_K (144 B): f16 d, f16 dmin, 12 B of 6-bit scales/mins (8 sub-blocks of 32), 128 B nibbles.
//! * Q5_K (176 B): as Q4_K, then 32 B of high bits, then 128 B nibbles.
//! * Q6_K (210 B): 128 B low nibbles, 64 B high 2-bit pairs, 16 × i8 scales, f16 d.

use super::common::{
    f32_to_f16_bits, for_each_super_block, make_qp_quants, nearest_int, put_u16, signed_absmax,
    GROUP_MAX_EPS, QK_K,
};
use crate::quant::kquants::scale_min_k4;

const Q4K_BYTES: usize = 144;
const Q5K_BYTES: usize = 176;
const Q6K_BYTES: usize = 210;

pub(crate) fn quantize_row_q4_k(row: &[f32], imatrix: Option<&[f32]>, out: &mut [u8]) {
    for_each_super_block(row, imatrix, out, Q4K_BYTES, quantize_block_qk::<15>);
}

pub(crate) fn quantize_row_q5_k(row: &[f32], imatrix: Option<&[f32]>, out: &mut [u8]) {
    for_each_super_block(row, imatrix, out, Q5K_BYTES, quantize_block_qk::<31>);
}

pub(crate) fn quantize_row_q6_k(row: &[f32], imatrix: Option<&[f32]>, out: &mut [u8]) {
    for_each_super_block(row, imatrix, out, Q6K_BYTES, quantize_block_q6_k);
}

// ---------------------------------------------------------------------------------------------
// Q4_K / Q5_K: 8 sub-blocks of 32 with an unsigned level 0..=NMAX, a scale and a min each.

/// One Q4_K (`NMAX` = 15) or Q5_K (`NMAX` = 31) super-block: x (256) → y (144 or 176 bytes).
fn quantize_block_qk<const NMAX: i32>(x: &[f32], qw: Option<&[f32]>, y: &mut [u8]) {
    let mut levels = [0u8; QK_K];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    // (6-bit scale, 6-bit min) per sub-block, and the f16 super-block d / dmin.
    let (ls, lm, d, dmin) = match qw {
        None => fit_scales_ref::<NMAX>(x, &mut levels, &mut scales, &mut mins),
        Some(qw) => fit_scales_imatrix::<NMAX>(x, qw, &mut levels, &mut scales, &mut mins),
    };

    let mut packed = [0u8; 12];
    pack_scales_mins_k4(&ls, &lm, &mut packed);
    put_u16(y, 0, d);
    put_u16(y, 2, dmin);
    y[4..16].copy_from_slice(&packed);

    // Re-quantize every value against the scale/min it will be decoded with.
    let d = half::f16::from_bits(d).to_f32();
    let dmin = half::f16::from_bits(dmin).to_f32();
    for j in 0..8 {
        let (sc, m) = scale_min_k4(&packed, j);
        let dl = d * f32::from(sc);
        if dl == 0.0 {
            continue;
        }
        let ml = dmin * f32::from(m);
        for ii in 0..32 {
            let l = nearest_int((x[32 * j + ii] + ml) / dl);
            levels[32 * j + ii] = l.clamp(0, NMAX) as u8;
        }
    }

    if NMAX == 15 {
        // Q4_K: 4 chunks of 64 values → 32 bytes, low nibble = first 32, high = next 32.
        for (c, q) in y[16..144].chunks_exact_mut(32).enumerate() {
            for (l, b) in q.iter_mut().enumerate() {
                *b = levels[64 * c + l] | (levels[64 * c + l + 32] << 4);
            }
        }
    } else {
        // Q5_K: bit 4 of each level goes to qh (2 bits per 64-value chunk), the rest as Q4_K.
        let (qh, ql) = y[16..176].split_at_mut(32);
        qh.fill(0);
        for (c, q) in ql.chunks_exact_mut(32).enumerate() {
            let (m1, m2) = (1u8 << (2 * c), 2u8 << (2 * c));
            for (l, b) in q.iter_mut().enumerate() {
                let mut l1 = levels[64 * c + l];
                if l1 > 15 {
                    l1 -= 16;
                    qh[l] |= m1;
                }
                let mut l2 = levels[64 * c + l + 32];
                if l2 > 15 {
                    l2 -= 16;
                    qh[l] |= m2;
                }
                *b = l1 | (l2 << 4);
            }
        }
    }
}

/// `quantize_row_q{4,5}_K_ref`'s scale fit: each sub-block by `make_qkx2_quants` with weights
/// `rms(sub-block) + |x|`, then scales and mins quantized to 6 bits against their maxima.
/// Returns (scale levels, min levels, f16 d, f16 dmin).
fn fit_scales_ref<const NMAX: i32>(
    x: &[f32],
    levels: &mut [u8; QK_K],
    scales: &mut [f32; 8],
    mins: &mut [f32; 8],
) -> ([u8; 8], [u8; 8], u16, u16) {
    let (rmin, rdelta, nstep) = if NMAX == 15 {
        (-1.0, 0.1, 20)
    } else {
        (-0.5, 0.1, 15)
    };
    let mut weights = [0f32; 32];
    let mut laux = [0u8; 32];
    let mut max_scale = 0f32;
    let mut max_min = 0f32;
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0f32;
        for v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        for (w, v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        let lv: &mut [u8; 32] = (&mut levels[32 * j..32 * j + 32]).try_into().unwrap();
        let (scale, min) = make_qkx2_quants(NMAX, xs, &weights, lv, &mut laux, rmin, rdelta, nstep);
        scales[j] = scale;
        mins[j] = min;
        if scale > max_scale {
            max_scale = scale;
        }
        if min > max_min {
            max_min = min;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    for j in 0..8 {
        // C stores nearest_int's int in a uint8_t (wrapping) before clamping to 63.
        ls[j] = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        lm[j] = (nearest_int(inv_min * mins[j]) as u8).min(63);
    }
    let d = f32_to_f16_bits(max_scale / 63.0);
    let dmin = f32_to_f16_bits(max_min / 63.0);
    (ls, lm, d, dmin)
}

/// `quantize_row_q{4,5}_K_impl`'s scale fit with an imatrix: weights `qw · sqrt(σ² + x²)`,
/// `make_qkx3_quants` per sub-block, then the 8 scales and 8 mins each fitted by
/// `make_qp_quants` (weighted by the sub-block weight sums).
fn fit_scales_imatrix<const NMAX: i32>(
    x: &[f32],
    qw: &[f32],
    levels: &mut [u8; QK_K],
    scales: &mut [f32; 8],
    mins: &mut [f32; 8],
) -> ([u8; 8], [u8; 8], u16, u16) {
    let mut sum_x2 = 0f32;
    for v in x {
        sum_x2 += v * v;
    }
    let sigma2 = 2.0 * sum_x2 / QK_K as f32;
    let mut weights = [0f32; 32];
    let mut laux = [0u8; 32];
    let mut sw = [0f32; 8];
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        for ((w, v), q) in weights.iter_mut().zip(xs).zip(&qw[32 * j..32 * j + 32]) {
            *w = q * (sigma2 + v * v).sqrt();
        }
        let mut sumw = 0f32;
        for w in &weights {
            sumw += w;
        }
        sw[j] = sumw;
        let lv: &mut [u8; 32] = (&mut levels[32 * j..32 * j + 32]).try_into().unwrap();
        let (scale, min) = make_qkx3_quants(NMAX, xs, &weights, lv, &mut laux, -0.9, 0.05, 36);
        scales[j] = scale;
        mins[j] = min;
    }
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    let d_block = make_qp_quants(63, scales, &sw, &mut ls);
    let m_block = make_qp_quants(63, mins, &sw, &mut lm);
    if NMAX == 31 {
        // Only ggml's Q5_K path clamps here (a no-op unless make_qp_quants wrapped a level).
        for j in 0..8 {
            ls[j] = ls[j].min(63);
            lm[j] = lm[j].min(63);
        }
    }
    (ls, lm, f32_to_f16_bits(d_block), f32_to_f16_bits(m_block))
}

/// ggml's 12-byte packing of eight 6-bit scales and mins (inverse of `get_scale_min_k4`).
fn pack_scales_mins_k4(ls: &[u8; 8], lm: &[u8; 8], q: &mut [u8; 12]) {
    for j in 0..8 {
        let (s, m) = (ls[j], lm[j]);
        if j < 4 {
            q[j] = s;
            q[j + 4] = m;
        } else {
            q[j + 4] = (s & 0xF) | ((m & 0xF) << 4);
            q[j - 4] |= (s >> 4) << 6;
            q[j] |= (m >> 4) << 6;
        }
    }
}

/// ggml's `make_qkx2_quants` (n = 32, `use_mad` = false): fits `x ≈ scale·L − min` with
/// L in 0..=nmax, minimising the weighted squared error over `nstep + 1` trial scales.
/// Returns (scale, min) with min ≥ 0 meaning an offset of −min.
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32; 32],
    l_out: &mut [u8; 32],
    laux: &mut [u8; 32],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    // A trial level: rounded, then clamped to 0..=nmax.
    let level = |v: f32| nearest_int(v).clamp(0, nmax);
    fit_scale_min(nmax, x, weights, l_out, laux, rmin, rdelta, nstep, level)
}

/// ggml's `make_qkx3_quants` (n = 32, explicit weights, `use_mad` = false): as
/// [`make_qkx2_quants`] but with its own trial grid and level clamping.
#[allow(clippy::too_many_arguments)]
fn make_qkx3_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32; 32],
    l_out: &mut [u8; 32],
    laux: &mut [u8; 32],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    // A trial level: 0 unless positive, else the value clamped to nmax, then rounded.
    let fmax = nmax as f32;
    let level = |v: f32| if v > 0.0 { nearest_int(v.min(fmax)) } else { 0 };
    fit_scale_min(nmax, x, weights, l_out, laux, rmin, rdelta, nstep, level)
}

/// The body `make_qkx2_quants` and `make_qkx3_quants` share: a first fit over `[min(x, 0), max]`,
/// then `nstep + 1` trial inverse scales `(rmin + rdelta·is + nmax) / (max − min)`, each followed
/// by the weighted least-squares (scale, min) for its levels (`level` maps `iscale·(x − min)` to a
/// level); the trial with the smallest weighted squared error wins.
#[allow(clippy::too_many_arguments)]
fn fit_scale_min(
    nmax: i32,
    x: &[f32],
    weights: &[f32; 32],
    l_out: &mut [u8; 32],
    laux: &mut [u8; 32],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    level: impl Fn(f32) -> i32,
) -> (f32, f32) {
    let n = 32;
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    // ggml tests `max == min` (qkx2) or `max <= min` (qkx3): the same here, as max ≥ min ≤ 0
    // whenever neither is NaN.
    if max == min {
        l_out.fill(0);
        return (0.0, -min);
    }
    let fmax = nmax as f32;
    let mut iscale = fmax / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min));
        l_out[i] = l.clamp(0, nmax) as u8;
        let diff = scale * f32::from(l_out[i]) + min - x[i];
        best_error += weights[i] * (diff * diff);
    }
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + fmax) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let l = level(iscale * (x[i] - min));
            laux[i] = l as u8;
            let (w, lf) = (weights[i], l as f32);
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for i in 0..n {
                let diff = this_scale * f32::from(laux[i]) + this_min - x[i];
                cur_error += weights[i] * (diff * diff);
            }
            if cur_error < best_error {
                l_out.copy_from_slice(laux);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

// ---------------------------------------------------------------------------------------------
// Q6_K: 16 sub-blocks of 16 with a signed level −32..=31 and an i8 scale each.

/// One Q6_K super-block: x (256) → y (210 bytes). `quantize_row_q6_K_ref` and `_impl` differ
/// only in the weights `make_qx_quants` gets (x² without an imatrix, the imatrix itself with).
fn quantize_block_q6_k(x: &[f32], qw: Option<&[f32]>, y: &mut [u8]) {
    let mut levels = [0u8; QK_K];
    let mut scales = [0f32; 16];
    let mut max_scale = 0f32;
    let mut max_abs_scale = 0f32;
    for ib in 0..16 {
        let xs: &[f32; 16] = x[16 * ib..16 * ib + 16].try_into().unwrap();
        let lv: &mut [u8; 16] = (&mut levels[16 * ib..16 * ib + 16]).try_into().unwrap();
        let w = qw.map(|q| -> &[f32; 16] { q[16 * ib..16 * ib + 16].try_into().unwrap() });
        let scale = make_qx_quants_16(32, xs, lv, w);
        scales[ib] = scale;
        let abs_scale = scale.abs();
        if abs_scale > max_abs_scale {
            max_abs_scale = abs_scale;
            max_scale = scale;
        }
    }

    if max_abs_scale < GROUP_MAX_EPS {
        y.fill(0);
        return;
    }

    let iscale = -128.0 / max_scale;
    let d_bits = f32_to_f16_bits(1.0 / iscale);
    let d = half::f16::from_bits(d_bits).to_f32();
    let mut sc = [0i8; 16];
    for ib in 0..16 {
        sc[ib] = nearest_int(iscale * scales[ib]).min(127) as i8;
    }
    for j in 0..16 {
        let dl = d * f32::from(sc[j]);
        if dl == 0.0 {
            continue;
        }
        for ii in 0..16 {
            let l = nearest_int(x[16 * j + ii] / dl).clamp(-32, 31);
            levels[16 * j + ii] = (l + 32) as u8;
        }
    }

    let (ql, rest) = y.split_at_mut(128);
    let (qh, rest) = rest.split_at_mut(64);
    for c in 0..2 {
        let lv = &levels[128 * c..128 * c + 128];
        for l in 0..32 {
            let (q1, q2, q3, q4) = (lv[l], lv[l + 32], lv[l + 64], lv[l + 96]);
            ql[64 * c + l] = (q1 & 0xF) | ((q3 & 0xF) << 4);
            ql[64 * c + l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4);
            qh[32 * c + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
        }
    }
    for (b, s) in rest[..16].iter_mut().zip(&sc) {
        *b = *s as u8;
    }
    put_u16(rest, 16, d_bits);
}

/// ggml's `make_qx_quants` for n = 16, `rmse_type` = 1: signed levels −nmax..nmax−1 stored as
/// L + nmax, weights x² (or `qw`), best of 19 trial scales by weighted least squares.
fn make_qx_quants_16(
    nmax: i32,
    x: &[f32; 16],
    l_out: &mut [u8; 16],
    qw: Option<&[f32; 16]>,
) -> f32 {
    let (amax, max) = signed_absmax(x);
    if amax < GROUP_MAX_EPS {
        l_out.fill(0);
        return 0.0;
    }
    let weight = |i: usize| match qw {
        Some(q) => q[i],
        None => x[i] * x[i],
    };
    let fmax = nmax as f32;
    let mut iscale = -fmax / max;
    let mut sumlx = 0f32;
    let mut suml2 = 0f32;
    for i in 0..16 {
        let l = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        l_out[i] = (l + nmax) as u8;
        let (w, lf) = (weight(i), l as f32);
        sumlx += w * x[i] * lf;
        suml2 += w * lf * lf;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(fmax + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for (i, &v) in x.iter().enumerate() {
            let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
            let (w, lf) = (weight(i), l as f32);
            sumlx += w * v * lf;
            suml2 += w * lf * lf;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (lo, &v) in l_out.iter_mut().zip(x) {
                let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
                *lo = (l + nmax) as u8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}
