//! The 256-element "k-quant" super-blocks: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K.
//!
//! The f32 expressions keep the reference's operation order (e.g. `(d * sc) * q - (dmin * m)`),
//! which is what makes the results bit-identical to ggml and gguf-py.

use super::simple::f16_at;

/// Q2_K, 256 elements in 84 bytes:
/// ```text
/// scales: [u8; 16] (low nibble = scale, high nibble = min, one pair per 16 elements)
/// qs: [u8; 64] | d: f16 | dmin: f16
/// element e = 128c + 32s + l (c < 2, s < 4, l < 32): q = (qs[32c + l] >> 2s) & 3
/// x[e] = (d * (scales[e/16] & 15)) * q - dmin * (scales[e/16] >> 4)
/// ```
pub fn dequantize_block_q2_k(block: &[u8; 84], out: &mut [f32; 256]) {
    let scales = &block[0..16];
    let qs = &block[16..80];
    let d = f16_at(block, 80);
    let dmin = f16_at(block, 82);
    for c in 0..2 {
        for s in 0..4 {
            for l in 0..32 {
                let e = 128 * c + 32 * s + l;
                let sc = scales[e / 16];
                let dl = d * f32::from(sc & 0x0F);
                let ml = dmin * f32::from(sc >> 4);
                let q = (qs[32 * c + l] >> (2 * s)) & 3;
                out[e] = dl * f32::from(q) - ml;
            }
        }
    }
}

/// Q3_K, 256 elements in 110 bytes:
/// ```text
/// hmask: [u8; 32] | qs: [u8; 64] | scales: [u8; 12] (16 six-bit scales) | d: f16
/// scale i: low 4 bits = i < 8 ? scales[i] & 15 : scales[i - 8] >> 4,
///          high 2 bits = (scales[8 + i % 4] >> 2(i / 4)) & 3;  value minus 32
/// element e = 128c + 32s + l: low = (qs[32c + l] >> 2s) & 3, hbit = (hmask[l] >> (4c + s)) & 1
/// x[e] = (d * scale[e/16]) * (low - (hbit ? 0 : 4))
/// ```
pub fn dequantize_block_q3_k(block: &[u8; 110], out: &mut [f32; 256]) {
    let hmask = &block[0..32];
    let qs = &block[32..96];
    let sc = &block[96..108];
    let d = f16_at(block, 108);

    let mut dl = [0.0f32; 16];
    for (i, dl) in dl.iter_mut().enumerate() {
        let low = if i < 8 { sc[i] & 0x0F } else { sc[i - 8] >> 4 };
        let high = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
        let scale = i32::from(low | (high << 4)) - 32;
        *dl = d * scale as f32;
    }
    for c in 0..2 {
        for s in 0..4 {
            for l in 0..32 {
                let e = 128 * c + 32 * s + l;
                let low = i32::from((qs[32 * c + l] >> (2 * s)) & 3);
                let hbit = (hmask[l] >> (4 * c + s)) & 1;
                let q = if hbit == 0 { low - 4 } else { low };
                out[e] = dl[e / 16] * q as f32;
            }
        }
    }
}

/// The 6-bit (scale, min) pair `j` (< 8) of the 12 packed scale bytes of Q4_K / Q5_K:
/// ```text
/// j < 4:  sc = s[j] & 63,                          m = s[j + 4] & 63
/// j >= 4: sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4,  m = (s[j + 4] >> 4) | (s[j] >> 6) << 4
/// ```
#[inline]
pub(crate) fn scale_min_k4(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Q4_K, 256 elements in 144 bytes, 8 sub-blocks of 32:
/// ```text
/// d: f16 | dmin: f16 | scales: [u8; 12] (8 six-bit (sc, m) pairs) | qs: [u8; 128]
/// qs in 4 chunks of 32 bytes: low nibbles → sub-block 2c, high nibbles → sub-block 2c + 1
/// x = (d * sc) * q - dmin * m
/// ```
pub fn dequantize_block_q4_k(block: &[u8; 144], out: &mut [f32; 256]) {
    let d = f16_at(block, 0);
    let dmin = f16_at(block, 2);
    let scales = &block[4..16];
    let qs = &block[16..144];
    for c in 0..4 {
        for h in 0..2 {
            let sub = 2 * c + h;
            let (sc, m) = scale_min_k4(scales, sub);
            let d1 = d * f32::from(sc);
            let m1 = dmin * f32::from(m);
            for l in 0..32 {
                let q = (qs[32 * c + l] >> (4 * h)) & 0x0F;
                out[32 * sub + l] = d1 * f32::from(q) - m1;
            }
        }
    }
}

/// Q5_K, 256 elements in 176 bytes; Q4_K plus a fifth bit per element:
/// ```text
/// d: f16 | dmin: f16 | scales: [u8; 12] | qh: [u8; 32] | qs: [u8; 128]
/// element l of sub-block b: q = (Q4_K nibble) | ((qh[l] >> b) & 1) << 4
/// x = (d * sc) * q - dmin * m
/// ```
pub fn dequantize_block_q5_k(block: &[u8; 176], out: &mut [f32; 256]) {
    let d = f16_at(block, 0);
    let dmin = f16_at(block, 2);
    let scales = &block[4..16];
    let qh = &block[16..48];
    let qs = &block[48..176];
    for c in 0..4 {
        for h in 0..2 {
            let sub = 2 * c + h;
            let (sc, m) = scale_min_k4(scales, sub);
            let d1 = d * f32::from(sc);
            let m1 = dmin * f32::from(m);
            for l in 0..32 {
                let low = (qs[32 * c + l] >> (4 * h)) & 0x0F;
                let high = (qh[l] >> sub) & 1;
                let q = low | (high << 4);
                out[32 * sub + l] = d1 * f32::from(q) - m1;
            }
        }
    }
}

/// Q6_K, 256 elements in 210 bytes, 16 scales of 16 elements:
/// ```text
/// ql: [u8; 128] | qh: [u8; 64] | scales: [i8; 16] | d: f16   (d comes last)
/// two halves c of 128 elements (ql 64 bytes, qh 32 bytes each); for l < 32, with L = ql[64c..], H = qh[32c..]:
///   e_l      = L[l] & 15      | (H[l] & 3) << 4
///   e_{l+32} = L[l + 32] & 15 | ((H[l] >> 2) & 3) << 4
///   e_{l+64} = L[l] >> 4      | ((H[l] >> 4) & 3) << 4
///   e_{l+96} = L[l + 32] >> 4 | ((H[l] >> 6) & 3) << 4
/// x = (d * scales[e/16]) * (e_val - 32)
/// ```
pub fn dequantize_block_q6_k(block: &[u8; 210], out: &mut [f32; 256]) {
    let ql = &block[0..128];
    let qh = &block[128..192];
    let scales = &block[192..208];
    let d = f16_at(block, 208);

    let mut ds = [0.0f32; 16];
    for (ds, &s) in ds.iter_mut().zip(scales) {
        *ds = d * f32::from(s as i8);
    }
    for c in 0..2 {
        let lo = &ql[64 * c..64 * c + 64];
        let hi = &qh[32 * c..32 * c + 32];
        let base = 128 * c;
        for l in 0..32 {
            let vals = [
                (lo[l] & 0x0F) | ((hi[l] & 3) << 4),
                (lo[l + 32] & 0x0F) | (((hi[l] >> 2) & 3) << 4),
                (lo[l] >> 4) | (((hi[l] >> 4) & 3) << 4),
                (lo[l + 32] >> 4) | (((hi[l] >> 6) & 3) << 4),
            ];
            for (k, v) in vals.into_iter().enumerate() {
                let e = base + 32 * k + l;
                let q = i32::from(v) - 32;
                out[e] = ds[e / 16] * q as f32;
            }
        }
    }
}

/// Q8_K, 256 elements in 292 bytes (an activation-side type):
/// ```text
/// d: f32 | qs: [i8; 256] | bsums: [i16; 16] (sums of 16-element groups, unused here)
/// x[j] = d * qs[j]
/// ```
pub fn dequantize_block_q8_k(block: &[u8; 292], out: &mut [f32; 256]) {
    let d = f32::from_le_bytes([block[0], block[1], block[2], block[3]]);
    for (o, &q) in out.iter_mut().zip(&block[4..260]) {
        *o = d * f32::from(q as i8);
    }
}
