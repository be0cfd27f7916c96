//! Quantizer for Q8_0 (placeholder: not written yet).

pub(crate) fn quantize_row_q8_0(_row: &[f32], _imatrix: Option<&[f32]>, _out: &mut [u8]) {
    unimplemented!("Q8_0 quantizer not written yet")
}
