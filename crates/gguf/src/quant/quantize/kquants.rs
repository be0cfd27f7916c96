//! Quantizers for Q4_K, Q5_K and Q6_K (placeholders: not written yet).

pub(crate) fn quantize_row_q4_k(_row: &[f32], _imatrix: Option<&[f32]>, _out: &mut [u8]) {
    unimplemented!("Q4_K quantizer not written yet")
}

pub(crate) fn quantize_row_q5_k(_row: &[f32], _imatrix: Option<&[f32]>, _out: &mut [u8]) {
    unimplemented!("Q5_K quantizer not written yet")
}

pub(crate) fn quantize_row_q6_k(_row: &[f32], _imatrix: Option<&[f32]>, _out: &mut [u8]) {
    unimplemented!("Q6_K quantizer not written yet")
}
