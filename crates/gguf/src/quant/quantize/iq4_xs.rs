//! Quantizer for IQ4_XS (ggml's `quantize_iq4_xs` → `quantize_row_iq4_nl_impl` with
//! super-block 256, block 32, `ntry` = 7), bit-exact with ggml with or without an imatrix.
//!
//! Super-block (136 bytes, 256 values): f16 d, u16 `scales_h` (2 high bits of each 6-bit
//! sub-block scale), 4 B `scales_l` (low nibbles), 128 B of 4-bit indices into the non-linear
//! table `KVALUES_IQ4NL`; value = d · (scale − 32) · table[index].

use super::common::{
    f32_to_f16_bits, for_each_super_block, nearest_int, put_u16, signed_absmax, GROUP_MAX_EPS, QK_K,
};
use crate::quant::grids::KVALUES_IQ4NL;

const BLOCK_BYTES: usize = 136;
const NTRY: i32 = 7;

pub(crate) fn quantize_row_iq4_xs(row: &[f32], imatrix: Option<&[f32]>, out: &mut [u8]) {
    for_each_super_block(row, imatrix, out, BLOCK_BYTES, quantize_block);
}

/// ggml's `best_index_int8` for the 16-entry table: the index of the table value nearest to
/// `x` (ties to the upper one), computed with the same f32 differences as ggml.
#[inline]
fn best_index_iq4nl(x: f32) -> u8 {
    let val = &KVALUES_IQ4NL;
    if x <= f32::from(val[0]) {
        return 0;
    }
    if x >= f32::from(val[15]) {
        return 15;
    }
    let (mut ml, mut mu) = (0usize, 15usize);
    while mu - ml > 1 {
        let mav = (ml + mu) / 2;
        if x < f32::from(val[mav]) {
            mu = mav;
        } else {
            ml = mav;
        }
    }
    if x - f32::from(val[mu - 1]) < f32::from(val[mu]) - x {
        (mu - 1) as u8
    } else {
        mu as u8
    }
}

/// One super-block: x (256), optional importance (256) → y (136 bytes).
fn quantize_block(x: &[f32], qw: Option<&[f32]>, y: &mut [u8]) {
    let values = &KVALUES_IQ4NL;
    let v0 = f32::from(values[0]);

    let mut sigma2 = 0f32;
    for v in x {
        sigma2 += v * v;
    }
    sigma2 *= 2.0 / QK_K as f32;

    // Per sub-block of 32: the best scale over 2·NTRY + 1 trial inverse scales.
    let mut scales = [0f32; 8];
    let mut weight = [0f32; 32];
    let mut max_scale = 0f32;
    let mut amax_scale = 0f32;
    for ib in 0..8 {
        let xb = &x[32 * ib..32 * ib + 32];
        match qw {
            Some(qw) => {
                for ((w, v), q) in weight.iter_mut().zip(xb).zip(&qw[32 * ib..32 * ib + 32]) {
                    *w = q * (sigma2 + v * v).sqrt();
                }
            }
            None => {
                for (w, v) in weight.iter_mut().zip(xb) {
                    *w = v * v;
                }
            }
        }
        let (amax, max) = signed_absmax(xb);
        if amax < GROUP_MAX_EPS {
            scales[ib] = 0.0;
            continue;
        }
        let mut d = -max / v0;
        let id = 1.0 / d;
        let (mut sumqx, mut sumq2) = weighted_fit(xb, &weight, id);
        d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
        let mut best = d * sumqx;
        for itry in -NTRY..=NTRY {
            let id = (itry + i32::from(values[0])) as f32 / max;
            (sumqx, sumq2) = weighted_fit(xb, &weight, id);
            if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
                d = sumqx / sumq2;
                best = d * sumqx;
            }
        }
        scales[ib] = d;
        let abs_d = d.abs();
        if abs_d > amax_scale {
            amax_scale = abs_d;
            max_scale = d;
        }
    }

    // Sub-block scales → 6-bit signed multiples of d = −max_scale/32; indices against them.
    let d = -max_scale / 32.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut scales_h = 0u16;
    let mut scales_l = [0u8; 4];
    let mut levels = [0u8; QK_K];
    for ib in 0..8 {
        let l = nearest_int(id * scales[ib]).clamp(-32, 31);
        let dl = d * l as f32;
        let idl = if dl != 0.0 { 1.0 / dl } else { 0.0 };
        for (lv, &v) in levels[32 * ib..32 * ib + 32]
            .iter_mut()
            .zip(&x[32 * ib..32 * ib + 32])
        {
            *lv = best_index_iq4nl(idl * v);
        }
        let l = (l + 32) as u8;
        scales_l[ib / 2] |= (l & 0xF) << (4 * (ib % 2));
        scales_h |= u16::from(l >> 4) << (2 * (ib % 8));
    }

    put_u16(y, 0, f32_to_f16_bits(d));
    put_u16(y, 2, scales_h);
    y[4..8].copy_from_slice(&scales_l);
    for (i, q) in y[8..136].chunks_exact_mut(16).enumerate() {
        for (j, b) in q.iter_mut().enumerate() {
            *b = levels[32 * i + j] | (levels[32 * i + 16 + j] << 4);
        }
    }
}

/// Σ w·q·x and Σ w·q² over a sub-block when each x is mapped to the table value nearest `id·x`.
#[inline]
fn weighted_fit(xb: &[f32], weight: &[f32; 32], id: f32) -> (f32, f32) {
    let mut sumqx = 0f32;
    let mut sumq2 = 0f32;
    for (&v, &w) in xb.iter().zip(weight) {
        let q = f32::from(KVALUES_IQ4NL[usize::from(best_index_iq4nl(id * v))]);
        sumqx += w * q * v;
        sumq2 += w * q * q;
    }
    (sumqx, sumq2)
}
