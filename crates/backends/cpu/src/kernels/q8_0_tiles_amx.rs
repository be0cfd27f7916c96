//! The Q8_0 tile product on Intel AMX (Sapphire Rapids and later): 16 activation rows against 16
//! weight rows a block in one `tdpbsud`, for verify passes and prompts of many rows.
//!
//! [`super::q8_0_tiles_x86`]'s VNNI kernel spends 8 `vpdpbusd` per block, weight group and
//! activation row on the integer sums; one AMX tile product computes the sums of a block for 16
//! activation rows × 16 weight rows at once, on its own unit. What is left on the vector ports is
//! the per-block f32 epilogue, which the one-row kernel's order fixes:
//!
//! * **A** (`tmm0`): block `b` of up to 16 activation rows, 32 signed quants each, packed row
//!   after row (`m × 32` bytes) once a call;
//! * **B** (`tmm1`): the weight tile's 8 quad vectors exactly as [`Q80Tile`] stores them (vector
//!   `k` holds bytes `4k..4k + 4` of the 16 rows, `w ^ 0x80`, unsigned) — no second layout;
//! * **C** (`tmm2`, `tmm3` alternating): started from a tile of the activation rows' `−128 · Σ y`
//!   (row `a` = activation row `a`'s bias, in every column), so that after `tdpbsud` (signed A ×
//!   unsigned B) `C[a][r] = Σ y · (w + 128) − 128 · Σ y = isum` exactly, the integer sum of row
//!   `r` against activation row `a`;
//! * the epilogue reads C row by row: `acc[a] += (d_w · d_y[a]) · isum[a]`, a vector over the 16
//!   weight rows, in block order from `acc = 0`.
//!
//! **Exactness:** the i32 sums are exact whichever unit adds them, and every f32 operation after
//! them is the row kernel's, in its order, so every output is bit-identical to `matvec`'s.
//!
//! AMX needs the kernel's permission for the tile data (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, asked
//! once a process, see [`available`]); `REDLITE_AMX=0` turns the kernel off (the VNNI one runs).

use super::q8_0_tiles_x86::{Q80Act, Q80Tile, TILE_ROWS};
use core::arch::asm;
use core::arch::x86_64::*;
use std::sync::OnceLock;

/// Whether the AMX kernel runs here: the CPU has AMX-TILE and AMX-INT8, the OS granted the tile
/// data, and `REDLITE_AMX` is not `0`.
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        if std::env::var("REDLITE_AMX").is_ok_and(|v| v == "0") {
            return false;
        }
        cpu_has_amx_int8() && request_tile_data()
    })
}

/// CPUID leaf 7: EDX bit 24 (AMX-TILE) and bit 25 (AMX-INT8); the OS must also save the tile
/// state (XCR0 bits 17 and 18).
fn cpu_has_amx_int8() -> bool {
    // SAFETY: CPUID leaf 0 always exists; leaf 7 only where leaf 0 says so.
    unsafe {
        if __cpuid(0).eax < 7 {
            return false;
        }
        let edx = __cpuid_count(7, 0).edx;
        let osxsave = __cpuid(1).ecx & (1 << 27) != 0;
        if edx & (1 << 24) == 0 || edx & (1 << 25) == 0 || !osxsave {
            return false;
        }
        let (lo, hi): (u32, u32);
        asm!("xgetbv", in("ecx") 0u32, out("eax") lo, out("edx") hi, options(nomem, nostack));
        let xcr0 = (u64::from(hi) << 32) | u64::from(lo);
        xcr0 & (0b11 << 17) == 0b11 << 17
    }
}

/// Asks Linux for permission to use the AMX tile data (process-wide, once).
#[cfg(target_os = "linux")]
fn request_tile_data() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain system call with integer arguments.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn request_tile_data() -> bool {
    false
}

/// The tile configuration (`ldtilecfg`'s 64-byte operand, palette 1).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    _reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    /// Two sets of A (16 × 32 bytes), B (8 × 64) and C (16 × 64), `tmm0`–`tmm2` and `tmm3`–`tmm5`.
    fn new() -> TileConfig {
        let m = TILE_ROWS as u8;
        let mut c = TileConfig {
            palette: 1,
            start_row: 0,
            _reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        for set in [0, 3] {
            (c.colsb[set], c.rows[set]) = (32, m);
            (c.colsb[set + 1], c.rows[set + 1]) = (64, 8);
            (c.colsb[set + 2], c.rows[set + 2]) = (64, m);
        }
        c
    }
}

/// Activation rows packed for the A and C tiles, 16 rows a block whatever their number (rows past
/// the activations are zero, so their sums are too): per block, the rows' quants (16 × 32 bytes),
/// the bias tile (16 rows of 16 copies of the row's `−128 · Σ y`) and the rows' scales.
struct Packed {
    quants: Vec<[i8; 32]>,
    bias: Vec<i32>,
    dy: Vec<f32>,
}

impl Packed {
    /// Chunk `ch` (activation rows `16 ch ..`), block `b`, row `a` of the chunk at index
    /// `(ch · nb + b) · 16 + a`.
    fn new(acts: &[&Q80Act], nb: usize) -> Packed {
        let slots = acts.len().div_ceil(TILE_ROWS) * nb * TILE_ROWS;
        let mut quants = vec![[0i8; 32]; slots];
        let mut bias = vec![0i32; slots];
        let mut dy = vec![0f32; slots];
        for (j, act) in acts.iter().enumerate() {
            let (ch, a) = (j / TILE_ROWS, j % TILE_ROWS);
            for b in 0..nb {
                let i = (ch * nb + b) * TILE_ROWS + a;
                quants[i] = act.q[b].qs;
                bias[i] = act.bias[b];
                dy[i] = act.d[b];
            }
        }
        Packed { quants, bias, dy }
    }
}

/// Rows `16·g0 ..` of `W · x_j` for every activation row `x_j = acts[j]` into `outs[j]`, as
/// [`super::q8_0_tiles_x86::Q80Tiles::matmul_groups`] does, on AMX: the rows in chunks of 16 (the
/// last one padded with zero rows), each weight group against every chunk while its tiles are in
/// L1. `tiles` are the matrix's tiles from group `g0` on, `nb` a row's blocks.
///
/// # Safety
/// [`available`] holds; every act has at least `nb` blocks; every `outs[j]` has the same length
/// `n`, and `tiles` holds `n.div_ceil(16)` groups of `nb` tiles.
pub unsafe fn matmul_groups(
    tiles: &[Q80Tile],
    nb: usize,
    acts: &[&Q80Act],
    outs: &mut [&mut [f32]],
) {
    debug_assert_eq!(acts.len(), outs.len());
    let Some(n) = outs.first().map(|o| o.len()) else {
        return;
    };
    if n == 0 || nb == 0 {
        return;
    }
    let packed = Packed::new(acts, nb);
    let mut dst = vec![core::ptr::null_mut(); acts.len().next_multiple_of(TILE_ROWS)];
    for (d, o) in dst.iter_mut().zip(outs.iter_mut()) {
        *d = o.as_mut_ptr();
    }
    let cfg = TileConfig::new();
    asm!("ldtilecfg [{}]", in(reg) &cfg as *const TileConfig, options(nostack, readonly));
    let shape = Shape {
        nb,
        chunks: acts.len().div_ceil(TILE_ROWS),
        groups: n.div_ceil(TILE_ROWS),
        n,
    };
    stream(tiles, &packed, &dst, shape);
    asm!("tilerelease", options(nostack, nomem));
}

/// The sizes of one call: blocks a row, activation chunks, weight groups, output rows.
#[derive(Clone, Copy)]
struct Shape {
    nb: usize,
    chunks: usize,
    groups: usize,
    n: usize,
}

/// A step of the stream: weight group `g`, activation chunk `ch`, block `b`.
#[derive(Clone, Copy)]
struct Pos {
    g: usize,
    ch: usize,
    b: usize,
}

impl Pos {
    fn next(self, s: Shape) -> Pos {
        if self.b + 1 < s.nb {
            Pos {
                b: self.b + 1,
                ..self
            }
        } else if self.ch + 1 < s.chunks {
            Pos {
                ch: self.ch + 1,
                b: 0,
                ..self
            }
        } else {
            Pos {
                g: self.g + 1,
                ch: 0,
                b: 0,
            }
        }
    }

    /// Index of this step's rows in [`Packed`].
    fn slot(self, s: Shape) -> usize {
        (self.ch * s.nb + self.b) * TILE_ROWS
    }
}

/// Every (group, chunk, block) step as one stream: step `t + 1`'s tile product is issued before
/// step `t`'s epilogue, so neither the end of a row nor a group drains the pipeline.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn stream(tiles: &[Q80Tile], p: &Packed, dst: &[*mut f32], s: Shape) {
    let mut acc = [_mm512_setzero_ps(); TILE_ROWS];
    // `c[k]`: tile set `k`'s sums, stored one step late (written by `tilestored` before any
    // read).
    let mut c = core::mem::MaybeUninit::<[CBuf; 2]>::uninit();
    let c = c.as_mut_ptr() as *mut CBuf;
    let steps = s.groups * s.chunks * s.nb;
    let (mut issue, mut done) = (Pos { g: 0, ch: 0, b: 0 }, Pos { g: 0, ch: 0, b: 0 });
    for t in 0..steps {
        // Step t's product, and step t − 1's sums out of their tile.
        let w = tiles.get_unchecked(issue.g * s.nb + issue.b);
        let a = p.quants.as_ptr().add(issue.slot(s));
        if t & 1 == 0 {
            block_step::<0>(w, a, c.add(1));
        } else {
            block_step::<1>(w, a, c);
        }
        issue = issue.next(s);
        if t > 0 {
            finish(&mut acc, tiles, p, &*c.add((t - 1) & 1), done, dst, s);
            done = done.next(s);
        }
    }
    if steps > 0 {
        if (steps - 1) & 1 == 0 {
            store_c::<0>(c);
        } else {
            store_c::<1>(c.add(1));
        }
        finish(&mut acc, tiles, p, &*c.add((steps - 1) & 1), done, dst, s);
    }
}

/// Step `u`'s epilogue, then, after the last block of a row, the chunk's outputs for the group.
#[inline(always)]
unsafe fn finish(
    acc: &mut [__m512; TILE_ROWS],
    tiles: &[Q80Tile],
    p: &Packed,
    c: &CBuf,
    u: Pos,
    dst: &[*mut f32],
    s: Shape,
) {
    epilogue(acc, tiles.get_unchecked(u.g * s.nb + u.b), p, u.slot(s), c);
    if u.b + 1 == s.nb {
        let valid = (s.n - u.g * TILE_ROWS).min(TILE_ROWS);
        let rows = dst.get_unchecked(u.ch * TILE_ROWS..(u.ch + 1) * TILE_ROWS);
        for (&out, acc) in rows.iter().zip(acc.iter_mut()) {
            if !out.is_null() {
                let out = out.add(u.g * TILE_ROWS);
                if valid == TILE_ROWS {
                    _mm512_storeu_ps(out, *acc);
                } else {
                    _mm512_mask_storeu_ps(out, (1u16 << valid) - 1, *acc);
                }
            }
            *acc = _mm512_setzero_ps();
        }
    }
}

/// C rows as `tilestored` leaves them: `[activation row][weight row]`.
#[repr(C, align(64))]
struct CBuf([[i32; 16]; TILE_ROWS]);

/// Issues the tile product of weight tile `w` against the 16 packed rows at `a` on tile set `S`
/// (A, B, C = `tmm0`–`tmm2` for 0, `tmm3`–`tmm5` for 1), then stores the other set's C tile (the
/// previous step's sums, issued a step earlier) into `prev`. Tile registers are not renamed: with
/// one set, each step's loads would wait for the previous step's product, and its store for its
/// own product.
///
/// # Safety
/// The tile configuration of [`TileConfig::new`] is loaded; `a` points at 16 × 32 bytes.
#[inline(always)]
unsafe fn block_step<const S: usize>(w: &Q80Tile, a: *const [i8; 32], prev: *mut CBuf) {
    macro_rules! step {
        ($a:literal, $b:literal, $c:literal, $other:literal) => {
            asm!(
                concat!("tilezero ", $c),
                concat!("tileloadd ", $a, ", [{a} + {s32}*1]"),
                concat!("tileloadd ", $b, ", [{w} + {s64}*1]"),
                concat!("tdpbsud ", $c, ", ", $a, ", ", $b),
                concat!("tilestored [{prev} + {s64}*1], ", $other),
                a = in(reg) a,
                w = in(reg) w as *const Q80Tile,
                prev = in(reg) prev,
                s32 = in(reg) 32usize,
                s64 = in(reg) 64usize,
                options(nostack),
            )
        };
    }
    if S == 0 {
        step!("tmm0", "tmm1", "tmm2", "tmm5");
    } else {
        step!("tmm3", "tmm4", "tmm5", "tmm2");
    }
}

/// Stores set `S`'s C tile into `c`.
///
/// # Safety
/// The tile configuration of [`TileConfig::new`] is loaded.
#[inline(always)]
unsafe fn store_c<const S: usize>(c: *mut CBuf) {
    if S == 0 {
        asm!("tilestored [{c} + {s64}*1], tmm2", c = in(reg) c, s64 = in(reg) 64usize, options(nostack));
    } else {
        asm!("tilestored [{c} + {s64}*1], tmm5", c = in(reg) c, s64 = in(reg) 64usize, options(nostack));
    }
}

/// One step's epilogue: `acc[a] += (d_w · d_y[a]) · isum[a]` (the row kernel's operations), the
/// packed rows at `slot`.
#[inline(always)]
unsafe fn epilogue(
    acc: &mut [__m512; TILE_ROWS],
    tile: &Q80Tile,
    p: &Packed,
    slot: usize,
    c: &CBuf,
) {
    let d = _mm512_load_ps(tile.scales().as_ptr());
    let dy = p.dy.as_ptr().add(slot);
    let bias = p.bias.as_ptr().add(slot);
    for (a, acc) in acc.iter_mut().enumerate() {
        let c = _mm512_load_si512(c.0[a].as_ptr() as *const __m512i);
        let isum = _mm512_cvtepi32_ps(_mm512_add_epi32(c, _mm512_set1_epi32(*bias.add(a))));
        let dya = _mm512_set1_ps(*dy.add(a));
        *acc = _mm512_add_ps(*acc, _mm512_mul_ps(_mm512_mul_ps(d, dya), isum));
    }
}

#[cfg(test)]
mod micro {
    use super::*;

    #[test]
    #[ignore]
    fn amx_micro() {
        assert!(available());
        let cfg = TileConfig::new();
        let a = vec![1i8; 16 * 32 * 64];
        let w = vec![1u8; 8 * 64 * 64];
        let mut c = vec![0i32; 16 * 16 * 8];
        let n = 1_000_000usize;
        unsafe {
            asm!("ldtilecfg [{}]", in(reg) &cfg as *const TileConfig);
            for variant in 0..8 {
                let t = std::time::Instant::now();
                for i in 0..n {
                    let ap = a.as_ptr().add((i % 64) * 512);
                    let wp = w.as_ptr().add((i % 64) * 512);
                    let cp = c.as_mut_ptr().add((i % 4) * 512);
                    match variant {
                        0 => asm!("tdpbsud tmm2, tmm0, tmm1", "tdpbsud tmm5, tmm3, tmm4"),
                        1 => {
                            asm!("tileloadd tmm0, [{a} + {s32}*1]", "tileloadd tmm1, [{w} + {s64}*1]",
                                  "tdpbsud tmm2, tmm0, tmm1",
                                  "tileloadd tmm3, [{a} + {s32}*1]", "tileloadd tmm4, [{w} + {s64}*1]",
                                  "tdpbsud tmm5, tmm3, tmm4",
                                  a = in(reg) ap, w = in(reg) wp, s32 = in(reg) 32usize, s64 = in(reg) 64usize)
                        }
                        2 => {
                            asm!("tilezero tmm2", "tilezero tmm5", "tileloadd tmm0, [{a} + {s32}*1]", "tileloadd tmm1, [{w} + {s64}*1]",
                                  "tdpbsud tmm2, tmm0, tmm1",
                                  "tileloadd tmm3, [{a} + {s32}*1]", "tileloadd tmm4, [{w} + {s64}*1]",
                                  "tdpbsud tmm5, tmm3, tmm4",
                                  a = in(reg) ap, w = in(reg) wp, s32 = in(reg) 32usize, s64 = in(reg) 64usize)
                        }
                        4 => {
                            asm!("tileloadd tmm0, [{a} + {s32}*1]", "tileloadd tmm1, [{w} + {s64}*1]",
                                  "tileloadd tmm3, [{a} + {s32}*1]", "tileloadd tmm4, [{w} + {s64}*1]",
                                  a = in(reg) ap, w = in(reg) wp, s32 = in(reg) 32usize, s64 = in(reg) 64usize)
                        }
                        5 => {
                            asm!("tileloadd tmm0, [{a} + {s32}*1]", "tileloadd tmm1, [{w} + {s64}*1]",
                                  "tileloadd tmm4, [{w} + {s64}*1]",
                                  "tdpbsud tmm2, tmm0, tmm1", "tdpbsud tmm5, tmm0, tmm4",
                                  a = in(reg) ap, w = in(reg) wp, s32 = in(reg) 32usize, s64 = in(reg) 64usize)
                        }
                        6 => {
                            asm!("tileloadd tmm0, [{a} + {s32}*1]", "tileloadd tmm1, [{w} + {s64}*1]",
                                  "tileloadd tmm3, [{a} + {s32}*1]", "tileloadd tmm4, [{w} + {s64}*1]",
                                  "tdpbsud tmm2, tmm0, tmm1", "tdpbsud tmm5, tmm0, tmm4",
                                  "tdpbsud tmm6, tmm3, tmm1", "tdpbsud tmm7, tmm3, tmm4",
                                  a = in(reg) ap, w = in(reg) wp, s32 = in(reg) 32usize, s64 = in(reg) 64usize)
                        }
                        7 => asm!("tileloadd tmm0, [{a} + {s32}*1]",
                                  "tileloadd tmm1, [{a} + {s32}*1]",
                                  a = in(reg) ap, s32 = in(reg) 32usize),
                        _ => {
                            asm!("tilezero tmm2", "tilezero tmm5", "tileloadd tmm0, [{a} + {s32}*1]", "tileloadd tmm1, [{w} + {s64}*1]",
                                  "tdpbsud tmm2, tmm0, tmm1",
                                  "tileloadd tmm3, [{a} + {s32}*1]", "tileloadd tmm4, [{w} + {s64}*1]",
                                  "tdpbsud tmm5, tmm3, tmm4",
                                  "tilestored [{c} + {s64}*1], tmm2",
                                  a = in(reg) ap, w = in(reg) wp, c = in(reg) cp, s32 = in(reg) 32usize, s64 = in(reg) 64usize)
                        }
                    }
                }
                let dt = t.elapsed().as_secs_f64();
                eprintln!(
                    "variant {variant}: {:.1} ns per pair of products",
                    dt / n as f64 * 1e9
                );
            }
            asm!("tilerelease");
        }
    }
}
