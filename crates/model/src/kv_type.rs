//! Element types of the KV cache: `f32` (the default), `f16` (IEEE half, round to nearest even)
//! and `q8_0` (ggml's Q8_0 block: 32 values share one f16 scale `d`, each stored as an `i8`
//! `q` with value `d·q`; `d = max|x| / 127`, `q = round(x / d)`, 34 bytes per block).
//!
//! Keys and values are written once when a token passes an attention layer and read back by every
//! later token, so a narrower type halves (f16) or nearly quarters (q8_0) the cache's memory and
//! the bytes attention streams per token, at a small cost in accuracy (`docs/quality.md`).

use std::fmt;
use std::str::FromStr;

use crate::ModelError;

/// Values per Q8_0 block.
pub const Q8_0_BLOCK: usize = 32;
/// Bytes per Q8_0 block: an f16 scale and 32 `i8`.
pub const Q8_0_BLOCK_BYTES: usize = 2 + Q8_0_BLOCK;

/// One Q8_0 block: `value[i] = f16(d) · qs[i]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BlockQ8_0 {
    /// The scale as IEEE half bits.
    pub d: u16,
    pub qs: [i8; Q8_0_BLOCK],
}

/// The element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum KvType {
    /// 4 bytes per value, exact.
    #[default]
    F32,
    /// 2 bytes per value, IEEE half rounded to nearest even.
    F16,
    /// 34 bytes per 32 values (ggml Q8_0 blocks).
    Q8_0,
}

impl KvType {
    /// Every type, in the order of the `--kv-type` help.
    pub const ALL: [KvType; 3] = [KvType::F32, KvType::F16, KvType::Q8_0];

    /// The name used on the command line and in state files.
    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
            KvType::Q8_0 => "q8_0",
        }
    }

    /// A stable one-byte code for file formats.
    pub fn code(self) -> u8 {
        match self {
            KvType::F32 => 0,
            KvType::F16 => 1,
            KvType::Q8_0 => 2,
        }
    }

    /// The type of a [`KvType::code`].
    pub fn from_code(code: u8) -> Option<KvType> {
        KvType::ALL.into_iter().find(|t| t.code() == code)
    }

    /// Bytes that `n_values` values take in this type (`n_values` a multiple of 32 for q8_0;
    /// see [`KvType::check_head_dim`]).
    pub fn bytes_for(self, n_values: u64) -> u64 {
        match self {
            KvType::F32 => n_values * 4,
            KvType::F16 => n_values * 2,
            KvType::Q8_0 => n_values.div_ceil(Q8_0_BLOCK as u64) * Q8_0_BLOCK_BYTES as u64,
        }
    }

    /// Whether rows of one KV head (`head_dim` values) can be stored in this type: Q8_0 blocks
    /// must not straddle two heads, so q8_0 needs `head_dim` to be a multiple of 32.
    pub fn check_head_dim(self, head_dim: usize) -> Result<(), ModelError> {
        if self == KvType::Q8_0 && (head_dim == 0 || !head_dim.is_multiple_of(Q8_0_BLOCK)) {
            return Err(ModelError::BadConfig(format!(
                "--kv-type q8_0 needs a head dimension that is a multiple of {Q8_0_BLOCK}, \
                 this model's is {head_dim}; use f16 or f32"
            )));
        }
        Ok(())
    }
}

impl fmt::Display for KvType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A name that is not a [`KvType`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown KV cache type '{0}' (available: f32, f16, q8_0)")]
pub struct UnknownKvType(pub String);

impl FromStr for KvType {
    type Err = UnknownKvType;

    fn from_str(s: &str) -> Result<KvType, UnknownKvType> {
        KvType::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| UnknownKvType(s.to_string()))
    }
}

/// f32 → IEEE half bits, round to nearest even (overflow to infinity).
pub fn f32_to_f16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

/// IEEE half bits → f32 (exact).
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// Quantize `x` (length a multiple of 32) into Q8_0 blocks, one per 32 values.
pub fn quantize_q8_0(x: &[f32], out: &mut Vec<BlockQ8_0>) {
    debug_assert!(x.len().is_multiple_of(Q8_0_BLOCK));
    for chunk in x.chunks_exact(Q8_0_BLOCK) {
        let amax = chunk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut qs = [0i8; Q8_0_BLOCK];
        for (q, v) in qs.iter_mut().zip(chunk) {
            // |v·inv| ≤ 127 (+ rounding), so the cast never saturates in practice.
            *q = (v * inv).round() as i8;
        }
        out.push(BlockQ8_0 {
            d: f32_to_f16(d),
            qs,
        });
    }
}

/// Dequantize Q8_0 blocks into `out` (32 values per block).
pub fn dequantize_q8_0(blocks: &[BlockQ8_0], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(Q8_0_BLOCK)) {
        let d = f16_to_f32(b.d);
        for (y, &q) in o.iter_mut().zip(&b.qs) {
            *y = d * q as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for t in KvType::ALL {
            assert_eq!(t.name().parse::<KvType>().unwrap(), t);
            assert_eq!(KvType::from_code(t.code()), Some(t));
        }
        assert!("q4_0".parse::<KvType>().is_err());
    }

    #[test]
    fn q8_0_round_trip_within_half_a_step() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 64) as f32 - 31.5) * 0.1)
            .collect();
        let mut blocks = Vec::new();
        quantize_q8_0(&x, &mut blocks);
        let mut y = vec![0.0; 64];
        dequantize_q8_0(&blocks, &mut y);
        for (c, (a, b)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
            let step = f16_to_f32(blocks[c].d);
            for (u, v) in a.iter().zip(b) {
                // Half a step of rounding plus the f16 rounding of d (≤ 2^-11 relative × 127 steps).
                assert!(
                    (u - v).abs() <= step * (0.5 + 127.0 / 2048.0),
                    "{u} {v} {step}"
                );
            }
        }
    }
}
