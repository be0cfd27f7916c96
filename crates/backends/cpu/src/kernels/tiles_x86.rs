//! Q4_K and Q6_K weights repacked for one-row products of small models: 16 weight rows
//! interleaved per block, one row per i32 lane, so a block of 16 rows is 64 `vpdpbusd` against
//! broadcast activation quads and no horizontal reduction at all ([`DecodeTiles`]).
//!
//! The row kernels spend most of their time per row, not per block: unpacking the block's
//! scales, reducing the vector sums, the f32 update. On the tiny fixture every row is one block
//! (256 columns), so that overhead is the whole cost (≈ 11 ns a row with two rows per
//! reduction). A [`Q4kTile`] holds block `i` of 16 rows with the quant bytes transposed (entry
//! `8c + k`, bytes `4r..4r + 4`: row `r`'s bytes `32c + 4k ..`; low nibbles are elements
//! `64c + 4k ..`, high nibbles `64c + 32 + 4k ..`) and the scales, mins and d/dmin of the 16
//! rows side by side: 2,368 bytes for 16 × 144 (≈ 3 % more). The repack is made once at load
//! for small files ([`CpuBackend`](crate::CpuBackend) decides).
//!
//! **Exactness:** per lane the sub-block sums are the exact integer sums of the row kernels
//! (`vpdpbusd` of the 4-bit codes with the Q8_K quants, `vpmulld` by the scale, the mins by
//! `vpdpwssd` against the sub-block sums of `bsums`), and the f32 update is their expression
//! `(y.d · d) · isum − (y.d · dmin) · isumm`, added in block order: each row's value is
//! bit-identical to `matvec`'s.
//!
//! A [`Q6kTile`] holds the 6-bit codes (0..63) as bytes, transposed the same way (entry `g`:
//! elements `4g .. 4g + 4` of each row), the 16 sub-block scales per row, and `d`: 4,672 bytes
//! for 16 × 210 (1.39×). Per lane: sub-block `j`'s four `vpdpbusd` times its scale, minus
//! `32 · Σ_j scale_j · bsums_j` (`vpdpwssd`), i.e. the Q6_K row kernel's exact block sum, then
//! its `(y.d · d) · isum`.

use super::kquants::{unpack_scales_k4, Q4K_BYTES, Q6K_BYTES};
use super::kquants_multi_x86::q8k_pair_sums;
use super::q8::BlockQ8K;
pub use super::q8_0_tiles_x86::{Q80Act, Q80Tiles};
use super::x86_util::{prefetch_ahead, prefetch_distance};
use super::{has_vnni, Isa};
use core::arch::x86_64::*;
use redlite_gguf::quant::GgmlType;

/// Weight rows per tile (one per i32 lane of a 512-bit vector).
pub const TILE_ROWS: usize = 16;

/// Block `i` of 16 Q4_K weight rows (see the module docs); missing rows are zero.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub struct Q4kTile {
    q: [[u8; 64]; 32],
    /// `scales[s][r]`: sub-block `s`'s scale of row `r`.
    scales: [[u8; 16]; 8],
    /// `mins[k][2r]`, `mins[k][2r + 1]`: sub-blocks `2k` and `2k + 1`'s mins of row `r`.
    mins: [[u8; 32]; 4],
    /// The rows' `d` and `dmin` (f16 bits).
    d: [u16; 16],
    dmin: [u16; 16],
}

impl Q4kTile {
    const ZERO: Q4kTile = Q4kTile {
        q: [[0; 64]; 32],
        scales: [[0; 16]; 8],
        mins: [[0; 32]; 4],
        d: [0; 16],
        dmin: [0; 16],
    };
}

/// A Q4_K matrix as tiles: tile group `t` (rows `16t ..`) is `tiles[t·nb .. (t + 1)·nb]`.
pub struct Q4kTiles {
    tiles: Vec<Q4kTile>,
    rows: usize,
    /// Blocks per row.
    nb: usize,
}

impl Q4kTiles {
    /// Whether the tile kernel can run here (AVX-512 with VNNI, at the active level).
    pub fn supported() -> bool {
        Isa::active() == Isa::Avx512 && has_vnni()
    }

    /// Repacks `rows` Q4_K rows of `cols` columns (`w`: raw GGUF bytes); `None` when the kernel
    /// cannot run here or the shape does not match `w`.
    pub fn repack(w: &[u8], rows: usize, cols: usize) -> Option<Q4kTiles> {
        if !Q4kTiles::supported() || !cols.is_multiple_of(256) {
            return None;
        }
        let nb = cols / 256;
        let rb = nb * Q4K_BYTES;
        if w.len() != rows.checked_mul(rb)? {
            return None;
        }
        let groups = rows.div_ceil(TILE_ROWS);
        let mut tiles = vec![Q4kTile::ZERO; groups * nb];
        for (t, group) in tiles.chunks_exact_mut(nb.max(1)).enumerate() {
            for r in 0..TILE_ROWS.min(rows - t * TILE_ROWS) {
                let row = &w[(t * TILE_ROWS + r) * rb..][..rb];
                for (tile, b) in group.iter_mut().zip(row.chunks_exact(Q4K_BYTES)) {
                    put_row(tile, r, b);
                }
            }
        }
        Some(Q4kTiles { tiles, rows, nb })
    }

    /// Weight rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Tile groups (16 rows each, the last one possibly partial).
    pub fn groups(&self) -> usize {
        self.rows.div_ceil(TILE_ROWS)
    }

    /// Rows `16·g0 ..` of `W · x` into `out` (`out.len()` rows, from the start of group `g0`):
    /// `x` is the activation row as Q8_K blocks, `pairs` their [`pair_sums`].
    pub fn matvec_groups(&self, g0: usize, x: &[BlockQ8K], pairs: &[[i32; 4]], out: &mut [f32]) {
        assert!(x.len() >= self.nb && pairs.len() >= self.nb);
        assert!(g0 * TILE_ROWS + out.len() <= self.rows);
        for (g, ys) in (g0..).zip(out.chunks_mut(TILE_ROWS)) {
            let group = &self.tiles[g * self.nb..(g + 1) * self.nb];
            // SAFETY: tiles exist only where `supported()` (AVX-512 VNNI) holds; the blocks read
            // are within `group`, `x` and `pairs` (checked above); `ys` has at most 16 rows.
            unsafe { group_dot(group, x, pairs, ys) };
        }
    }
}

/// A matrix repacked for small models' products: Q4_K or Q6_K tiles (one-row products on Q8_K
/// activations), or Q8_0 tiles (any number of rows, on Q8_0 activations).
pub enum DecodeTiles {
    Q4K(Q4kTiles),
    Q6K(Q6kTiles),
    Q8_0(Q80Tiles),
}

impl DecodeTiles {
    /// Tiles of `rows × cols` weights of type `ty` (raw GGUF bytes `w`); `None` for other
    /// types, where the kernel cannot run, or when the shape does not match.
    pub fn repack(ty: GgmlType, w: &[u8], rows: usize, cols: usize) -> Option<DecodeTiles> {
        match ty {
            GgmlType::Q4K => Q4kTiles::repack(w, rows, cols).map(DecodeTiles::Q4K),
            GgmlType::Q6K => Q6kTiles::repack(w, rows, cols).map(DecodeTiles::Q6K),
            GgmlType::Q8_0 if q8_0_tiles_enabled() => {
                Q80Tiles::repack(w, rows, cols).map(DecodeTiles::Q8_0)
            }
            _ => None,
        }
    }

    /// Rows `16·g0 ..` of `W · x` into `out` (see [`Q4kTiles::matvec_groups`]; `pairs` is only
    /// read by Q4_K tiles). Q8_0 tiles read Q8_0 activations instead: [`DecodeTiles::q8_0`].
    pub fn matvec_groups(&self, g0: usize, x: &[BlockQ8K], pairs: &[[i32; 4]], out: &mut [f32]) {
        match self {
            DecodeTiles::Q4K(t) => t.matvec_groups(g0, x, pairs, out),
            DecodeTiles::Q6K(t) => t.matvec_groups(g0, x, out),
            DecodeTiles::Q8_0(_) => unreachable!("Q8_0 tiles take Q8_0 activations"),
        }
    }

    /// The Q8_0 tiles, which read Q8_0 activations ([`Q80Tiles::matmul_groups`]).
    pub fn q8_0(&self) -> Option<&Q80Tiles> {
        match self {
            DecodeTiles::Q8_0(t) => Some(t),
            _ => None,
        }
    }

    /// Whether [`DecodeTiles::matvec_groups`] reads `pairs` ([`pair_sums`] of the input).
    pub fn needs_pairs(&self) -> bool {
        matches!(self, DecodeTiles::Q4K(_))
    }
}

/// Whether Q8_0 matrices get tiles (`REDLITE_Q8_0_TILES=0` turns them off, for A/B runs: the
/// products then take the row and lane kernels, with the same values).
fn q8_0_tiles_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("REDLITE_Q8_0_TILES").map_or(true, |v| v.trim() != "0"))
}

/// Block `i` of 16 Q6_K weight rows (see the module docs); missing rows are zero.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub struct Q6kTile {
    /// `q[g][4r + i]`: code (0..63) of row `r`'s element `4g + i`.
    q: [[u8; 64]; 64],
    /// `scales[j][r]`: sub-block `j`'s scale of row `r`.
    scales: [[i8; 16]; 16],
    /// `pairs[k][2r]`, `pairs[k][2r + 1]`: scales `2k` and `2k + 1` of row `r`.
    pairs: [[i8; 32]; 8],
    /// The rows' `d` (f16 bits).
    d: [u16; 16],
}

impl Q6kTile {
    const ZERO: Q6kTile = Q6kTile {
        q: [[0; 64]; 64],
        scales: [[0; 16]; 16],
        pairs: [[0; 32]; 8],
        d: [0; 16],
    };
}

/// A Q6_K matrix as tiles, laid out as [`Q4kTiles`].
pub struct Q6kTiles {
    tiles: Vec<Q6kTile>,
    rows: usize,
    nb: usize,
}

impl Q6kTiles {
    /// As [`Q4kTiles::repack`], for Q6_K.
    pub fn repack(w: &[u8], rows: usize, cols: usize) -> Option<Q6kTiles> {
        if !Q4kTiles::supported() || !cols.is_multiple_of(256) {
            return None;
        }
        let nb = cols / 256;
        let rb = nb * Q6K_BYTES;
        if w.len() != rows.checked_mul(rb)? {
            return None;
        }
        let groups = rows.div_ceil(TILE_ROWS);
        let mut tiles = vec![Q6kTile::ZERO; groups * nb];
        for (t, group) in tiles.chunks_exact_mut(nb.max(1)).enumerate() {
            for r in 0..TILE_ROWS.min(rows - t * TILE_ROWS) {
                let row = &w[(t * TILE_ROWS + r) * rb..][..rb];
                for (tile, b) in group.iter_mut().zip(row.chunks_exact(Q6K_BYTES)) {
                    put_row_q6k(tile, r, b);
                }
            }
        }
        Some(Q6kTiles { tiles, rows, nb })
    }

    /// As [`Q4kTiles::matvec_groups`].
    pub fn matvec_groups(&self, g0: usize, x: &[BlockQ8K], out: &mut [f32]) {
        assert!(x.len() >= self.nb);
        assert!(g0 * TILE_ROWS + out.len() <= self.rows);
        for (g, ys) in (g0..).zip(out.chunks_mut(TILE_ROWS)) {
            let group = &self.tiles[g * self.nb..(g + 1) * self.nb];
            // SAFETY: as in `Q4kTiles::matvec_groups`.
            unsafe { group_dot_q6k(group, x, ys) };
        }
    }
}

/// Puts Q6_K block `b` of one row into lane `r` of `tile` (ggml's element order: in half `c`,
/// byte `l` of `ql`/`qh` feeds elements `128c + l + 32m`, `m` = 0..4).
fn put_row_q6k(tile: &mut Q6kTile, r: usize, b: &[u8]) {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    for c in 0..2 {
        for l in 0..32 {
            let (lo0, lo1, hi) = (ql[64 * c + l], ql[64 * c + l + 32], qh[32 * c + l]);
            let codes = [
                (lo0 & 0x0F) | ((hi & 3) << 4),
                (lo1 & 0x0F) | (((hi >> 2) & 3) << 4),
                (lo0 >> 4) | (((hi >> 4) & 3) << 4),
                (lo1 >> 4) | (((hi >> 6) & 3) << 4),
            ];
            for (m, code) in codes.into_iter().enumerate() {
                let e = 128 * c + 32 * m + l;
                tile.q[e / 4][4 * r + e % 4] = code;
            }
        }
    }
    for (j, &s) in sc.iter().enumerate() {
        tile.scales[j][r] = s as i8;
        tile.pairs[j / 2][2 * r + j % 2] = s as i8;
    }
    tile.d[r] = u16::from_le_bytes([b[208], b[209]]);
}

/// The first `out.len()` (≤ 16) rows of one Q6_K tile group (`nb` tiles) · `x` into `out`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn group_dot_q6k(group: &[Q6kTile], x: &[BlockQ8K], out: &mut [f32]) {
    let mut acc = _mm512_setzero_ps();
    for (tb, y) in group.iter().zip(x) {
        let yq = y.qs.as_ptr();
        let quad = |at: usize| _mm512_set1_epi32((yq.add(at) as *const i32).read_unaligned());
        let mut isum = _mm512_setzero_si512();
        for j in 0..16 {
            let mut t = _mm512_setzero_si512();
            for g in 0..4 {
                let v = _mm512_load_si512(tb.q[4 * j + g].as_ptr() as *const _);
                t = _mm512_dpbusd_epi32(t, v, quad(16 * j + 4 * g));
            }
            let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(tb.scales[j].as_ptr() as *const __m128i));
            isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(t, sc));
        }
        // 32 · Σ_j scale_j · bsums_j (the codes' offset), bsums as i16 pairs.
        let bs = y.bsums.as_ptr() as *const i32;
        let mut corr = _mm512_setzero_si512();
        for k in 0..8 {
            let sp =
                _mm512_cvtepi8_epi16(_mm256_loadu_si256(tb.pairs[k].as_ptr() as *const __m256i));
            corr = _mm512_dpwssd_epi32(corr, sp, _mm512_set1_epi32(bs.add(k).read_unaligned()));
        }
        isum = _mm512_sub_epi32(isum, _mm512_slli_epi32::<5>(corr));
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(tb.d.as_ptr() as *const __m256i));
        let yd = _mm512_set1_ps(y.d);
        acc = _mm512_add_ps(
            acc,
            _mm512_mul_ps(_mm512_mul_ps(yd, d), _mm512_cvtepi32_ps(isum)),
        );
    }
    store_rows(out, acc);
}

/// The first `out.len()` (≤ 16) lanes of `v` into `out`.
#[inline(always)]
unsafe fn store_rows(out: &mut [f32], v: __m512) {
    let mask = (1u32 << out.len().min(TILE_ROWS)) - 1;
    _mm512_mask_storeu_ps(out.as_mut_ptr(), mask as __mmask16, v);
}

/// The activation blocks' sub-block sums as the tile kernel reads them.
pub fn pair_sums(x: &[BlockQ8K]) -> Vec<[i32; 4]> {
    x.iter().map(q8k_pair_sums).collect()
}

/// Puts Q4_K block `b` of one row into lane `r` of `tile`.
fn put_row(tile: &mut Q4kTile, r: usize, b: &[u8]) {
    tile.d[r] = u16::from_le_bytes([b[0], b[1]]);
    tile.dmin[r] = u16::from_le_bytes([b[2], b[3]]);
    let (sc, m) = unpack_scales_k4(&b[4..16]);
    for s in 0..8 {
        tile.scales[s][r] = (sc >> (8 * s)) as u8;
    }
    for k in 0..4 {
        tile.mins[k][2 * r] = (m >> (16 * k)) as u8;
        tile.mins[k][2 * r + 1] = (m >> (16 * k + 8)) as u8;
    }
    for (e, quad) in b[16..Q4K_BYTES].chunks_exact(4).enumerate() {
        tile.q[e][4 * r..4 * r + 4].copy_from_slice(quad);
    }
}

/// The first `out.len()` (≤ 16) rows of one tile group (`nb` tiles) · `x` into `out`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn group_dot(group: &[Q4kTile], x: &[BlockQ8K], pairs: &[[i32; 4]], out: &mut [f32]) {
    let m4 = _mm512_set1_epi8(0x0F);
    let mut acc = _mm512_setzero_ps();
    let pf = prefetch_distance();
    for ((tb, y), p) in group.iter().zip(x).zip(pairs) {
        // Streamed from memory (groups follow each other), the tiles ran 6.0–6.4 ns per block
        // without software prefetch and 4.3–4.5 with the lines requested `pf` bytes ahead
        // (4096; 2048 4.6–4.7, 8192 4.5–4.6, 12288 4.4–4.9; 1 thread, 512 MiB, 4096 columns).
        prefetch_ahead(tb as *const Q4kTile as *const u8, pf, size_of::<Q4kTile>());
        let yq = y.qs.as_ptr();
        let quad = |at: usize| _mm512_set1_epi32((yq.add(at) as *const i32).read_unaligned());
        let mut isum = _mm512_setzero_si512();
        for c in 0..4 {
            // Sub-blocks 2c (low nibbles) and 2c + 1 (high nibbles), four elements per step.
            let (mut lo, mut hi) = (_mm512_setzero_si512(), _mm512_setzero_si512());
            for k in 0..8 {
                let v = _mm512_load_si512(tb.q[8 * c + k].as_ptr() as *const _);
                let wl = _mm512_and_si512(v, m4);
                let wh = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4);
                lo = _mm512_dpbusd_epi32(lo, wl, quad(64 * c + 4 * k));
                hi = _mm512_dpbusd_epi32(hi, wh, quad(64 * c + 32 + 4 * k));
            }
            let scale = |s: usize| {
                _mm512_cvtepu8_epi32(_mm_loadu_si128(tb.scales[s].as_ptr() as *const __m128i))
            };
            isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(lo, scale(2 * c)));
            isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(hi, scale(2 * c + 1)));
        }
        let mut isumm = _mm512_setzero_si512();
        for (k, &pk) in p.iter().enumerate() {
            let mv =
                _mm512_cvtepu8_epi16(_mm256_loadu_si256(tb.mins[k].as_ptr() as *const __m256i));
            isumm = _mm512_dpwssd_epi32(isumm, mv, _mm512_set1_epi32(pk));
        }
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(tb.d.as_ptr() as *const __m256i));
        let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(tb.dmin.as_ptr() as *const __m256i));
        let yd = _mm512_set1_ps(y.d);
        let a = _mm512_mul_ps(_mm512_mul_ps(yd, d), _mm512_cvtepi32_ps(isum));
        let b = _mm512_mul_ps(_mm512_mul_ps(yd, dmin), _mm512_cvtepi32_ps(isumm));
        acc = _mm512_add_ps(acc, _mm512_sub_ps(a, b));
    }
    store_rows(out, acc);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::q8::quantize_row_q8_k;
    use crate::kernels::selftest::{random_activations, random_weights};

    #[test]
    fn tiles_match_matvec_bit_for_bit() {
        if !Q4kTiles::supported() {
            return;
        }
        let shapes = [(16, 256), (37, 256), (5, 512), (40, 2048), (1, 768)];
        for (ty, (rows, cols)) in [GgmlType::Q4K, GgmlType::Q6K]
            .into_iter()
            .flat_map(|ty| shapes.map(|s| (ty, s)))
        {
            let w = random_weights(ty, rows, cols, rows as u64 * 31 + cols as u64);
            let x = random_activations(cols, cols as u64);
            let mut want = vec![0.0f32; rows];
            crate::kernels::matvec(ty, &w, rows, cols, &x, &mut want).unwrap();
            let tiles = DecodeTiles::repack(ty, &w, rows, cols).unwrap();
            let mut q = vec![BlockQ8K::ZERO; cols / 256];
            quantize_row_q8_k(&x, &mut q);
            let mut got = vec![0.0f32; rows];
            tiles.matvec_groups(0, &q, &pair_sums(&q), &mut got);
            for (r, (g, e)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    e.to_bits(),
                    "{rows}x{cols} row {r}: {g} vs {e}"
                );
            }
            // From the second group on, as a task would.
            if rows > TILE_ROWS {
                let mut tail = vec![0.0f32; rows - TILE_ROWS];
                tiles.matvec_groups(1, &q, &pair_sums(&q), &mut tail);
                assert_eq!(tail, want[TILE_ROWS..]);
            }
        }
    }
}
