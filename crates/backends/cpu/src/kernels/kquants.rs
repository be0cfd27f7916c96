//! Scalar row kernels for the k-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) · Q8_K activations.
//! The x86 SIMD versions are in [`super::kquants_x86`].
//!
//! Every kernel works the same way: per 256-element block, the integer part is computed exactly
//! in i32 — `isum = Σ_groups scale_g · Σ_{i∈g} q_i · y_i`, and for the types with minimums
//! `isumm = Σ_groups min_g · Σ_{i∈g} y_i` (from the activation block's `bsums`) — and the block
//! adds `(d_y · d) · isum − (d_y · dmin) · isumm` (each product rounded to f32, no fused
//! multiply-add) to one f32 accumulator, blocks in order. The dequantized value of element `i`
//! is `d·scale_g·q_i − dmin·min_g`, so this is the exact dot product of the dequantized weights with
//! the dequantized activations up to the f32 roundings of the per-block terms.

use super::q8::BlockQ8K;
use super::simple::f16_at;
use super::{Isa, RowDot};
use redlite_gguf::quant::GgmlType;

/// Block sizes in bytes.
pub(crate) const Q2K_BYTES: usize = 84;
pub(crate) const Q3K_BYTES: usize = 110;
pub(crate) const Q4K_BYTES: usize = 144;
pub(crate) const Q5K_BYTES: usize = 176;
pub(crate) const Q6K_BYTES: usize = 210;

/// Unpacks the 12 scale bytes of Q4_K/Q5_K into eight 6-bit scales and eight 6-bit minimums,
/// returned as two little-endian u64 (byte `j` = sub-block `j`):
/// ```text
/// j < 4:  sc = s[j] & 63,                          m = s[j + 4] & 63
/// j >= 4: sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4,  m = (s[j + 4] >> 4) | (s[j] >> 6) << 4
/// ```
/// computed four lanes at a time on u32 words.
#[inline(always)]
pub(crate) fn unpack_scales_k4(s: &[u8]) -> (u64, u64) {
    let w0 = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    let w1 = u32::from_le_bytes([s[4], s[5], s[6], s[7]]);
    let w2 = u32::from_le_bytes([s[8], s[9], s[10], s[11]]);
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let sc_lo = w0 & LOW6;
    let sc_hi = (w2 & LOW4) | (((w0 >> 6) & LOW2) << 4);
    let m_lo = w1 & LOW6;
    let m_hi = ((w2 >> 4) & LOW4) | (((w1 >> 6) & LOW2) << 4);
    (
        u64::from(sc_lo) | (u64::from(sc_hi) << 32),
        u64::from(m_lo) | (u64::from(m_hi) << 32),
    )
}

/// Σ_{j<n} a[j]·b[j] in i32, `a` unsigned bytes mapped through `f`.
#[inline(always)]
fn idot(a: &[u8], b: &[i8], f: impl Fn(u8) -> i32) -> i32 {
    a.iter().zip(b).map(|(&q, &y)| f(q) * i32::from(y)).sum()
}

/// Q2_K (84 bytes: scales[16] (scale | min << 4 per 16 elements), qs[64], d, dmin).
/// Element `128c + 32s + l`: `q = (qs[32c + l] >> 2s) & 3`.
pub(crate) fn dot_q2_k(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (b, y) in w.chunks_exact(Q2K_BYTES).zip(x) {
        let scales = &b[0..16];
        let qs = &b[16..80];
        let mut isum = 0i32;
        for c in 0..2 {
            for s in 0..4 {
                for h in 0..2 {
                    let g = 8 * c + 2 * s + h; // group of 16 elements
                    let q = &qs[32 * c + 16 * h..32 * c + 16 * h + 16];
                    let yq = &y.qs[16 * g..16 * g + 16];
                    let dot = idot(q, yq, |v| i32::from((v >> (2 * s)) & 3));
                    isum += i32::from(scales[g] & 0x0F) * dot;
                }
            }
        }
        let isumm: i32 = scales
            .iter()
            .zip(&y.bsums)
            .map(|(&sc, &bs)| i32::from(sc >> 4) * i32::from(bs))
            .sum();
        let dd = y.d * f16_at(b, 80);
        let dm = y.d * f16_at(b, 82);
        acc += dd * isum as f32 - dm * isumm as f32;
    }
    acc
}

/// The 16 six-bit scales of Q3_K (minus 32).
#[inline(always)]
fn q3k_scales(sc: &[u8]) -> [i32; 16] {
    let mut out = [0i32; 16];
    for (i, o) in out.iter_mut().enumerate() {
        let low = if i < 8 { sc[i] & 0x0F } else { sc[i - 8] >> 4 };
        let high = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
        *o = i32::from(low | (high << 4)) - 32;
    }
    out
}

/// Q3_K (110 bytes: hmask[32], qs[64], scales[12], d). Element `128c + 32s + l`:
/// `q = ((qs[32c + l] >> 2s) & 3) − (hmask[l] bit (4c + s) ? 0 : 4)`.
pub(crate) fn dot_q3_k(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (b, y) in w.chunks_exact(Q3K_BYTES).zip(x) {
        let hmask = &b[0..32];
        let qs = &b[32..96];
        let scales = q3k_scales(&b[96..108]);
        let mut isum = 0i32;
        for c in 0..2 {
            for s in 0..4 {
                let bit = 4 * c + s;
                for h in 0..2 {
                    let g = 8 * c + 2 * s + h;
                    let mut dot = 0i32;
                    for l in 16 * h..16 * h + 16 {
                        let low = i32::from((qs[32 * c + l] >> (2 * s)) & 3);
                        // low − 4 when the high bit is clear (branch-free).
                        let q = low - 4 + 4 * i32::from((hmask[l] >> bit) & 1);
                        dot += q * i32::from(y.qs[128 * c + 32 * s + l]);
                    }
                    isum += scales[g] * dot;
                }
            }
        }
        acc += (y.d * f16_at(b, 108)) * isum as f32;
    }
    acc
}

/// Q4_K (144 bytes: d, dmin, scales[12], qs[128]). Chunk `c` of 32 bytes: low nibbles are
/// sub-block `2c`, high nibbles sub-block `2c + 1`.
pub(crate) fn dot_q4_k(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (b, y) in w.chunks_exact(Q4K_BYTES).zip(x) {
        let (sc, m) = unpack_scales_k4(&b[4..16]);
        let (sc, m) = (sc.to_le_bytes(), m.to_le_bytes());
        let qs = &b[16..144];
        let mut isum = 0i32;
        for c in 0..4 {
            let q = &qs[32 * c..32 * c + 32];
            let lo = idot(q, &y.qs[64 * c..64 * c + 32], |v| i32::from(v & 0x0F));
            let hi = idot(q, &y.qs[64 * c + 32..64 * c + 64], |v| i32::from(v >> 4));
            isum += i32::from(sc[2 * c]) * lo + i32::from(sc[2 * c + 1]) * hi;
        }
        let isumm = min_sum(&m, &y.bsums);
        let dd = y.d * f16_at(b, 0);
        let dm = y.d * f16_at(b, 2);
        acc += dd * isum as f32 - dm * isumm as f32;
    }
    acc
}

/// Σ_j m[j] · (bsums[2j] + bsums[2j + 1]) for the eight 32-element sub-blocks.
#[inline(always)]
fn min_sum(m: &[u8; 8], bsums: &[i16; 16]) -> i32 {
    (0..8)
        .map(|j| i32::from(m[j]) * (i32::from(bsums[2 * j]) + i32::from(bsums[2 * j + 1])))
        .sum()
}

/// Q5_K (176 bytes: d, dmin, scales[12], qh[32], qs[128]): Q4_K plus a fifth bit,
/// `(qh[l] >> sub_block) & 1`, for element `l` of each sub-block.
pub(crate) fn dot_q5_k(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (b, y) in w.chunks_exact(Q5K_BYTES).zip(x) {
        let (sc, m) = unpack_scales_k4(&b[4..16]);
        let (sc, m) = (sc.to_le_bytes(), m.to_le_bytes());
        let qh = &b[16..48];
        let qs = &b[48..176];
        let mut isum = 0i32;
        for c in 0..4 {
            let (mut lo, mut hi) = (0i32, 0i32);
            for l in 0..32 {
                let q = qs[32 * c + l];
                let h = qh[l] >> (2 * c);
                let q_lo = i32::from((q & 0x0F) | ((h & 1) << 4));
                let q_hi = i32::from((q >> 4) | (((h >> 1) & 1) << 4));
                lo += q_lo * i32::from(y.qs[64 * c + l]);
                hi += q_hi * i32::from(y.qs[64 * c + 32 + l]);
            }
            isum += i32::from(sc[2 * c]) * lo + i32::from(sc[2 * c + 1]) * hi;
        }
        let isumm = min_sum(&m, &y.bsums);
        let dd = y.d * f16_at(b, 0);
        let dm = y.d * f16_at(b, 2);
        acc += dd * isum as f32 - dm * isumm as f32;
    }
    acc
}

/// Q6_K (210 bytes: ql[128], qh[64], scales[16] i8, d). Two halves of 128 elements; in half `c`,
/// for `l < 32` with `L = ql[64c..]`, `H = qh[32c..]`:
/// `e_l = L[l] & 15 | (H[l] & 3) << 4`, `e_{l+32} = L[l+32] & 15 | (H[l] >> 2 & 3) << 4`,
/// `e_{l+64} = L[l] >> 4 | (H[l] >> 4 & 3) << 4`, `e_{l+96} = L[l+32] >> 4 | (H[l] >> 6) << 4`;
/// value `e − 32`, one scale per 16 elements.
pub(crate) fn dot_q6_k(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (b, y) in w.chunks_exact(Q6K_BYTES).zip(x) {
        let ql = &b[0..128];
        let qh = &b[128..192];
        let scales = &b[192..208];
        let mut isum = 0i32;
        for c in 0..2 {
            let lq = &ql[64 * c..64 * c + 64];
            let hq = &qh[32 * c..32 * c + 32];
            let yq = &y.qs[128 * c..128 * c + 128];
            // Row k of the half: low nibbles of L[0..32] (k = 0), of L[32..64] (k = 1), high
            // nibbles of L[0..32] (k = 2), of L[32..64] (k = 3); high bits 2k, 2k + 1 of H.
            for k in 0..4 {
                let lsrc = &lq[32 * (k % 2)..32 * (k % 2) + 32];
                let (lshift, hshift) = (4 * (k / 2), 2 * k);
                for h in 0..2 {
                    let mut dot = 0i32;
                    for l in 16 * h..16 * h + 16 {
                        let e = ((lsrc[l] >> lshift) & 0x0F) | (((hq[l] >> hshift) & 3) << 4);
                        dot += (i32::from(e) - 32) * i32::from(yq[32 * k + l]);
                    }
                    isum += i32::from(scales[8 * c + 2 * k + h] as i8) * dot;
                }
            }
        }
        acc += (y.d * f16_at(b, 208)) * isum as f32;
    }
    acc
}

/// The scalar kernels of this module.
pub(crate) fn kernel(ty: GgmlType, isa: Isa) -> Option<RowDot> {
    if isa != Isa::Scalar {
        return None;
    }
    let f: fn(&[u8], &[BlockQ8K]) -> f32 = match ty {
        GgmlType::Q2K => dot_q2_k,
        GgmlType::Q3K => dot_q3_k,
        GgmlType::Q4K => dot_q4_k,
        GgmlType::Q5K => dot_q5_k,
        GgmlType::Q6K => dot_q6_k,
        _ => return None,
    };
    Some(RowDot::Q8K(f))
}
