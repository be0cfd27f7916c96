//! Row kernels for the "i-quant" weight types: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S,
//! IQ1_M and IQ4_XS against Q8_K activations (256-element super-blocks), and IQ4_NL against Q8_0
//! activations (32-element blocks).
//!
//! # Arithmetic
//! Every kernel works like ggml's `ggml_vec_dot_<type>_q8_K`: inside a block the weight codes (grid
//! values with their signs, or IQ4 table values) are multiplied with the 8-bit activations in
//! exact integer arithmetic, each sub-block sum is weighted by its small integer scale, and only
//! the block's total is converted to f32 and multiplied by `d_w · d_x`. The fractional factors of
//! the formats (the `0.25` of IQ2, the `0.5` of IQ3_XXS, the `±0.125` delta of IQ1) are folded
//! into integers, so a block contributes `d_w · d_x · bsum` and the row total is multiplied by
//! one power-of-two factor at the end:
//!
//! | type | per-element weight | integer code | final factor |
//! |---|---|---|---|
//! | IQ2_XXS, IQ2_XS, IQ2_S | `d·(0.5+s)·0.25·g·(±1)` | `(2s+1)·g·(±1)` | 1/8 |
//! | IQ3_XXS | `d·(0.5+s)·0.5·g·(±1)` | `(2s+1)·g·(±1)` | 1/4 |
//! | IQ3_S | `d·(1+2s)·g·(±1)` | `(2s+1)·g·(±1)` | 1 |
//! | IQ1_S, IQ1_M | `d·(2s+1)·(g ± 0.125)` | `(2s+1)·(8g ± 1)` | 1/8 |
//! | IQ4_XS | `d·(ls−32)·KV[q]` | `(ls−32)·KV[q]` | 1 |
//! | IQ4_NL | `d·KV[q]` | `KV[q]` | 1 |
//!
//! The integer part is therefore exact; the only roundings are the f32 conversion of each block
//! sum, the product with the scales and the accumulation over blocks.
//!
//! # Entry points
//! * `vec_dot_<type>_q8_k_scalar(n, w, x)` (and `vec_dot_iq4_nl_q8_0_scalar`): portable
//!   reference kernels; `n` is the number of elements, `w` the raw GGUF bytes of the row.
//! * On x86-64, [`super::iquants_avx512`] holds the AVX-512 (VBMI + VNNI) versions of the hot
//!   types (IQ2_XXS, IQ3_XXS, IQ3_S, IQ1_M, IQ4_XS) and [`super::iquants_avx2`] AVX2 versions
//!   of all of them.
//! * [`kernel`] answers the dispatch table in [`super::lookup`]: scalar and AVX2 for every type
//!   here, AVX-512 for IQ2_XXS, IQ3_XXS, IQ3_S, IQ1_M, IQ4_XS when the CPU has VBMI + VNNI.
//!
//! SIMD kernels compute the same exact integer block sums (also for −128 activations), reduce
//! them exactly and then run the scalar kernels' f32 operations in the same order: every level
//! returns the scalar result bit for bit.
//!
//! The grids and sign tables are the ones of `redlite_gguf::quant::grids` (generated from
//! gguf-py's tables, MIT); nothing is duplicated here.

use super::q8::{BlockQ8K, BlockQ8_0, QK8_0, QK_K};
use super::{Isa, RowDot};
use redlite_gguf::quant::f16_bits_to_f32;
use redlite_gguf::quant::grids::{
    IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS,
    KVALUES_IQ4NL,
};
use redlite_gguf::quant::GgmlType;

/// Bytes of one IQ2_XXS block (256 elements).
pub const IQ2_XXS_BYTES: usize = 66;
/// Bytes of one IQ2_XS block (256 elements).
pub const IQ2_XS_BYTES: usize = 74;
/// Bytes of one IQ2_S block (256 elements).
pub const IQ2_S_BYTES: usize = 82;
/// Bytes of one IQ3_XXS block (256 elements).
pub const IQ3_XXS_BYTES: usize = 98;
/// Bytes of one IQ3_S block (256 elements).
pub const IQ3_S_BYTES: usize = 110;
/// Bytes of one IQ1_S block (256 elements).
pub const IQ1_S_BYTES: usize = 50;
/// Bytes of one IQ1_M block (256 elements).
pub const IQ1_M_BYTES: usize = 56;
/// Bytes of one IQ4_XS block (256 elements).
pub const IQ4_XS_BYTES: usize = 136;
/// Bytes of one IQ4_NL block (32 elements).
pub const IQ4_NL_BYTES: usize = 18;

/// The number of whole blocks a kernel processes: `n / block_elems`, clamped so that neither
/// slice is read past its end (callers are expected to pass matching sizes; a mismatch is a bug
/// of theirs, caught in debug builds).
#[inline]
pub(crate) fn block_count(
    n: usize,
    block_elems: usize,
    w_len: usize,
    block_bytes: usize,
    x_blocks: usize,
) -> usize {
    let nb = n / block_elems;
    debug_assert!(
        n.is_multiple_of(block_elems) && w_len >= nb * block_bytes && x_blocks >= nb,
        "row kernel: n = {n} (blocks of {block_elems}), {w_len} weight bytes \
         ({block_bytes} per block), {x_blocks} activation blocks"
    );
    nb.min(w_len / block_bytes).min(x_blocks)
}

/// The f16 at `b[at..at + 2]`, as f32.
#[inline]
pub(crate) fn f16_le(b: &[u8], at: usize) -> f32 {
    f16_bits_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

#[inline]
fn u16_le(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

#[inline]
fn u32_le(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Sign byte `s` → 8 bytes of 0xFF (bit `j` of `s` set) or 0x00.
static SIGN_MASKS: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut i = 0;
    while i < 256 {
        let mut j = 0;
        while j < 8 {
            if (i >> j) & 1 != 0 {
                t[i] |= 0xFF << (8 * j);
            }
            j += 1;
        }
        i += 1;
    }
    t
};

/// The grid row `row` (8 unsigned values in 1..=127, one per byte) with the bytes flagged in
/// `signs` negated, as 8 i8 bytes. `(g ^ 0xFF) + 1 = −g` per byte, without carries since no
/// value is 0.
#[inline]
fn signed_row(row: u64, signs: u8) -> u64 {
    let m = SIGN_MASKS[usize::from(signs)];
    (row ^ m) + (m & 0x0101_0101_0101_0101)
}

/// `Σ_e w_e · q_e` over `8·R` elements: `rows` holds the i8 weights, 8 per u64.
#[inline]
fn dot_rows<const R: usize>(rows: [u64; R], q: &[i8]) -> i32 {
    let mut w = [[0i8; 8]; R];
    for (wk, row) in w.iter_mut().zip(rows) {
        *wk = row.to_le_bytes().map(|b| b as i8);
    }
    w.as_flattened()
        .iter()
        .zip(&q[..8 * R])
        .map(|(&a, &b)| i32::from(a) * i32::from(b))
        .sum()
}

/// `Σ_j (8·grid[j] + delta) · q[j]` over one 8-element IQ1 group (grid bytes are −1, 0 or +1 as
/// i8; `delta` is ±1, i.e. ±0.125 scaled by 8).
#[inline]
fn iq1_group_dot(row: u64, delta: i32, q: &[i8]) -> i32 {
    let g = row.to_le_bytes();
    let mut s = 0i32;
    for j in 0..8 {
        s += (8 * i32::from(g[j] as i8) + delta) * i32::from(q[j]);
    }
    s
}

/// IQ2_XXS row · Q8_K row. Block: `d: f16 | 8 × { grid rows: [u8; 4], aux: u32 }`; group `l` of
/// sub-block `ib` uses grid row `idx[l]` with signs `KSIGNS[(aux >> 7l) & 127]`, scale
/// `2·(aux >> 28) + 1`.
pub fn vec_dot_iq2_xxs_q8_k_scalar(n: usize, w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = block_count(n, QK_K, w.len(), IQ2_XXS_BYTES, x.len());
    let mut sumf = 0.0f32;
    for (b, y) in w.chunks_exact(IQ2_XXS_BYTES).zip(x).take(nb) {
        let d = f16_le(b, 0) * y.d;
        let mut bsum = 0i32;
        for ib in 0..8 {
            let at = 2 + 8 * ib;
            let aux = u32_le(b, at + 4);
            let ls = 2 * (aux >> 28) as i32 + 1;
            let rows: [u64; 4] = core::array::from_fn(|l| {
                let signs = KSIGNS_IQ2XS[((aux >> (7 * l)) & 127) as usize];
                signed_row(IQ2XXS_GRID[usize::from(b[at + l])], signs)
            });
            bsum += ls * dot_rows(rows, &y.qs[32 * ib..]);
        }
        sumf += d * bsum as f32;
    }
    0.125 * sumf
}

/// IQ2_XS row · Q8_K row. Block: `d: f16 | qs: [u16; 32] | scales: [u8; 8]`; each u16 is a 9-bit
/// grid row and a 7-bit sign index; scale nibble `g / 2` for group `g`.
pub fn vec_dot_iq2_xs_q8_k_scalar(n: usize, w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = block_count(n, QK_K, w.len(), IQ2_XS_BYTES, x.len());
    let mut sumf = 0.0f32;
    for (b, y) in w.chunks_exact(IQ2_XS_BYTES).zip(x).take(nb) {
        let d = f16_le(b, 0) * y.d;
        let mut bsum = 0i32;
        for ib in 0..8 {
            let sc = b[66 + ib];
            let ls = [2 * i32::from(sc & 15) + 1, 2 * i32::from(sc >> 4) + 1];
            // Groups 4ib, 4ib + 1 (scale ls[0]) and 4ib + 2, 4ib + 3 (ls[1]).
            for (h, ls) in ls.into_iter().enumerate() {
                let rows: [u64; 2] = core::array::from_fn(|l| {
                    let v = u16_le(b, 2 + 2 * (4 * ib + 2 * h + l));
                    signed_row(
                        IQ2XS_GRID[usize::from(v & 511)],
                        KSIGNS_IQ2XS[usize::from(v >> 9)],
                    )
                });
                bsum += ls * dot_rows(rows, &y.qs[32 * ib + 16 * h..]);
            }
        }
        sumf += d * bsum as f32;
    }
    0.125 * sumf
}

/// IQ2_S row · Q8_K row. Block: `d: f16 | qs: [u8; 32] | signs: [u8; 32] | qh: [u8; 8] |
/// scales: [u8; 8]`; group `g` uses the 10-bit row `qs[g] | ((qh[g/4] >> 2(g%4)) & 3) << 8` and
/// the sign byte `signs[g]`.
pub fn vec_dot_iq2_s_q8_k_scalar(n: usize, w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = block_count(n, QK_K, w.len(), IQ2_S_BYTES, x.len());
    let mut sumf = 0.0f32;
    for (b, y) in w.chunks_exact(IQ2_S_BYTES).zip(x).take(nb) {
        let d = f16_le(b, 0) * y.d;
        let mut bsum = 0i32;
        for ib in 0..8 {
            let sc = b[74 + ib];
            let ls = [2 * i32::from(sc & 15) + 1, 2 * i32::from(sc >> 4) + 1];
            // Groups 4ib, 4ib + 1 (scale ls[0]) and 4ib + 2, 4ib + 3 (ls[1]).
            for (h, ls) in ls.into_iter().enumerate() {
                let rows: [u64; 2] = core::array::from_fn(|l| {
                    let g = 4 * ib + 2 * h + l;
                    let high = usize::from((b[66 + g / 4] >> (2 * (g % 4))) & 3);
                    signed_row(IQ2S_GRID[usize::from(b[2 + g]) | (high << 8)], b[34 + g])
                });
                bsum += ls * dot_rows(rows, &y.qs[32 * ib + 16 * h..]);
            }
        }
        sumf += d * bsum as f32;
    }
    0.125 * sumf
}

/// IQ3_XXS row · Q8_K row. Block: `d: f16 | qs: [u8; 64] | aux: [u32; 8]`; group `l` of
/// sub-block `ib` is grid rows `qs[8ib + 2l]`, `qs[8ib + 2l + 1]` (4 values each) with signs
/// `KSIGNS[(aux[ib] >> 7l) & 127]`, scale `2·(aux[ib] >> 28) + 1`.
pub fn vec_dot_iq3_xxs_q8_k_scalar(n: usize, w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = block_count(n, QK_K, w.len(), IQ3_XXS_BYTES, x.len());
    let mut sumf = 0.0f32;
    for (b, y) in w.chunks_exact(IQ3_XXS_BYTES).zip(x).take(nb) {
        let d = f16_le(b, 0) * y.d;
        let mut bsum = 0i32;
        for ib in 0..8 {
            let aux = u32_le(b, 66 + 4 * ib);
            let ls = 2 * (aux >> 28) as i32 + 1;
            let rows: [u64; 4] = core::array::from_fn(|l| {
                let at = 2 + 8 * ib + 2 * l;
                let row = u64::from(IQ3XXS_GRID[usize::from(b[at])])
                    | u64::from(IQ3XXS_GRID[usize::from(b[at + 1])]) << 32;
                signed_row(row, KSIGNS_IQ2XS[((aux >> (7 * l)) & 127) as usize])
            });
            bsum += ls * dot_rows(rows, &y.qs[32 * ib..]);
        }
        sumf += d * bsum as f32;
    }
    0.25 * sumf
}

/// IQ3_S row · Q8_K row. Block: `d: f16 | qs: [u8; 64] | qh: [u8; 8] | signs: [u8; 32] |
/// scales: [u8; 4]`; 4-group `k` uses the 9-bit row `qs[k] | ((qh[k/8] >> (k%8)) & 1) << 8`,
/// element `e` the sign bit `(signs[e/8] >> (e%8)) & 1`, sub-block `ib` the scale nibble `ib`.
pub fn vec_dot_iq3_s_q8_k_scalar(n: usize, w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = block_count(n, QK_K, w.len(), IQ3_S_BYTES, x.len());
    let mut sumf = 0.0f32;
    for (b, y) in w.chunks_exact(IQ3_S_BYTES).zip(x).take(nb) {
        let d = f16_le(b, 0) * y.d;
        let mut bsum = 0i32;
        for ib in 0..8 {
            let s = (b[106 + ib / 2] >> (4 * (ib % 2))) & 15;
            let ls = 2 * i32::from(s) + 1;
            let row_of = |k: usize| {
                let high = usize::from((b[66 + k / 8] >> (k % 8)) & 1);
                u64::from(IQ3S_GRID[usize::from(b[2 + k]) | (high << 8)])
            };
            // Group l of 8 = 4-groups k = 8ib + 2l and k + 1.
            let rows: [u64; 4] = core::array::from_fn(|l| {
                let k = 8 * ib + 2 * l;
                signed_row(row_of(k) | row_of(k + 1) << 32, b[74 + 4 * ib + l])
            });
            bsum += ls * dot_rows(rows, &y.qs[32 * ib..]);
        }
        sumf += d * bsum as f32;
    }
    sumf
}

/// IQ1_S row · Q8_K row. Block: `d: f16 | qs: [u8; 32] | qh: [u16; 8]`; group `l` of sub-block
/// `ib` is the 11-bit row `qs[4ib + l] | ((qh[ib] >> 3l) & 7) << 8`, scale `2·((qh >> 12) & 7) + 1`,
/// delta `qh bit 15 ? −1/8 : +1/8`.
pub fn vec_dot_iq1_s_q8_k_scalar(n: usize, w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = block_count(n, QK_K, w.len(), IQ1_S_BYTES, x.len());
    let mut sumf = 0.0f32;
    for (b, y) in w.chunks_exact(IQ1_S_BYTES).zip(x).take(nb) {
        let d = f16_le(b, 0) * y.d;
        let mut bsum = 0i32;
        for ib in 0..8 {
            let qh = u16_le(b, 34 + 2 * ib);
            let ls = 2 * i32::from((qh >> 12) & 7) + 1;
            let delta = if qh & 0x8000 != 0 { -1 } else { 1 };
            let mut sumi = 0i32;
            for l in 0..4 {
                let high = usize::from((qh >> (3 * l)) & 7);
                let row = IQ1S_GRID[usize::from(b[2 + 4 * ib + l]) | (high << 8)];
                let q = &y.qs[32 * ib + 8 * l..32 * ib + 8 * l + 8];
                sumi += iq1_group_dot(row, delta, q);
            }
            bsum += sumi * ls;
        }
        sumf += d * bsum as f32;
    }
    0.125 * sumf
}

/// The f16 scale of an IQ1_M block, assembled from the top nibbles of its four scale u16s
/// (`u16 #k` bits 12–15 → d bits `4k..4k + 4`).
#[inline]
pub(crate) fn iq1_m_scale(b: &[u8]) -> f32 {
    let sc = |k: usize| u16_le(b, 48 + 2 * k) >> 12;
    f16_bits_to_f32(sc(0) | sc(1) << 4 | sc(2) << 8 | sc(3) << 12)
}

/// IQ1_M row · Q8_K row. Block: `qs: [u8; 32] | qh: [u8; 16] | sc: [u16; 4]` (no separate `d`:
/// it is assembled from the top nibbles of the scale u16s); group `k` uses nibble `k % 2` of
/// `qh[k / 2]` (low 3 bits: high row bits, bit 3: delta sign), the 16-element scale `i = k / 2`
/// is `2·((sc[i/4] >> 3(i%4)) & 7) + 1`.
pub fn vec_dot_iq1_m_q8_k_scalar(n: usize, w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = block_count(n, QK_K, w.len(), IQ1_M_BYTES, x.len());
    let mut sumf = 0.0f32;
    for (b, y) in w.chunks_exact(IQ1_M_BYTES).zip(x).take(nb) {
        let d = iq1_m_scale(b) * y.d;
        let mut bsum = 0i32;
        for i in 0..16 {
            let s = (u16_le(b, 48 + 2 * (i / 4)) >> (3 * (i % 4))) & 7;
            let ls = 2 * i32::from(s) + 1;
            let mut sumi = 0i32;
            for k in [2 * i, 2 * i + 1] {
                let nibble = (b[32 + k / 2] >> (4 * (k % 2))) & 15;
                let row = IQ1S_GRID[usize::from(b[k]) | (usize::from(nibble & 7) << 8)];
                let delta = if nibble & 8 != 0 { -1 } else { 1 };
                sumi += iq1_group_dot(row, delta, &y.qs[8 * k..8 * k + 8]);
            }
            bsum += sumi * ls;
        }
        sumf += d * bsum as f32;
    }
    0.125 * sumf
}

/// `Σ_j KV[q[j] & 15] · a[j] + KV[q[j] >> 4] · a[j + 16]` over 16 bytes of packed nibbles.
#[inline]
fn iq4_nibbles_dot(qs: &[u8], a: &[i8]) -> i32 {
    let mut s = 0i32;
    for j in 0..16 {
        s += i32::from(KVALUES_IQ4NL[usize::from(qs[j] & 15)]) * i32::from(a[j]);
        s += i32::from(KVALUES_IQ4NL[usize::from(qs[j] >> 4)]) * i32::from(a[j + 16]);
    }
    s
}

/// IQ4_XS row · Q8_K row. Block: `d: f16 | scales_h: u16 | scales_l: [u8; 4] | qs: [u8; 128]`;
/// sub-block `ib` has the 6-bit scale `ls` (low nibble from `scales_l`, 2 high bits from
/// `scales_h`) and weight `d·(ls − 32)·KV[nibble]`.
pub fn vec_dot_iq4_xs_q8_k_scalar(n: usize, w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = block_count(n, QK_K, w.len(), IQ4_XS_BYTES, x.len());
    let mut sumf = 0.0f32;
    for (b, y) in w.chunks_exact(IQ4_XS_BYTES).zip(x).take(nb) {
        let d = f16_le(b, 0) * y.d;
        let scales_h = u16_le(b, 2);
        let mut bsum = 0i32;
        for ib in 0..8 {
            let low = i32::from((b[4 + ib / 2] >> (4 * (ib % 2))) & 15);
            let high = i32::from((scales_h >> (2 * ib)) & 3);
            let ls = (low | (high << 4)) - 32;
            let qs = &b[8 + 16 * ib..8 + 16 * ib + 16];
            bsum += ls * iq4_nibbles_dot(qs, &y.qs[32 * ib..32 * ib + 32]);
        }
        sumf += d * bsum as f32;
    }
    sumf
}

/// IQ4_NL row · Q8_0 row (32-element blocks). Block: `d: f16 | qs: [u8; 16]`, weight
/// `d·KV[nibble]` (low nibble → element j, high → j + 16).
pub fn vec_dot_iq4_nl_q8_0_scalar(n: usize, w: &[u8], x: &[BlockQ8_0]) -> f32 {
    let nb = block_count(n, QK8_0, w.len(), IQ4_NL_BYTES, x.len());
    let mut sumf = 0.0f32;
    for (b, y) in w.chunks_exact(IQ4_NL_BYTES).zip(x).take(nb) {
        let d = f16_le(b, 0) * f16_bits_to_f32(y.d);
        sumf += d * iq4_nibbles_dot(&b[2..18], &y.qs) as f32;
    }
    sumf
}

/// Adapts a `(n, w, x)` Q8_K kernel to the dispatch table's `(w, x)` form: the row length is what
/// both slices hold.
macro_rules! q8k_row_dot {
    ($name:ident, $kernel:path, $bytes:expr) => {
        fn $name(w: &[u8], x: &[BlockQ8K]) -> f32 {
            $kernel((w.len() / $bytes).min(x.len()) * QK_K, w, x)
        }
    };
}

q8k_row_dot!(iq2_xxs_scalar, vec_dot_iq2_xxs_q8_k_scalar, IQ2_XXS_BYTES);
q8k_row_dot!(iq2_xs_scalar, vec_dot_iq2_xs_q8_k_scalar, IQ2_XS_BYTES);
q8k_row_dot!(iq2_s_scalar, vec_dot_iq2_s_q8_k_scalar, IQ2_S_BYTES);
q8k_row_dot!(iq3_xxs_scalar, vec_dot_iq3_xxs_q8_k_scalar, IQ3_XXS_BYTES);
q8k_row_dot!(iq3_s_scalar, vec_dot_iq3_s_q8_k_scalar, IQ3_S_BYTES);
q8k_row_dot!(iq1_s_scalar, vec_dot_iq1_s_q8_k_scalar, IQ1_S_BYTES);
q8k_row_dot!(iq1_m_scalar, vec_dot_iq1_m_q8_k_scalar, IQ1_M_BYTES);
q8k_row_dot!(iq4_xs_scalar, vec_dot_iq4_xs_q8_k_scalar, IQ4_XS_BYTES);

fn iq4_nl_scalar(w: &[u8], x: &[BlockQ8_0]) -> f32 {
    vec_dot_iq4_nl_q8_0_scalar((w.len() / IQ4_NL_BYTES).min(x.len()) * QK8_0, w, x)
}

/// This module's entry of the dispatch table (see [`super::lookup`]): the kernel for `ty` at
/// exactly level `isa`, if there is one.
pub fn kernel(ty: GgmlType, isa: Isa) -> Option<RowDot> {
    match isa {
        Isa::Scalar => scalar_kernel(ty),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => super::iquants_avx2::kernel(ty),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => super::iquants_avx512::kernel(ty),
        #[cfg(not(target_arch = "x86_64"))]
        _ => None,
    }
}

fn scalar_kernel(ty: GgmlType) -> Option<RowDot> {
    Some(match ty {
        GgmlType::IQ2XXS => RowDot::Q8K(iq2_xxs_scalar),
        GgmlType::IQ2XS => RowDot::Q8K(iq2_xs_scalar),
        GgmlType::IQ2S => RowDot::Q8K(iq2_s_scalar),
        GgmlType::IQ3XXS => RowDot::Q8K(iq3_xxs_scalar),
        GgmlType::IQ3S => RowDot::Q8K(iq3_s_scalar),
        GgmlType::IQ1S => RowDot::Q8K(iq1_s_scalar),
        GgmlType::IQ1M => RowDot::Q8K(iq1_m_scalar),
        GgmlType::IQ4XS => RowDot::Q8K(iq4_xs_scalar),
        GgmlType::IQ4NL => RowDot::Q8_0(iq4_nl_scalar),
        _ => return None,
    })
}
