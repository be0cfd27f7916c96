//! Row kernels for the float types (F32, F16, BF16: dot with f32 activations) and the 32-element
//! quants Q8_0 and Q4_0 (dot with Q8_0 activations). Scalar versions here; the x86 SIMD versions
//! are in [`super::simple_x86`].
//!
//! Scalar semantics (the reference for the SIMD kernels, which only differ in f32 rounding):
//! * float rows: each product `w·x` in f32, summed into 8 interleaved f32 partial sums
//!   (element `i` into sum `i % 8`), reduced pairwise at the end;
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

/// Sums 8 partial sums pairwise: ((s0+s4)+(s2+s6)) + ((s1+s5)+(s3+s7)).
#[inline]
fn reduce8(s: [f32; 8]) -> f32 {
    let a = [s[0] + s[4], s[1] + s[5], s[2] + s[6], s[3] + s[7]];
    (a[0] + a[2]) + (a[1] + a[3])
}

/// Dot of `n = min(w.len() / 4, x.len())` float values decoded by `get` with `x`.
#[inline(always)]
fn float_dot(n: usize, x: &[f32], get: impl Fn(usize) -> f32) -> f32 {
    let mut s = [0.0f32; 8];
    let full = n / 8 * 8;
    for i in (0..full).step_by(8) {
        for (k, sk) in s.iter_mut().enumerate() {
            *sk += get(i + k) * x[i + k];
        }
    }
    for i in full..n {
        s[i % 8] += get(i) * x[i];
    }
    reduce8(s)
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
