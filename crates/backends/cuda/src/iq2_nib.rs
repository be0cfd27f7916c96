//! The IQ2_XXS experts' nibble copy (`IQ2_NIB`, an experiment, off by default).
//!
//! IQ2_XXS stores eight weights as one row index into a 256 × 8 grid (its bytes are 8, 25 or 43)
//! plus a 7-bit sign code; the q8 expert kernels spend about 19 instructions on each group (the
//! grid lookup in shared memory, the sign bits spread to byte masks, two masked dp4a pairs). The
//! nibble copy holds the same values with one 4-bit code per weight, `m + 4 s` (`m` the grid
//! byte's index in `[8, 25, 43]`, `s` = 1 for a negative weight), so that one `PRMT` on a
//! two-register table ([`NIB_TABLE`]) turns four codes into the four signed bytes: about 5
//! instructions per eight weights, the same exact integer sums, so the same bits. It costs 4.5
//! bits a weight instead of 2.06: the copy sits beside the IQ2_XXS experts (which prompts'
//! tensor-core kernels and the other paths keep reading), so it is for every-expert-resident runs
//! on a GPU with room for both.
//!
//! A block of 256 weights, 144 bytes (its sub-blocks' codes 16-byte aligned):
//! ```text
//! d: f16 | 0: u16 | scales: u32 (sub-block j's 4-bit scale at bits 4j) | 0: [u8; 8]
//! codes: 8 × 16 bytes, weight i of sub-block j in byte 16 + 16 j + i / 2, low nibble first
//! ```

use redlite_gguf::quant::grids::{IQ2XXS_GRID, KSIGNS_IQ2XS};

/// Bytes of an IQ2_XXS block (256 weights).
pub const IQ2_XXS_BLOCK: usize = 66;
/// Bytes of a nibble block (256 weights).
pub const NIB_BLOCK: usize = 144;
/// The signed byte of each code (the kernels' `PRMT` table: codes 0..3 in its first register,
/// 4..7 in its second).
pub const NIB_TABLE: [i8; 8] = [8, 25, 43, 0, -8, -25, -43, 0];

/// Whether the kernels are compiled with `IQ2_NIB` (`REDLITE_CUDA_DEFINES`, not 0): the q8
/// IQ2_XXS expert kernels then read only the nibble copy.
pub fn enabled() -> bool {
    crate::kernels::env_defines()
        .iter()
        .any(|(name, value)| name == "IQ2_NIB" && value != "0")
}

/// Bytes of the nibble copy of `iq2_bytes` IQ2_XXS bytes (`None` unless whole blocks).
pub fn nib_bytes(iq2_bytes: usize) -> Option<usize> {
    iq2_bytes
        .is_multiple_of(IQ2_XXS_BLOCK)
        .then_some(iq2_bytes / IQ2_XXS_BLOCK * NIB_BLOCK)
}

/// The magnitude code (0, 1, 2) of a grid byte (every IQ2_XXS grid byte is 8, 25 or 43; a test
/// checks the table).
fn magnitude(g: u8) -> u8 {
    match g {
        8 => 0,
        25 => 1,
        _ => 2,
    }
}

/// The eight codes (a u32, weight i in bits 4i..4i+3) of grid row `row` with sign code `signs`
/// (7 bits), for every pair: 256 × 128 words, made once.
fn group_codes() -> &'static [u32] {
    static CODES: std::sync::OnceLock<Vec<u32>> = std::sync::OnceLock::new();
    CODES.get_or_init(|| {
        let mut t = vec![0u32; 256 * 128];
        for (r, &row) in IQ2XXS_GRID.iter().enumerate() {
            for (sc, &signs) in KSIGNS_IQ2XS.iter().enumerate() {
                t[128 * r + sc] = (0..8).fold(0u32, |w, i| {
                    let code = magnitude((row >> (8 * i)) as u8) | (((signs >> i) & 1) << 2);
                    w | (u32::from(code) << (4 * i))
                });
            }
        }
        t
    })
}

/// One IQ2_XXS block (`src`, 66 bytes) into its nibble block (`dst`, 144 bytes).
fn repack_block(src: &[u8], dst: &mut [u8]) {
    let (src, dst) = (&src[..IQ2_XXS_BLOCK], &mut dst[..NIB_BLOCK]);
    let codes = group_codes();
    dst.fill(0);
    dst[..2].copy_from_slice(&src[..2]);
    let mut scales = 0u32;
    for j in 0..8 {
        let at = 2 + 8 * j;
        let aux = u32::from_le_bytes([src[at + 4], src[at + 5], src[at + 6], src[at + 7]]);
        scales |= (aux >> 28) << (4 * j);
        for l in 0..4 {
            let sc = ((aux >> (7 * l)) & 127) as usize;
            let w = codes[128 * usize::from(src[at + l]) + sc];
            dst[16 + 16 * j + 4 * l..][..4].copy_from_slice(&w.to_le_bytes());
        }
    }
    dst[4..8].copy_from_slice(&scales.to_le_bytes());
}

/// IQ2_XXS bytes (whole blocks) into their nibble copy (`nib_bytes(src.len())` bytes).
pub fn repack(src: &[u8], dst: &mut [u8]) {
    for (s, d) in src
        .chunks_exact(IQ2_XXS_BLOCK)
        .zip(dst.chunks_exact_mut(NIB_BLOCK))
    {
        repack_block(s, d);
    }
}

/// The nibble copy of IQ2_XXS bytes (whole blocks), as a new buffer.
pub fn repacked(src: &[u8]) -> Vec<u8> {
    let mut dst = vec![0u8; nib_bytes(src.len()).unwrap_or(0)];
    repack(src, &mut dst);
    dst
}

#[cfg(test)]
mod tests {
    use super::*;
    use redlite_gguf::quant::dequantize_block_iq2_xxs;

    /// The nibble block's values, in the IQ2_XXS dequantizer's f32 operations:
    /// `d (0.5 + scale) / 4 · value`.
    fn dequantize_nib(b: &[u8], out: &mut [f32; 256]) {
        let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
        let scales = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        for j in 0..8 {
            let db = d * (0.5 + ((scales >> (4 * j)) & 15) as f32) * 0.25;
            for w in 0..32 {
                let code = (b[16 + 16 * j + w / 2] >> (4 * (w % 2))) & 15;
                out[32 * j + w] = db * f32::from(NIB_TABLE[usize::from(code)]);
            }
        }
    }

    #[test]
    fn grid_bytes_are_the_three_magnitudes() {
        for row in IQ2XXS_GRID {
            for i in 0..8 {
                let g = (row >> (8 * i)) as u8;
                assert!(matches!(g, 8 | 25 | 43), "grid byte {g}");
                assert_eq!(NIB_TABLE[usize::from(magnitude(g))], g as i8);
            }
        }
    }

    /// The reference's IQ2_XXS blocks (real and edge-case blocks, `../shared/reference/quant`)
    /// and their dequantization by ggml: the nibble copy holds the same values, bit for bit.
    #[test]
    fn nibble_copy_dequantizes_as_the_reference() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../../shared/reference/quant");
        let blocks = std::fs::read(dir.join("IQ2_XXS.blocks")).expect("IQ2_XXS.blocks");
        let want: Vec<f32> = std::fs::read(dir.join("IQ2_XXS.f32"))
            .expect("IQ2_XXS.f32")
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(blocks.len() % IQ2_XXS_BLOCK, 0);
        let n = blocks.len() / IQ2_XXS_BLOCK;
        assert_eq!(want.len(), 256 * n);
        let nib = repacked(&blocks);
        assert_eq!(Some(nib.len()), nib_bytes(blocks.len()));
        let (mut got, mut ours) = ([0f32; 256], [0f32; 256]);
        for b in 0..n {
            dequantize_nib(&nib[b * NIB_BLOCK..][..NIB_BLOCK], &mut got);
            dequantize_block_iq2_xxs(
                blocks[b * IQ2_XXS_BLOCK..][..IQ2_XXS_BLOCK]
                    .try_into()
                    .unwrap(),
                &mut ours,
            );
            for i in 0..256 {
                let w = want[256 * b + i];
                assert_eq!(
                    got[i].to_bits(),
                    w.to_bits(),
                    "block {b} weight {i}: {} vs {w}",
                    got[i]
                );
                assert_eq!(ours[i].to_bits(), w.to_bits());
            }
        }
    }

    /// The kernel's `PRMT` table words (`iq2nib_bytes` in `kernels/moe.cu`) are [`NIB_TABLE`],
    /// and its four-codes-a-word reading gives each weight its signed byte.
    #[test]
    fn kernel_table_words_are_the_table() {
        let src = include_str!("../kernels/moe.cu");
        let bytes: Vec<u8> = NIB_TABLE.iter().map(|&v| v as u8).collect();
        let lo = u32::from_le_bytes(bytes[..4].try_into().unwrap());
        let hi = u32::from_le_bytes(bytes[4..].try_into().unwrap());
        assert!(
            src.contains(&format!("\"r\"(0x{lo:08X}u), \"r\"(0x{hi:08X}u)")),
            "{lo:08X} {hi:08X}"
        );
        // PRMT (default mode): result byte k = byte (selector nibble k & 7) of {hi, lo}.
        let prmt = |codes: u32| -> [i8; 4] {
            let all = (u64::from(hi) << 32) | u64::from(lo);
            std::array::from_fn(|k| (all >> (8 * ((codes >> (4 * k)) & 7))) as u8 as i8)
        };
        let blocks = [[0x5Au8; IQ2_XXS_BLOCK], [0xA7u8; IQ2_XXS_BLOCK]];
        for b in blocks {
            let mut nib = [0u8; NIB_BLOCK];
            repack_block(&b, &mut nib);
            let mut ours = [0f32; 256];
            dequantize_block_iq2_xxs(&b, &mut ours);
            for j in 0..8 {
                for l in 0..4 {
                    let at = 16 + 16 * j + 4 * l;
                    let word = u32::from_le_bytes(nib[at..at + 4].try_into().unwrap());
                    for (h, codes) in [word, word >> 16].into_iter().enumerate() {
                        for (k, v) in prmt(codes).into_iter().enumerate() {
                            let x = ours[32 * j + 8 * l + 4 * h + k];
                            let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                            let at = 2 + 8 * j + 4;
                            let aux = u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
                            let db = d * (0.5 + (aux >> 28) as f32) * 0.25;
                            assert_eq!(x.to_bits(), (db * f32::from(v)).to_bits(), "sub-block {j}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(nib_bytes(66 * 8), Some(144 * 8));
        assert_eq!(nib_bytes(65), None);
    }
}
