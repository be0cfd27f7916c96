//! f32 → GGUF tensor bytes for the output types the converter writes.

use redlite_gguf::GgmlType;

/// Q8_0: blocks of 32 values, an f16 scale d = max|x| / 127 and 32 signed bytes round(x / d)
/// (round half away from zero), as gguf-py's reference quantizer computes it.
pub fn quantize_q8_0(x: &[f32], out: &mut Vec<u8>) {
    debug_assert_eq!(x.len() % 32, 0);
    for block in x.chunks_exact(32) {
        let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        out.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
        for &v in block {
            let q = if d == 0.0 { 0.0 } else { (v / d).round() };
            out.push(q as i8 as u8);
        }
    }
}

/// Encodes `x` (a whole tensor, ne0-contiguous rows) as `ty`. Only F32, F16, BF16 and Q8_0 are
/// produced by the converter; the caller guarantees ne0 % 32 == 0 for Q8_0.
pub fn encode(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    match ty {
        GgmlType::F16 => x
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        GgmlType::BF16 => x
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
        GgmlType::Q8_0 => {
            let mut out = Vec::with_capacity(x.len() / 32 * 34);
            quantize_q8_0(x, &mut out);
            out
        }
        _ => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_block_layout() {
        let x: Vec<f32> = (0..32).map(|i| (i as f32 - 16.0) * 0.5).collect();
        let b = encode(GgmlType::Q8_0, &x);
        assert_eq!(b.len(), 34);
        let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
        assert!((d - 8.0 / 127.0).abs() < 1e-4);
        assert_eq!(b[2] as i8, -127);
        assert_eq!(b[2 + 16] as i8, 0);
        let zeros = encode(GgmlType::Q8_0, &[0.0; 32]);
        assert!(zeros.iter().all(|&v| v == 0));
    }
}
