//! Quantizer for IQ2_XXS (placeholder: not written yet).

pub(crate) fn quantize_row_iq2_xxs(_row: &[f32], _imatrix: Option<&[f32]>, _out: &mut [u8]) {
    unimplemented!("IQ2_XXS quantizer not written yet")
}
