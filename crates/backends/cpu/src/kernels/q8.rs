//! 8-bit activation blocks and their quantizers.
//!
//! The quantized kernels never multiply a weight block by f32 activations: the activation row is
//! first quantized once per matvec to 8-bit integers, and the inner loops are integer dot products.
//! Two activation formats are used, exactly as in ggml:
//!
//! * [`BlockQ8K`] (ggml's `block_q8_K`, 256 values, f32 scale, per-16 sums) for the k-quants and
//!   most IQ types;
//! * [`BlockQ8_0`] (ggml's `block_q8_0`, 32 values, f16 scale) for Q8_0, Q4_0 and IQ4_NL.
//!
//! Both quantizers are bit-exact with ggml's reference quantizers (`quantize_row_q8_K_ref`,
//! `quantize_row_q8_0_ref`); the tests check this against the fixtures in `shared/reference/quant`.

use half::f16;

/// Elements per [`BlockQ8K`].
pub const QK_K: usize = 256;
/// Elements per [`BlockQ8_0`].
pub const QK8_0: usize = 32;

/// ggml's `block_q8_K`: 256 values `d * qs[i]`, plus the sums of each group of 16 quants
/// (`bsums[g] = Σ qs[16g..16g+16]`), which the k-quant kernels use to apply the weight minimums.
/// 292 bytes, no padding.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ8K {
    /// Scale (f32, unlike the other formats).
    pub d: f32,
    /// Quants in −127..=127 (the reference quantizer never produces −128).
    pub qs: [i8; 256],
    /// Sum of each group of 16 quants.
    pub bsums: [i16; 16],
}

/// ggml's `block_q8_0`: 32 values `d * qs[i]`, `d` stored as f16 bits. 34 bytes, no padding.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ8_0 {
    /// Scale as IEEE half-precision bits.
    pub d: u16,
    /// Quants in −127..=127.
    pub qs: [i8; 32],
}

const _: () = assert!(std::mem::size_of::<BlockQ8K>() == 292);
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);

impl BlockQ8K {
    /// An all-zero block (scale 0).
    pub const ZERO: BlockQ8K = BlockQ8K {
        d: 0.0,
        qs: [0; 256],
        bsums: [0; 16],
    };

    /// Parses the 292-byte little-endian serialization (the layout of the `Q8_K` fixtures).
    pub fn from_bytes(b: &[u8; 292]) -> BlockQ8K {
        let mut out = BlockQ8K::ZERO;
        out.d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        for (q, &byte) in out.qs.iter_mut().zip(&b[4..260]) {
            *q = byte as i8;
        }
        for (g, s) in out.bsums.iter_mut().enumerate() {
            *s = i16::from_le_bytes([b[260 + 2 * g], b[261 + 2 * g]]);
        }
        out
    }

    /// The 292-byte little-endian serialization (identical to ggml's in-memory layout).
    pub fn to_bytes(&self) -> [u8; 292] {
        let mut b = [0u8; 292];
        b[0..4].copy_from_slice(&self.d.to_le_bytes());
        for (byte, &q) in b[4..260].iter_mut().zip(&self.qs) {
            *byte = q as u8;
        }
        for (g, s) in self.bsums.iter().enumerate() {
            b[260 + 2 * g..262 + 2 * g].copy_from_slice(&s.to_le_bytes());
        }
        b
    }
}

impl BlockQ8_0 {
    /// An all-zero block (scale 0).
    pub const ZERO: BlockQ8_0 = BlockQ8_0 { d: 0, qs: [0; 32] };

    /// Parses the 34-byte little-endian serialization.
    pub fn from_bytes(b: &[u8; 34]) -> BlockQ8_0 {
        let mut out = BlockQ8_0::ZERO;
        out.d = u16::from_le_bytes([b[0], b[1]]);
        for (q, &byte) in out.qs.iter_mut().zip(&b[2..34]) {
            *q = byte as i8;
        }
        out
    }

    /// The 34-byte little-endian serialization (identical to ggml's in-memory layout).
    pub fn to_bytes(&self) -> [u8; 34] {
        let mut b = [0u8; 34];
        b[0..2].copy_from_slice(&self.d.to_le_bytes());
        for (byte, &q) in b[2..34].iter_mut().zip(&self.qs) {
            *byte = q as u8;
        }
        b
    }

    /// The scale as f32.
    #[inline]
    pub fn scale(&self) -> f32 {
        f16::from_bits(self.d).to_f32()
    }
}

/// ggml's `nearest_int`: round to nearest, ties to even, via the 1.5·2^23 magic constant.
/// Valid for |v| ≤ 2^22 (always true here: |v| ≤ 127).
#[inline(always)]
fn nearest_int(v: f32) -> i32 {
    let bits = (v + 12_582_912.0f32).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

/// Quantizes `x` (a multiple of 256 values) to Q8_K blocks, bit-exact with ggml's
/// `quantize_row_q8_K_ref`: `iscale = −127 / max` where `max` is the signed value of largest
/// magnitude (the first one on ties), `q = min(127, nearest_int(iscale · x))`, `d = 1 / iscale`.
///
/// Blocks that are all zero get `d = 0`, zero quants and zero sums (ggml leaves the sums
/// unwritten there). Only `min(x.len() / 256, out.len())` blocks are written; callers size the
/// slices (`out.len() == x.len() / 256`).
pub fn quantize_row_q8_k(x: &[f32], out: &mut [BlockQ8K]) {
    #[cfg(target_arch = "x86_64")]
    if super::Isa::active() >= super::Isa::Avx2 {
        // SAFETY: AVX2/FMA/F16C were detected (`Isa::active` never exceeds the CPU's level).
        unsafe { super::q8_x86::quantize_row_q8_k_avx2(x, out) };
        return;
    }
    quantize_row_q8_k_scalar(x, out)
}

/// The portable version of [`quantize_row_q8_k`] (the reference for the SIMD one, which is
/// bit-identical for every input).
pub fn quantize_row_q8_k_scalar(x: &[f32], out: &mut [BlockQ8K]) {
    for (xb, yb) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let mut max = 0.0f32;
        let mut amax = 0.0f32;
        for &v in xb {
            let a = v.abs();
            if a > amax {
                amax = a;
                max = v;
            }
        }
        if amax == 0.0 {
            *yb = BlockQ8K::ZERO;
            continue;
        }
        let iscale = -127.0f32 / max;
        for (q, &v) in yb.qs.iter_mut().zip(xb) {
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        for (g, s) in yb.bsums.iter_mut().enumerate() {
            *s = yb.qs[16 * g..16 * g + 16]
                .iter()
                .map(|&q| i16::from(q))
                .sum();
        }
        yb.d = 1.0 / iscale;
    }
}

/// Quantizes `x` (a multiple of 32 values) to Q8_0 blocks, bit-exact with ggml's
/// `quantize_row_q8_0_ref`: `d = amax / 127`, `q = round(x / d)` (computed as `x · (1/d)`,
/// halves away from zero), `d` stored as f16 (round to nearest even).
///
/// Only `min(x.len() / 32, out.len())` blocks are written.
pub fn quantize_row_q8_0(x: &[f32], out: &mut [BlockQ8_0]) {
    #[cfg(target_arch = "x86_64")]
    {
        let isa = super::Isa::active();
        if isa >= super::Isa::Avx512 {
            // SAFETY: AVX-512 F/BW/VL (and AVX2/FMA/F16C) were detected.
            unsafe { super::q8_x86::quantize_row_q8_0_avx512(x, out) };
            return;
        }
        if isa >= super::Isa::Avx2 {
            // SAFETY: AVX2/FMA/F16C were detected (`Isa::active` never exceeds the CPU's level).
            unsafe { super::q8_x86::quantize_row_q8_0_avx2(x, out) };
            return;
        }
    }
    quantize_row_q8_0_scalar(x, out)
}

/// The portable version of [`quantize_row_q8_0`] (the reference for the SIMD one, which is
/// bit-identical for every input).
pub fn quantize_row_q8_0_scalar(x: &[f32], out: &mut [BlockQ8_0]) {
    for (xb, yb) in x.chunks_exact(QK8_0).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0.0f32, |m, &v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        yb.d = f16::from_f32(d).to_bits();
        for (q, &v) in yb.qs.iter_mut().zip(xb) {
            // `as` saturates; the value is within −127..=127 for finite input.
            *q = (v * id).round() as i8;
        }
    }
}

/// Dequantizes Q8_K blocks (`d · q`, the same f32 product as ggml's `dequantize_row_q8_K`).
pub fn dequantize_q8_k(blocks: &[BlockQ8K], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        for (v, &q) in o.iter_mut().zip(&b.qs) {
            *v = b.d * f32::from(q);
        }
    }
}

/// Dequantizes Q8_0 blocks (`d · q` in f32, as ggml's `dequantize_row_q8_0`).
pub fn dequantize_q8_0(blocks: &[BlockQ8_0], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK8_0)) {
        let d = b.scale();
        for (v, &q) in o.iter_mut().zip(&b.qs) {
            *v = f32::from(q) * d;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_ties_to_even() {
        assert_eq!(nearest_int(0.5), 0);
        assert_eq!(nearest_int(1.5), 2);
        assert_eq!(nearest_int(2.5), 2);
        assert_eq!(nearest_int(-0.5), 0);
        assert_eq!(nearest_int(-1.5), -2);
        assert_eq!(nearest_int(-126.6), -127);
        assert_eq!(nearest_int(127.0), 127);
    }

    #[test]
    fn q8k_zero_block_and_sums() {
        let mut out = [BlockQ8K::ZERO; 2];
        let mut x = vec![0.0f32; 512];
        x[256] = -2.0;
        x[300] = 1.0;
        quantize_row_q8_k(&x, &mut out);
        assert_eq!(out[0], BlockQ8K::ZERO);
        // iscale = -127 / -2 = 63.5: the extreme maps to -127, 1.0 to 63.5 -> ties to even -> 64.
        assert_eq!(out[1].qs[0], -127);
        assert_eq!(out[1].qs[44], 64);
        assert_eq!(out[1].d, 1.0 / 63.5);
        assert_eq!(out[1].bsums[0], -127);
        assert_eq!(out[1].bsums[2], 64);
        let bytes = out[1].to_bytes();
        assert_eq!(BlockQ8K::from_bytes(&bytes), out[1]);
    }

    #[test]
    fn q8_0_rounds_half_away() {
        let mut x = [0.0f32; 32];
        x[0] = 127.0;
        x[1] = 0.5;
        x[2] = -0.5;
        let mut out = [BlockQ8_0::ZERO];
        quantize_row_q8_0(&x, &mut out);
        assert_eq!(out[0].scale(), 1.0);
        assert_eq!(&out[0].qs[..3], &[127, 1, -1]);
        assert_eq!(BlockQ8_0::from_bytes(&out[0].to_bytes()), out[0]);
    }
}
