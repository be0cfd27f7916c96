//! IQ2_XXS single-row kernel on element-major activations (decode), with GFNI.
//!
//! A pair of weight blocks holds 64 grid rows of 8 elements. Packed row `k = 32h + 4sb + l` is
//! grid row `l` of sub-block `sb` of block `h`. The activations are reordered once per input
//! ([`element_major_q8k`]) so that 64-byte chunk `j` of a block pair holds element `j` of every
//! packed row: byte `k` of chunk `j` = activation `32sb + 8l + j` of block `h`. Then
//!
//! * **grid values**: one `vgf2p8affineqb` per chunk. A grid row's 16-bit code (two table
//!   lookups per pair, as in the other kernels) holds element `j`'s value index in bits
//!   `2j, 2j + 1`, and index → value (0 → 8, 1 → 25, 2 → 43) is affine over GF(2):
//!   `8 ⊕ 17·bit0 ⊕ 35·bit1`. One 8×8 bit matrix per `j % 4` picks the two bits of the code
//!   byte and maps them to the value, so no `vpmultishiftqb` + `vpermb` pair per 64 elements;
//! * **signs**: element `j`'s flip mask (`j` < 7) is bit `j` of every row's 7-bit sign field,
//!   picked straight out of the lane-aligned aux words by one `vpshufbitqmb` (BITALG); the
//!   parity bit 7 is bit 7 of the row's KSIGNS byte (one `vpermi2b` per pair, `vpmovb2m`). The
//!   masks are applied to the activations (`0 − q8`, exact as long as no activation is −128);
//! * **sub-block sums without shuffles**: four packed rows of a sub-block sit in one i32 lane, so
//!   each `vpdpbusd` adds 4 products of one sub-block to its lane, and after the 8 chunks
//!   lane `8h + sb` is sub-block `sb`'s exact sum; one `vpmulld` by the scales
//!   (`2·(aux >> 28) + 1`, lane-aligned by one `vpermt2d` of the aux words) and one reduction
//!   per half give the two exact block sums.
//!
//! The row loop walks a call's rows with raw pointers (bounds asserted once) and is
//! software-pipelined across row ends: the next pair's codes, aux words and KSIGNS bytes are
//! decoded before this pair's products, so the lookup chains of one pair overlap the products
//! of the one before. Two pairs' vectors are reduced together (four block sums from one
//! reduction, [`quad_sums`]): within a row, or, for rows of one pair (≤ 2 blocks), across two
//! rows ([`rows_one_pair`]).
//!
//! The block sums are the exact integers of the scalar kernel and the f32 operations are its
//! own, in block order, so the result is bit-identical to every other IQ2_XXS kernel.

use super::{
    f16_to_f32, load256, load64, lookup256, BlockQ8K, IQ2XXS_CODE_HI, IQ2XXS_CODE_LO,
    IQ2XXS_KSIGNS, IQ2_XXS_BYTES, V64,
};
use core::arch::x86_64::*;

/// Whether the CPU has the features of the parent module plus GFNI and BITALG
/// (`vpshufbitqmb`).
pub fn supported() -> bool {
    super::supported()
        && is_x86_feature_detected!("gfni")
        && is_x86_feature_detected!("avx512bitalg")
}

/// `vpermt2b` over the 64 bytes after `d` of a block pair: packed row `k = 32h + 4sb + l` takes
/// index byte `8sb + l` of block `h`.
static PACK: V64 = {
    let mut t = [0u8; 64];
    let mut k = 0;
    while k < 64 {
        let (h, sb, l) = (k / 32, (k % 32) / 4, k % 4);
        t[k] = (64 * h + 8 * sb + l) as u8;
        k += 1;
    }
    V64(t)
};

/// `vpermt2d` over the same bytes: dword `t = 8h + sb` takes the aux word of sub-block `sb` of
/// block `h` (the high dword of its qword).
static AUX_DWORDS: V64 = {
    let mut t = [0u8; 64];
    let mut d = 0;
    while d < 16 {
        let (h, sb) = (d / 8, d % 8);
        t[4 * d] = (16 * h + 2 * sb + 1) as u8;
        d += 1;
    }
    V64(t)
};

/// `vpmultishiftqb` over the lane-aligned aux words (qword `q` = aux words `2q` and `2q + 1`):
/// byte `4s + l` of a qword takes the 7-bit sign index of row `l` (bits `7l..`) of aux word `s`.
static SIGN_FIELDS: V64 = lanes!(|_g, j| (32 * (j / 4) + 7 * (j % 4)) as u8);

/// `vpshufbitqmb` over the lane-aligned aux words: byte `k` of table `j` (`j` < 7) selects bit
/// `j` of row `k`'s 7-bit sign field, which is bit `j` of its KSIGNS byte (the low 7 bits of a
/// KSIGNS byte are the field itself; bit 7, the parity, comes from the table lookup).
static SIGN_BITS: [V64; 7] = {
    const fn table(j: usize) -> V64 {
        lanes!(|_g, l| (32 * (l / 4) + 7 * (l % 4) + j) as u8)
    }
    [
        table(0),
        table(1),
        table(2),
        table(3),
        table(4),
        table(5),
        table(6),
    ]
};

/// The GF(2) matrix (`vgf2p8affineqb` layout: byte `7 − i` selects the input bits of output
/// bit `i`) mapping the 2-bit field `m` of a byte to `17·bit0 ⊕ 35·bit1`; with the constant
/// 8 added this is the IQ2 grid value of the field's index (0 → 8, 1 → 25, 2 → 43).
const fn value_matrix(m: usize) -> u64 {
    let (b0, b1) = (1u64 << (2 * m), 1u64 << (2 * m + 1));
    // 17 = bits 0, 4; 35 = bits 0, 1, 5: output bit i reads b0 where 17 has bit i, b1 where
    // 35 has it.
    let mut a = 0u64;
    let mut i = 0;
    while i < 8 {
        let mut row = 0;
        if (17 >> i) & 1 == 1 {
            row |= b0;
        }
        if (35 >> i) & 1 == 1 {
            row |= b1;
        }
        a |= row << (8 * (7 - i));
        i += 1;
    }
    a
}

/// The four value matrices, one per 2-bit field of a code byte.
const VALUE_MATRICES: [u64; 4] = [
    value_matrix(0),
    value_matrix(1),
    value_matrix(2),
    value_matrix(3),
];

/// Q8_K activations in the element-major order of [`iq2_xxs_row_element_major`]: blocks in
/// pairs (a zero block appended to an odd count), and 64-byte chunk `j` of a pair (chunks 0..4
/// in the first block's `qs`, 4..8 in the second's) holds, at byte `32h + 4sb + l`, element
/// `32sb + 8l + j` of block `h`. `d` and `bsums` stay with their blocks. Made once per
/// activation vector and read by every weight row.
pub fn element_major_q8k(x: &[BlockQ8K]) -> Vec<BlockQ8K> {
    let mut out = x.to_vec();
    if out.len() % 2 == 1 {
        out.push(BlockQ8K::ZERO);
    }
    for (pair, src) in out.chunks_exact_mut(2).zip(x.chunks(2)) {
        // The pair's 512 reordered bytes: the 8 elements of grid row r = 4sb + l of block h
        // (elements 8r..8r + 8) go to byte k = 32h + r of chunks 0..8.
        let mut bytes = [0i8; 512];
        for (h, b) in src.iter().enumerate() {
            for (r, row) in b.qs.chunks_exact(8).enumerate() {
                for (j, &v) in row.iter().enumerate() {
                    bytes[64 * j + 32 * h + r] = v;
                }
            }
        }
        pair[0].qs.copy_from_slice(&bytes[..256]);
        pair[1].qs.copy_from_slice(&bytes[256..]);
    }
    out
}

/// The exact sums of i32 lanes 0..8 and of lanes 8..16 of `v`.
#[inline]
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c,gfni,avx512bitalg"
)]
fn hsum_halves(v: __m512i) -> (i32, i32) {
    // Per 128-bit lane: every dword = the lane's sum.
    let t = _mm512_add_epi32(v, _mm512_shuffle_epi32::<0x4E>(v));
    let t = _mm512_add_epi32(t, _mm512_shuffle_epi32::<0xB1>(t));
    // 128-bit lanes 0 + 1 (block 0) and 2 + 3 (block 1).
    let t = _mm512_add_epi32(t, _mm512_shuffle_i64x2::<0b1011_0001>(t, t));
    let s1 = _mm512_extracti32x4_epi32::<2>(t);
    (
        _mm_cvtsi128_si32(_mm512_castsi512_si128(t)),
        _mm_cvtsi128_si32(s1),
    )
}

/// The constant registers of [`decode`].
struct Tables {
    code_lo: [__m512i; 4],
    code_hi: [__m512i; 4],
    pack: __m512i,
    aux_dwords: __m512i,
    fields: __m512i,
}

/// What [`pair_vec`] needs of a block pair's weights, decoded ahead of its products (the
/// loop decodes the next pair before this pair's products, so the long lookup chains of one
/// pair overlap the products of the one before).
#[derive(Clone, Copy)]
struct Decoded {
    /// Grid-row codes of the 64 packed rows (low byte: elements 0..4, high: 4..8).
    lo: __m512i,
    hi: __m512i,
    /// Dword `8h + sb`: the aux word of sub-block `sb` of block `h`.
    aux: __m512i,
    /// Byte `k`: the KSIGNS byte of packed row `k` (only its bit 7 is read).
    signs: __m512i,
}

/// Decodes the IQ2_XXS blocks `q0`, `q1` (their 64 bytes after `d`).
#[inline]
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c,gfni,avx512bitalg"
)]
fn decode(t: &Tables, q0: __m512i, q1: __m512i) -> Decoded {
    let idx = _mm512_permutex2var_epi8(q0, t.pack, q1);
    let high_half = _mm512_movepi8_mask(idx);
    let aux = _mm512_permutex2var_epi32(q0, t.aux_dwords, q1);
    Decoded {
        lo: lookup256(&t.code_lo, idx, high_half),
        hi: lookup256(&t.code_hi, idx, high_half),
        aux,
        signs: _mm512_permutex2var_epi8(
            load64(&IQ2XXS_KSIGNS[0]),
            _mm512_multishift_epi64_epi8(t.fields, aux),
            load64(&IQ2XXS_KSIGNS[1]),
        ),
    }
}

/// The scaled sub-block sums of a decoded block pair against the element-major activations of
/// the pair `y` (two blocks): i32 lane `8h + sb` = scale × exact sum of sub-block `sb` of block
/// `h` (lanes 0..8 add up to block 0's sum, 8..16 to block 1's: [`hsum_halves`],
/// [`quad_sums`]).
#[inline]
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c,gfni,avx512bitalg"
)]
fn pair_vec(d: &Decoded, y: &[BlockQ8K]) -> __m512i {
    let zero = _mm512_setzero_si512();
    let mut acc = [zero; 4];
    for j in 0..8 {
        let codes = if j < 4 { d.lo } else { d.hi };
        let matrix = _mm512_set1_epi64(VALUE_MATRICES[j % 4] as i64);
        let grid = _mm512_gf2p8affine_epi64_epi8::<8>(codes, matrix);
        // Element j's flip bits: bit j of each row's sign field straight from the aux words
        // (`vpshufbitqmb`, not waiting for the KSIGNS lookup), the parity bit 7 from it.
        let flip = if j < 7 {
            _mm512_bitshuffle_epi64_mask(d.aux, load64(&SIGN_BITS[j]))
        } else {
            _mm512_movepi8_mask(d.signs)
        };
        // Chunk j: bytes 64·(j % 4).. of block j / 4.
        let chunk = &y[j / 4].qs[64 * (j % 4)..64 * (j % 4) + 64];
        // SAFETY: `chunk` is 64 readable bytes.
        let q8 = unsafe { _mm512_loadu_si512(chunk.as_ptr().cast()) };
        let signed = _mm512_mask_sub_epi8(q8, flip, zero, q8);
        acc[j % 4] = _mm512_dpbusd_epi32(acc[j % 4], grid, signed);
    }
    let sums = _mm512_add_epi32(
        _mm512_add_epi32(acc[0], acc[1]),
        _mm512_add_epi32(acc[2], acc[3]),
    );
    // (aux >> 27) | 1 = 2·(aux >> 28) + 1.
    let scales = _mm512_or_si512(_mm512_srli_epi32::<27>(d.aux), _mm512_set1_epi32(1));
    _mm512_mullo_epi32(sums, scales)
}

/// The four exact block sums of two pairs' [`pair_vec`] vectors `a`, `b` (blocks `a0, a1, b0,
/// b1`), converted to f32 (`vcvtdq2ps`, the same rounding as `as f32`), from one reduction.
#[inline]
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c,gfni,avx512bitalg"
)]
fn quad_sums(a: __m512i, b: __m512i) -> [f32; 4] {
    // 128-bit lane L: the partial sums of block L (a0, a1, b0, b1).
    let z = _mm512_add_epi32(
        _mm512_shuffle_i64x2::<0x88>(a, b),
        _mm512_shuffle_i64x2::<0xDD>(a, b),
    );
    let z = _mm512_add_epi32(z, _mm512_shuffle_epi32::<0x4E>(z));
    let z = _mm512_add_epi32(z, _mm512_shuffle_epi32::<0xB1>(z));
    let f = _mm512_cvtepi32_ps(z);
    [
        _mm_cvtss_f32(_mm512_castps512_ps128(f)),
        _mm_cvtss_f32(_mm512_extractf32x4_ps::<1>(f)),
        _mm_cvtss_f32(_mm512_extractf32x4_ps::<2>(f)),
        _mm_cvtss_f32(_mm512_extractf32x4_ps::<3>(f)),
    ]
}

/// The f16 scale `d` of the IQ2_XXS block at `b`.
///
/// # Safety
/// `b` must point to 2 readable bytes.
#[inline]
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c,gfni,avx512bitalg"
)]
unsafe fn block_d(b: *const u8) -> f32 {
    // SAFETY: as the caller promises.
    f16_to_f32(unsafe { b.cast::<u16>().read_unaligned() }.to_le())
}

impl Tables {
    #[inline]
    #[target_feature(
        enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c,gfni,avx512bitalg"
    )]
    fn load() -> Tables {
        Tables {
            code_lo: load256(&IQ2XXS_CODE_LO),
            code_hi: load256(&IQ2XXS_CODE_HI),
            pack: load64(&PACK),
            aux_dwords: load64(&AUX_DWORDS),
            fields: load64(&SIGN_FIELDS),
        }
    }
}

/// `$out[r]` = row `r` of `$w` (rows of `$row_bytes`, `$nb` blocks used) against the
/// element-major activations `$x` (at least `$nb` rounded up to even blocks), with the tables
/// `$t`, prefetching each row's bytes `$ahead` bytes on (0: none). One raw-pointer loop with
/// the bounds asserted once (slice indexing per pair cost ≈ 25 scalar instructions per pair:
/// 3.5 → 2.9 ns per block). A macro so that the loop sits in its caller with the tables in
/// registers (an out-of-line helper read them through a pointer in every iteration: 7.4
/// instead of 6.6 ns per block on the Zen 4 host).
macro_rules! rows_dot {
    ($t:expr, $w:expr, $row_bytes:expr, $nb:expr, $x:expr, $out:expr, $ahead:expr) => {{
        let (t, w, row_bytes, nb, x, out, ahead): (
            &Tables,
            &[u8],
            usize,
            usize,
            &[BlockQ8K],
            &mut [f32],
            usize,
        ) = ($t, $w, $row_bytes, $nb, $x, $out, $ahead);
        let rows = out.len();
        let pairs = nb.div_ceil(2);
        if pairs == 0 {
            out.fill(0.0);
        } else if rows > 0 {
            assert!(
                nb * IQ2_XXS_BYTES <= row_bytes
                    && (rows - 1) * row_bytes + nb * IQ2_XXS_BYTES <= w.len()
                    && 2 * pairs <= x.len()
            );
            let (wp, xp) = (w.as_ptr(), x.as_ptr());
            // The 64 bytes after `d` of the block at `b`.
            // SAFETY (of every use): `b` is the start of one of the `nb` blocks of a row.
            let quants = |b: *const u8| unsafe { _mm512_loadu_si512(b.add(2).cast()) };
            // Software-pipelined over all rows' block pairs as one stream: the next pair
            // (maybe the first of the next row, so that short rows overlap too) is decoded
            // before this pair's products. A pair of an odd count's last block reads it twice
            // and drops its second sum.
            let mut next = decode(
                t,
                quants(wp),
                quants(wp.wrapping_add(IQ2_XXS_BYTES.min((nb - 1) * IQ2_XXS_BYTES))),
            );
            for (r, y) in out.iter_mut().enumerate() {
                let row = wp.wrapping_add(r * row_bytes);
                prefetch_row(row, ahead, row_bytes);
                let mut sumf = 0.0f32;
                // Decodes the pair after pair `k` of this row into `next`.
                macro_rules! advance {
                    ($k:expr) => {
                        let k = $k;
                        if k + 1 < pairs {
                            let n0 = row.wrapping_add((2 * k + 2) * IQ2_XXS_BYTES);
                            let n1 = if 2 * k + 3 < nb {
                                n0.wrapping_add(IQ2_XXS_BYTES)
                            } else {
                                n0
                            };
                            next = decode(t, quants(n0), quants(n1));
                        } else if r + 1 < rows {
                            let n0 = row.wrapping_add(row_bytes);
                            let n1 = if nb > 1 {
                                n0.wrapping_add(IQ2_XXS_BYTES)
                            } else {
                                n0
                            };
                            next = decode(t, quants(n0), quants(n1));
                        }
                    };
                }
                // SAFETY (of the `x` reads): `2 * pairs <= x.len()`; of the `block_d` reads:
                // their blocks are blocks `< nb` of row `r`.
                let mut k = 0;
                // Two pairs at a time, their four block sums from one reduction.
                while k + 1 < pairs {
                    let i = 2 * k;
                    let d = next;
                    advance!(k);
                    let va = pair_vec(&d, unsafe { core::slice::from_raw_parts(xp.add(i), 2) });
                    let d = next;
                    advance!(k + 1);
                    let vb = pair_vec(&d, unsafe { core::slice::from_raw_parts(xp.add(i + 2), 2) });
                    let f = quad_sums(va, vb);
                    let b0 = row.wrapping_add(i * IQ2_XXS_BYTES);
                    unsafe {
                        let y4 = core::slice::from_raw_parts(xp.add(i), 4);
                        sumf += block_d(b0) * y4[0].d * f[0];
                        sumf += block_d(b0.add(IQ2_XXS_BYTES)) * y4[1].d * f[1];
                        sumf += block_d(b0.add(2 * IQ2_XXS_BYTES)) * y4[2].d * f[2];
                        if i + 3 < nb {
                            sumf += block_d(b0.add(3 * IQ2_XXS_BYTES)) * y4[3].d * f[3];
                        }
                    }
                    k += 2;
                }
                if k < pairs {
                    let i = 2 * k;
                    let d = next;
                    advance!(k);
                    let y2 = unsafe { core::slice::from_raw_parts(xp.add(i), 2) };
                    let (s0, s1) = hsum_halves(pair_vec(&d, y2));
                    let b0 = row.wrapping_add(i * IQ2_XXS_BYTES);
                    unsafe {
                        sumf += block_d(b0) * y2[0].d * s0 as f32;
                        if i + 1 < nb {
                            sumf += block_d(b0.add(IQ2_XXS_BYTES)) * y2[1].d * s1 as f32;
                        }
                    }
                }
                *y = 0.125 * sumf;
            }
        }
    }};
}

/// The IQ2_XXS kernel for one activation row in element-major order ([`element_major_q8k`],
/// no activation −128): `w` holds `nb` blocks and `x` at least `nb` rounded up to even. (Two
/// pairs per iteration were slower: 8.4 vs 6.9 ns per block.)
///
/// # Safety
/// The CPU must support the features of [`supported`].
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c,gfni,avx512bitalg"
)]
pub unsafe fn iq2_xxs_row_element_major(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let mut y = [0.0f32];
    rows_dot!(
        &Tables::load(),
        w,
        w.len(),
        w.len() / IQ2_XXS_BYTES,
        x,
        &mut y,
        0
    );
    y[0]
}

/// The blocks of a row that [`iq2_xxs_row`] and [`iq2_xxs_rows`] use: `min(w_blocks,
/// x.len())` rounded down to even (an odd block count needs the pair's padding block;
/// `element_major_q8k` always makes an even count, so an odd `x` was not made by it and only
/// its even part is used).
fn used_blocks(w_blocks: usize, x: &[BlockQ8K]) -> usize {
    w_blocks.min(x.len() & !1)
}

/// Safe entry: blocks `min(w.len() / 66, x.len())`; `x` in element-major order (padded to an
/// even count by [`element_major_q8k`]).
pub fn iq2_xxs_row(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = used_blocks(w.len() / IQ2_XXS_BYTES, x);
    // SAFETY: handed out only when `supported()` holds; `x` holds `nb` rounded up to even
    // blocks.
    unsafe { iq2_xxs_row_element_major(&w[..nb * IQ2_XXS_BYTES], x) }
}

/// `out[r]` = [`iq2_xxs_row`] of row `r` of `w` (rows of `row_bytes`) for every `r` <
/// `out.len()`, the constant tables loaded once for all rows and the rows' work free to overlap
/// (short rows, such as the 2-block down rows of the 80B experts, pay the per-call setup
/// once). Bit-identical to the single-row calls.
pub fn iq2_xxs_rows(w: &[u8], row_bytes: usize, x: &[BlockQ8K], out: &mut [f32]) {
    let nb = used_blocks(row_bytes / IQ2_XXS_BYTES, x);
    // SAFETY: handed out only when `supported()` holds; as in `iq2_xxs_row`.
    unsafe { rows_element_major(w, row_bytes, nb, x, out) }
}

/// How far ahead of the row being computed [`rows_element_major`] asks for weight bytes
/// (`REDLITE_IQ2_PREFETCH` bytes, 0 = no software prefetch). The kernel reads its rows at
/// ~10 GB/s per thread, compute-bound, so the hardware prefetcher, which restarts at every
/// 4 KiB page (a 4 KiB page of a memory-mapped expert is ~0.4 µs of work), leaves it waiting at
/// page starts; asking 2 KiB ahead measured 6.9 → 6.6 ns per block on one thread over the
/// full-size file's experts and +2 % full-size decode.
fn prefetch_distance() -> usize {
    static D: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *D.get_or_init(|| {
        std::env::var("REDLITE_IQ2_PREFETCH")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(PREFETCH_BYTES)
    })
}

/// Default of [`prefetch_distance`].
const PREFETCH_BYTES: usize = 2048;

#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c,gfni,avx512bitalg"
)]
fn rows_element_major(w: &[u8], row_bytes: usize, nb: usize, x: &[BlockQ8K], out: &mut [f32]) {
    if nb.div_ceil(2) == 1 && out.len() > 1 {
        // A function of its own: inside this one, the general loop lost 5 % (2048 columns).
        rows_one_pair(w, row_bytes, nb, x, out, prefetch_distance());
    } else {
        rows_dot!(
            &Tables::load(),
            w,
            row_bytes,
            nb,
            x,
            out,
            prefetch_distance()
        );
    }
}

/// [`rows_element_major`] for rows of one block pair (at most 2 blocks, such as the 80B
/// experts' down rows): two rows at a time, their four block sums from one [`quad_sums`]
/// reduction, each row's f32 operations those of `rows_dot!`; software-pipelined like it.
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c,gfni,avx512bitalg"
)]
fn rows_one_pair(
    w: &[u8],
    row_bytes: usize,
    nb: usize,
    x: &[BlockQ8K],
    out: &mut [f32],
    ahead: usize,
) {
    let rows = out.len();
    assert!(
        (1..=2).contains(&nb)
            && nb * IQ2_XXS_BYTES <= row_bytes
            && rows > 0
            && (rows - 1) * row_bytes + nb * IQ2_XXS_BYTES <= w.len()
            && x.len() >= 2
    );
    let t = Tables::load();
    let wp = w.as_ptr();
    // The 64 bytes after `d` of block 0 and of block `nb − 1` of the row at `b`.
    // SAFETY (of every use): `b` is the start of a row, whose first `nb` blocks are in `w`.
    let first = |b: *const u8| unsafe { _mm512_loadu_si512(b.add(2).cast()) };
    let second =
        |b: *const u8| unsafe { _mm512_loadu_si512(b.add((nb - 1) * IQ2_XXS_BYTES + 2).cast()) };
    let prefetch = |row: *const u8| prefetch_row(row, ahead, row_bytes);
    let y2 = &x[..2];
    // The f32 operations of `rows_dot!` for the row at `b` with block sums `s0`, `s1`.
    // SAFETY: `b` (and `b + 66` when `nb > 1`) start blocks of a row.
    let row_value = |b: *const u8, s0: f32, s1: f32| unsafe {
        let mut sumf = 0.0f32;
        sumf += block_d(b) * y2[0].d * s0;
        if nb > 1 {
            sumf += block_d(b.add(IQ2_XXS_BYTES)) * y2[1].d * s1;
        }
        0.125 * sumf
    };
    let mut next = decode(&t, first(wp), second(wp));
    let mut r = 0;
    while r + 1 < rows {
        let ra = wp.wrapping_add(r * row_bytes);
        let rb = ra.wrapping_add(row_bytes);
        prefetch(ra);
        prefetch(rb);
        let d = next;
        next = decode(&t, first(rb), second(rb));
        let va = pair_vec(&d, y2);
        let d = next;
        if r + 2 < rows {
            let rc = rb.wrapping_add(row_bytes);
            next = decode(&t, first(rc), second(rc));
        }
        let vb = pair_vec(&d, y2);
        let f = quad_sums(va, vb);
        out[r] = row_value(ra, f[0], f[1]);
        out[r + 1] = row_value(rb, f[2], f[3]);
        r += 2;
    }
    if r < rows {
        // The last row of an odd count (`next` is its pair).
        let ra = wp.wrapping_add(r * row_bytes);
        prefetch(ra);
        let (s0, s1) = hsum_halves(pair_vec(&next, y2));
        out[r] = row_value(ra, s0 as f32, s1 as f32);
    }
}

/// Asks for the `row_bytes` bytes `ahead` bytes after `row` (0: nothing), one request per cache
/// line. A prefetch never faults, so lines past the end of the weights are harmless.
#[inline(always)]
fn prefetch_row(row: *const u8, ahead: usize, row_bytes: usize) {
    if ahead == 0 {
        return;
    }
    let p = row.wrapping_add(ahead);
    let mut line = 0;
    while line < row_bytes {
        // SAFETY: SSE is part of x86-64; a prefetch reads nothing and never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(line).cast()) };
        line += 64;
    }
}
