//! Row kernels for the float types (F32, F16, BF16: dot with f32 activations) and the 32-element
//! quants Q8_0 and Q4_0 (dot with Q8_0 activations). Scalar versions here; the x86 SIMD versions
//! are in [`super::simple_x86`].
//!
//! Scalar semantics, which the SIMD kernels reproduce bit for bit:
//! * float rows: each product `w·x` rounded to f32 (no fused multiply-add), added into 16
//!   interleaved f32 partial sums (element `i` into sum `i % 16`), reduced by [`reduce16`];
//! * Q8_0/Q4_0: the integer dot of each 32-block is exact (i32); the block adds
//!   `(d_w · d_x) · isum` to one f32 accumulator, blocks in order.

use super::q8::BlockQ8_0;
use super::{Isa, RowDot};
use redlite_gguf::quant::GgmlType;

/// f16 bits → f32.
#[inline]
pub(crate) fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// The f16 at byte offset `off` of `b` (little-endian), as f32.
#[inline]
pub(crate) fn f16_at(b: &[u8], off: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[off], b[off + 1]]))
}

/// Reduces 16 partial sums by halving: `t[k] = s[k] + s[k + 8]`, then `t[k] + t[k + 4]`,
/// `t[k] + t[k + 2]`, `t[0] + t[1]` — the order of the SIMD horizontal sums (one 16-lane
/// register, or two 8-lane ones).
#[inline]
pub(crate) fn reduce16(s: [f32; 16]) -> f32 {
    let t8: [f32; 8] = std::array::from_fn(|k| s[k] + s[k + 8]);
    let t4: [f32; 4] = std::array::from_fn(|k| t8[k] + t8[k + 4]);
    let t2 = [t4[0] + t4[2], t4[1] + t4[3]];
    t2[0] + t2[1]
}

/// Dot of `n` float values decoded by `get` with `x[..n]`, in the canonical order.
#[inline(always)]
fn float_dot(n: usize, x: &[f32], get: impl Fn(usize) -> f32) -> f32 {
    let mut s = [0.0f32; 16];
    for i in 0..n {
        s[i % 16] += get(i) * x[i];
    }
    reduce16(s)
}

/// F32 row · f32 activations.
pub(crate) fn dot_f32(w: &[u8], x: &[f32]) -> f32 {
    let n = (w.len() / 4).min(x.len());
    float_dot(n, x, |i| {
        f32::from_le_bytes([w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]])
    })
}

/// F16 row · f32 activations.
pub(crate) fn dot_f16(w: &[u8], x: &[f32]) -> f32 {
    let n = (w.len() / 2).min(x.len());
    float_dot(n, x, |i| f16_at(w, 2 * i))
}

/// BF16 row · f32 activations (bf16 → f32 is `bits << 16`).
pub(crate) fn dot_bf16(w: &[u8], x: &[f32]) -> f32 {
    let n = (w.len() / 2).min(x.len());
    float_dot(n, x, |i| {
        f32::from_bits(u32::from(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])) << 16)
    })
}

/// Q8_0 row (34-byte blocks: f16 d, 32 × i8) · Q8_0 activations.
pub(crate) fn dot_q8_0(w: &[u8], x: &[BlockQ8_0]) -> f32 {
    let mut acc = 0.0f32;
    for (b, y) in w.chunks_exact(34).zip(x) {
        let isum: i32 = b[2..34]
            .iter()
            .zip(&y.qs)
            .map(|(&q, &v)| i32::from(q as i8) * i32::from(v))
            .sum();
        acc += (f16_at(b, 0) * y.scale()) * isum as f32;
    }
    acc
}

/// Q4_0 row (18-byte blocks: f16 d, 16 bytes of nibbles; value `nibble − 8`, low nibbles are
/// elements 0..16, high nibbles 16..32) · Q8_0 activations.
pub(crate) fn dot_q4_0(w: &[u8], x: &[BlockQ8_0]) -> f32 {
    let mut acc = 0.0f32;
    for (b, y) in w.chunks_exact(18).zip(x) {
        let mut isum = 0i32;
        for (j, &q) in b[2..18].iter().enumerate() {
            isum += (i32::from(q & 0x0F) - 8) * i32::from(y.qs[j]);
            isum += (i32::from(q >> 4) - 8) * i32::from(y.qs[j + 16]);
        }
        acc += (f16_at(b, 0) * y.scale()) * isum as f32;
    }
    acc
}

/// The scalar kernels of this module.
pub(crate) fn kernel(ty: GgmlType, isa: Isa) -> Option<RowDot> {
    if isa != Isa::Scalar {
        return None;
    }
    Some(match ty {
        GgmlType::F32 => RowDot::F32(dot_f32),
        GgmlType::F16 => RowDot::F32(dot_f16),
        GgmlType::BF16 => RowDot::F32(dot_bf16),
        GgmlType::Q8_0 => RowDot::Q8_0(dot_q8_0),
        GgmlType::Q4_0 => RowDot::Q8_0(dot_q4_0),
        _ => return None,
    })
}
