//! Q8_0 weights repacked for small models: 16 weight rows interleaved per block, one row per
//! i32 lane, against any number of Q8_0 activation rows ([`Q80Tiles`]).
//!
//! The one-row kernel ([`super::simple_x86`]) spends most of a block on per-row work: the sign
//! split, a horizontal reduction of the block sum, the scale product and a serial f32 add — on a
//! model that runs from cache (the demo model's 31 MB) that, not the bytes, is the cost. The
//! lane kernel ([`super::q8_0_lanes_x86`]) removes it for many activation rows, at a fixed cost
//! per weight block that a 2–4-row verify pass pays in full. Here the lanes are the *weight*
//! rows instead, so the cost per activation row is the same whatever the row count:
//!
//! * a [`Q80Tile`] is block `i` of 16 weight rows: vector `k` holds bytes `4k..4k+4` of every
//!   row's block (row `r` in lane `r`) with their top bit flipped (`w ^ 0x80 = w + 128`,
//!   unsigned), and the 16 scales as f32 (exact from f16); 576 bytes for 16 × 34 (1.06×);
//! * an activation row's four bytes `4k..4k+4` (signed) are broadcast to every lane straight from
//!   memory (`vpdpbusd`'s `{1to16}` operand), so eight `vpdpbusd` give `Σ (w + 128) · y =
//!   isum + 128 · Σ y` for 16 rows; the lanes start from the activation block's `−128 · Σ y`
//!   (one scalar per activation block, shared by every weight row), which leaves `isum` exactly.
//!
//! **Exactness:** per lane the f32 update is the row kernel's `acc += (d_w · d_y) · isum` in block
//! order from `acc = 0`, so every output is bit-identical to `matvec`'s (and to the lane kernel's,
//! so a verify row equals a decode step whichever kernel each takes).

use super::q8::BlockQ8_0;
use super::{has_vnni, Isa};
use core::arch::x86_64::*;

/// Weight rows per tile (one per i32 lane of a 512-bit vector).
pub const TILE_ROWS: usize = 16;

/// Q8_0 block bytes: the f16 scale, then 32 quants.
const BLOCK_BYTES: usize = 34;

/// Block `i` of 16 Q8_0 weight rows (see the module docs); missing rows are zero.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub struct Q80Tile {
    /// `q[k][4r..4r + 4]`: row `r`'s quants `4k..4k + 4`, each `^ 0x80`.
    q: [[u8; 64]; 8],
    /// The rows' scales as f32.
    d: [f32; 16],
}

impl Q80Tile {
    const ZERO: Q80Tile = Q80Tile {
        q: [[0x80; 64]; 8],
        d: [0.0; 16],
    };
}

/// A Q8_0 matrix as tiles: tile group `t` (rows `16t ..`) is `tiles[t·nb .. (t + 1)·nb]`.
pub struct Q80Tiles {
    tiles: Vec<Q80Tile>,
    rows: usize,
    /// Blocks per row.
    nb: usize,
}

/// One activation row as the tile kernel reads it: its Q8_0 blocks, each block's `−128 · Σ y`
/// and scale as f32.
pub struct Q80Act<'a> {
    q: &'a [BlockQ8_0],
    bias: Vec<i32>,
    d: Vec<f32>,
}

impl<'a> Q80Act<'a> {
    /// Prepares the quantized row `q` (from [`super::q8::quantize_row_q8_0`]).
    pub fn new(q: &'a [BlockQ8_0]) -> Q80Act<'a> {
        Q80Act {
            q,
            bias: q
                .iter()
                .map(|b| -128 * b.qs.iter().map(|&v| i32::from(v)).sum::<i32>())
                .collect(),
            d: q.iter()
                .map(|b| half::f16::from_bits(b.d).to_f32())
                .collect(),
        }
    }
}

impl Q80Tiles {
    /// Whether the tile kernel can run here (AVX-512 with VNNI, at the active level).
    pub fn supported() -> bool {
        Isa::active() == Isa::Avx512 && has_vnni()
    }

    /// Repacks `rows` Q8_0 rows of `cols` columns (`w`: raw GGUF bytes); `None` when the kernel
    /// cannot run here or the shape does not match `w`.
    pub fn repack(w: &[u8], rows: usize, cols: usize) -> Option<Q80Tiles> {
        if !Q80Tiles::supported() || !cols.is_multiple_of(32) || cols == 0 {
            return None;
        }
        let nb = cols / 32;
        let rb = nb * BLOCK_BYTES;
        if w.len() != rows.checked_mul(rb)? {
            return None;
        }
        let groups = rows.div_ceil(TILE_ROWS);
        let mut tiles = vec![Q80Tile::ZERO; groups * nb];
        for (t, group) in tiles.chunks_exact_mut(nb).enumerate() {
            for r in 0..TILE_ROWS.min(rows - t * TILE_ROWS) {
                let row = &w[(t * TILE_ROWS + r) * rb..][..rb];
                for (tile, b) in group.iter_mut().zip(row.chunks_exact(BLOCK_BYTES)) {
                    tile.d[r] = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                    for (k, q) in tile.q.iter_mut().enumerate() {
                        for i in 0..4 {
                            q[4 * r + i] = b[2 + 4 * k + i] ^ 0x80;
                        }
                    }
                }
            }
        }
        Some(Q80Tiles { tiles, rows, nb })
    }

    /// Weight rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Tile groups (16 rows each, the last one possibly partial).
    pub fn groups(&self) -> usize {
        self.rows.div_ceil(TILE_ROWS)
    }

    /// Blocks per row.
    pub fn blocks(&self) -> usize {
        self.nb
    }

    /// Rows `16·g0 ..` of `W · x_j` for every activation row `x_j = acts[j]`, into `outs[j]`
    /// (every `outs[j]` holds the same number of rows, from the start of group `g0`).
    pub fn matmul_groups(&self, g0: usize, acts: &[&Q80Act], outs: &mut [&mut [f32]]) {
        assert_eq!(acts.len(), outs.len());
        let n = outs.first().map_or(0, |o| o.len());
        assert!(outs.iter().all(|o| o.len() == n));
        assert!(g0 * TILE_ROWS + n <= self.rows);
        assert!(acts
            .iter()
            .all(|a| a.q.len() >= self.nb && a.bias.len() >= self.nb && a.d.len() >= self.nb));
        let groups = n.div_ceil(TILE_ROWS);
        let mut g = 0;
        while g < groups {
            // Two groups a pass where there are two: each activation quad broadcast once for
            // both (the kernel is bound by its loads: 8 tile vectors per group and block, one
            // broadcast per quad, row and block).
            let two = g + 1 < groups;
            let width = if two { 2 } else { 1 };
            let lo = g * TILE_ROWS;
            let hi = (lo + width * TILE_ROWS).min(n);
            let group = |i: usize| &self.tiles[(g0 + g + i) * self.nb..(g0 + g + i + 1) * self.nb];
            let mut j = 0;
            while j < acts.len() {
                let m = (acts.len() - j).min(4);
                let a = &acts[j..j + m];
                // Row `lo..hi` of each of these activation rows' outputs, stored in place.
                let dst: [*mut f32; 4] = core::array::from_fn(|r| {
                    outs.get_mut(j + r)
                        .map_or(core::ptr::null_mut(), |o| o[lo..hi].as_mut_ptr())
                });
                let valid = hi - lo;
                // SAFETY: tiles exist only where `supported()` (AVX-512 VNNI) holds; every
                // activation row has at least `nb` blocks (checked above); `dst[..m]` point at
                // `valid` writable values each (`o[lo..hi]`).
                unsafe {
                    if two {
                        let gs = [group(0), group(1)];
                        match m {
                            1 => groups_dot::<2, 1>(gs, a, dst, valid),
                            2 => groups_dot::<2, 2>(gs, a, dst, valid),
                            3 => groups_dot::<2, 3>(gs, a, dst, valid),
                            _ => groups_dot::<2, 4>(gs, a, dst, valid),
                        }
                    } else {
                        let gs = [group(0)];
                        match m {
                            1 => groups_dot::<1, 1>(gs, a, dst, valid),
                            2 => groups_dot::<1, 2>(gs, a, dst, valid),
                            3 => groups_dot::<1, 3>(gs, a, dst, valid),
                            _ => groups_dot::<1, 4>(gs, a, dst, valid),
                        }
                    }
                }
                j += m;
            }
            g += width;
        }
    }
}

/// `G` consecutive tile groups (16 weight rows each, the same number of blocks) against `M`
/// activation rows: `dst[j][16 i + r]` = weight row `r` of group `i` · `acts[j]`, for the first
/// `valid` of the `16 G` rows (masked stores past them).
///
/// # Safety
/// AVX-512 VNNI; every `acts[j]` has the groups' block count; `dst[j]` (j < M) points at `valid`
/// writable f32s, `valid <= 16 G`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn groups_dot<const G: usize, const M: usize>(
    groups: [&[Q80Tile]; G],
    acts: &[&Q80Act],
    dst: [*mut f32; 4],
    valid: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); G]; M];
    let nb = groups[0].len();
    for b in 0..nb {
        let tiles: [&Q80Tile; G] = core::array::from_fn(|i| groups[i].get_unchecked(b));
        let y: [*const i32; M] =
            core::array::from_fn(|j| acts[j].q.get_unchecked(b).qs.as_ptr() as *const i32);
        // Integer sums per (row, group), from the activation block's bias; the quad k of every
        // tile row is loaded once for all M rows (fewer live registers than holding a block's 8
        // vectors per group: no spills). i32 sums are exact, so their order leaves `isum` as is.
        let mut s: [[__m512i; G]; M] =
            core::array::from_fn(|j| [_mm512_set1_epi32(*acts[j].bias.get_unchecked(b)); G]);
        for k in 0..8 {
            let q: [__m512i; G] = core::array::from_fn(|i| {
                _mm512_load_si512(tiles[i].q[k].as_ptr() as *const __m512i)
            });
            for (sj, yj) in s.iter_mut().zip(&y) {
                let yk = _mm512_set1_epi32(yj.add(k).read_unaligned());
                for i in 0..G {
                    sj[i] = _mm512_dpbusd_epi32(sj[i], q[i], yk);
                }
            }
        }
        for ((accj, sj), a) in acc.iter_mut().zip(&s).zip(&acts[..M]) {
            let dy = _mm512_set1_ps(*a.d.get_unchecked(b));
            for i in 0..G {
                let isum = _mm512_cvtepi32_ps(sj[i]);
                let d = _mm512_load_ps(tiles[i].d.as_ptr());
                accj[i] = _mm512_add_ps(accj[i], _mm512_mul_ps(_mm512_mul_ps(d, dy), isum));
            }
        }
    }
    for (&out, acc) in dst.iter().zip(acc) {
        for (i, a) in acc.into_iter().enumerate() {
            let left = valid.saturating_sub(TILE_ROWS * i).min(TILE_ROWS);
            if left == TILE_ROWS {
                _mm512_storeu_ps(out.add(TILE_ROWS * i), a);
            } else if left > 0 {
                _mm512_mask_storeu_ps(out.add(TILE_ROWS * i), (1u16 << left) - 1, a);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::q8::quantize_row_q8_0;
    use crate::kernels::selftest::{random_activations, random_weights};
    use redlite_gguf::quant::GgmlType;

    #[test]
    fn tiles_match_matvec_bit_for_bit() {
        if !Q80Tiles::supported() {
            return;
        }
        for (rows, cols) in [(16, 32), (37, 384), (5, 160), (160, 384), (1, 2048)] {
            let ty = GgmlType::Q8_0;
            let w = random_weights(ty, rows, cols, rows as u64 * 7 + cols as u64);
            let tiles = Q80Tiles::repack(&w, rows, cols).unwrap();
            // The kernel takes activation rows four at a time: single rows, partial quads and runs
            // of many quads with every remainder.
            for n in [1, 2, 3, 5, 9, 16, 17, 24, 33, 40] {
                let xs: Vec<Vec<f32>> = (0..n)
                    .map(|j| random_activations(cols, (cols * 13 + j) as u64))
                    .collect();
                let qs: Vec<Vec<BlockQ8_0>> = xs
                    .iter()
                    .map(|x| {
                        let mut q = vec![BlockQ8_0::ZERO; cols / 32];
                        quantize_row_q8_0(x, &mut q);
                        q
                    })
                    .collect();
                let owned: Vec<Q80Act> = qs.iter().map(|q| Q80Act::new(q)).collect();
                let acts: Vec<&Q80Act> = owned.iter().collect();
                let mut got = vec![vec![0.0f32; rows]; n];
                {
                    let mut outs: Vec<&mut [f32]> = got.iter_mut().map(|g| &mut g[..]).collect();
                    tiles.matmul_groups(0, &acts, &mut outs);
                }
                for (x, g) in xs.iter().zip(&got) {
                    let mut want = vec![0.0f32; rows];
                    crate::kernels::matvec(ty, &w, rows, cols, x, &mut want).unwrap();
                    for (r, (a, e)) in g.iter().zip(&want).enumerate() {
                        assert_eq!(a.to_bits(), e.to_bits(), "{rows}x{cols} n {n} row {r}");
                    }
                }
                // From the second group on, as a task would.
                if rows > TILE_ROWS {
                    let mut tail = vec![vec![0.0f32; rows - TILE_ROWS]; n];
                    let mut outs: Vec<&mut [f32]> = tail.iter_mut().map(|g| &mut g[..]).collect();
                    tiles.matmul_groups(1, &acts, &mut outs);
                    for (t, g) in tail.iter().zip(&got) {
                        assert_eq!(t[..], g[TILE_ROWS..]);
                    }
                }
            }
        }
    }
}
