//! Random but *valid* quant blocks, for benchmark files and kernel tests (never a correctness
//! oracle).
//!
//! A block of random bytes is almost a valid block of any ggml type: every grid index, nibble and
//! sign bit pattern decodes to something. What random bytes break are the floating-point scale
//! fields (an f16 `d` may come out as NaN, infinity or 60000). [`fill_random_blocks`] therefore
//! fills each block with random bytes and then overwrites its scale fields with a small positive
//! value (uniform in `[0.5e-3, 2e-3)`, like `tools/make_qwen3next_random.py`). The float types get
//! small random values instead of random bit patterns, and Q8_K's `bsums` are made consistent
//! with its quants. The types with a min (Q2_K, Q4_K, Q5_K) get `m = sc` and `dmin = mean(q)·d`
//! so that their values are centred on zero like every other type's (random mins would add a
//! large offset to every sub-block, making all matrix products of a random model nearly
//! token-independent).
//!
//! The generator is a seeded xoshiro256++ ([`QuantRng`]): fast (several GB/s of random bytes),
//! reproducible, not cryptographic.

use super::types::GgmlType;

/// Smallest scale written into a random block's f16 scale fields.
pub const SCALE_MIN: f32 = 0.5e-3;
/// Upper bound (exclusive) of the scales written into random blocks.
pub const SCALE_MAX: f32 = 2e-3;

/// A small, fast, seeded PRNG (xoshiro256++, seeded through SplitMix64).
#[derive(Debug, Clone)]
pub struct QuantRng {
    s: [u64; 4],
}

impl QuantRng {
    /// A generator whose whole stream is determined by `seed`.
    pub fn new(seed: u64) -> QuantRng {
        let mut sm = seed;
        let mut next = || {
            sm = sm.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = sm;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        QuantRng {
            s: [next(), next(), next(), next()],
        }
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Fills `out` with random bytes.
    pub fn fill_bytes(&mut self, out: &mut [u8]) {
        let mut chunks = out.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        if !rest.is_empty() {
            let v = self.next_u64().to_le_bytes();
            rest.copy_from_slice(&v[..rest.len()]);
        }
    }

    /// Uniform in `[0, 1)` with 24 random bits.
    #[inline]
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Uniform in `[lo, hi)`.
    #[inline]
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.next_f32()
    }

    /// Approximately normal with the given mean and standard deviation (Irwin–Hall sum of four
    /// uniforms, rescaled: bounded tails, which is what benchmark weights want).
    #[inline]
    pub fn normal(&mut self, mean: f32, std: f32) -> f32 {
        let x = self.next_u64();
        // Four 16-bit uniforms from one draw: sum has mean 2, variance 4/12.
        let sum: f32 = (0..4)
            .map(|i| ((x >> (16 * i)) & 0xffff) as f32 * (1.0 / 65536.0))
            .sum();
        mean + std * (sum - 2.0) * 3.0f32.sqrt()
    }
}

/// A small positive scale as f16 bits.
fn random_scale_f16(rng: &mut QuantRng) -> u16 {
    half::f16::from_f32(rng.uniform(SCALE_MIN, SCALE_MAX)).to_bits()
}

fn put_u16(block: &mut [u8], off: usize, v: u16) {
    block[off..off + 2].copy_from_slice(&v.to_le_bytes());
}

/// Byte offsets of the f16 scale fields (`d`, then `dmin` where there is one) in one block of
/// `ty`; empty for the float types (handled separately), IQ1_M (its scale is spread over
/// nibbles) and Q8_K (an f32 scale).
pub fn f16_scale_offsets(ty: GgmlType) -> &'static [usize] {
    use GgmlType::*;
    match ty {
        F32 | F16 | BF16 | Q8K | IQ1M => &[],
        // d first.
        Q4_0 | Q8_0 | IQ4NL | IQ2XXS | IQ2XS | IQ2S | IQ3XXS | IQ3S | IQ1S | IQ4XS => &[0],
        // d, dmin first.
        Q4K | Q5K => &[0, 2],
        // scales[16], qs[64], then d, dmin.
        Q2K => &[80, 82],
        // hmask[32], qs[64], scales[12], then d.
        Q3K => &[108],
        // ql[128], qh[64], scales[16], then d.
        Q6K => &[208],
    }
}

/// Fills `out` (a whole number of `ty` blocks) with random valid blocks: random bytes with the
/// scale fields set to small positive values. Float types get small finite values
/// (normal, σ = 0.02). Errors when `out` is not a multiple of the block size.
pub fn fill_random_blocks(
    ty: GgmlType,
    out: &mut [u8],
    rng: &mut QuantRng,
) -> Result<(), RandomBlocksError> {
    if !out.len().is_multiple_of(ty.block_bytes()) {
        return Err(RandomBlocksError { ty, len: out.len() });
    }
    fill_whole_blocks(ty, out, rng);
    Ok(())
}

/// [`fill_random_blocks`] on a buffer already known to be whole blocks.
fn fill_whole_blocks(ty: GgmlType, out: &mut [u8], rng: &mut QuantRng) {
    let bb = ty.block_bytes();
    match ty {
        GgmlType::F32 => {
            for c in out.chunks_exact_mut(4) {
                c.copy_from_slice(&rng.normal(0.0, 0.02).to_le_bytes());
            }
            return;
        }
        GgmlType::F16 => {
            for c in out.chunks_exact_mut(2) {
                let v = half::f16::from_f32(rng.normal(0.0, 0.02));
                c.copy_from_slice(&v.to_bits().to_le_bytes());
            }
            return;
        }
        GgmlType::BF16 => {
            for c in out.chunks_exact_mut(2) {
                let v = half::bf16::from_f32(rng.normal(0.0, 0.02));
                c.copy_from_slice(&v.to_bits().to_le_bytes());
            }
            return;
        }
        _ => {}
    }

    rng.fill_bytes(out);
    let offsets = f16_scale_offsets(ty);
    for block in out.chunks_exact_mut(bb) {
        for &off in offsets {
            let d = random_scale_f16(rng);
            put_u16(block, off, d);
        }
        match ty {
            GgmlType::IQ1M => {
                // qs[32], qh[16], scales[8] = four u16 at byte 48. The f16 super-scale is made
                // of the top nibbles: u16 #k bits 12..16 hold d bits 4k..4k+4.
                let d = random_scale_f16(rng);
                for k in 0..4 {
                    let off = 48 + 2 * k;
                    let sc = u16::from_le_bytes([block[off], block[off + 1]]);
                    let nib = (d >> (4 * k)) & 0xf;
                    put_u16(block, off, (sc & 0x0fff) | (nib << 12));
                }
            }
            GgmlType::Q4K | GgmlType::Q5K => {
                // value = d·sc·q − dmin·m with q ≥ 0: random (sc, m) would give every sub-block a
                // large offset of random sign, and matrix products a token-independent bias.
                // Setting m = sc and dmin = mean(q)·d centres every sub-block on zero.
                let mean_q = if ty == GgmlType::Q4K { 7.5 } else { 15.5 };
                let d = half::f16::from_bits(u16::from_le_bytes([block[0], block[1]])).to_f32();
                put_u16(block, 2, half::f16::from_f32(mean_q * d).to_bits());
                let v: [u8; 8] = std::array::from_fn(|_| (rng.next_u64() & 63) as u8);
                for j in 0..4 {
                    let low = v[j] | ((v[j + 4] >> 4) << 6);
                    block[4 + j] = low; // sc_j and the high bits of sc_{j+4}
                    block[8 + j] = low; // m_j and the high bits of m_{j+4}
                    block[12 + j] = (v[j + 4] & 15) * 17; // low bits of sc_{j+4} and m_{j+4}
                }
            }
            GgmlType::Q2K => {
                // value = d·sc·q − dmin·m, q in 0..3: m = sc and dmin = 1.5·d centre it on zero.
                let d = half::f16::from_bits(u16::from_le_bytes([block[80], block[81]])).to_f32();
                put_u16(block, 82, half::f16::from_f32(1.5 * d).to_bits());
                for b in &mut block[..16] {
                    *b = (*b & 15) * 17;
                }
            }
            GgmlType::Q8K => {
                // d: f32 at 0, qs: 256 × i8 at 4, bsums: 16 × i16 at 260 (sums of 16 quants).
                let d = rng.uniform(SCALE_MIN, SCALE_MAX);
                block[0..4].copy_from_slice(&d.to_le_bytes());
                for j in 0..16 {
                    let sum: i16 = block[4 + 16 * j..4 + 16 * (j + 1)]
                        .iter()
                        .map(|&b| i16::from(b as i8))
                        .sum();
                    let off = 260 + 2 * j;
                    block[off..off + 2].copy_from_slice(&sum.to_le_bytes());
                }
            }
            _ => {}
        }
    }
}

/// `n_blocks` random valid blocks of `ty` (see [`fill_random_blocks`]).
pub fn random_blocks(ty: GgmlType, n_blocks: usize, rng: &mut QuantRng) -> Vec<u8> {
    let mut out = vec![0u8; n_blocks * ty.block_bytes()];
    fill_whole_blocks(ty, &mut out, rng);
    out
}

/// A buffer handed to [`fill_random_blocks`] that is not a whole number of blocks.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{len} bytes is not a whole number of {ty} blocks ({} bytes each)", ty.block_bytes())]
pub struct RandomBlocksError {
    pub ty: GgmlType,
    pub len: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequantize_to_vec;
    use crate::TYPE_TRAITS;

    #[test]
    fn every_type_dequantizes_to_finite_values() {
        let mut rng = QuantRng::new(42);
        for t in TYPE_TRAITS {
            let n_blocks = 4096 / t.block_elems.max(1) + 64;
            let bytes = random_blocks(t.ty, n_blocks, &mut rng);
            assert_eq!(bytes.len(), n_blocks * t.block_bytes, "{}", t.name);
            let vals = dequantize_to_vec(t.ty, &bytes)
                .unwrap_or_else(|e| panic!("{}: dequantize failed: {e}", t.name));
            assert_eq!(vals.len(), n_blocks * t.block_elems);
            let max = vals.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert!(
                vals.iter().all(|v| v.is_finite()),
                "{}: non-finite value",
                t.name
            );
            assert!(max > 0.0, "{}: all zeros", t.name);
            // Scales ≤ 2e-3 times at most a few thousand quant units.
            assert!(max < 64.0, "{}: max |value| {max} is not small", t.name);
        }
    }

    #[test]
    fn values_are_roughly_centred() {
        // A large common offset would make every matrix product token-independent.
        let mut rng = QuantRng::new(11);
        for t in TYPE_TRAITS {
            let bytes = random_blocks(t.ty, 65536 / t.block_elems.max(1), &mut rng);
            let v = dequantize_to_vec(t.ty, &bytes).unwrap();
            let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len() as f64;
            let mean_abs = v.iter().map(|&x| f64::from(x).abs()).sum::<f64>() / v.len() as f64;
            assert!(
                mean.abs() < 0.15 * mean_abs,
                "{}: mean {mean} vs mean |v| {mean_abs}",
                t.name
            );
        }
    }

    #[test]
    fn scales_are_small_and_positive() {
        let mut rng = QuantRng::new(7);
        for t in TYPE_TRAITS {
            let bytes = random_blocks(t.ty, 64, &mut rng);
            for block in bytes.chunks_exact(t.block_bytes) {
                // `d` (the first field); a `dmin` is set to mean(q)·d afterwards.
                for &off in f16_scale_offsets(t.ty).iter().take(1) {
                    let d = half::f16::from_bits(u16::from_le_bytes([block[off], block[off + 1]]))
                        .to_f32();
                    assert!(
                        (SCALE_MIN * 0.99..SCALE_MAX * 1.01).contains(&d),
                        "{}",
                        t.name
                    );
                }
                if t.ty == GgmlType::IQ1M {
                    let mut bits = 0u16;
                    for k in 0..4 {
                        let sc = u16::from_le_bytes([block[48 + 2 * k], block[49 + 2 * k]]);
                        bits |= (sc >> 12) << (4 * k);
                    }
                    let d = half::f16::from_bits(bits).to_f32();
                    assert!((SCALE_MIN * 0.99..SCALE_MAX * 1.01).contains(&d));
                }
            }
        }
    }

    #[test]
    fn deterministic_and_bad_length_rejected() {
        let a = random_blocks(GgmlType::Q4K, 3, &mut QuantRng::new(1));
        let b = random_blocks(GgmlType::Q4K, 3, &mut QuantRng::new(1));
        assert_eq!(a, b);
        let mut buf = vec![0u8; 145];
        assert!(fill_random_blocks(GgmlType::Q4K, &mut buf, &mut QuantRng::new(1)).is_err());
    }

    #[test]
    fn normal_has_roughly_the_asked_moments() {
        let mut rng = QuantRng::new(3);
        let n = 100_000;
        let xs: Vec<f32> = (0..n).map(|_| rng.normal(1.0, 0.5)).collect();
        let mean = xs.iter().sum::<f32>() / n as f32;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / n as f32;
        assert!((mean - 1.0).abs() < 0.01, "{mean}");
        assert!((var.sqrt() - 0.5).abs() < 0.01, "{}", var.sqrt());
    }
}
