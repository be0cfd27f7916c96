//! AVX-512 versions of the hot i-quant kernels (x86-64 only): IQ2_XXS, IQ3_XXS, IQ1_M, IQ4_XS.
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
//! * **Grid rows without memory gathers** (IQ2_XXS, IQ3_XXS). The grids have only 3 (IQ2) or 8
//!   (IQ3) distinct values, so a 256-entry grid row compresses to a 16-bit code of 2- or 4-bit
//!   value indices. The code tables (256 × 16 bits, split into a low-byte and a high-byte table of
//!   256 bytes = four registers each) are looked up for all 64 index bytes of a block at once with
//!   `vpermi2b` (two per table, blended by index bit 7). Per 64 elements one `vpermi2b` moves each
//!   row's code into its own 64-bit lane, `vpmultishiftqb` extracts every element's value index
//!   into its own byte, and a `vpermb` through a 64-byte table turns indices into grid values.
//! * **Signs as mask registers.** The 7-bit sign indices are extracted with `vpmultishiftqb`,
//!   mapped through the 128-byte `KSIGNS` table with `vpermi2b` and turned into a 64-bit mask with
//!   `vptestmb`.
//! * **Exact products with −128.** The signed grid values (|v| ≤ 127) are the signed operand of
//!   `vpmaddubsw`; the unsigned operand is `|q8|` (so −128 becomes 128, exactly), and the sign of
//!   `q8` is moved to the weight by XOR-ing the sign masks. Pair sums stay within i16.
//! * **Scales** are applied by `vpdpwssd` (i16 pair sums × i16 sub-block scale, accumulated in
//!   i32); each block ends with one `cvtdq2ps` + FMA with `d_w · d_x` into 16 f32 lanes.
//!
//! IQ1_M has a 2048-row grid of {−1, 0, +1}: its rows are fetched with `vpgatherdq`.

use super::iquants::{IQ1_M_BYTES, IQ2_XXS_BYTES, IQ3_XXS_BYTES, IQ4_XS_BYTES};
use super::q8::{BlockQ8K, QK_K};
use super::RowDot;
use core::arch::x86_64::*;
use redlite_gguf::quant::grids::{
    IQ1S_GRID, IQ2XXS_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS, KVALUES_IQ4NL,
};
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
        _ => return None,
    })
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

/// The sign table, 128 bytes (two registers) for `vpermi2b`.
static KSIGNS: [V64; 2] = {
    let mut lo = [0u8; 64];
    let mut hi = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        lo[i] = KSIGNS_IQ2XS[i];
        hi[i] = KSIGNS_IQ2XS[64 + i];
        i += 1;
    }
    [V64(lo), V64(hi)]
};

/// Byte `j` of every 64-bit lane = `1 << j`: tests bit `j` of a sign byte for element `j`.
const BIT_SELECT: i64 = 0x8040_2010_0804_0201_u64 as i64;

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

/// IQ2_XXS, chunk `c`: 64-bit lane `g` takes the block's lane `2c + g / 4` (the one holding the
/// aux word of its sub-block in its upper half).
static IQ2XXS_AUX_LANES: [V64; 4] = {
    const fn chunk(c: usize) -> V64 {
        lanes!(|g, j| if j == 0 { (2 * c + g / 4) as u8 } else { 0 })
    }
    [chunk(0), chunk(1), chunk(2), chunk(3)]
};

/// `vpmultishiftqb` control: every byte of lane `g` takes the 7-bit sign index of group `g % 4`,
/// at bit `32 + 7·(g % 4)` (the aux word is the lane's upper half).
static SHIFT_SIGNS_HI: V64 = lanes!(|g, _j| (32 + 7 * (g % 4)) as u8);

/// As [`SHIFT_SIGNS_HI`] with the aux word in the lane's lower half.
static SHIFT_SIGNS_LO: V64 = lanes!(|g, _j| (7 * (g % 4)) as u8);

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

// ---------------------------------------------------------------------------------------------
// IQ2_XXS
// ---------------------------------------------------------------------------------------------

/// IQ2_XXS row · Q8_K row over `nb = min(w.len() / 66, x.len())` blocks.
///
/// # Safety
/// The CPU must support the features of [`supported`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,bmi2,fma,f16c")]
pub unsafe fn vec_dot_iq2_xxs_q8_k_avx512(n: usize, w: &[u8], x: &[BlockQ8K]) -> f32 {
    let nb = super::iquants::block_count(n, QK_K, w.len(), IQ2_XXS_BYTES, x.len());
    let code_lo = load256(&IQ2XXS_CODE_LO);
    let code_hi = load256(&IQ2XXS_CODE_HI);
    let values = load64(&IQ2_VALUES);
    let shift_2j = load64(&SHIFT_2J);
    let shift_signs = load64(&SHIFT_SIGNS_HI);
    let ksigns = [load64(&KSIGNS[0]), load64(&KSIGNS[1])];
    let bit_select = _mm512_set1_epi64(BIT_SELECT);
    let one = _mm512_set1_epi64(1);
    let row_codes = IQ2XXS_ROW_CODES.each_ref().map(|v| load64(v));
    let aux_lanes = IQ2XXS_AUX_LANES.each_ref().map(|v| load64(v));
    let scale_words = IQ2XXS_SCALE_WORDS.each_ref().map(|v| load64(v));

    let mut accf = _mm512_setzero_ps();
    for (b, y) in w.chunks_exact(IQ2_XXS_BYTES).zip(x).take(nb) {
        let d = f16_to_f32(u16::from_le_bytes([b[0], b[1]])) * y.d;
        // The 64 bytes after d: 8 × { 4 grid-row indices, u32 aux }.
        let qs = &b[2..66];
        // SAFETY: `qs` is 64 readable bytes.
        let q = unsafe { _mm512_loadu_si512(qs.as_ptr().cast()) };
        let high_half = _mm512_movepi8_mask(q);
        let lo = lookup256(&code_lo, q, high_half);
        let hi = lookup256(&code_hi, q, high_half);
        // Lane sb: (aux >> 59) | 1 = 2·(aux >> 28) + 1, the scale of sub-block sb.
        let scales = _mm512_or_si512(_mm512_srli_epi64::<59>(q), one);
        let mut acc = _mm512_setzero_si512();
        for c in 0..4 {
            let codes = _mm512_permutex2var_epi8(lo, row_codes[c], hi);
            let grid =
                _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(shift_2j, codes), values);
            let aux = _mm512_permutexvar_epi64(aux_lanes[c], q);
            let sign_idx = _mm512_multishift_epi64_epi8(shift_signs, aux);
            let signs = _mm512_permutex2var_epi8(ksigns[0], sign_idx, ksigns[1]);
            let flip = _mm512_test_epi8_mask(signs, bit_select);
            let pairs = signed_pairs(grid, flip, load_q8(y, c));
            let ls = _mm512_permutexvar_epi16(scale_words[c], scales);
            acc = _mm512_dpwssd_epi32(acc, pairs, ls);
        }
        accf = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(d), accf);
    }
    0.125 * _mm512_reduce_add_ps(accf)
}

fn iq2_xxs_row(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let n = (w.len() / IQ2_XXS_BYTES).min(x.len()) * QK_K;
    // SAFETY: handed out by `kernel` only when `supported()` holds.
    unsafe { vec_dot_iq2_xxs_q8_k_avx512(n, w, x) }
}
