//! The 256-element "i-quant" super-blocks: IQ4_XS, IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S,
//! IQ1_M. Most of them index lattice tables (`grids`): a grid row packs 8 (or 4) small values, one
//! per byte, and a sign pattern flips some of them.
//!
//! Signs are applied by multiplying with ±1.0, like the reference, and the f32 expressions keep the
//! reference's operation order (e.g. `d * (0.5 + s) * 0.25`), for bit-identical results.

use super::grids::{
    IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS,
    KVALUES_IQ4NL,
};
use super::simple::{f16_at, f16_bits_to_f32};

/// Byte `j` of a packed grid row, i.e. grid element `j`.
#[inline]
fn grid_byte(row: u64, j: usize) -> u8 {
    (row >> (8 * j)) as u8
}

/// +1.0, or -1.0 when bit `j` of `mask` is set.
#[inline]
fn sign(mask: u8, j: usize) -> f32 {
    if (mask >> j) & 1 != 0 {
        -1.0
    } else {
        1.0
    }
}

#[inline]
fn u16_at(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([bytes[at], bytes[at + 1]])
}

#[inline]
fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// The 4-bit scale of 16-element group `k` (< 16) in IQ2_XS / IQ2_S: nibble `k % 2` of byte `k / 2`.
#[inline]
fn scale_nibble(scales: &[u8], k: usize) -> u8 {
    (scales[k / 2] >> (4 * (k % 2))) & 0x0F
}

/// IQ4_XS, 256 elements in 136 bytes, 8 sub-blocks of 32:
/// ```text
/// d: f16 | scales_h: u16 | scales_l: [u8; 4] | qs: [u8; 128]
/// ls(ib) = ((scales_l[ib/2] >> 4(ib%2)) & 15) | ((scales_h >> 2ib) & 3) << 4;  dl = d * (ls - 32)
/// sub-block ib uses qs[16ib..16ib+16]: low nibble → element j, high nibble → element j + 16
/// x = dl * KV[nibble]   (KV = the IQ4_NL table)
/// ```
pub fn dequantize_block_iq4_xs(block: &[u8; 136], out: &mut [f32; 256]) {
    let d = f16_at(block, 0);
    let scales_h = u16_at(block, 2);
    let scales_l = &block[4..8];
    let qs = &block[8..136];
    for ib in 0..8 {
        let low = (scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0F;
        let high = ((scales_h >> (2 * ib)) & 3) as u8;
        let dl = d * (i32::from(low | (high << 4)) - 32) as f32;
        for j in 0..16 {
            let q = qs[16 * ib + j];
            out[32 * ib + j] = dl * f32::from(KVALUES_IQ4NL[usize::from(q & 0x0F)]);
            out[32 * ib + 16 + j] = dl * f32::from(KVALUES_IQ4NL[usize::from(q >> 4)]);
        }
    }
}

/// IQ3_XXS, 256 elements in 98 bytes, 8 sub-blocks of 32:
/// ```text
/// d: f16 | qs: [u8; 64] (indices into the 256 × 4 grid) | aux: [u32; 8]
/// sub-block ib, 8-group l (< 4): grid rows qs[8ib + 2l] and qs[8ib + 2l + 1] (4 values each),
///   signs = KSIGNS[(aux[ib] >> 7l) & 127];  db = d * (0.5 + (aux[ib] >> 28)) * 0.5
/// x = db * grid * (±1)
/// ```
pub fn dequantize_block_iq3_xxs(block: &[u8; 98], out: &mut [f32; 256]) {
    let d = f16_at(block, 0);
    let qs = &block[2..66];
    for ib in 0..8 {
        let aux = u32_at(block, 66 + 4 * ib);
        let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
        for l in 0..4 {
            let signs = KSIGNS_IQ2XS[((aux >> (7 * l)) & 127) as usize];
            let rows = [
                IQ3XXS_GRID[usize::from(qs[8 * ib + 2 * l])],
                IQ3XXS_GRID[usize::from(qs[8 * ib + 2 * l + 1])],
            ];
            for j in 0..8 {
                let g = grid_byte(u64::from(rows[j / 4]), j % 4);
                out[32 * ib + 8 * l + j] = db * f32::from(g) * sign(signs, j);
            }
        }
    }
}

/// IQ3_S, 256 elements in 110 bytes, 8 sub-blocks of 32:
/// ```text
/// d: f16 | qs: [u8; 64] | qh: [u8; 8] | signs: [u8; 32] | scales: [u8; 4]
/// 4-group k (< 64): row index = qs[k] | ((qh[k/8] >> (k%8)) & 1) << 8 into the 512 × 4 grid
/// element e: sign bit = (signs[e/8] >> (e%8)) & 1;  db(ib) = d * (1 + 2 * nibble ib of scales)
/// x = db * grid * (±1)
/// ```
pub fn dequantize_block_iq3_s(block: &[u8; 110], out: &mut [f32; 256]) {
    let d = f16_at(block, 0);
    let qs = &block[2..66];
    let qh = &block[66..74];
    let signs = &block[74..106];
    let scales = &block[106..110];
    for ib in 0..8 {
        let s = (scales[ib / 2] >> (4 * (ib % 2))) & 0x0F;
        let db = d * f32::from(1 + 2 * s);
        for k in 8 * ib..8 * ib + 8 {
            let hbit = usize::from((qh[k / 8] >> (k % 8)) & 1);
            let row = u64::from(IQ3S_GRID[usize::from(qs[k]) | (hbit << 8)]);
            for j in 0..4 {
                let e = 4 * k + j;
                out[e] = db * f32::from(grid_byte(row, j)) * sign(signs[e / 8], e % 8);
            }
        }
    }
}

/// IQ2_XXS, 256 elements in 66 bytes, 8 sub-blocks of 32:
/// ```text
/// d: f16 | 8 × { idx: [u8; 4] (rows of the 256 × 8 grid), aux: u32 }
/// 8-group l (< 4) of sub-block ib: row idx[l], signs = KSIGNS[(aux >> 7l) & 127]
/// db = d * (0.5 + (aux >> 28)) * 0.25;  x = db * grid * (±1)
/// ```
pub fn dequantize_block_iq2_xxs(block: &[u8; 66], out: &mut [f32; 256]) {
    let d = f16_at(block, 0);
    for ib in 0..8 {
        let at = 2 + 8 * ib;
        let idx = &block[at..at + 4];
        let aux = u32_at(block, at + 4);
        let db = d * (0.5 + (aux >> 28) as f32) * 0.25;
        for (l, &row_index) in idx.iter().enumerate() {
            let row = IQ2XXS_GRID[usize::from(row_index)];
            let signs = KSIGNS_IQ2XS[((aux >> (7 * l)) & 127) as usize];
            for j in 0..8 {
                out[32 * ib + 8 * l + j] = db * f32::from(grid_byte(row, j)) * sign(signs, j);
            }
        }
    }
}

/// IQ2_XS, 256 elements in 74 bytes, 32 groups of 8:
/// ```text
/// d: f16 | qs: [u16; 32] | scales: [u8; 8]
/// group g: row = qs[g] & 511 (512 × 8 grid), signs = KSIGNS[qs[g] >> 9]
/// scale s = nibble g/2 of scales (low nibble of scales[i] → groups 4i, 4i+1; high → 4i+2, 4i+3)
/// db = d * (0.5 + s) * 0.25;  x = db * grid * (±1)
/// ```
pub fn dequantize_block_iq2_xs(block: &[u8; 74], out: &mut [f32; 256]) {
    let d = f16_at(block, 0);
    let scales = &block[66..74];
    for g in 0..32 {
        let v = u16_at(block, 2 + 2 * g);
        let row = IQ2XS_GRID[usize::from(v & 511)];
        let signs = KSIGNS_IQ2XS[usize::from(v >> 9)];
        let db = d * (0.5 + f32::from(scale_nibble(scales, g / 2))) * 0.25;
        for j in 0..8 {
            out[8 * g + j] = db * f32::from(grid_byte(row, j)) * sign(signs, j);
        }
    }
}

/// IQ2_S, 256 elements in 82 bytes, 32 groups of 8:
/// ```text
/// d: f16 | qs: [u8; 32] | signs: [u8; 32] | qh: [u8; 8] | scales: [u8; 8]
/// group g: row = qs[g] | ((qh[g/4] >> 2(g%4)) & 3) << 8 (1024 × 8 grid), sign bits = signs[g]
/// scale s = nibble g/2 of scales;  db = d * (0.5 + s) * 0.25;  x = db * grid * (±1)
/// ```
pub fn dequantize_block_iq2_s(block: &[u8; 82], out: &mut [f32; 256]) {
    let d = f16_at(block, 0);
    let qs = &block[2..34];
    let signs = &block[34..66];
    let qh = &block[66..74];
    let scales = &block[74..82];
    for g in 0..32 {
        let high = usize::from((qh[g / 4] >> (2 * (g % 4))) & 3);
        let row = IQ2S_GRID[usize::from(qs[g]) | (high << 8)];
        let db = d * (0.5 + f32::from(scale_nibble(scales, g / 2))) * 0.25;
        for j in 0..8 {
            out[8 * g + j] = db * f32::from(grid_byte(row, j)) * sign(signs[g], j);
        }
    }
}

/// The IQ1 delta: +0.125, or -0.125 when the sign flag is set.
#[inline]
fn iq1_delta(negative: bool) -> f32 {
    if negative {
        -0.125
    } else {
        0.125
    }
}

/// IQ1_S, 256 elements in 50 bytes, 8 sub-blocks of 32:
/// ```text
/// d: f16 | qs: [u8; 32] | qh: [u16; 8]
/// 8-group l of sub-block ib: row = qs[4ib + l] | ((qh[ib] >> 3l) & 7) << 8 (2048 × 8 grid of -1/0/+1)
/// dl = d * (2 * ((qh[ib] >> 12) & 7) + 1);  delta = qh[ib] bit 15 ? -0.125 : +0.125
/// x = dl * (grid + delta)
/// ```
pub fn dequantize_block_iq1_s(block: &[u8; 50], out: &mut [f32; 256]) {
    let d = f16_at(block, 0);
    let qs = &block[2..34];
    for ib in 0..8 {
        let qh = u16_at(block, 34 + 2 * ib);
        let dl = d * f32::from(2 * ((qh >> 12) & 7) + 1);
        let delta = iq1_delta(qh & 0x8000 != 0);
        for l in 0..4 {
            let high = usize::from((qh >> (3 * l)) & 7);
            let row = IQ1S_GRID[usize::from(qs[4 * ib + l]) | (high << 8)];
            for j in 0..8 {
                let g = f32::from(grid_byte(row, j) as i8);
                out[32 * ib + 8 * l + j] = dl * (g + delta);
            }
        }
    }
}

/// IQ1_M, 256 elements in 56 bytes, 32 groups of 8, no separate d:
/// ```text
/// qs: [u8; 32] | qh: [u8; 16] | sc: [u16; 4]
/// d (f16 bits) = (sc[0] >> 12) | (sc[1] >> 12) << 4 | (sc[2] >> 12) << 8 | (sc[3] >> 12) << 12
/// 16 three-bit scales, one per 16 elements: s(i) = (sc[i/4] >> 3(i%4)) & 7;  dl = d * (2s + 1)
/// group k: nibble = (qh[k/2] >> 4(k%2)) & 15; row = qs[k] | (nibble & 7) << 8 (IQ1_S grid),
///   delta = nibble bit 3 ? -0.125 : +0.125
/// x = dl(k/2) * (grid + delta)
/// ```
pub fn dequantize_block_iq1_m(block: &[u8; 56], out: &mut [f32; 256]) {
    let qs = &block[0..32];
    let qh = &block[32..48];
    let sc = [
        u16_at(block, 48),
        u16_at(block, 50),
        u16_at(block, 52),
        u16_at(block, 54),
    ];
    let d_bits =
        (sc[0] >> 12) | ((sc[1] >> 12) << 4) | ((sc[2] >> 12) << 8) | ((sc[3] >> 12) << 12);
    let d = f16_bits_to_f32(d_bits);
    for k in 0..32 {
        let i = k / 2; // 16-element scale index
        let s = (sc[i / 4] >> (3 * (i % 4))) & 7;
        let dl = d * f32::from(2 * s + 1);
        let nibble = (qh[k / 2] >> (4 * (k % 2))) & 0x0F;
        let row = IQ1S_GRID[usize::from(qs[k]) | (usize::from(nibble & 7) << 8)];
        let delta = iq1_delta(nibble & 8 != 0);
        for j in 0..8 {
            let g = f32::from(grid_byte(row, j) as i8);
            out[8 * k + j] = dl * (g + delta);
        }
    }
}
