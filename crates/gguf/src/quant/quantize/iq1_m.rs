//! Quantizer for IQ1_M (placeholder: not written yet).

pub(crate) fn quantize_row_iq1_m(_row: &[f32], _imatrix: Option<&[f32]>, _out: &mut [u8]) {
    unimplemented!("IQ1_M quantizer not written yet")
}
