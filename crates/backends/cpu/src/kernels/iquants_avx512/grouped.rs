//! Multi-row IQ2_XXS kernel on grouped offset activations
//! (`kquants_multi_x86::grouped_activations(_, true)`): i32 lane `l` of each of the four 64-byte
//! chunks of a block belongs to sub-block `l / 2`, so one row's four `vpdpbusd` (offset quants
//! `q8 + 128` unsigned × signed weights) leave in each lane a sum of 16 products of one
//! sub-block, which one `vpmulld` scales. That is 5 multiplies per block and row instead of the
//! 8 (`vpmaddubsw` + `vpdpwssd` per chunk) of [`super::iq2_xxs_rows_offset`]; the exact i32
//! block sum and the f32 arithmetic are that kernel's, so the results are bit-identical to it
//! (and to the single-row kernel).

use super::{
    f16_to_f32, hsum4_512, load256, load64, lookup256, BlockQ8K, IQ2XXS_CODE_HI, IQ2XXS_CODE_LO,
    IQ2_VALUES, IQ2_XXS_BYTES, SHIFT_2J, V64,
};
use core::arch::x86_64::*;

/// The most activation rows [`iq2_xxs_multi_row_grouped`] takes per call.
pub(crate) const ROWS: usize = 8;

/// Grouped chunk `k`, qword `s`: the low (byte 0) and high (byte 1) code bytes of grid row `k`
/// of sub-block `s` (index byte `8s + k` of the block).
static ROW_CODES: [V64; 4] = {
    const fn chunk(k: usize) -> V64 {
        lanes!(|g, j| {
            let p = (8 * g + k) as u8;
            if j == 1 {
                64 + p
            } else {
                p
            }
        })
    }
    [chunk(0), chunk(1), chunk(2), chunk(3)]
};

/// `vpmultishiftqb` control: byte `k < 4` of qword `s` takes the 8 bits at 32 + 7k, whose low 7
/// are the sign index of grid row `k` of sub-block `s` (the aux word is the qword's high half).
static SIGN_SHIFTS: V64 = lanes!(|_g, j| if j < 4 { (32 + 7 * j) as u8 } else { 0 });

/// 7-bit sign index → its sign byte (the index plus an even-parity bit 7), as two 64-byte
/// halves for `vpermt2b`.
static KSIGNS: [V64; 2] = {
    const fn half(h: usize) -> V64 {
        let mut t = [0u8; 64];
        let mut i = 0;
        while i < 64 {
            let v = (64 * h + i) as u8;
            t[i] = v | (((v.count_ones() & 1) as u8) << 7);
            i += 1;
        }
        V64(t)
    }
    [half(0), half(1)]
};

/// Chunk `k`: every byte of qword `s` takes sign byte `k` of qword `s` (grid row `k` of
/// sub-block `s`).
static SIGN_BCAST: [V64; 4] = {
    const fn chunk(k: usize) -> V64 {
        lanes!(|g, _j| (8 * g + k) as u8)
    }
    [chunk(0), chunk(1), chunk(2), chunk(3)]
};

/// Byte `j` of every qword: bit `j` (which of the 8 elements of a grid row a sign bit flips).
static ELEMENT_BITS: V64 = lanes!(|_g, j| 1u8 << j);

pub(crate) fn iq2_xxs_multi_row_grouped(w: &[u8], xs: &[&[BlockQ8K]], out: &mut [f32]) {
    let blocks = xs.iter().map(|x| x.len()).min().unwrap_or(0);
    let nb = (w.len() / IQ2_XXS_BYTES).min(blocks);
    let w = &w[..nb * IQ2_XXS_BYTES];
    /// `R` rows of `xs`, cut to `nb` blocks.
    fn rows<'a, const R: usize>(xs: &[&'a [BlockQ8K]], nb: usize) -> [&'a [BlockQ8K]; R] {
        core::array::from_fn(|r| &xs[r][..nb])
    }
    // SAFETY: handed out by `multi_kernel_grouped` only when `supported()` holds.
    unsafe {
        match xs.len() {
            0 => {}
            1 => out[..1].copy_from_slice(&rows_grouped::<1>(w, rows(xs, nb))),
            2 => out[..2].copy_from_slice(&rows_grouped::<2>(w, rows(xs, nb))),
            3 => out[..3].copy_from_slice(&rows_grouped::<3>(w, rows(xs, nb))),
            4 => out[..4].copy_from_slice(&rows_grouped::<4>(w, rows(xs, nb))),
            5 => out[..5].copy_from_slice(&rows_grouped::<5>(w, rows(xs, nb))),
            6 => out[..6].copy_from_slice(&rows_grouped::<6>(w, rows(xs, nb))),
            7 => out[..7].copy_from_slice(&rows_grouped::<7>(w, rows(xs, nb))),
            8 => out[..8].copy_from_slice(&rows_grouped::<8>(w, rows(xs, nb))),
            // The driver never passes more than ROWS rows.
            _ => out.fill(f32::NAN),
        }
    }
}

/// IQ2_XXS · grouped offset Q8_K for `R` ≤ 8 rows (`w` and every row cut to the same blocks).
///
/// Per block: the signed weights of the four grouped chunks (the same grid lookups as the plain
/// kernel, with other row-code tables; the sign bits of all 32 grid rows turned into sign bytes
/// by one table lookup and spread over the elements with `vptestmb`), the sub-block scales per
/// lane, and `tc` = the four chunks' `vpdpbusd` with 128 (what the offset adds). Per row,
/// `Σ lanes (t − tc) · scale` is the exact block sum of [`super::iq2_xxs_rows_offset`].
#[allow(clippy::needless_range_loop)] // block `i` of the weights and of every activation row
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
fn rows_grouped<const R: usize>(w: &[u8], xs: [&[BlockQ8K]; R]) -> [f32; R] {
    let code_lo = load256(&IQ2XXS_CODE_LO);
    let code_hi = load256(&IQ2XXS_CODE_HI);
    let values = load64(&IQ2_VALUES);
    let shift_2j = load64(&SHIFT_2J);
    let one = _mm512_set1_epi64(1);
    let offset = _mm512_set1_epi8(0x80u8 as i8);
    let low7 = _mm512_set1_epi8(0x7F);
    let row_codes = ROW_CODES.each_ref().map(|v| load64(v));
    let sign_shifts = load64(&SIGN_SHIFTS);
    let ksigns = KSIGNS.each_ref().map(|v| load64(v));
    let sign_bcast = SIGN_BCAST.each_ref().map(|v| load64(v));
    let element_bits = load64(&ELEMENT_BITS);
    // Lane l → qword l / 2 (its low dword: the scale of sub-block l / 2).
    let scale_lanes = _mm512_setr_epi32(0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14);

    let mut sumf = [0.0f32; R];
    let mut sum4 = [_mm_setzero_ps(); 2];
    for (i, b) in w.chunks_exact(IQ2_XXS_BYTES).enumerate() {
        let dw = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
        // SAFETY: `b[2..66]` is 64 readable bytes.
        let q = unsafe { _mm512_loadu_si512(b[2..66].as_ptr().cast()) };
        let high_half = _mm512_movepi8_mask(q);
        let lo = lookup256(&code_lo, q, high_half);
        let hi = lookup256(&code_hi, q, high_half);
        // Qword s: 2·(aux >> 28) + 1, the scale of sub-block s; then one per lane.
        let scales = _mm512_or_si512(_mm512_srli_epi64::<59>(q), one);
        let s32 = _mm512_permutexvar_epi32(scale_lanes, scales);
        // Byte k of qword s: the sign byte of grid row k of sub-block s.
        let sidx = _mm512_and_si512(_mm512_multishift_epi64_epi8(sign_shifts, q), low7);
        let signs = _mm512_permutex2var_epi8(ksigns[0], sidx, ksigns[1]);
        let mut signed = [_mm512_setzero_si512(); 4];
        let mut tc = _mm512_setzero_si512();
        for k in 0..4 {
            let codes = _mm512_permutex2var_epi8(lo, row_codes[k], hi);
            let grid =
                _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(shift_2j, codes), values);
            let flip =
                _mm512_test_epi8_mask(_mm512_permutexvar_epi8(sign_bcast[k], signs), element_bits);
            signed[k] = _mm512_mask_sub_epi8(grid, flip, _mm512_setzero_si512(), grid);
            tc = _mm512_dpbusd_epi32(tc, offset, signed[k]);
        }
        // Row r's exact block sum, spread over the 16 lanes.
        let row_sum = |r: usize| {
            let y = xs[r][i].qs.as_ptr();
            let mut t = _mm512_setzero_si512();
            for k in 0..4 {
                // SAFETY: `qs` is 256 readable bytes.
                let yv = unsafe { _mm512_loadu_si512(y.add(64 * k).cast()) };
                t = _mm512_dpbusd_epi32(t, yv, signed[k]);
            }
            _mm512_mullo_epi32(_mm512_sub_epi32(t, tc), s32)
        };
        for (g, s4) in sum4.iter_mut().enumerate().take(R / 4) {
            let r0 = 4 * g;
            let sums = [
                row_sum(r0),
                row_sum(r0 + 1),
                row_sum(r0 + 2),
                row_sum(r0 + 3),
            ];
            // SAFETY: AVX-512 F is enabled for this function.
            let isum = _mm_cvtepi32_ps(unsafe { hsum4_512(sums) });
            let yd = _mm_setr_ps(
                xs[r0][i].d,
                xs[r0 + 1][i].d,
                xs[r0 + 2][i].d,
                xs[r0 + 3][i].d,
            );
            *s4 = _mm_add_ps(*s4, _mm_mul_ps(_mm_mul_ps(_mm_set1_ps(dw), yd), isum));
        }
        for r in R / 4 * 4..R {
            let d = dw * xs[r][i].d;
            sumf[r] += d * _mm512_reduce_add_epi32(row_sum(r)) as f32;
        }
    }
    for (g, s4) in sum4.iter().enumerate().take(R / 4) {
        let mut four = [0.0f32; 4];
        // SAFETY: `four` is 4 writable f32.
        unsafe { _mm_storeu_ps(four.as_mut_ptr(), *s4) };
        sumf[4 * g..4 * g + 4].copy_from_slice(&four);
    }
    sumf.map(|s| 0.125 * s)
}

// ---------------------------------------------------------------------------------------------
// Tile GEMM: 16 weight rows interleaved per lane, for experts with many tokens
// ---------------------------------------------------------------------------------------------

/// Weight rows per tile (one per i32 lane).
const TILE_ROWS: usize = 16;

/// One IQ2_XXS block of 16 weight rows, lane `r` = weight row `r`: the signed weights as bytes,
/// four per lane (`q[g]`: elements `4g..4g + 4`), the sub-block scales `2s + 1`, the offset
/// correction `Σ_s scale_s · 128 · Σ_{e ∈ s} w_e`, and `d`.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct Iq2xxsTileBlock {
    q: [[u8; 64]; 64],
    scales: [[i32; 16]; 8],
    corr: [i32; 16],
    d: [f32; 16],
}

impl Iq2xxsTileBlock {
    const ZERO: Iq2xxsTileBlock = Iq2xxsTileBlock {
        q: [[0; 64]; 64],
        scales: [[0; 16]; 8],
        corr: [0; 16],
        d: [0.0; 16],
    };
}

/// Repacks up to 16 IQ2_XXS weight rows (`rows_here` rows of `rb` bytes, `nb` blocks) into `out`.
pub(crate) fn iq2_xxs_tile_repack(
    w: &[u8],
    rows_here: usize,
    rb: usize,
    nb: usize,
    out: &mut Vec<Iq2xxsTileBlock>,
) {
    use redlite_gguf::quant::grids::{IQ2XXS_GRID, KSIGNS_IQ2XS};
    out.clear();
    out.resize(nb, Iq2xxsTileBlock::ZERO);
    for (i, t) in out.iter_mut().enumerate() {
        for r in 0..rows_here.min(TILE_ROWS) {
            let b = &w[r * rb + i * IQ2_XXS_BYTES..][..IQ2_XXS_BYTES];
            t.d[r] = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
            let mut corr = 0i32;
            for (s, sub) in b[2..].chunks_exact(8).enumerate() {
                let aux = u32::from_le_bytes([sub[4], sub[5], sub[6], sub[7]]);
                let scale = 2 * (aux >> 28) as i32 + 1;
                t.scales[s][r] = scale;
                let mut wsum = 0i32;
                for k in 0..4 {
                    let grid = IQ2XXS_GRID[sub[k] as usize];
                    let signs = u64::from(KSIGNS_IQ2XS[((aux >> (7 * k)) & 127) as usize]);
                    // Byte j of `neg`: 0xFF where sign bit j is set. Negating a byte (≥ 8) as
                    // `!g + 1` never carries into the next byte.
                    const LOW7: u64 = 0x7F7F_7F7F_7F7F_7F7F;
                    let bit = (signs * 0x0101_0101_0101_0101) & 0x8040_2010_0804_0201;
                    let set = (((bit & LOW7) + LOW7) | bit) & !LOW7;
                    let neg = (set >> 7) * 0xFF;
                    let v = ((grid ^ neg).wrapping_add(neg & 0x0101_0101_0101_0101)).to_le_bytes();
                    wsum += v.iter().map(|&b| i32::from(b as i8)).sum::<i32>();
                    // Elements 32s + 8k + 0..8: groups 8s + 2k and 8s + 2k + 1.
                    let g0 = 8 * s + 2 * k;
                    t.q[g0][4 * r..4 * r + 4].copy_from_slice(&v[..4]);
                    t.q[g0 + 1][4 * r..4 * r + 4].copy_from_slice(&v[4..]);
                }
                corr += scale * 128 * wsum;
            }
            t.corr[r] = corr;
        }
    }
}

/// The IQ2_XXS tile micro-kernel: the 16 weight rows of `tile` against `ys.len()` ≤ 4
/// activation rows in offset form (`q8 ^ 0x80`, `iquants_avx512::offset_activations`);
/// `out[j][r]` gets weight row `r` · activation row `j`.
///
/// Per sub-block eight `vpdpbusd` (offset quants broadcast four at a time × signed weights) give
/// lane `r` its sum of 32 products, `vpmulld` scales it; the correction for the offset comes off
/// once per block. These are the exact i32 block sums of the single-row kernel, and per lane the
/// f32 update is its `(d · y.d) · isum` in block order, then `· 0.125`: bit-identical.
pub(crate) fn iq2_xxs_tile_rows(
    tile: &[Iq2xxsTileBlock],
    ys: &[&[BlockQ8K]],
    out: &mut [[f32; TILE_ROWS]],
) {
    /// The first `J` entries of `v`.
    fn first<T: Copy, const J: usize>(v: &[T]) -> [T; J] {
        core::array::from_fn(|j| v[j])
    }
    if !super::supported() {
        return;
    }
    // SAFETY: the features were checked above.
    unsafe {
        match ys.len() {
            1 => out[..1].copy_from_slice(&iq2_tile_j::<1>(tile, first(ys))),
            2 => out[..2].copy_from_slice(&iq2_tile_j::<2>(tile, first(ys))),
            3 => out[..3].copy_from_slice(&iq2_tile_j::<3>(tile, first(ys))),
            4 => out[..4].copy_from_slice(&iq2_tile_j::<4>(tile, first(ys))),
            _ => {}
        }
    }
}

#[allow(clippy::needless_range_loop)] // block `i` of the tile and of every activation row
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
unsafe fn iq2_tile_j<const J: usize>(
    tile: &[Iq2xxsTileBlock],
    ys: [&[BlockQ8K]; J],
) -> [[f32; TILE_ROWS]; J] {
    let nb = ys.iter().map(|y| y.len()).fold(tile.len(), usize::min);
    let mut facc = [_mm512_setzero_ps(); J];
    for i in 0..nb {
        let tb = &tile[i];
        let mut isum = [_mm512_setzero_si512(); J];
        for s in 0..8 {
            let mut t = [_mm512_setzero_si512(); J];
            for g in 0..8 {
                let wv = _mm512_load_si512(tb.q[8 * s + g].as_ptr().cast());
                for j in 0..J {
                    let p = ys[j][i].qs.as_ptr().add(32 * s + 4 * g) as *const i32;
                    let a = _mm512_set1_epi32(p.read_unaligned());
                    t[j] = _mm512_dpbusd_epi32(t[j], a, wv);
                }
            }
            let sc = _mm512_load_si512(tb.scales[s].as_ptr().cast());
            for j in 0..J {
                isum[j] = _mm512_add_epi32(isum[j], _mm512_mullo_epi32(t[j], sc));
            }
        }
        let corr = _mm512_load_si512(tb.corr.as_ptr().cast());
        let d = _mm512_load_ps(tb.d.as_ptr());
        for j in 0..J {
            let isum = _mm512_sub_epi32(isum[j], corr);
            let dy = _mm512_mul_ps(d, _mm512_set1_ps(ys[j][i].d));
            facc[j] = _mm512_add_ps(facc[j], _mm512_mul_ps(dy, _mm512_cvtepi32_ps(isum)));
        }
    }
    let eighth = _mm512_set1_ps(0.125);
    let mut out = [[0.0f32; TILE_ROWS]; J];
    for j in 0..J {
        _mm512_storeu_ps(out[j].as_mut_ptr(), _mm512_mul_ps(eighth, facc[j]));
    }
    out
}
