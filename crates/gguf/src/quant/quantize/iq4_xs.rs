//! Quantizer for IQ4_XS (placeholder: not written yet).

pub(crate) fn quantize_row_iq4_xs(_row: &[f32], _imatrix: Option<&[f32]>, _out: &mut [u8]) {
    unimplemented!("IQ4_XS quantizer not written yet")
}
