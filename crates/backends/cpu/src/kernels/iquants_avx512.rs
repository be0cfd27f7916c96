//! AVX-512 versions of the hot i-quant kernels (x86-64 only): IQ2_XXS, IQ3_XXS, IQ3_S, IQ1_M,
//! IQ4_XS.
//!
//! They need AVX-512 F/BW/VL plus **VBMI** (byte permutes, `vpmultishiftqb`) and **VNNI**
//! (`vpdpwssd`), BMI2 and F16C; [`supported`] checks all of them and [`kernel`] only hands the
//! kernels out when it is true (else the dispatch falls back to a lower level).
//!
//! # Technique
//! The arithmetic is the one of the scalar kernels in [`super::iquants`] (exact integers inside a
//! block, one f32 multiply-add per block), laid out for 64 elements (two 32-element sub-blocks) per
//! 512-bit register:
//!
//! * **Grid rows without memory gathers** (IQ2_XXS, IQ3_XXS, IQ3_S). The grids have only 3 (IQ2)
//!   or 8 (IQ3) distinct values, so a grid row compresses to a 16-bit code of 2- or 4-bit
//!   value indices. The code tables (256 or 512 × 16 bits, split into a low-byte and a high-byte
//!   table of four or eight registers each) are looked up for all 64 index bytes of a block at
//!   once with `vpermi2b` (two or four per table, blended by the high index bits). Per 64 elements one `vpermi2b` moves each
//!   row's code into its own 64-bit lane, `vpmultishiftqb` extracts every element's value index
//!   into its own byte, and a `vpermb` through a 64-byte table turns indices into grid values.
//! * **Signs as mask registers.** Eight 7-bit sign indices are spread to bytes with `pdep` and
//!   completed with their parity bit (= `KSIGNS`) in general-purpose registers, giving the 64-bit
//!   flip mask of 64 elements directly (IQ3_S stores that mask as is). This keeps the vector
//!   ports, the bottleneck, free of sign work.
//! * **Exact products with −128.** The signed grid values (|v| ≤ 127) are the signed operand of
//!   `vpmaddubsw`; the unsigned operand is `|q8|` (so −128 becomes 128, exactly), and the sign of
//!   `q8` is moved to the weight by XOR-ing the sign masks. Pair sums stay within i16.
//! * **Scales** are applied by `vpdpwssd` (i16 pair sums × i16 sub-block scale, accumulated in
//!   i32). Each block's 16 lanes are then summed exactly and the scalar kernels' f32 operations
//!   follow (`sumf += d · bsum`), so results are bit-identical to them. (Accumulating
//!   `cvt(acc) · d` per lane instead, as ggml does, is 10–35% faster on Zen 4 but lost up to
//!   1e-5 relative on fixture blocks whose lanes cancel.)
//!
//! IQ2_XXS runs two blocks at a time: the 32 grid-row indices of both are packed into one
//! register (one set of code lookups for the pair) and both block sums come out of one
//! horizontal reduction (13% fewer ns per block than one block at a time on Zen 4).
//! [`vec_dot_iq2_xxs_q8_k_avx512_multi`] decodes each IQ2_XXS weight block once for up to four
//! activation rows (batched products; the driver's `matmul` uses it through [`multi_kernel`]).
//! Decode (one activation row) runs IQ2_XXS through `element_major` where the CPU has GFNI:
//! activations reordered once per input, grid values by `vgf2p8affineqb`, ~1.5× fewer ns per
//! block than the kernels here (same results bit for bit).
//!
//! IQ1_M has a 2048-row grid of {−1, 0, +1}: its rows are loaded one by one (row indices are
//! computed in a vector register, then stored) and assembled with `_mm512_set_epi64`.

use super::iquants::{IQ1_M_BYTES, IQ2_XXS_BYTES, IQ3_S_BYTES, IQ3_XXS_BYTES, IQ4_XS_BYTES};
use super::q8::{BlockQ8K, QK_K};
use super::x86_util::hsum4_512;
use super::RowDot;
use core::arch::x86_64::*;
use redlite_gguf::quant::grids::{IQ1S_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KVALUES_IQ4NL};
use redlite_gguf::quant::GgmlType;

/// Whether the running CPU has everything the kernels of this module use.
pub fn supported() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vbmi")
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("bmi2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// The AVX-512 kernel for `ty`, if there is one and the CPU has every feature it needs.
pub fn kernel(ty: GgmlType) -> Option<RowDot> {
    if !supported() {
        return None;
    }
    Some(match ty {
        GgmlType::IQ2XXS => RowDot::Q8K(iq2_xxs_row),
        GgmlType::IQ3XXS => RowDot::Q8K(iq3_xxs_row),
        GgmlType::IQ3S => RowDot::Q8K(iq3_s_row),
        GgmlType::IQ4XS => RowDot::Q8K(iq4_xs_row),
        GgmlType::IQ1M => RowDot::Q8K(iq1_m_row),
        _ => return None,
    })
}

/// A multi-row kernel: one weight row against up to [`MULTI_ROWS`] Q8_K activation rows (one
/// result per row in `out`), each result bit-identical to the single-row kernel of the same type.
pub type MultiRowDot = fn(w: &[u8], xs: &[&[BlockQ8K]], out: &mut [f32]);

/// The most activation rows a [`MultiRowDot`] takes per call.
pub const MULTI_ROWS: usize = 4;

/// The most activation rows a kernel of [`multi_kernel_offset`] (or of the Q4_K multi-row
/// kernel) takes per call.
pub const MULTI_ROWS_WIDE: usize = 8;

/// The multi-row kernel for `ty` when [`kernel`] hands out this module's single-row kernel for it
/// (same arithmetic per row), else `None`.
pub fn multi_kernel(ty: GgmlType) -> Option<MultiRowDot> {
    if !supported() {
        return None;
    }
    match ty {
        GgmlType::IQ2XXS => Some(iq2_xxs_multi_row),
        _ => None,
    }
}

/// The multi-row kernel for `ty` that takes its activation rows in offset form
/// ([`offset_activations`]), when [`kernel`] hands out this module's single-row kernel for it
/// (same block sums and f32 arithmetic per row), else `None`.
pub fn multi_kernel_offset(ty: GgmlType) -> Option<MultiRowDot> {
    if !supported() {
        return None;
    }
    match ty {
        GgmlType::IQ2XXS => Some(iq2_xxs_multi_row_offset),
        _ => None,
    }
}

fn iq2_xxs_multi_row_offset(w: &[u8], xs: &[&[BlockQ8K]], out: &mut [f32]) {
    let blocks = xs.iter().map(|x| x.len()).min().unwrap_or(0);
    let nb = (w.len() / IQ2_XXS_BYTES).min(blocks);
    let w = &w[..nb * IQ2_XXS_BYTES];
    /// `R` rows of `xs`, cut to `nb` blocks.
    fn rows<'a, const R: usize>(xs: &[&'a [BlockQ8K]], nb: usize) -> [&'a [BlockQ8K]; R] {
        core::array::from_fn(|r| &xs[r][..nb])
    }
    // SAFETY: handed out by `multi_kernel_offset` only when `supported()` holds.
    unsafe {
        match xs.len() {
            0 => {}
            1 => out[..1].copy_from_slice(&iq2_xxs_rows_offset::<1>(w, rows(xs, nb))),
            2 => out[..2].copy_from_slice(&iq2_xxs_rows_offset::<2>(w, rows(xs, nb))),
            3 => out[..3].copy_from_slice(&iq2_xxs_rows_offset::<3>(w, rows(xs, nb))),
            4 => out[..4].copy_from_slice(&iq2_xxs_rows_offset::<4>(w, rows(xs, nb))),
            5 => out[..5].copy_from_slice(&iq2_xxs_rows_offset::<5>(w, rows(xs, nb))),
            6 => out[..6].copy_from_slice(&iq2_xxs_rows_offset::<6>(w, rows(xs, nb))),
            7 => out[..7].copy_from_slice(&iq2_xxs_rows_offset::<7>(w, rows(xs, nb))),
            8 => out[..8].copy_from_slice(&iq2_xxs_rows_offset::<8>(w, rows(xs, nb))),
            // The driver never passes more than MULTI_ROWS_WIDE rows.
            _ => out.fill(f32::NAN),
        }
    }
}

fn iq2_xxs_multi_row(w: &[u8], xs: &[&[BlockQ8K]], out: &mut [f32]) {
    let blocks = xs.iter().map(|x| x.len()).min().unwrap_or(0);
    let n = (w.len() / IQ2_XXS_BYTES).min(blocks) * QK_K;
    // SAFETY: handed out by `multi_kernel` only when `supported()` holds; the driver passes at
    // most `MULTI_ROWS` rows and as many outputs.
    unsafe { vec_dot_iq2_xxs_q8_k_avx512_multi(n, w, xs, out) }
}

// ---------------------------------------------------------------------------------------------
// Constant tables (built at compile time from the grids of redlite-gguf).
// ---------------------------------------------------------------------------------------------

/// 64 bytes, aligned for a 512-bit load.
#[repr(C, align(64))]
struct V64([u8; 64]);

/// 256 bytes: four 512-bit registers.
#[repr(C, align(64))]
struct V256([u8; 256]);

/// The 2-bit index of an IQ2 grid value (8, 25, 43).
const fn iq2_value_index(v: u8) -> u16 {
    match v {
        8 => 0,
        25 => 1,
        43 => 2,
        _ => panic!("IQ2 grid value outside (8, 25, 43)"),
    }
}

/// Low (`HIGH = false`) or high byte of the 16-bit code of every IQ2_XXS grid row: element `j`'s
/// value index in bits `2j..2j + 2`.
const fn iq2xxs_code_bytes(high: bool) -> V256 {
    let mut out = [0u8; 256];
    let mut r = 0;
    while r < 256 {
        let row = IQ2XXS_GRID[r];
        let mut code = 0u16;
        let mut j = 0;
        while j < 8 {
            code |= iq2_value_index((row >> (8 * j)) as u8) << (2 * j);
            j += 1;
        }
        out[r] = if high { (code >> 8) as u8 } else { code as u8 };
        r += 1;
    }
    V256(out)
}

static IQ2XXS_CODE_LO: V256 = iq2xxs_code_bytes(false);
static IQ2XXS_CODE_HI: V256 = iq2xxs_code_bytes(true);

/// Value index → IQ2 grid value, for `vpermb` (only the low 2 bits of an index matter).
static IQ2_VALUES: V64 = {
    let mut t = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        t[i] = [8, 25, 43, 0][i & 3];
        i += 1;
    }
    V64(t)
};

/// The 3-bit index of an IQ3 grid value (4, 12, …, 52, 62): `(v − 4) >> 3`.
const fn iq3_value_index(v: u8) -> u16 {
    match v {
        4 | 12 | 20 | 28 | 36 | 44 | 52 | 62 => ((v - 4) >> 3) as u16,
        _ => panic!("IQ3 grid value outside (4, 12, ..., 52, 62)"),
    }
}

/// Low or high byte of the 16-bit code of every IQ3_XXS grid row: element `j`'s value index in
/// bits `4j..4j + 3`.
const fn iq3xxs_code_bytes(high: bool) -> V256 {
    let mut out = [0u8; 256];
    let mut r = 0;
    while r < 256 {
        let row = IQ3XXS_GRID[r];
        let mut code = 0u16;
        let mut j = 0;
        while j < 4 {
            code |= iq3_value_index((row >> (8 * j)) as u8) << (4 * j);
            j += 1;
        }
        out[r] = if high { (code >> 8) as u8 } else { code as u8 };
        r += 1;
    }
    V256(out)
}

static IQ3XXS_CODE_LO: V256 = iq3xxs_code_bytes(false);
static IQ3XXS_CODE_HI: V256 = iq3xxs_code_bytes(true);

/// Value index → IQ3 grid value, for `vpermb` (only the low 3 bits of an index matter).
static IQ3_VALUES: V64 = {
    let mut t = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        t[i] = [4, 12, 20, 28, 36, 44, 52, 62][i & 7];
        i += 1;
    }
    V64(t)
};

/// 512 bytes: eight 512-bit registers.
#[repr(C, align(64))]
struct V512([u8; 512]);

/// Low or high byte of the 16-bit code of every IQ3_S grid row: element `j`'s value index
/// (`(v − 1) / 2` for the values 1, 3, …, 15) in bits `4j..4j + 3`.
const fn iq3s_code_bytes(high: bool) -> V512 {
    let mut out = [0u8; 512];
    let mut r = 0;
    while r < 512 {
        let row = IQ3S_GRID[r];
        let mut code = 0u16;
        let mut j = 0;
        while j < 4 {
            let v = (row >> (8 * j)) as u8;
            assert!(
                v % 2 == 1 && v <= 15,
                "IQ3_S grid value outside (1, 3, ..., 15)"
            );
            code |= ((v / 2) as u16) << (4 * j);
            j += 1;
        }
        out[r] = if high { (code >> 8) as u8 } else { code as u8 };
        r += 1;
    }
    V512(out)
}

static IQ3S_CODE_LO: V512 = iq3s_code_bytes(false);
static IQ3S_CODE_HI: V512 = iq3s_code_bytes(true);

/// Value index → IQ3_S grid value `2i + 1`, for `vpermb` (only the low 3 bits of an index
/// matter).
static IQ3S_VALUES: V64 = {
    let mut t = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        t[i] = 2 * (i & 7) as u8 + 1;
        i += 1;
    }
    V64(t)
};

/// Nibble → IQ4_NL value (as i8 bits), for `vpermb` (only the low 4 bits of an index matter).
static IQ4_VALUES: V64 = {
    let mut t = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        t[i] = KVALUES_IQ4NL[i & 15] as u8;
        i += 1;
    }
    V64(t)
};

/// Builds a `V64` whose byte `8g + j` is `$e` (with `g` and `j` bound).
macro_rules! lanes {
    (|$g:ident, $j:ident| $e:expr) => {{
        let mut t = [0u8; 64];
        let mut i = 0;
        while i < 64 {
            let $g = i / 8;
            let $j = i % 8;
            t[i] = $e;
            i += 1;
        }
        V64(t)
    }};
}

/// Builds a `V64` of 32 u16 words, word `k` being `$e` (with `k` bound).
macro_rules! words {
    (|$k:ident| $e:expr) => {{
        let mut t = [0u8; 64];
        let mut i = 0;
        while i < 32 {
            let $k = i;
            let v: u16 = $e;
            t[2 * i] = v as u8;
            t[2 * i + 1] = (v >> 8) as u8;
            i += 1;
        }
        V64(t)
    }};
}

/// IQ2_XXS, chunk `c` (sub-blocks `2c`, `2c + 1`): lane `g` gathers the low and high code bytes
/// of grid row `l = g % 4` of sub-block `2c + g / 4`, whose index byte sits at `8·sb + l` of the
/// 64 bytes after `d` (`vpermi2b`: 0..63 = low table result, 64..127 = high).
static IQ2XXS_ROW_CODES: [V64; 4] = {
    const fn chunk(c: usize) -> V64 {
        lanes!(|g, j| {
            let p = (8 * (2 * c + g / 4) + g % 4) as u8;
            if j == 1 {
                64 + p
            } else {
                p
            }
        })
    }
    [chunk(0), chunk(1), chunk(2), chunk(3)]
};

/// `vpmultishiftqb` control: byte `j` of a lane takes bits `2j..` (IQ2 value index of element j).
static SHIFT_2J: V64 = lanes!(|_g, j| (2 * j) as u8);

/// `vpmultishiftqb` control: byte `j` takes bits `4j..` (IQ3 value index of element j: the two
/// 16-bit row codes sit at bits 0 and 16 of the lane) — for j < 4: 4j, else 16 + 4(j − 4).
static SHIFT_IQ3: V64 = lanes!(|_g, j| if j < 4 {
    (4 * j) as u8
} else {
    (16 + 4 * (j - 4)) as u8
});

/// IQ2_XXS, chunk `c`: words 0..16 take word `4·2c` (the scale of sub-block `2c`, in the low word
/// of its 64-bit lane), words 16..32 word `4·(2c + 1)`.
static IQ2XXS_SCALE_WORDS: [V64; 4] = {
    const fn chunk(c: usize) -> V64 {
        words!(|k| (4 * (2 * c + k / 16)) as u16)
    }
    [chunk(0), chunk(1), chunk(2), chunk(3)]
};

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
fn load64(v: &V64) -> __m512i {
    // SAFETY: `V64` is 64 readable, 64-byte aligned bytes.
    unsafe { _mm512_load_si512(v.0.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
fn load256(v: &V256) -> [__m512i; 4] {
    // SAFETY: `V256` is 256 readable, 64-byte aligned bytes.
    unsafe {
        let p = v.0.as_ptr();
        [
            _mm512_load_si512(p.cast()),
            _mm512_load_si512(p.add(64).cast()),
            _mm512_load_si512(p.add(128).cast()),
            _mm512_load_si512(p.add(192).cast()),
        ]
    }
}

/// Looks every byte of `idx` up in a 256-byte table held in four registers.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
fn lookup256(t: &[__m512i; 4], idx: __m512i, high_half: __mmask64) -> __m512i {
    let low = _mm512_permutex2var_epi8(t[0], idx, t[1]);
    let high = _mm512_permutex2var_epi8(t[2], idx, t[3]);
    _mm512_mask_blend_epi8(high_half, low, high)
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
fn load512(v: &V512) -> [__m512i; 8] {
    // SAFETY: `V512` is 512 readable, 64-byte aligned bytes.
    core::array::from_fn(|i| unsafe { _mm512_load_si512(v.0.as_ptr().add(64 * i).cast()) })
}

/// Looks 9-bit indices up in a 512-byte table held in eight registers: the low 7 bits are the
/// bytes of `idx`, bit 7 is in `bit7` and bit 8 in `bit8`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
fn lookup512(t: &[__m512i; 8], idx: __m512i, bit7: __mmask64, bit8: __mmask64) -> __m512i {
    let q0 = _mm512_permutex2var_epi8(t[0], idx, t[1]);
    let q1 = _mm512_permutex2var_epi8(t[2], idx, t[3]);
    let q2 = _mm512_permutex2var_epi8(t[4], idx, t[5]);
    let q3 = _mm512_permutex2var_epi8(t[6], idx, t[7]);
    let low = _mm512_mask_blend_epi8(bit7, q0, q1);
    let high = _mm512_mask_blend_epi8(bit7, q2, q3);
    _mm512_mask_blend_epi8(bit8, low, high)
}

/// f16 bits → f32 via F16C.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
fn f16_to_f32(bits: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// `Σ_e weight_e · q8_e` for 64 elements as 32 i16 pair sums: `weight` holds signed bytes
/// (|w| ≤ 127) whose signs are flipped where `flip` is set; the sign of `q8` is moved onto the
/// weight so that `|q8|` (exact also for −128) is the unsigned operand.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
fn signed_pairs(weight: __m512i, flip: __mmask64, q8: __m512i) -> __m512i {
    let k = flip ^ _mm512_movepi8_mask(q8);
    let w = _mm512_mask_sub_epi8(weight, k, _mm512_setzero_si512(), weight);
    _mm512_maddubs_epi16(_mm512_abs_epi8(q8), w)
}

/// Loads activation bytes `64c..64c + 64` of a Q8_K block.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
fn load_q8(y: &BlockQ8K, c: usize) -> __m512i {
    let q = &y.qs[64 * c..64 * c + 64];
    // SAFETY: `q` is 64 readable bytes.
    unsafe { _mm512_loadu_si512(q.as_ptr().cast()) }
}

/// The 64-bit flip mask of eight 8-element groups from their eight 7-bit sign indices (packed
/// in the low 56 bits of `idx7`): byte `g` = `KSIGNS[index g]` = the index plus an even-parity
/// bit 7.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
fn sign_mask(idx7: u64) -> u64 {
    let m = _pdep_u64(idx7, 0x7F7F_7F7F_7F7F_7F7F);
    // Bit 0 of every byte of `p` becomes the parity of that byte of `m`.
    let mut p = m ^ (m >> 4);
    p ^= p >> 2;
    p ^= p >> 1;
    m | ((p & 0x0101_0101_0101_0101) << 7)
}

// ---------------------------------------------------------------------------------------------
// IQ2_XXS
// ---------------------------------------------------------------------------------------------

/// IQ2_XXS row · Q8_K row over `min(n / 256, w.len() / 66, x.len())` blocks.
///
/// # Safety
/// The CPU must support the features of [`supported`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
pub unsafe fn vec_dot_iq2_xxs_q8_k_avx512(n: usize, w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = super::iquants::block_count(n, QK_K, w.len(), IQ2_XXS_BYTES, x.len());
    iq2_xxs_pair_row::<true>(&w[..nb * IQ2_XXS_BYTES], &x[..nb])
}

/// One IQ2_XXS weight row against up to four activation rows at once (`xs.len()` ≤ 4 rows, one
/// result each in `out`): each weight block is decoded once for all of them, which makes a row
/// of a batched product (prefill) cheaper than separate [`vec_dot_iq2_xxs_q8_k_avx512`] calls.
/// Blocks: `min(n / 256, w.len() / 66, every xs[r].len())`.
///
/// # Safety
/// The CPU must support the features of [`supported`].
///
/// # Panics
/// If `xs` has more than 4 rows or `out` fewer entries than `xs`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
pub unsafe fn vec_dot_iq2_xxs_q8_k_avx512_multi(
    n: usize,
    w: &[u8],
    xs: &[&[BlockQ8K]],
    out: &mut [f32],
) {
    let Some(x_blocks) = xs.iter().map(|x| x.len()).min() else {
        return;
    };
    let nb = super::iquants::block_count(n, QK_K, w.len(), IQ2_XXS_BYTES, x_blocks);
    let w = &w[..nb * IQ2_XXS_BYTES];
    match *xs {
        [] => {}
        [a] => out[..1].copy_from_slice(&iq2_xxs_pair_rows(w, [&a[..nb]])),
        [a, b] => out[..2].copy_from_slice(&iq2_xxs_rows(w, [&a[..nb], &b[..nb]])),
        [a, b, c] => out[..3].copy_from_slice(&iq2_xxs_rows(w, [&a[..nb], &b[..nb], &c[..nb]])),
        [a, b, c, d] => {
            out[..4].copy_from_slice(&iq2_xxs_rows(w, [&a[..nb], &b[..nb], &c[..nb], &d[..nb]]))
        }
        _ => panic!("vec_dot_iq2_xxs_q8_k_avx512_multi: at most 4 activation rows"),
    }
}

/// The IQ2_XXS kernel for `R` activation rows, one block at a time (`w` and every `xs[r]` hold
/// the same number of blocks). With several rows this beats [`iq2_xxs_pair_rows`], whose two
/// sets of accumulators no longer fit in registers (4 rows: 8.4 vs 10.8 ns per block and row).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
fn iq2_xxs_rows<const R: usize>(w: &[u8], xs: [&[BlockQ8K]; R]) -> [f32; R] {
    let code_lo = load256(&IQ2XXS_CODE_LO);
    let code_hi = load256(&IQ2XXS_CODE_HI);
    let values = load64(&IQ2_VALUES);
    let shift_2j = load64(&SHIFT_2J);
    let one = _mm512_set1_epi64(1);
    let row_codes = IQ2XXS_ROW_CODES.each_ref().map(|v| load64(v));
    let scale_words = IQ2XXS_SCALE_WORDS.each_ref().map(|v| load64(v));

    let mut sumf = [0.0f32; R];
    for (i, b) in w.chunks_exact(IQ2_XXS_BYTES).enumerate() {
        let dw = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
        // The 64 bytes after d: 8 × { 4 grid-row indices, u32 aux }.
        let qs = &b[2..66];
        // SAFETY: `qs` is 64 readable bytes.
        let q = unsafe { _mm512_loadu_si512(qs.as_ptr().cast()) };
        let high_half = _mm512_movepi8_mask(q);
        let lo = lookup256(&code_lo, q, high_half);
        let hi = lookup256(&code_hi, q, high_half);
        // Lane sb: (aux >> 59) | 1 = 2·(aux >> 28) + 1, the scale of sub-block sb.
        let scales = _mm512_or_si512(_mm512_srli_epi64::<59>(q), one);
        let aux = |sb: usize| {
            let at = 8 * sb + 4;
            u32::from_le_bytes([qs[at], qs[at + 1], qs[at + 2], qs[at + 3]])
        };
        let mut acc = [_mm512_setzero_si512(); R];
        for c in 0..4 {
            let codes = _mm512_permutex2var_epi8(lo, row_codes[c], hi);
            let grid =
                _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(shift_2j, codes), values);
            let flip =
                sign_mask(u64::from(aux(2 * c) & 0x0FFF_FFFF) | u64::from(aux(2 * c + 1)) << 28);
            let ls = _mm512_permutexvar_epi16(scale_words[c], scales);
            for r in 0..R {
                let pairs = signed_pairs(grid, flip, load_q8(&xs[r][i], c));
                acc[r] = _mm512_dpwssd_epi32(acc[r], pairs, ls);
            }
        }
        for r in 0..R {
            let d = dw * xs[r][i].d;
            sumf[r] += d * _mm512_reduce_add_epi32(acc[r]) as f32;
        }
    }
    sumf.map(|s| 0.125 * s)
}

/// The IQ2_XXS kernel for `R` activation rows in offset form: each activation block's `qs` holds
/// `q8 ^ 0x80` (= q8 + 128 as an unsigned byte, see [`offset_activations`]). The weight signs are
/// applied to the weights once per block for every row, and a row costs one `vpmaddubsw` +
/// `vpdpwssd` per 64 elements: `Σ w·(q8 + 128) − 128·Σ w` is exactly `Σ w·q8` (all in i32;
/// |w| ≤ 43 keeps the pair sums below the i16 limit). The block is decoded once, before the rows
/// meet it, so the live registers do not grow with `R`. The block sums are those of
/// [`iq2_xxs_rows`] and so is the f32 arithmetic (four rows at a time in the lanes of a vector):
/// bit-identical results.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
fn iq2_xxs_rows_offset<const R: usize>(w: &[u8], xs: [&[BlockQ8K]; R]) -> [f32; R] {
    let code_lo = load256(&IQ2XXS_CODE_LO);
    let code_hi = load256(&IQ2XXS_CODE_HI);
    let values = load64(&IQ2_VALUES);
    let shift_2j = load64(&SHIFT_2J);
    let one = _mm512_set1_epi64(1);
    let offset = _mm512_set1_epi8(0x80u8 as i8);
    let row_codes = IQ2XXS_ROW_CODES.each_ref().map(|v| load64(v));
    let scale_words = IQ2XXS_SCALE_WORDS.each_ref().map(|v| load64(v));

    let mut sumf = [0.0f32; R];
    let mut sum4 = [_mm_setzero_ps(); 2];
    for (i, b) in w.chunks_exact(IQ2_XXS_BYTES).enumerate() {
        let dw = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
        let qs = &b[2..66];
        // SAFETY: `qs` is 64 readable bytes.
        let q = unsafe { _mm512_loadu_si512(qs.as_ptr().cast()) };
        let high_half = _mm512_movepi8_mask(q);
        let lo = lookup256(&code_lo, q, high_half);
        let hi = lookup256(&code_hi, q, high_half);
        let scales = _mm512_or_si512(_mm512_srli_epi64::<59>(q), one);
        let aux = |sb: usize| {
            let at = 8 * sb + 4;
            u32::from_le_bytes([qs[at], qs[at + 1], qs[at + 2], qs[at + 3]])
        };
        // The block's signed weights and sub-block scales, 64 elements per chunk, and
        // 128·Σ w (scaled per sub-block), which comes off every row's sum.
        let mut signed = [_mm512_setzero_si512(); 4];
        let mut ls = [_mm512_setzero_si512(); 4];
        let mut corr = _mm512_setzero_si512();
        for c in 0..4 {
            let codes = _mm512_permutex2var_epi8(lo, row_codes[c], hi);
            let grid =
                _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(shift_2j, codes), values);
            let flip =
                sign_mask(u64::from(aux(2 * c) & 0x0FFF_FFFF) | u64::from(aux(2 * c + 1)) << 28);
            signed[c] = _mm512_mask_sub_epi8(grid, flip, _mm512_setzero_si512(), grid);
            ls[c] = _mm512_permutexvar_epi16(scale_words[c], scales);
            corr = _mm512_dpwssd_epi32(corr, _mm512_maddubs_epi16(offset, signed[c]), ls[c]);
        }
        let row_sum = |r: usize| {
            let mut acc = _mm512_setzero_si512();
            for c in 0..4 {
                let pairs = _mm512_maddubs_epi16(load_q8(&xs[r][i], c), signed[c]);
                acc = _mm512_dpwssd_epi32(acc, pairs, ls[c]);
            }
            _mm512_sub_epi32(acc, corr)
        };
        // Groups of four rows: one transposing reduction, the f32 updates in the lanes of one
        // vector (per lane the scalar expression below).
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

/// Q8_K activation blocks in the offset form the `*_offset` kernels take: `qs` as `q8 ^ 0x80`
/// (the byte q8 + 128), `d` and `bsums` unchanged.
pub fn offset_activations(q: &[BlockQ8K]) -> Vec<BlockQ8K> {
    q.iter()
        .map(|b| {
            let mut o = *b;
            for v in o.qs.iter_mut() {
                *v = (*v as u8 ^ 0x80) as i8;
            }
            o
        })
        .collect()
}

/// IQ2_XXS, a pair of blocks: byte `k < 32` of the packed index register is index byte `k`
/// (grid row `k % 4` of sub-block `k / 4`) of the first block, byte `32 + k` that of the second
/// (`vpermi2b` over the two blocks' 64 bytes after `d`).
static IQ2XXS_PAIR_INDICES: V64 = {
    let mut t = [0u8; 64];
    let mut k = 0;
    while k < 64 {
        let p = k % 32;
        t[k] = (8 * (p / 4) + p % 4 + 64 * (k / 32)) as u8;
        k += 1;
    }
    V64(t)
};

/// IQ2_XXS, packed pair, block `h` chunk `c`: lane `g` gathers the low and high code bytes of
/// packed row `32h + 8c + g` (grid row `g % 4` of sub-block `2c + g / 4`).
static IQ2XXS_PAIR_ROW_CODES: [[V64; 4]; 2] = {
    const fn chunk(h: usize, c: usize) -> V64 {
        lanes!(|g, j| {
            let p = (32 * h + 8 * c + g) as u8;
            if j == 1 {
                64 + p
            } else {
                p
            }
        })
    }
    [
        [chunk(0, 0), chunk(0, 1), chunk(0, 2), chunk(0, 3)],
        [chunk(1, 0), chunk(1, 1), chunk(1, 2), chunk(1, 3)],
    ]
};

/// IQ2_XXS single row, block `h` of a packed pair, the codes transposed by one `vpermi2b` per
/// block: bytes `8g + 2c` and `8g + 2c + 1` are the low and high code bytes of packed row
/// `32h + 8c + g` (lane `g` of chunk `c`), so lane `g` holds the 16-bit codes of its four chunks
/// and [`IQ2XXS_CHUNK_SHIFTS`] reads chunk `c`'s straight out of it (one permute per block
/// instead of one per block and chunk).
static IQ2XXS_PAIR_CODES_T: [V64; 2] = {
    const fn block(h: usize) -> V64 {
        lanes!(|g, j| {
            let p = (32 * h + 8 * (j / 2) + g) as u8;
            if j % 2 == 1 {
                64 + p
            } else {
                p
            }
        })
    }
    [block(0), block(1)]
};

/// `vpmultishiftqb` control over [`IQ2XXS_PAIR_CODES_T`], chunk `c`: byte `j` of a lane takes
/// bits `16c + 2j..` (the value index of element `j` of the lane's chunk-`c` grid row).
static IQ2XXS_CHUNK_SHIFTS: [V64; 4] = {
    const fn chunk(c: usize) -> V64 {
        lanes!(|_g, j| (16 * c + 2 * j) as u8)
    }
    [chunk(0), chunk(1), chunk(2), chunk(3)]
};

/// The exact sums of the 16 i32 lanes of `a` and of `b`, reduced together.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
fn hsum_pair_epi32(a: __m512i, b: __m512i) -> (i32, i32) {
    // Per 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3].
    let t = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    let t = _mm256_add_epi32(_mm512_castsi512_si256(t), _mm512_extracti64x4_epi64::<1>(t));
    let t = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256::<1>(t));
    let t = _mm_add_epi32(t, _mm_unpackhi_epi64(t, t));
    (_mm_cvtsi128_si32(t), _mm_extract_epi32::<1>(t))
}

/// The exact sums of dwords 0-1 and of dwords 2-3 of every 128-bit lane of `v`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
fn hsum_interleaved_pair(v: __m512i) -> (i32, i32) {
    let t = _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v));
    let t = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256::<1>(t));
    // [a0 + a1, b0 + b1, …]
    let t = _mm_hadd_epi32(t, t);
    (_mm_cvtsi128_si32(t), _mm_extract_epi32::<1>(t))
}

/// One IQ2_XXS block of a packed pair (`h`: which one) against `R` activation rows: the exact
/// per-lane partial sums (`lo`/`hi`: the code bytes of both blocks' grid rows).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
fn iq2_xxs_pair_block<const R: usize>(
    h: usize,
    lo: __m512i,
    hi: __m512i,
    q: __m512i,
    qs: &[u8],
    xs: &[&BlockQ8K; R],
) -> [__m512i; R] {
    let aux = |sb: usize| {
        let at = 8 * sb + 4;
        u32::from_le_bytes([qs[at], qs[at + 1], qs[at + 2], qs[at + 3]])
    };
    // Lane sb: (aux >> 59) | 1 = 2·(aux >> 28) + 1, the scale of sub-block sb.
    let scales = _mm512_or_si512(_mm512_srli_epi64::<59>(q), _mm512_set1_epi64(1));
    let mut acc = [_mm512_setzero_si512(); R];
    for c in 0..4 {
        let codes = _mm512_permutex2var_epi8(lo, load64(&IQ2XXS_PAIR_ROW_CODES[h][c]), hi);
        let grid = _mm512_permutexvar_epi8(
            _mm512_multishift_epi64_epi8(load64(&SHIFT_2J), codes),
            load64(&IQ2_VALUES),
        );
        let flip = sign_mask(u64::from(aux(2 * c) & 0x0FFF_FFFF) | u64::from(aux(2 * c + 1)) << 28);
        let ls = _mm512_permutexvar_epi16(load64(&IQ2XXS_SCALE_WORDS[c]), scales);
        for r in 0..R {
            let pairs = signed_pairs(grid, flip, load_q8(xs[r], c));
            acc[r] = _mm512_dpwssd_epi32(acc[r], pairs, ls);
        }
    }
    acc
}

/// The IQ2_XXS kernel for `R` activation rows, two weight blocks at a time: the grid-row codes
/// of both blocks come from one set of table lookups and the block sums of both from one
/// horizontal reduction. Per row and block the integer sum is exact and the f32 operations are
/// the scalar kernel's, in block order. `w` and every `xs[r]` hold the same number of blocks.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
fn iq2_xxs_pair_rows<const R: usize>(w: &[u8], xs: [&[BlockQ8K]; R]) -> [f32; R] {
    let code_lo = load256(&IQ2XXS_CODE_LO);
    let code_hi = load256(&IQ2XXS_CODE_HI);
    let pack = load64(&IQ2XXS_PAIR_INDICES);

    let nb = w.len() / IQ2_XXS_BYTES;
    let mut sumf = [0.0f32; R];
    let mut i = 0;
    while i < nb {
        let (i1, b0, b1, q0, q1) = block_pair(w, i, nb);
        let idx = _mm512_permutex2var_epi8(q0, pack, q1);
        let high_half = _mm512_movepi8_mask(idx);
        let lo = lookup256(&code_lo, idx, high_half);
        let hi = lookup256(&code_hi, idx, high_half);
        let y0: [&BlockQ8K; R] = core::array::from_fn(|r| &xs[r][i]);
        let y1: [&BlockQ8K; R] = core::array::from_fn(|r| &xs[r][i1]);
        let acc0 = iq2_xxs_pair_block(0, lo, hi, q0, &b0[2..66], &y0);
        let acc1 = iq2_xxs_pair_block(1, lo, hi, q1, &b1[2..66], &y1);
        let d0 = f16_to_f32(u16::from_le_bytes([b0[0], b0[1]]));
        let d1 = f16_to_f32(u16::from_le_bytes([b1[0], b1[1]]));
        for r in 0..R {
            let (s0, s1) = hsum_pair_epi32(acc0[r], acc1[r]);
            sumf[r] += d0 * y0[r].d * s0 as f32;
            if i1 != i {
                sumf[r] += d1 * y1[r].d * s1 as f32;
            }
        }
        i += 2;
    }
    sumf.map(|s| 0.125 * s)
}

fn iq2_xxs_row(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let n = (w.len() / IQ2_XXS_BYTES).min(x.len()) * QK_K;
    // SAFETY: handed out by `kernel` only when `supported()` holds.
    unsafe { vec_dot_iq2_xxs_q8_k_avx512(n, w, x) }
}

/// IQ2_XXS single row, chunk `c` of a block pair: the scale of every i16 word of
/// `packs(block 0's chunk-c sums, block 1's chunk-c sums)`, as `vpermi2w` indices into the two
/// blocks' `scales` (block 1 from 32 on). Word `w` sits in 128-bit lane `l = w / 8`; its first
/// four words come from block 0, the last four from block 1, and 128-bit lane `l` of a chunk's
/// sums holds elements `16l..16l + 16`, i.e. sub-block `2c + l / 2` (its scale: the low word of
/// qword `sb` of `scales`).
static IQ2XXS_PAIR_SCALE_WORDS: [V64; 4] = {
    const fn chunk(c: usize) -> V64 {
        words!(|w| {
            let block = (w % 8) / 4;
            (32 * block + 4 * (2 * c + (w / 8) / 2)) as u16
        })
    }
    [chunk(0), chunk(1), chunk(2), chunk(3)]
};

/// `vpmultishiftqb` control: byte `j < 4` of lane `sb` takes the `j`-th 7-bit sign index of
/// sub-block `sb` (bits `32 + 7j..` of its 8 bytes: `aux` is the high half).
static IQ2XXS_SIGN_FIELDS: V64 = lanes!(|_g, j| if j < 4 { (32 + 7 * j) as u8 } else { 0 });

/// `vpermi2b` over the sign fields of a block pair: output lane `4h + c` (block `h`, chunk `c`)
/// gets the four sign indices of sub-block `2c`, then those of sub-block `2c + 1`.
static IQ2XXS_SIGN_COMPACT: V64 =
    lanes!(|l, k| (64 * (l / 4) + 8 * (2 * (l % 4) + k / 4) + k % 4) as u8);

/// ggml's `ksigns_iq2xs` as a 128-byte `vpermi2b` table: index `i` (7 bits) plus an even-parity
/// bit 7, i.e. the signs of 8 elements.
static IQ2XXS_KSIGNS: [V64; 2] = {
    const fn half(h: usize) -> V64 {
        let mut t = [0u8; 64];
        let mut k = 0;
        while k < 64 {
            let i = (64 * h + k) as u8;
            t[k] = i | ((i.count_ones() as u8 & 1) << 7);
            k += 1;
        }
        V64(t)
    }
    [half(0), half(1)]
};

/// The products of one IQ2_XXS block of a packed pair (`codes`: its transposed grid-row codes,
/// [`IQ2XXS_PAIR_CODES_T`]) with its activation block, chunk `c`: the
/// grid values are the unsigned operand of `vpdpbusd` and the weight signs are moved onto the
/// activations (`0 − q8` where a weight is negative; `flip`: the chunk's sign mask). This is
/// exact only when no activation is −128 (whose negation wraps); with `CHECK`, `min` collects the
/// smallest activation byte so the caller can tell. Each i32 lane is a four-product sum,
/// |Σ| ≤ 4·43·127 < 2¹⁵.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
fn iq2_xxs_chunk_single<const CHECK: bool>(
    c: usize,
    codes: __m512i,
    flip: u64,
    y: &BlockQ8K,
    min: &mut __m512i,
) -> __m512i {
    let grid = _mm512_permutexvar_epi8(
        _mm512_multishift_epi64_epi8(load64(&IQ2XXS_CHUNK_SHIFTS[c]), codes),
        load64(&IQ2_VALUES),
    );
    let q8 = load_q8(y, c);
    if CHECK {
        *min = _mm512_min_epi8(*min, q8);
    }
    let signed = _mm512_mask_sub_epi8(q8, flip, _mm512_setzero_si512(), q8);
    _mm512_dpbusd_epi32(_mm512_setzero_si512(), grid, signed)
}

/// The flip bits of a block pair's quant bytes `q0`, `q1`: the 7-bit sign codes cut out of
/// each sub-block's aux word (`vpmultishiftqb`), compacted into lanes by `order`, then looked up
/// in the 128-entry KSIGNS table (8 flip bits each).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
fn pair_flips(q0: __m512i, q1: __m512i, order: __m512i) -> __m512i {
    let fields = load64(&IQ2XXS_SIGN_FIELDS);
    let sign_idx = _mm512_permutex2var_epi8(
        _mm512_multishift_epi64_epi8(fields, q0),
        order,
        _mm512_multishift_epi64_epi8(fields, q1),
    );
    _mm512_permutex2var_epi8(
        load64(&IQ2XXS_KSIGNS[0]),
        sign_idx,
        load64(&IQ2XXS_KSIGNS[1]),
    )
}

/// IQ2_XXS blocks `i` and `i1 = i + 1` of a row of `nb` (an odd last block is paired with itself,
/// `i1 = i`; its second result is dropped): `(i1, block i, block i1, their quant bytes 2..66)`.
#[inline]
#[target_feature(enable = "avx512f")]
fn block_pair(w: &[u8], i: usize, nb: usize) -> (usize, &[u8], &[u8], __m512i, __m512i) {
    let i1 = if i + 1 < nb { i + 1 } else { i };
    let b0 = &w[i * IQ2_XXS_BYTES..(i + 1) * IQ2_XXS_BYTES];
    let b1 = &w[i1 * IQ2_XXS_BYTES..(i1 + 1) * IQ2_XXS_BYTES];
    // SAFETY: bytes 2..66 of each block are 64 readable bytes.
    let (q0, q1) = unsafe {
        (
            _mm512_loadu_si512(b0[2..66].as_ptr().cast()),
            _mm512_loadu_si512(b1[2..66].as_ptr().cast()),
        )
    };
    (i1, b0, b1, q0, q1)
}

/// The IQ2_XXS kernel for one activation row (decode). Per block pair, as in
/// [`iq2_xxs_pair_rows`], the grid-row codes of both blocks come from one set of table lookups
/// and both block sums from one horizontal reduction; unlike it, the sign masks of both blocks
/// are made in vector registers (three byte permutes instead of `pdep` and a parity fold per 64
/// elements in general-purpose registers), each 64 elements cost one `vpdpbusd` instead of
/// `vpabsb`, a sign-mask extraction, `vpmaddubsw` and `vpdpwssd`, and the same chunk of both
/// blocks is packed to i16 and scaled by one `vpdpwssd` into one accumulator (one reduction per
/// pair). The block sums are exact and the f32 operations are the scalar
/// kernel's, in block order, so the result is bit-identical; an activation row holding −128
/// (never made by our Q8_K quantizer, but valid in the format) is recomputed by
/// [`iq2_xxs_pair_rows`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
fn iq2_xxs_pair_row<const CHECK: bool>(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let code_lo = load256(&IQ2XXS_CODE_LO);
    let code_hi = load256(&IQ2XXS_CODE_HI);
    let pack = load64(&IQ2XXS_PAIR_INDICES);

    let nb = w.len() / IQ2_XXS_BYTES;
    let mut sumf = 0.0f32;
    let mut min = _mm512_setzero_si512();
    let mut flips = [0u64; 8];
    let mut i = 0;
    while i < nb {
        let (i1, b0, b1, q0, q1) = block_pair(w, i, nb);
        let idx = _mm512_permutex2var_epi8(q0, pack, q1);
        let high_half = _mm512_movepi8_mask(idx);
        let lo = lookup256(&code_lo, idx, high_half);
        let hi = lookup256(&code_hi, idx, high_half);
        let codes0 = _mm512_permutex2var_epi8(lo, load64(&IQ2XXS_PAIR_CODES_T[0]), hi);
        let codes1 = _mm512_permutex2var_epi8(lo, load64(&IQ2XXS_PAIR_CODES_T[1]), hi);
        // Sign masks: lane 4h + c = the 64 flip bits of block h, chunk c.
        let signs = pair_flips(q0, q1, load64(&IQ2XXS_SIGN_COMPACT));
        // SAFETY: `flips` is 64 writable bytes.
        unsafe { _mm512_storeu_si512(flips.as_mut_ptr().cast(), signs) };
        // Lane sb: (aux >> 59) | 1 = 2·(aux >> 28) + 1, the scale of sub-block sb.
        let one = _mm512_set1_epi64(1);
        let scales0 = _mm512_or_si512(_mm512_srli_epi64::<59>(q0), one);
        let scales1 = _mm512_or_si512(_mm512_srli_epi64::<59>(q1), one);
        // Chunk c of both blocks packed together and scaled into one accumulator: dwords 0-1 of
        // each 128-bit lane belong to block 0, dwords 2-3 to block 1.
        let mut acc = _mm512_setzero_si512();
        for (c, scale_words) in IQ2XXS_PAIR_SCALE_WORDS.iter().enumerate() {
            let s0 = iq2_xxs_chunk_single::<CHECK>(c, codes0, flips[c], &x[i], &mut min);
            let s1 = iq2_xxs_chunk_single::<CHECK>(c, codes1, flips[4 + c], &x[i1], &mut min);
            let ls = _mm512_permutex2var_epi16(scales0, load64(scale_words), scales1);
            acc = _mm512_dpwssd_epi32(acc, _mm512_packs_epi32(s0, s1), ls);
        }
        let d0 = f16_to_f32(u16::from_le_bytes([b0[0], b0[1]]));
        let d1 = f16_to_f32(u16::from_le_bytes([b1[0], b1[1]]));
        let (s0, s1) = hsum_interleaved_pair(acc);
        sumf += d0 * x[i].d * s0 as f32;
        if i1 != i {
            sumf += d1 * x[i1].d * s1 as f32;
        }
        i += 2;
    }
    if CHECK && _mm512_cmpeq_epi8_mask(min, _mm512_set1_epi8(i8::MIN)) != 0 {
        return iq2_xxs_pair_rows(w, [x])[0];
    }
    0.125 * sumf
}

/// Q8_K activations reordered for [`iq2_xxs_interleaved_kernel`]: in every block, 64-byte chunk
/// `c` holds grid row `c` of each sub-block, i.e. bytes `8·sb + e` = element `32·sb + 8c + e`
/// (`sb` < 8, `e` < 8). Made once per activation vector and read by every weight row; `d` and
/// `bsums` are kept.
pub fn interleave_q8k_for_iq2_xxs(x: &[BlockQ8K]) -> Vec<BlockQ8K> {
    x.iter()
        .map(|b| {
            let mut o = *b;
            for c in 0..4 {
                for sb in 0..8 {
                    let (to, from) = (64 * c + 8 * sb, 32 * sb + 8 * c);
                    o.qs[to..to + 8].copy_from_slice(&b.qs[from..from + 8]);
                }
            }
            o
        })
        .collect()
}

/// The IQ2_XXS single-row kernel on activations reordered by [`interleave_q8k_for_iq2_xxs`]
/// (and, like [`kernel_without_minus_128`], holding no −128), when the CPU has it. The same
/// result as the [`kernel`] entry on the activations in their usual order.
pub fn iq2_xxs_interleaved_kernel() -> Option<Q8KRowDot> {
    supported().then_some(iq2_xxs_row_interleaved as Q8KRowDot)
}

fn iq2_xxs_row_interleaved(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = (w.len() / IQ2_XXS_BYTES).min(x.len());
    // SAFETY: handed out by `iq2_xxs_interleaved_kernel` only when `supported()` holds.
    unsafe { iq2_xxs_pair_row_interleaved(&w[..nb * IQ2_XXS_BYTES], &x[..nb]) }
}

/// IQ2_XXS, a pair of blocks for [`iq2_xxs_pair_row_interleaved`]: in 128-bit lane `L`, bytes
/// `4t + c` (`t` < 2) are index byte `c` (grid row `c`) of sub-block `2L + t` of the first block
/// and bytes `8 + 4t + c` those of the second, so that after the code lookups `vpunpcklbw` /
/// `vpunpckhbw` of the low and high code bytes put sub-block `sb`'s four 16-bit row codes in
/// 64-bit lane `sb`, for the first / the second block.
static IQ2XXS_INTERLEAVED_INDICES: V64 = {
    let mut t = [0u8; 64];
    let mut k = 0;
    while k < 64 {
        let (lane, b) = (k / 16, k % 16);
        let (block, t4, c) = (b / 8, (b % 8) / 4, b % 4);
        t[k] = (64 * block + 8 * (2 * lane + t4) + c) as u8;
        k += 1;
    }
    V64(t)
};

/// `vpermi2b` over the sign fields of a block pair (as [`IQ2XXS_SIGN_COMPACT`]) for the
/// interleaved order: byte `sb` of output lane `4h + c` is sign index `c` of sub-block `sb` of
/// block `h`.
static IQ2XXS_INTERLEAVED_SIGNS: V64 = lanes!(|l, k| (64 * (l / 4) + 8 * k + l % 4) as u8);

/// The IQ2_XXS kernel for one activation row in the interleaved order: chunk `c` of a block is
/// grid row `c` of every sub-block, so i32 lanes `2·sb` and `2·sb + 1` belong to sub-block `sb`
/// in every chunk. The four chunks of a block accumulate into one register by `vpdpbusd` (each
/// lane ≤ 16·43·127 < 2³¹) and the sub-block scales are applied once per block (`vpmuldq` of
/// each lane pair's sum), instead of a pack, a word permute and a `vpdpwssd` per chunk. The
/// block sums are the same exact integers and the f32 operations those of the other kernels, in
/// block order: bit-identical.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
fn iq2_xxs_pair_row_interleaved(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let code_lo = load256(&IQ2XXS_CODE_LO);
    let code_hi = load256(&IQ2XXS_CODE_HI);
    let pack = load64(&IQ2XXS_INTERLEAVED_INDICES);

    let nb = w.len() / IQ2_XXS_BYTES;
    let mut sumf = 0.0f32;
    let mut flips = [0u64; 8];
    let mut i = 0;
    while i < nb {
        let (i1, b0, b1, q0, q1) = block_pair(w, i, nb);
        let idx = _mm512_permutex2var_epi8(q0, pack, q1);
        let high_half = _mm512_movepi8_mask(idx);
        let lo = lookup256(&code_lo, idx, high_half);
        let hi = lookup256(&code_hi, idx, high_half);
        let codes0 = _mm512_unpacklo_epi8(lo, hi);
        let codes1 = _mm512_unpackhi_epi8(lo, hi);
        // Sign masks: lane 4h + c = the 64 flip bits of block h, chunk c.
        let signs = pair_flips(q0, q1, load64(&IQ2XXS_INTERLEAVED_SIGNS));
        // SAFETY: `flips` is 64 writable bytes.
        unsafe { _mm512_storeu_si512(flips.as_mut_ptr().cast(), signs) };
        let mut acc0 = _mm512_setzero_si512();
        let mut acc1 = _mm512_setzero_si512();
        for c in 0..4 {
            let shifts = load64(&IQ2XXS_CHUNK_SHIFTS[c]);
            let values = load64(&IQ2_VALUES);
            let grid0 =
                _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(shifts, codes0), values);
            let grid1 =
                _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(shifts, codes1), values);
            let y0 = load_q8(&x[i], c);
            let y1 = load_q8(&x[i1], c);
            let zero = _mm512_setzero_si512();
            acc0 = _mm512_dpbusd_epi32(acc0, grid0, _mm512_mask_sub_epi8(y0, flips[c], zero, y0));
            acc1 = _mm512_dpbusd_epi32(
                acc1,
                grid1,
                _mm512_mask_sub_epi8(y1, flips[4 + c], zero, y1),
            );
        }
        let (p0, p1) = (scale_sub_blocks(acc0, q0), scale_sub_blocks(acc1, q1));
        // Block 0 in the even i32 lanes, block 1 in the odd ones.
        let both = _mm512_mask_blend_epi32(0xAAAA, p0, _mm512_slli_epi64::<32>(p1));
        let (s0, s1) = hsum_even_odd(both);
        let d0 = f16_to_f32(u16::from_le_bytes([b0[0], b0[1]]));
        let d1 = f16_to_f32(u16::from_le_bytes([b1[0], b1[1]]));
        sumf += d0 * x[i].d * s0 as f32;
        if i1 != i {
            sumf += d1 * x[i1].d * s1 as f32;
        }
        i += 2;
    }
    0.125 * sumf
}

/// Per 64-bit lane `sb` of an interleaved block: (i32 lane `2·sb` + lane `2·sb + 1` of `acc`) ×
/// the scale of sub-block `sb`, as an i64 (exact, and < 2³¹). `q` is the block's 64 bytes after
/// `d`: lane `sb` holds `aux` in its high half, and `(aux >> 59) | 1 = 2·(aux >> 28) + 1`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
fn scale_sub_blocks(acc: __m512i, q: __m512i) -> __m512i {
    let pair = _mm512_add_epi32(acc, _mm512_srli_epi64::<32>(acc));
    let scale = _mm512_or_si512(_mm512_srli_epi64::<59>(q), _mm512_set1_epi64(1));
    _mm512_mul_epi32(pair, scale)
}

/// The exact sums of the even and of the odd i32 lanes of `v`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
fn hsum_even_odd(v: __m512i) -> (i32, i32) {
    let t = _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v));
    let t = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256::<1>(t));
    // [e0 + e1, o0 + o1, …]
    let t = _mm_add_epi32(t, _mm_unpackhi_epi64(t, t));
    (_mm_cvtsi128_si32(t), _mm_extract_epi32::<1>(t))
}

/// A row kernel on Q8_K activations (the function of a [`RowDot::Q8K`]).
pub type Q8KRowDot = fn(w: &[u8], x: &[BlockQ8K]) -> f32;

/// The single-row IQ2_XXS kernel for activations made by
/// [`quantize_row_q8_k`](super::q8::quantize_row_q8_k), which never writes −128: the same result
/// as the [`kernel`] entry without its −128 check (one `vpminsb` per 64 elements, ~10 %).
/// Callers that quantize the activations themselves (the fused MoE decode) use it.
pub fn kernel_without_minus_128(ty: GgmlType) -> Option<Q8KRowDot> {
    if !supported() {
        return None;
    }
    match ty {
        GgmlType::IQ2XXS => Some(iq2_xxs_row_without_minus_128),
        _ => None,
    }
}

fn iq2_xxs_row_without_minus_128(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = (w.len() / IQ2_XXS_BYTES).min(x.len());
    // SAFETY: handed out by `kernel_without_minus_128` only when `supported()` holds.
    unsafe { iq2_xxs_pair_row::<false>(&w[..nb * IQ2_XXS_BYTES], &x[..nb]) }
}

// ---------------------------------------------------------------------------------------------
// IQ3_XXS
// ---------------------------------------------------------------------------------------------

/// IQ3_XXS, chunk `c` (sub-blocks `2c`, `2c + 1`, grid rows `16c..16c + 16`): lane `g` gathers
/// the low and high code bytes of rows `16c + 2g` and `16c + 2g + 1` (its 8 elements).
static IQ3XXS_ROW_CODES: [V64; 4] = {
    const fn chunk(c: usize) -> V64 {
        lanes!(|g, j| {
            let row = (16 * c + 2 * g + (j / 2) % 2) as u8;
            if j % 2 == 1 {
                64 + row
            } else {
                row
            }
        })
    }
    [chunk(0), chunk(1), chunk(2), chunk(3)]
};

/// Chunk `c`: words 0..16 take word `2·2c` (the low word of dword `2c`, sub-block `2c`'s scale),
/// words 16..32 word `2·(2c + 1)`.
static DWORD_SCALE_WORDS: [V64; 4] = {
    const fn chunk(c: usize) -> V64 {
        words!(|k| (2 * (2 * c + k / 16)) as u16)
    }
    [chunk(0), chunk(1), chunk(2), chunk(3)]
};

/// IQ3_XXS row · Q8_K row over `min(n / 256, w.len() / 98, x.len())` blocks.
///
/// # Safety
/// The CPU must support the features of [`supported`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
pub unsafe fn vec_dot_iq3_xxs_q8_k_avx512(n: usize, w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = super::iquants::block_count(n, QK_K, w.len(), IQ3_XXS_BYTES, x.len());
    let code_lo = load256(&IQ3XXS_CODE_LO);
    let code_hi = load256(&IQ3XXS_CODE_HI);
    let values = load64(&IQ3_VALUES);
    let shift = load64(&SHIFT_IQ3);
    let row_codes = IQ3XXS_ROW_CODES.each_ref().map(|v| load64(v));
    let scale_words = DWORD_SCALE_WORDS.each_ref().map(|v| load64(v));

    let mut sumf = 0.0f32;
    for (b, y) in w.chunks_exact(IQ3_XXS_BYTES).zip(x).take(nb) {
        let d = f16_to_f32(u16::from_le_bytes([b[0], b[1]])) * y.d;
        let qs = &b[2..66];
        let aux = &b[66..98];
        // SAFETY: `qs` is 64 readable bytes, `aux` 32.
        let (q, aux_v) = unsafe {
            (
                _mm512_loadu_si512(qs.as_ptr().cast()),
                _mm256_loadu_si256(aux.as_ptr().cast()),
            )
        };
        let high_half = _mm512_movepi8_mask(q);
        let lo = lookup256(&code_lo, q, high_half);
        let hi = lookup256(&code_hi, q, high_half);
        // Dword sb: (aux >> 27) | 1 = 2·(aux >> 28) + 1.
        let scales = _mm512_zextsi256_si512(_mm256_or_si256(
            _mm256_srli_epi32::<27>(aux_v),
            _mm256_set1_epi32(1),
        ));
        let mut acc = _mm512_setzero_si512();
        for c in 0..4 {
            let codes = _mm512_permutex2var_epi8(lo, row_codes[c], hi);
            let grid = _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(shift, codes), values);
            let a0 =
                u32::from_le_bytes([aux[8 * c], aux[8 * c + 1], aux[8 * c + 2], aux[8 * c + 3]]);
            let a1 = u32::from_le_bytes([
                aux[8 * c + 4],
                aux[8 * c + 5],
                aux[8 * c + 6],
                aux[8 * c + 7],
            ]);
            let flip = sign_mask(u64::from(a0 & 0x0FFF_FFFF) | u64::from(a1) << 28);
            let pairs = signed_pairs(grid, flip, load_q8(y, c));
            let ls = _mm512_permutexvar_epi16(scale_words[c], scales);
            acc = _mm512_dpwssd_epi32(acc, pairs, ls);
        }
        sumf += d * _mm512_reduce_add_epi32(acc) as f32;
    }
    0.25 * sumf
}

fn iq3_xxs_row(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let n = (w.len() / IQ3_XXS_BYTES).min(x.len()) * QK_K;
    // SAFETY: handed out by `kernel` only when `supported()` holds.
    unsafe { vec_dot_iq3_xxs_q8_k_avx512(n, w, x) }
}

// ---------------------------------------------------------------------------------------------
// IQ3_S
// ---------------------------------------------------------------------------------------------

/// IQ3_S row · Q8_K row over `min(n / 256, w.len() / 110, x.len())` blocks.
///
/// Like IQ3_XXS with a 512-row grid (the 9th index bit of row `k` is bit `k` of the 8 `qh` bytes
/// read as one u64), explicit sign bits (8 bytes per 64 elements: exactly the flip mask) and
/// 4-bit scales `2s + 1`.
///
/// # Safety
/// The CPU must support the features of [`supported`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
pub unsafe fn vec_dot_iq3_s_q8_k_avx512(n: usize, w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = super::iquants::block_count(n, QK_K, w.len(), IQ3_S_BYTES, x.len());
    let code_lo = load512(&IQ3S_CODE_LO);
    let code_hi = load512(&IQ3S_CODE_HI);
    let values = load64(&IQ3S_VALUES);
    let shift = load64(&SHIFT_IQ3);
    let row_codes = IQ3XXS_ROW_CODES.each_ref().map(|v| load64(v));
    let scale_words = WORD_SCALE_WORDS.each_ref().map(|v| load64(v));

    let mut sumf = 0.0f32;
    for (b, y) in w.chunks_exact(IQ3_S_BYTES).zip(x).take(nb) {
        let d = f16_to_f32(u16::from_le_bytes([b[0], b[1]])) * y.d;
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or([0; 8]));
        // SAFETY: bytes 2..66 (qs) are readable.
        let q = unsafe { _mm512_loadu_si512(b[2..66].as_ptr().cast()) };
        let bit7 = _mm512_movepi8_mask(q);
        let bit8 = u64_at(66);
        let lo = lookup512(&code_lo, q, bit7, bit8);
        let hi = lookup512(&code_hi, q, bit7, bit8);
        // Byte ib = 2·s_ib + 1, s_ib = nibble ib of the 4 scale bytes.
        let s4 = u64::from(u32::from_le_bytes([b[106], b[107], b[108], b[109]]));
        let ls = (_pdep_u64(s4, 0x0F0F_0F0F_0F0F_0F0F) << 1) | 0x0101_0101_0101_0101;
        let scales = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(ls as i64)));
        let mut acc = _mm512_setzero_si512();
        for c in 0..4 {
            let codes = _mm512_permutex2var_epi8(lo, row_codes[c], hi);
            let grid = _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(shift, codes), values);
            let pairs = signed_pairs(grid, u64_at(74 + 8 * c), load_q8(y, c));
            let ls = _mm512_permutexvar_epi16(scale_words[c], scales);
            acc = _mm512_dpwssd_epi32(acc, pairs, ls);
        }
        sumf += d * _mm512_reduce_add_epi32(acc) as f32;
    }
    sumf
}

fn iq3_s_row(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let n = (w.len() / IQ3_S_BYTES).min(x.len()) * QK_K;
    // SAFETY: handed out by `kernel` only when `supported()` holds.
    unsafe { vec_dot_iq3_s_q8_k_avx512(n, w, x) }
}

// ---------------------------------------------------------------------------------------------
// IQ4_XS
// ---------------------------------------------------------------------------------------------

/// Chunk `c`: words 0..16 take word `2c` (sub-block `2c`'s scale), words 16..32 word `2c + 1`.
static WORD_SCALE_WORDS: [V64; 4] = {
    const fn chunk(c: usize) -> V64 {
        words!(|k| (2 * c + k / 16) as u16)
    }
    [chunk(0), chunk(1), chunk(2), chunk(3)]
};

/// IQ4_XS row · Q8_K row over `min(n / 256, w.len() / 136, x.len())` blocks.
///
/// # Safety
/// The CPU must support the features of [`supported`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
pub unsafe fn vec_dot_iq4_xs_q8_k_avx512(n: usize, w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = super::iquants::block_count(n, QK_K, w.len(), IQ4_XS_BYTES, x.len());
    let values = load64(&IQ4_VALUES);
    let scale_words = WORD_SCALE_WORDS.each_ref().map(|v| load64(v));
    // 16 bytes of packed nibbles per sub-block: lanes 0-1 low nibbles of bytes 0..16, lanes 2-3
    // their high nibbles, lanes 4-7 the same for bytes 16..32.
    let spread = _mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0);
    // 16-bit elements of lanes 2-3 and 6-7: words 8..16 and 24..32.
    let high_nibbles: __mmask32 = 0xFF00_FF00;

    let mut sumf = 0.0f32;
    for (b, y) in w.chunks_exact(IQ4_XS_BYTES).zip(x).take(nb) {
        let d = f16_to_f32(u16::from_le_bytes([b[0], b[1]])) * y.d;
        let scales_h = u64::from(u16::from_le_bytes([b[2], b[3]]));
        let scales_l = u64::from(u32::from_le_bytes([b[4], b[5], b[6], b[7]]));
        // Byte ib = the 6-bit scale of sub-block ib: low nibble from scales_l (nibble ib), two
        // high bits from scales_h (bits 2ib..2ib + 2).
        let ls =
            _pdep_u64(scales_l, 0x0F0F_0F0F_0F0F_0F0F) | _pdep_u64(scales_h, 0x3030_3030_3030_3030);
        let ls = _mm_sub_epi8(_mm_cvtsi64_si128(ls as i64), _mm_set1_epi8(32));
        let scales = _mm512_castsi128_si512(_mm_cvtepi8_epi16(ls));
        let mut acc = _mm512_setzero_si512();
        for c in 0..4 {
            let qs = &b[8 + 32 * c..8 + 32 * c + 32];
            // SAFETY: `qs` is 32 readable bytes.
            let packed = unsafe { _mm256_loadu_si256(qs.as_ptr().cast()) };
            let nibbles = _mm512_permutexvar_epi64(spread, _mm512_castsi256_si512(packed));
            let nibbles = _mm512_mask_srli_epi16(nibbles, high_nibbles, nibbles, 4);
            let kv = _mm512_permutexvar_epi8(nibbles, values);
            let pairs = signed_pairs(kv, 0, load_q8(y, c));
            let ls = _mm512_permutexvar_epi16(scale_words[c], scales);
            acc = _mm512_dpwssd_epi32(acc, pairs, ls);
        }
        sumf += d * _mm512_reduce_add_epi32(acc) as f32;
    }
    sumf
}

fn iq4_xs_row(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let n = (w.len() / IQ4_XS_BYTES).min(x.len()) * QK_K;
    // SAFETY: handed out by `kernel` only when `supported()` holds.
    unsafe { vec_dot_iq4_xs_q8_k_avx512(n, w, x) }
}

// ---------------------------------------------------------------------------------------------
// IQ1_M
// ---------------------------------------------------------------------------------------------

/// IQ1 grid byte (−1, 0, +1; `vpermb` sees 63, 0, 1) → `8·g + 1`, the weight code for a
/// positive delta (a negative delta subtracts 2 afterwards).
static IQ1_CODES: V64 = {
    let mut t = [0u8; 64];
    t[0] = 1;
    t[1] = 9;
    t[63] = (-7i8) as u8;
    V64(t)
};

/// Word `i` (< 16) takes word `i / 4` (the scale u16 holding 16-element scale `i`).
static IQ1M_SCALE_SPREAD: V64 = words!(|k| (k / 4 % 4) as u16);

/// Word `i` (< 16) is shifted right by `3·(i % 4)` (the 3-bit field of scale `i`).
static IQ1M_SCALE_SHIFTS: V64 = words!(|k| (3 * (k % 4)) as u16);

/// Chunk `c`: word `k` takes scale `4c + k / 8` (8 pair sums per 16 elements).
static IQ1M_SCALE_WORDS: [V64; 4] = {
    const fn chunk(c: usize) -> V64 {
        words!(|k| (4 * c + k / 8) as u16)
    }
    [chunk(0), chunk(1), chunk(2), chunk(3)]
};

/// IQ1_M row · Q8_K row over `min(n / 256, w.len() / 56, x.len())` blocks.
///
/// # Safety
/// The CPU must support the features of [`supported`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
pub unsafe fn vec_dot_iq1_m_q8_k_avx512(n: usize, w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = super::iquants::block_count(n, QK_K, w.len(), IQ1_M_BYTES, x.len());
    let codes = load64(&IQ1_CODES);
    let scale_spread = load64(&IQ1M_SCALE_SPREAD);
    let scale_shifts = load64(&IQ1M_SCALE_SHIFTS);
    let scale_words = IQ1M_SCALE_WORDS.each_ref().map(|v| load64(v));
    let two = _mm512_set1_epi8(2);

    let mut sumf = 0.0f32;
    for (b, y) in w.chunks_exact(IQ1_M_BYTES).zip(x).take(nb) {
        let sc = u64::from_le_bytes([b[48], b[49], b[50], b[51], b[52], b[53], b[54], b[55]]);
        // d's f16 bits are the top nibbles of the four scale u16s.
        let d = f16_to_f32(_pext_u64(sc, 0xF000_F000_F000_F000) as u16) * y.d;
        // SAFETY: bytes 0..32 (qs) and 32..48 (qh) of the block are readable.
        let (qs, qh) = unsafe {
            (
                _mm256_loadu_si256(b.as_ptr().cast()),
                _mm_loadu_si128(b[32..48].as_ptr().cast()),
            )
        };
        // Word k = row index of group k: qs[k] | (nibble k of qh & 7) << 8; nibble k is the low
        // (k even) or high (k odd) nibble of qh[k / 2]. Dword i of `h` = qh[i].
        let h = _mm512_cvtepu8_epi32(qh);
        let nib = _mm512_or_si512(_mm512_slli_epi32::<8>(h), _mm512_slli_epi32::<20>(h));
        let rows = _mm512_or_si512(
            _mm512_cvtepu8_epi16(qs),
            _mm512_and_si512(nib, _mm512_set1_epi32(0x0700_0700)),
        );
        // Bit k: group k has a negative delta (bit 3 of its nibble).
        let neg_delta = _mm512_test_epi16_mask(nib, _mm512_set1_epi32(0x0800_0800));
        let mut row_idx = [0u16; 32];
        // SAFETY: `row_idx` is 64 writable bytes.
        unsafe { _mm512_storeu_si512(row_idx.as_mut_ptr().cast(), rows) };
        // Word i (< 16) = 2·s_i + 1 for the 16-element scales.
        let s = _mm512_srlv_epi16(
            _mm512_permutexvar_epi16(scale_spread, _mm512_set1_epi64(sc as i64)),
            scale_shifts,
        );
        let scales = _mm512_or_si512(
            _mm512_slli_epi16::<1>(_mm512_and_si512(s, _mm512_set1_epi16(7))),
            _mm512_set1_epi16(1),
        );
        let mut acc = _mm512_setzero_si512();
        for c in 0..4 {
            // Grid rows by scalar loads (cheaper than `vpgatherdq` on Zen 4, and much cheaper on
            // Intel CPUs with the gather-data-sampling mitigation); indices are < 2048.
            let r = |k: usize| IQ1S_GRID[usize::from(row_idx[8 * c + k] & 2047)] as i64;
            let g = _mm512_set_epi64(r(7), r(6), r(5), r(4), r(3), r(2), r(1), r(0));
            let wv = _mm512_permutexvar_epi8(g, codes);
            let neg = (neg_delta >> (8 * c)) as u8;
            let wv = _mm512_sub_epi8(wv, _mm512_maskz_mov_epi64(neg, two));
            let pairs = signed_pairs(wv, 0, load_q8(y, c));
            let ls = _mm512_permutexvar_epi16(scale_words[c], scales);
            acc = _mm512_dpwssd_epi32(acc, pairs, ls);
        }
        sumf += d * _mm512_reduce_add_epi32(acc) as f32;
    }
    0.125 * sumf
}

fn iq1_m_row(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let n = (w.len() / IQ1_M_BYTES).min(x.len()) * QK_K;
    // SAFETY: handed out by `kernel` only when `supported()` holds.
    unsafe { vec_dot_iq1_m_q8_k_avx512(n, w, x) }
}

mod element_major;
mod grouped;

pub use element_major::element_major_q8k;

/// The IQ2_XXS single-row kernel on activations reordered by [`element_major_q8k`] (holding no
/// −128, as [`quantize_row_q8_k`](super::q8::quantize_row_q8_k) makes them), when the CPU has it
/// (this module's features plus GFNI). The same result as the [`kernel`] entry on the
/// activations in their usual order.
pub fn iq2_xxs_element_major_kernel() -> Option<Q8KRowDot> {
    element_major::supported().then_some(element_major::iq2_xxs_row as Q8KRowDot)
}

/// Several weight rows at once: `out[r]` = row `r` of `w` (rows of `row_bytes` bytes) · `x`.
pub type Q8KRowsDot = fn(w: &[u8], row_bytes: usize, x: &[BlockQ8K], out: &mut [f32]);

/// [`iq2_xxs_element_major_kernel`] over a range of rows per call (tables loaded once; the same
/// result per row).
pub fn iq2_xxs_element_major_rows_kernel() -> Option<Q8KRowsDot> {
    element_major::supported().then_some(element_major::iq2_xxs_rows as Q8KRowsDot)
}

/// The multi-row kernel for `ty` that takes its activation rows grouped and in offset form
/// (`kquants_multi_x86::grouped_activations(_, true)`), with the most rows it takes per call,
/// when [`kernel`] hands out this module's single-row kernel for it, else `None`.
pub(crate) fn multi_kernel_grouped(ty: GgmlType) -> Option<(MultiRowDot, usize)> {
    if !supported() {
        return None;
    }
    match ty {
        GgmlType::IQ2XXS => Some((grouped::iq2_xxs_multi_row_grouped, grouped::ROWS)),
        _ => None,
    }
}

pub(crate) use grouped::{iq2_xxs_tile_repack, iq2_xxs_tile_rows, Iq2xxsTileBlock};
