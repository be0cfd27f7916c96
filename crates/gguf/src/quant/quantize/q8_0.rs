//! Quantizer for Q8_0 (ggml's `quantize_row_q8_0_ref`; ggml ignores the imatrix for this type).
//!
//! Block (34 bytes, 32 values): f16 scale `d = amax / 127`, then 32 × i8 `round(x / d)`.

use super::common::{c_f32_to_i32, f32_to_f16_bits, put_u16};

const QK: usize = 32;
const BLOCK_BYTES: usize = 34;

pub(crate) fn quantize_row_q8_0(row: &[f32], _imatrix: Option<&[f32]>, out: &mut [u8]) {
    for (x, y) in row.chunks_exact(QK).zip(out.chunks_exact_mut(BLOCK_BYTES)) {
        quantize_block(x, y);
    }
}

/// One block: x (32) → y (34 bytes).
fn quantize_block(x: &[f32], y: &mut [u8]) {
    let amax = x
        .iter()
        .fold(0.0f32, |m, v| if m > v.abs() { m } else { v.abs() });
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_u16(y, 0, f32_to_f16_bits(d));
    for (q, v) in y[2..].iter_mut().zip(x) {
        // C's `(int8_t)roundf(v·id)`: |v·id| ≤ 127 except when d is subnormal and id overflows
        // (then x86 gives the low byte of i32::MIN, i.e. 0, or wraps 128 to −128).
        *q = c_f32_to_i32((v * id).round()) as u8;
    }
}
