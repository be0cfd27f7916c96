//! Attention decode on the CPU: one pass over the KV cache per query head with an online softmax
//! (running maximum and normaliser, values accumulated as they stream by), heads in parallel,
//! compiled for the widest vector unit present.
//!
//! The cache may hold f32, f16 or Q8_0 elements; narrower ones are converted on the fly inside
//! the two inner products (`q·k_j` and `acc += p·v_j`), never materialised: f16 through the
//! hardware half→single conversion, Q8_0 as `d · Σ q_i·qs_i` with the query kept in f32.

use redlite_model::kv_type::{f16_to_f32, BlockQ8_0, Q8_0_BLOCK};
use redlite_model::state::{KvCache, KvRows};

use crate::kernels::Isa;

/// `Σ a_i·b_i` with 16 independent partial sums (vectorises to one AVX-512 register).
#[inline(always)]
fn dot16(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// One KV head's keys or values (`hd` values per position), read position by position.
trait HeadRows {
    /// `q · row_j`.
    fn dot(&self, j: usize, q: &[f32]) -> f32;
    /// `acc += p · row_j`.
    fn axpy(&self, j: usize, p: f32, acc: &mut [f32]);
    /// `acc += p_i · row_{j0 + i}` for every `i` in order: per element the same operations as
    /// one [`HeadRows::axpy`] per position (a reader may keep `acc` in registers meanwhile).
    #[inline(always)]
    fn axpy_block(&self, j0: usize, p: &[f32], acc: &mut [f32]) {
        for (i, &pi) in p.iter().enumerate() {
            self.axpy(j0 + i, pi, acc);
        }
    }
    /// `out[i] = q · row_{j0 + i} · scale` for `i < out.len()` (at most [`BLOCK`]): a reader may
    /// compute a whole block's dot products together (its own fixed order of operations, the same
    /// whichever heads or rows share the pass).
    #[inline(always)]
    fn dots_block(&self, j0: usize, q: &[f32], scale: f32, out: &mut [f32]) {
        for (i, s) in out.iter_mut().enumerate() {
            *s = self.dot(j0 + i, q) * scale;
        }
    }
}

/// Where head `g`'s values of position `j` start in a cache row layout.
#[derive(Clone, Copy)]
struct HeadSlice {
    /// Values per position (all KV heads).
    width: usize,
    /// First value of the head within a position.
    offset: usize,
    hd: usize,
}

impl HeadSlice {
    #[inline(always)]
    fn start(&self, j: usize) -> usize {
        j * self.width + self.offset
    }
}

struct F32Rows<'a>(&'a [f32], HeadSlice);

impl HeadRows for F32Rows<'_> {
    #[inline(always)]
    fn dot(&self, j: usize, q: &[f32]) -> f32 {
        let s = self.1.start(j);
        dot16(q, &self.0[s..s + self.1.hd])
    }

    #[inline(always)]
    fn axpy(&self, j: usize, p: f32, acc: &mut [f32]) {
        let s = self.1.start(j);
        for (a, v) in acc.iter_mut().zip(&self.0[s..s + self.1.hd]) {
            *a += p * v;
        }
    }
}

/// f16 rows, converted 16 at a time (portable; the AVX-512 build has its own below).
struct F16Rows<'a>(&'a [u16], HeadSlice);

impl HeadRows for F16Rows<'_> {
    #[inline(always)]
    fn dot(&self, j: usize, q: &[f32]) -> f32 {
        let s = self.1.start(j);
        let row = &self.0[s..s + self.1.hd];
        let mut acc = [0.0f32; 16];
        let (cq, ck) = (q.chunks_exact(16), row.chunks_exact(16));
        let (rq, rk) = (cq.remainder(), ck.remainder());
        for (x, h) in cq.zip(ck) {
            for i in 0..16 {
                acc[i] += x[i] * f16_to_f32(h[i]);
            }
        }
        let mut sum: f32 = acc.iter().sum();
        for (x, &h) in rq.iter().zip(rk) {
            sum += x * f16_to_f32(h);
        }
        sum
    }

    #[inline(always)]
    fn axpy(&self, j: usize, p: f32, acc: &mut [f32]) {
        let s = self.1.start(j);
        for (a, &h) in acc.iter_mut().zip(&self.0[s..s + self.1.hd]) {
            *a += p * f16_to_f32(h);
        }
    }
}

/// Q8_0 rows: head `g` of position `j` is `hd / 32` whole blocks.
struct Q8Rows<'a>(&'a [BlockQ8_0], HeadSlice);

impl Q8Rows<'_> {
    #[inline(always)]
    fn blocks(&self, j: usize) -> &[BlockQ8_0] {
        let s = self.1.start(j) / Q8_0_BLOCK;
        &self.0[s..s + self.1.hd / Q8_0_BLOCK]
    }
}

impl HeadRows for Q8Rows<'_> {
    #[inline(always)]
    fn dot(&self, j: usize, q: &[f32]) -> f32 {
        let mut sum = 0.0f32;
        for (b, qb) in self.blocks(j).iter().zip(q.chunks_exact(Q8_0_BLOCK)) {
            let mut acc = [0.0f32; 16];
            for half in 0..2 {
                for i in 0..16 {
                    acc[i] += qb[half * 16 + i] * b.qs[half * 16 + i] as f32;
                }
            }
            sum += f16_to_f32(b.d) * acc.iter().sum::<f32>();
        }
        sum
    }

    #[inline(always)]
    fn axpy(&self, j: usize, p: f32, acc: &mut [f32]) {
        for (b, ab) in self.blocks(j).iter().zip(acc.chunks_exact_mut(Q8_0_BLOCK)) {
            let c = p * f16_to_f32(b.d);
            for (a, &q) in ab.iter_mut().zip(&b.qs) {
                *a += c * q as f32;
            }
        }
    }
}

/// Positions per softmax block: scores are computed, maximised and exponentiated 16 at a time
/// (one AVX-512 register). Blocks start at absolute multiples of `BLOCK`, so a head's blocks, and
/// with them its arithmetic, depend only on its own length.
const BLOCK: usize = 16;

/// `e^x` for `x ≤ 0` in plain f32 operations (no library call, no fused multiply-add: no ISA falls back to a
/// software `fmaf`), so that [`exp_block`]
/// vectorises; `x < -87.3` (including `-∞`) gives 0. `x = n·ln2 + r` with `|r| ≤ ln2/2`
/// (Cody–Waite split of ln2), `e^r` by a degree-7 polynomial (Cephes' `expf` coefficients),
/// `2^n` built in the exponent bits. Relative error about 1e-7.
#[inline(always)]
fn exp_neg(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5·2^23: adding it rounds to an integer, held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    const LOWEST: f32 = -87.3;
    let xc = x.max(LOWEST);
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND;
    let ni = t.to_bits() as i32 - ROUND.to_bits() as i32;
    // `n·LN2_HI` is exact (9 + 7 significant bits).
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.987_569_2e-4f32;
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ] {
        p = p * r + c;
    }
    let er = (r * r * p + r) + 1.0;
    let y = er * f32::from_bits(((ni + 127) << 23) as u32);
    if x < LOWEST {
        0.0
    } else {
        y
    }
}

/// [`exp_neg`] of every lane.
#[inline(always)]
fn exp_block(x: &mut [f32; BLOCK]) {
    for v in x.iter_mut() {
        *v = exp_neg(*v);
    }
}

/// Query heads `q` (`[m, hd]`, all reading the same KV head) over that head's keys `k` and
/// values `v`, query head `i` over positions `0..lens[i]`: per head
/// `Σ_j softmax(q·k_j·scale)_j · v_j` in one pass, an online softmax over blocks of [`BLOCK`]
/// positions (block maximum, one rescale per block when it grows, the block's weights
/// `e^(s - max)` in one vector exp, then `acc += p_j·v_j` in position order). The heads share the
/// pass so each cached row is read from memory once for all of them (GQA heads, and the rows of a
/// verify pass); every head's own operations and their order are those of a pass of its own, so a
/// head's result does not depend on which other heads share the pass.
#[inline(always)]
fn head_online<R: HeadRows>(
    q: &[f32],
    lens: &[usize],
    k: &R,
    v: &R,
    hd: usize,
    scale: f32,
) -> Vec<f32> {
    let m = q.len() / hd;
    debug_assert_eq!(lens.len(), m);
    let n = lens.iter().copied().max().unwrap_or(0);
    let mut acc = vec![0.0f32; m * hd];
    // The softmax denominator per head as BLOCK lane sums (lane i adds the weights of positions
    // i, i + BLOCK, …: no serial chain of adds per block), added in lane order at the end.
    let (mut max, mut norm) = (vec![f32::NEG_INFINITY; m], vec![[0.0f32; BLOCK]; m]);
    for j0 in (0..n).step_by(BLOCK) {
        // Two heads a step, their stages side by side (scores, then the softmax updates, then
        // the accumulations), so the core overlaps the two dependency chains; each head's own
        // operations and their order are those of a step of its own.
        let mut h = 0;
        while h < m {
            let pair = h + 1 < m;
            let b = |h: usize| lens[h].min(j0 + BLOCK).saturating_sub(j0);
            let (b0, b1) = (b(h), if pair { b(h + 1) } else { 0 });
            let (mut p0, mut p1) = ([f32::NEG_INFINITY; BLOCK], [f32::NEG_INFINITY; BLOCK]);
            let (a0, a1) = acc[h * hd..].split_at_mut(hd);
            if b0 > 0 {
                k.dots_block(j0, &q[h * hd..(h + 1) * hd], scale, &mut p0[..b0]);
            }
            if b1 > 0 {
                k.dots_block(j0, &q[(h + 1) * hd..(h + 2) * hd], scale, &mut p1[..b1]);
            }
            let (m0, m1) = max[h..].split_at_mut(1);
            let (n0, n1) = norm[h..].split_at_mut(1);
            if b0 > 0 {
                softmax_block(&mut p0, &mut m0[0], &mut n0[0], a0);
            }
            if b1 > 0 {
                softmax_block(&mut p1, &mut m1[0], &mut n1[0], &mut a1[..hd]);
            }
            if b0 > 0 {
                v.axpy_block(j0, &p0[..b0], a0);
            }
            if b1 > 0 {
                v.axpy_block(j0, &p1[..b1], &mut a1[..hd]);
            }
            h += if pair { 2 } else { 1 };
        }
    }
    for (ah, nh) in acc.chunks_exact_mut(hd).zip(&norm) {
        let inv = 1.0 / nh.iter().sum::<f32>();
        ah.iter_mut().for_each(|a| *a *= inv);
    }
    acc
}

/// One block of a head's online softmax once its scores `p` are in (positions past the head's
/// length at −∞): on a new maximum the accumulator `ah` and the normaliser's lanes are rescaled,
/// then `p` becomes the weights `e^(s − max)` and is added to the normaliser's lanes.
#[inline(always)]
fn softmax_block(p: &mut [f32; BLOCK], max: &mut f32, norm: &mut [f32; BLOCK], ah: &mut [f32]) {
    let block_max = max_of_block(p);
    if block_max > *max {
        let c = exp_neg(*max - block_max);
        for a in ah.iter_mut() {
            *a *= c;
        }
        for l in norm.iter_mut() {
            *l *= c;
        }
        *max = block_max;
    }
    for s in p.iter_mut() {
        *s -= *max;
    }
    exp_block(p);
    for (l, &pi) in norm.iter_mut().zip(p.iter()) {
        *l += pi;
    }
}

/// The largest of a block's scores by a pairwise tree (exact, as a fold; vectorises). NaN-free
/// input (scores of finite queries and keys, −∞ padding).
#[inline(always)]
fn max_of_block(p: &[f32; BLOCK]) -> f32 {
    let mut m = *p;
    let mut width = BLOCK / 2;
    while width > 0 {
        for i in 0..width {
            m[i] = if m[i + width] > m[i] {
                m[i + width]
            } else {
                m[i]
            };
        }
        width /= 2;
    }
    m[0]
}

/// [`head_online`] for query heads `q` (`[m, hd]`) against KV head `g` of `kv`, whatever its
/// element type, with the portable row readers.
#[inline(always)]
fn head_portable(
    q: &[f32],
    lens: &[usize],
    kv: &KvCache,
    g: usize,
    hd: usize,
    scale: f32,
) -> Vec<f32> {
    let at = HeadSlice {
        width: kv.width,
        offset: g * hd,
        hd,
    };
    match (kv.keys(), kv.values()) {
        (KvRows::F32(k), KvRows::F32(v)) => {
            head_online(q, lens, &F32Rows(k, at), &F32Rows(v, at), hd, scale)
        }
        (KvRows::F16(k), KvRows::F16(v)) => {
            head_online(q, lens, &F16Rows(k, at), &F16Rows(v, at), hd, scale)
        }
        (KvRows::Q8_0(k), KvRows::Q8_0(v)) => {
            head_online(q, lens, &Q8Rows(k, at), &Q8Rows(v, at), hd, scale)
        }
        _ => unreachable!("a KvCache holds keys and values of one type"),
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! f16 and Q8_0 row readers with AVX-512 intrinsics; constructed only inside
    //! [`head_avx512`], which runs only when the CPU has AVX-512.

    use std::arch::x86_64::*;

    use super::*;

    /// A cache element the 16-lane readers load: f32 as it is, f16 widened by F16C.
    pub(super) trait Lane16: Copy {
        /// 16 elements from `p` as f32 lanes.
        ///
        /// # Safety
        /// `p .. p + 16` readable; AVX-512F (and F16C for f16) present.
        unsafe fn load16(p: *const Self) -> __m512;
        fn to_f32(self) -> f32;
    }

    impl Lane16 for f32 {
        #[inline(always)]
        unsafe fn load16(p: *const f32) -> __m512 {
            // SAFETY: the caller's contract.
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline(always)]
        fn to_f32(self) -> f32 {
            self
        }
    }

    impl Lane16 for u16 {
        #[inline(always)]
        unsafe fn load16(p: *const u16) -> __m512 {
            // SAFETY: the caller's contract.
            unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
        }
        #[inline(always)]
        fn to_f32(self) -> f32 {
            f16_to_f32(self)
        }
    }

    /// f32 or f16 cache rows read 16 lanes at a time (AVX-512F, F16C).
    pub(super) struct Rows512<'a, E>(pub &'a [E], pub HeadSlice);

    impl<E: Lane16> HeadRows for Rows512<'_, E> {
        #[inline(always)]
        fn dot(&self, j: usize, q: &[f32]) -> f32 {
            let s = self.1.start(j);
            let row = &self.0[s..s + self.1.hd];
            let full = row.len() / 16 * 16;
            // SAFETY: AVX-512F/F16C are present (module docs); every load reads 16 elements
            // inside `row` / `q` (`i + 16 ≤ full ≤ len`).
            let mut sum = unsafe {
                let mut acc = _mm512_setzero_ps();
                for i in (0..full).step_by(16) {
                    let k = E::load16(row.as_ptr().add(i));
                    acc = _mm512_fmadd_ps(_mm512_loadu_ps(q.as_ptr().add(i)), k, acc);
                }
                _mm512_reduce_add_ps(acc)
            };
            for (x, &e) in q[full..].iter().zip(&row[full..]) {
                sum += x * e.to_f32();
            }
            sum
        }

        #[inline(always)]
        fn axpy(&self, j: usize, p: f32, acc: &mut [f32]) {
            let s = self.1.start(j);
            let row = &self.0[s..s + self.1.hd];
            let full = row.len() / 16 * 16;
            // SAFETY: as in `dot`; `acc` has `hd` elements like `row`.
            unsafe {
                let pv = _mm512_set1_ps(p);
                for i in (0..full).step_by(16) {
                    let a = acc.as_mut_ptr().add(i);
                    let v = E::load16(row.as_ptr().add(i));
                    _mm512_storeu_ps(a, _mm512_fmadd_ps(pv, v, _mm512_loadu_ps(a)));
                }
            }
            for (a, &e) in acc[full..].iter_mut().zip(&row[full..]) {
                *a += p * e.to_f32();
            }
        }

        /// A full block of 16 positions with `hd` a multiple of 16: one accumulator per
        /// position, then the 16 horizontal sums together by a transposing add tree (45
        /// shuffles and adds for the block instead of a 9-operation reduction per position).
        #[inline(always)]
        fn dots_block(&self, j0: usize, q: &[f32], scale: f32, out: &mut [f32]) {
            let (at, hd) = (self.1, self.1.hd);
            if out.len() != BLOCK || !hd.is_multiple_of(16) || q.len() < hd {
                for (i, s) in out.iter_mut().enumerate() {
                    *s = self.dot(j0 + i, q) * scale;
                }
                return;
            }
            assert!(at.start(j0 + BLOCK - 1) + hd <= self.0.len());
            // SAFETY: AVX-512F/F16C are present (module docs); position `j0 + i` (`i < 16`)
            // reads `start(j0 + i) + c .. + 16 ≤ start(j0 + 15) + hd ≤ len` (asserted above), `q`
            // is read at `c .. c + 16 ≤ hd ≤ q.len()`, `out` holds 16 values.
            unsafe {
                let mut acc = [_mm512_setzero_ps(); BLOCK];
                for c in (0..hd).step_by(16) {
                    let qv = _mm512_loadu_ps(q.as_ptr().add(c));
                    for (i, a) in acc.iter_mut().enumerate() {
                        let k = E::load16(self.0.as_ptr().add(at.start(j0 + i) + c));
                        *a = _mm512_fmadd_ps(qv, k, *a);
                    }
                }
                let w = lane_sums(&acc);
                _mm512_storeu_ps(out.as_mut_ptr(), _mm512_mul_ps(w, _mm512_set1_ps(scale)));
            }
        }

        /// 16 elements of `acc` at a time stay in a register over the whole block; for head
        /// sizes 64, 128 and 256 all of `acc` does, so the chunks' add chains run side by side
        /// (per element the same operations in the same order either way).
        #[inline(always)]
        fn axpy_block(&self, j0: usize, p: &[f32], acc: &mut [f32]) {
            let Some(last) = p.len().checked_sub(1) else {
                return;
            };
            let (at, hd) = (self.1, self.1.hd);
            assert!(at.start(j0 + last) + hd <= self.0.len() && acc.len() >= hd);
            match hd {
                // SAFETY: as below (asserted bounds; `N · 16 = hd`).
                64 => return unsafe { self.axpy_block_regs::<4>(j0, p, acc) },
                128 => return unsafe { self.axpy_block_regs::<8>(j0, p, acc) },
                256 => return unsafe { self.axpy_block_regs::<16>(j0, p, acc) },
                _ => {}
            }
            let full = hd / 16 * 16;
            // SAFETY: AVX-512F/F16C are present (module docs); position `j0 + i` (`i ≤ last`)
            // reads `start(j0 + i) + c .. + 16 ≤ start(j0 + last) + hd ≤ len` (asserted above),
            // and `acc` is read and written at `c .. c + 16 ≤ hd`.
            unsafe {
                for c in (0..full).step_by(16) {
                    let a = acc.as_mut_ptr().add(c);
                    let mut x = _mm512_loadu_ps(a);
                    for (i, &pi) in p.iter().enumerate() {
                        let v = E::load16(self.0.as_ptr().add(at.start(j0 + i) + c));
                        x = _mm512_fmadd_ps(_mm512_set1_ps(pi), v, x);
                    }
                    _mm512_storeu_ps(a, x);
                }
            }
            for (i, &pi) in p.iter().enumerate() {
                let s = at.start(j0 + i);
                for (a, &e) in acc[full..hd].iter_mut().zip(&self.0[s + full..s + hd]) {
                    *a += pi * e.to_f32();
                }
            }
        }
    }

    /// The 16 horizontal sums of `acc` as one vector (lane i = the sum of `acc[i]`'s lanes) by a
    /// transposing add tree: 45 shuffles and adds for the 16 instead of a 9-operation reduction
    /// each.
    #[inline(always)]
    unsafe fn lane_sums(acc: &[__m512; BLOCK]) -> __m512 {
        // SAFETY: register-only AVX-512F operations (the caller guarantees the feature).
        unsafe {
            // 16 → 8: per 128-bit lane [a0+a2, b0+b2, a1+a3, b1+b3] of rows 2k, 2k + 1.
            let mut x = [_mm512_setzero_ps(); 8];
            for (k, xk) in x.iter_mut().enumerate() {
                let (a, b) = (acc[2 * k], acc[2 * k + 1]);
                *xk = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
            }
            // 8 → 4: per 128-bit lane, element e is row 4m + e's sum over that lane.
            let mut y = [_mm512_setzero_ps(); 4];
            for (m, ym) in y.iter_mut().enumerate() {
                let (a, b) = (_mm512_castps_pd(x[2 * m]), _mm512_castps_pd(x[2 * m + 1]));
                *ym = _mm512_add_ps(
                    _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                    _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
                );
            }
            // 4 → 2 → 1: the 128-bit lanes added; lane L of the result holds rows 4L .. 4L + 3.
            let z0 = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(y[0], y[1]),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(y[0], y[1]),
            );
            let z1 = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(y[2], y[3]),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(y[2], y[3]),
            );
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(z0, z1),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(z0, z1),
            )
        }
    }

    impl<E: Lane16> Rows512<'_, E> {
        /// [`HeadRows::axpy_block`] with all `N · 16 = hd` elements of `acc` in registers: per
        /// position one broadcast of `p_i`, then one FMA per chunk.
        ///
        /// # Safety
        /// `N · 16 == hd`, `acc.len() ≥ hd`, and `start(j0 + p.len() − 1) + hd ≤ len`; AVX-512F
        /// (and F16C) present.
        #[inline(always)]
        unsafe fn axpy_block_regs<const N: usize>(&self, j0: usize, p: &[f32], acc: &mut [f32]) {
            let at = self.1;
            // SAFETY: the caller's contract: every read is `start(j0 + i) + 16 c .. + 16 ≤
            // start(j0 + i) + hd`, and `acc` is read and written at `16 c .. 16 c + 16 ≤ hd`.
            unsafe {
                let mut x = [_mm512_setzero_ps(); N];
                for (c, xc) in x.iter_mut().enumerate() {
                    *xc = _mm512_loadu_ps(acc.as_ptr().add(16 * c));
                }
                for (i, &pi) in p.iter().enumerate() {
                    let pv = _mm512_set1_ps(pi);
                    let row = self.0.as_ptr().add(at.start(j0 + i));
                    for (c, xc) in x.iter_mut().enumerate() {
                        *xc = _mm512_fmadd_ps(pv, E::load16(row.add(16 * c)), *xc);
                    }
                }
                for (c, xc) in x.iter().enumerate() {
                    _mm512_storeu_ps(acc.as_mut_ptr().add(16 * c), *xc);
                }
            }
        }
    }

    pub(super) struct Q8Rows512<'a>(pub Q8Rows<'a>);

    /// An f16 scale as f32 with the F16C instruction (inline, unlike a library call per block).
    #[inline(always)]
    unsafe fn scale_f32(d: u16) -> f32 {
        // SAFETY: the caller guarantees F16C (implied by the AVX-512 level here).
        unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(d)))) }
    }

    /// 16 signed bytes at `p` as 16 f32 lanes.
    #[inline(always)]
    unsafe fn i8x16_to_f32(p: *const i8) -> __m512 {
        // SAFETY: the caller guarantees AVX-512F and 16 readable bytes at `p`.
        unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i))) }
    }

    impl HeadRows for Q8Rows512<'_> {
        #[inline(always)]
        fn dot(&self, j: usize, q: &[f32]) -> f32 {
            let blocks = self.0.blocks(j);
            debug_assert!(q.len() >= blocks.len() * Q8_0_BLOCK);
            // SAFETY: AVX-512F is present; block `b` reads `qs[0..32]` and `q[32b..32b + 32]`,
            // inside `q` (`hd = 32 × blocks`).
            unsafe {
                let mut acc = _mm512_setzero_ps();
                for (b, blk) in blocks.iter().enumerate() {
                    let qp = q.as_ptr().add(b * Q8_0_BLOCK);
                    let lo = _mm512_mul_ps(_mm512_loadu_ps(qp), i8x16_to_f32(blk.qs.as_ptr()));
                    let both = _mm512_fmadd_ps(
                        _mm512_loadu_ps(qp.add(16)),
                        i8x16_to_f32(blk.qs.as_ptr().add(16)),
                        lo,
                    );
                    acc = _mm512_fmadd_ps(both, _mm512_set1_ps(scale_f32(blk.d)), acc);
                }
                _mm512_reduce_add_ps(acc)
            }
        }

        #[inline(always)]
        fn axpy(&self, j: usize, p: f32, acc: &mut [f32]) {
            let blocks = self.0.blocks(j);
            debug_assert!(acc.len() >= blocks.len() * Q8_0_BLOCK);
            // SAFETY: as in `dot`, with `acc` (`hd` elements) in place of `q`.
            unsafe {
                for (b, blk) in blocks.iter().enumerate() {
                    let c = _mm512_set1_ps(p * scale_f32(blk.d));
                    for half in 0..2 {
                        let a = acc.as_mut_ptr().add(b * Q8_0_BLOCK + half * 16);
                        let x = i8x16_to_f32(blk.qs.as_ptr().add(half * 16));
                        _mm512_storeu_ps(a, _mm512_fmadd_ps(c, x, _mm512_loadu_ps(a)));
                    }
                }
            }
        }

        /// 16 elements of `acc` at a time stay in a register over the whole block.
        #[inline(always)]
        fn axpy_block(&self, j0: usize, p: &[f32], acc: &mut [f32]) {
            if p.len() > BLOCK {
                for (i, &pi) in p.iter().enumerate() {
                    self.axpy(j0 + i, pi, acc);
                }
                return;
            }
            let mut rows: [&[BlockQ8_0]; BLOCK] = [&[]; BLOCK];
            for (i, r) in rows.iter_mut().enumerate().take(p.len()) {
                *r = self.0.blocks(j0 + i);
            }
            let n_blocks = self.0 .1.hd / Q8_0_BLOCK;
            assert!(acc.len() >= n_blocks * Q8_0_BLOCK);
            match n_blocks {
                // SAFETY: as below, with `N = 2 · n_blocks` 16-value chunks.
                2 => return unsafe { q8_axpy_block_regs::<4>(&rows[..p.len()], p, acc) },
                4 => return unsafe { q8_axpy_block_regs::<8>(&rows[..p.len()], p, acc) },
                8 => return unsafe { q8_axpy_block_regs::<16>(&rows[..p.len()], p, acc) },
                _ => {}
            }
            // SAFETY: AVX-512F/F16C are present; every `rows[i]` (`i < p.len()`) holds
            // `n_blocks` blocks (a checked slice, indexed with bounds checks), and `acc` is read
            // and written inside its `hd` elements.
            unsafe {
                for b in 0..n_blocks {
                    for half in 0..2 {
                        let a = acc.as_mut_ptr().add(b * Q8_0_BLOCK + half * 16);
                        let mut x = _mm512_loadu_ps(a);
                        for (row, &pi) in rows[..p.len()].iter().zip(p) {
                            let blk = &row[b];
                            let c = _mm512_set1_ps(pi * scale_f32(blk.d));
                            let v = i8x16_to_f32(blk.qs.as_ptr().add(half * 16));
                            x = _mm512_fmadd_ps(c, v, x);
                        }
                        _mm512_storeu_ps(a, x);
                    }
                }
            }
        }
    }

    /// [`HeadRows::axpy_block`] of Q8_0 rows with all `N · 16 = hd` elements of `acc` in
    /// registers: per position and block one scale, then one FMA per half, so the chunks' chains
    /// run side by side (per element the same operations in the same order as the loop above).
    ///
    /// # Safety
    /// Every row holds `N / 2` blocks, `acc.len() ≥ 16 N`; AVX-512F/F16C present.
    #[inline(always)]
    unsafe fn q8_axpy_block_regs<const N: usize>(
        rows: &[&[BlockQ8_0]],
        p: &[f32],
        acc: &mut [f32],
    ) {
        // SAFETY: the caller's contract: `acc` is read and written at `16 c .. 16 c + 16 ≤ 16 N`,
        // and block `c / 2` of each row exists (checked indexing).
        unsafe {
            let mut x = [_mm512_setzero_ps(); N];
            for (c, xc) in x.iter_mut().enumerate() {
                *xc = _mm512_loadu_ps(acc.as_ptr().add(16 * c));
            }
            for (row, &pi) in rows.iter().zip(p) {
                for b in 0..N / 2 {
                    let blk = &row[b];
                    let c = _mm512_set1_ps(pi * scale_f32(blk.d));
                    for half in 0..2 {
                        let v = i8x16_to_f32(blk.qs.as_ptr().add(half * 16));
                        x[2 * b + half] = _mm512_fmadd_ps(c, v, x[2 * b + half]);
                    }
                }
            }
            for (c, xc) in x.iter().enumerate() {
                _mm512_storeu_ps(acc.as_mut_ptr().add(16 * c), *xc);
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn head_avx512(
        q: &[f32],
        lens: &[usize],
        kv: &KvCache,
        g: usize,
        hd: usize,
        scale: f32,
    ) -> Vec<f32> {
        let at = HeadSlice {
            width: kv.width,
            offset: g * hd,
            hd,
        };
        match (kv.keys(), kv.values()) {
            (KvRows::F16(k), KvRows::F16(v)) => {
                head_online(q, lens, &Rows512(k, at), &Rows512(v, at), hd, scale)
            }
            (KvRows::Q8_0(k), KvRows::Q8_0(v)) => head_online(
                q,
                lens,
                &Q8Rows512(Q8Rows(k, at)),
                &Q8Rows512(Q8Rows(v, at)),
                hd,
                scale,
            ),
            (KvRows::F32(k), KvRows::F32(v)) => {
                head_online(q, lens, &Rows512(k, at), &Rows512(v, at), hd, scale)
            }
            _ => unreachable!("a KvCache holds keys and values of one type"),
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! f32, f16 and Q8_0 row readers with AVX2 + FMA + F16C intrinsics (8 lanes); constructed only
    //! inside [`head_avx2`], which runs only when the CPU has those extensions.

    use std::arch::x86_64::*;

    use super::*;

    /// Sum of the 8 lanes.
    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        // SAFETY: the caller guarantees AVX.
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
        }
    }

    /// A cache element the 8-lane readers load: f32 as it is, f16 widened by F16C.
    pub(super) trait Lane8: Copy {
        /// 8 elements from `p` as f32 lanes.
        ///
        /// # Safety
        /// `p .. p + 8` readable; AVX2 (and F16C for f16) present.
        unsafe fn load8(p: *const Self) -> __m256;
        fn to_f32(self) -> f32;
    }

    impl Lane8 for f32 {
        #[inline(always)]
        unsafe fn load8(p: *const f32) -> __m256 {
            // SAFETY: the caller's contract.
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        fn to_f32(self) -> f32 {
            self
        }
    }

    impl Lane8 for u16 {
        #[inline(always)]
        unsafe fn load8(p: *const u16) -> __m256 {
            // SAFETY: the caller's contract.
            unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
        }
        #[inline(always)]
        fn to_f32(self) -> f32 {
            f16_to_f32(self)
        }
    }

    /// The 8 horizontal sums of `acc` as one vector (lane i = the sum of `acc[i]`'s lanes) by a
    /// transposing add tree (`hadd` pairs, then the 128-bit halves).
    #[inline(always)]
    unsafe fn lane_sums8(acc: &[__m256]) -> __m256 {
        // SAFETY: register-only AVX operations (the caller guarantees the feature).
        unsafe {
            // hadd(a, b) per 128-bit half: [a0+a1, a2+a3, b0+b1, b2+b3].
            let h01 = _mm256_hadd_ps(acc[0], acc[1]);
            let h23 = _mm256_hadd_ps(acc[2], acc[3]);
            let h45 = _mm256_hadd_ps(acc[4], acc[5]);
            let h67 = _mm256_hadd_ps(acc[6], acc[7]);
            // per 128-bit half: [s0, s1, s2, s3] (rows 0..3) and [s4 .. s7].
            let q0 = _mm256_hadd_ps(h01, h23);
            let q1 = _mm256_hadd_ps(h45, h67);
            // The two halves added: low half from q0's halves (rows 0..3), high from q1's.
            let lo = _mm256_permute2f128_ps::<0x20>(q0, q1);
            let hi = _mm256_permute2f128_ps::<0x31>(q0, q1);
            _mm256_add_ps(lo, hi)
        }
    }

    /// f32 or f16 cache rows read 8 lanes at a time (AVX2, FMA, F16C).
    pub(super) struct Rows256<'a, E>(pub &'a [E], pub HeadSlice);

    impl<E: Lane8> HeadRows for Rows256<'_, E> {
        #[inline(always)]
        fn dot(&self, j: usize, q: &[f32]) -> f32 {
            let s = self.1.start(j);
            let row = &self.0[s..s + self.1.hd];
            let full = row.len() / 8 * 8;
            // SAFETY: AVX2/FMA/F16C are present (module docs); every load reads 8 elements
            // inside `row` / `q` (`i + 8 ≤ full ≤ len`).
            let mut sum = unsafe {
                let mut acc = _mm256_setzero_ps();
                for i in (0..full).step_by(8) {
                    let x = _mm256_loadu_ps(q.as_ptr().add(i));
                    acc = _mm256_fmadd_ps(x, E::load8(row.as_ptr().add(i)), acc);
                }
                hsum(acc)
            };
            for (x, &e) in q[full..].iter().zip(&row[full..]) {
                sum += x * e.to_f32();
            }
            sum
        }

        #[inline(always)]
        fn axpy(&self, j: usize, p: f32, acc: &mut [f32]) {
            let s = self.1.start(j);
            let row = &self.0[s..s + self.1.hd];
            let full = row.len() / 8 * 8;
            // SAFETY: as in `dot`; `acc` has `hd` elements like `row`.
            unsafe {
                let pv = _mm256_set1_ps(p);
                for i in (0..full).step_by(8) {
                    let a = acc.as_mut_ptr().add(i);
                    let y = _mm256_fmadd_ps(pv, E::load8(row.as_ptr().add(i)), _mm256_loadu_ps(a));
                    _mm256_storeu_ps(a, y);
                }
            }
            for (a, &e) in acc[full..].iter_mut().zip(&row[full..]) {
                *a += p * e.to_f32();
            }
        }

        /// A full block of 16 positions with `hd` a multiple of 8: one accumulator per position,
        /// then two transposing add trees of 8.
        #[inline(always)]
        fn dots_block(&self, j0: usize, q: &[f32], scale: f32, out: &mut [f32]) {
            let (at, hd) = (self.1, self.1.hd);
            if out.len() != BLOCK || !hd.is_multiple_of(8) || q.len() < hd {
                for (i, s) in out.iter_mut().enumerate() {
                    *s = self.dot(j0 + i, q) * scale;
                }
                return;
            }
            assert!(at.start(j0 + BLOCK - 1) + hd <= self.0.len());
            // SAFETY: AVX2/FMA/F16C are present (module docs); position `j0 + i` (`i < 16`)
            // reads `start(j0 + i) + c .. + 8 ≤ start(j0 + 15) + hd ≤ len` (asserted above), `q`
            // is read at `c .. c + 8 ≤ hd ≤ q.len()`, `out` holds 16 values.
            unsafe {
                let mut acc = [_mm256_setzero_ps(); BLOCK];
                for c in (0..hd).step_by(8) {
                    let qv = _mm256_loadu_ps(q.as_ptr().add(c));
                    for (i, a) in acc.iter_mut().enumerate() {
                        let k = E::load8(self.0.as_ptr().add(at.start(j0 + i) + c));
                        *a = _mm256_fmadd_ps(qv, k, *a);
                    }
                }
                let sv = _mm256_set1_ps(scale);
                _mm256_storeu_ps(out.as_mut_ptr(), _mm256_mul_ps(lane_sums8(&acc[..8]), sv));
                _mm256_storeu_ps(
                    out.as_mut_ptr().add(8),
                    _mm256_mul_ps(lane_sums8(&acc[8..]), sv),
                );
            }
        }

        /// Up to 64 elements of `acc` (8 registers) at a time over the whole block, so 8
        /// chains of FMAs run side by side; per element the same operations in the same order
        /// as one `axpy` per position.
        #[inline(always)]
        fn axpy_block(&self, j0: usize, p: &[f32], acc: &mut [f32]) {
            let Some(last) = p.len().checked_sub(1) else {
                return;
            };
            let (at, hd) = (self.1, self.1.hd);
            if !hd.is_multiple_of(8) {
                for (i, &pi) in p.iter().enumerate() {
                    self.axpy(j0 + i, pi, acc);
                }
                return;
            }
            assert!(at.start(j0 + last) + hd <= self.0.len() && acc.len() >= hd);
            // SAFETY: AVX2/FMA/F16C are present; position `j0 + i` (`i ≤ last`) reads
            // `start(j0 + i) + c .. + 8 ≤ start(j0 + last) + hd ≤ len` (asserted above), and `acc`
            // is read and written at `c .. c + 8 ≤ hd`.
            unsafe {
                for c0 in (0..hd).step_by(64) {
                    let n = ((hd - c0) / 8).min(8);
                    let mut x = [_mm256_setzero_ps(); 8];
                    for (k, xk) in x.iter_mut().enumerate().take(n) {
                        *xk = _mm256_loadu_ps(acc.as_ptr().add(c0 + 8 * k));
                    }
                    for (i, &pi) in p.iter().enumerate() {
                        let pv = _mm256_set1_ps(pi);
                        let row = self.0.as_ptr().add(at.start(j0 + i) + c0);
                        for (k, xk) in x.iter_mut().enumerate().take(n) {
                            *xk = _mm256_fmadd_ps(pv, E::load8(row.add(8 * k)), *xk);
                        }
                    }
                    for (k, xk) in x.iter().enumerate().take(n) {
                        _mm256_storeu_ps(acc.as_mut_ptr().add(c0 + 8 * k), *xk);
                    }
                }
            }
        }
    }

    pub(super) struct Q8Rows256<'a>(pub Q8Rows<'a>);

    /// An f16 scale as f32 with the F16C instruction.
    #[inline(always)]
    unsafe fn scale_f32(d: u16) -> f32 {
        // SAFETY: the caller guarantees F16C.
        unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(d)))) }
    }

    /// 8 signed bytes at `p` as 8 f32 lanes.
    #[inline(always)]
    unsafe fn i8x8_to_f32(p: *const i8) -> __m256 {
        // SAFETY: the caller guarantees AVX2 and 8 readable bytes at `p`.
        unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i))) }
    }

    impl HeadRows for Q8Rows256<'_> {
        #[inline(always)]
        fn dot(&self, j: usize, q: &[f32]) -> f32 {
            let blocks = self.0.blocks(j);
            debug_assert!(q.len() >= blocks.len() * Q8_0_BLOCK);
            // SAFETY: AVX2/FMA/F16C are present; block `b` reads `qs[0..32]` and
            // `q[32b..32b + 32]`, inside `q` (`hd = 32 × blocks`).
            unsafe {
                let mut acc = _mm256_setzero_ps();
                for (b, blk) in blocks.iter().enumerate() {
                    let qp = q.as_ptr().add(b * Q8_0_BLOCK);
                    let mut s = _mm256_mul_ps(_mm256_loadu_ps(qp), i8x8_to_f32(blk.qs.as_ptr()));
                    for part in 1..4 {
                        s = _mm256_fmadd_ps(
                            _mm256_loadu_ps(qp.add(8 * part)),
                            i8x8_to_f32(blk.qs.as_ptr().add(8 * part)),
                            s,
                        );
                    }
                    acc = _mm256_fmadd_ps(s, _mm256_set1_ps(scale_f32(blk.d)), acc);
                }
                hsum(acc)
            }
        }

        #[inline(always)]
        fn axpy(&self, j: usize, p: f32, acc: &mut [f32]) {
            let blocks = self.0.blocks(j);
            debug_assert!(acc.len() >= blocks.len() * Q8_0_BLOCK);
            // SAFETY: as in `dot`, with `acc` (`hd` elements) in place of `q`.
            unsafe {
                for (b, blk) in blocks.iter().enumerate() {
                    let c = _mm256_set1_ps(p * scale_f32(blk.d));
                    for part in 0..4 {
                        let a = acc.as_mut_ptr().add(b * Q8_0_BLOCK + part * 8);
                        let x = i8x8_to_f32(blk.qs.as_ptr().add(part * 8));
                        _mm256_storeu_ps(a, _mm256_fmadd_ps(c, x, _mm256_loadu_ps(a)));
                    }
                }
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn head_avx2(
        q: &[f32],
        lens: &[usize],
        kv: &KvCache,
        g: usize,
        hd: usize,
        scale: f32,
    ) -> Vec<f32> {
        let at = HeadSlice {
            width: kv.width,
            offset: g * hd,
            hd,
        };
        match (kv.keys(), kv.values()) {
            (KvRows::F16(k), KvRows::F16(v)) => {
                head_online(q, lens, &Rows256(k, at), &Rows256(v, at), hd, scale)
            }
            (KvRows::F32(k), KvRows::F32(v)) => {
                head_online(q, lens, &Rows256(k, at), &Rows256(v, at), hd, scale)
            }
            (KvRows::Q8_0(k), KvRows::Q8_0(v)) => head_online(
                q,
                lens,
                &Q8Rows256(Q8Rows(k, at)),
                &Q8Rows256(Q8Rows(v, at)),
                hd,
                scale,
            ),
            _ => unreachable!("a KvCache holds keys and values of one type"),
        }
    }
}

/// Query heads `q` (`[m, hd]`, all of KV head `g`, head `i` over positions `0..lens[i]`) with the
/// code of `isa` (a level the CPU supports).
fn head(
    isa: Isa,
    q: &[f32],
    lens: &[usize],
    kv: &KvCache,
    g: usize,
    hd: usize,
    scale: f32,
) -> Vec<f32> {
    debug_assert!(isa.supported());
    #[cfg(target_arch = "x86_64")]
    {
        if isa >= Isa::Avx512 {
            // SAFETY: callers pass `Isa::active()` or a level from `Isa::available()`, both only
            // AVX-512 when the CPU supports it.
            return unsafe { avx512::head_avx512(q, lens, kv, g, hd, scale) };
        }
        if isa >= Isa::Avx2 {
            // SAFETY: as above, for AVX2 + FMA + F16C.
            return unsafe { avx2::head_avx2(q, lens, kv, g, hd, scale) };
        }
    }
    head_portable(q, lens, kv, g, hd, scale)
}

/// Every query head of one token (`q` is `[n_heads, hd]`), heads in parallel.
pub fn attention_online(
    q: &[f32],
    kv: &KvCache,
    n_heads: usize,
    hd: usize,
    scale: f32,
) -> Vec<f32> {
    attention_online_isa(Isa::active(), q, kv, n_heads, hd, scale)
}

/// [`attention_online`] with the code of `isa` (one the CPU supports, see [`Isa::available`]).
pub fn attention_online_isa(
    isa: Isa,
    q: &[f32],
    kv: &KvCache,
    n_heads: usize,
    hd: usize,
    scale: f32,
) -> Vec<f32> {
    let mut rows = attention_rows_online_isa(isa, &[q.to_vec()], kv, n_heads, hd, scale);
    rows.pop().unwrap_or_default()
}

/// Causal attention of a run of tokens whose keys and values are the last `qs.len()` rows of
/// `kv` (`qs[t]` is `[n_heads, hd]`): row t over positions `0..kv.len() - qs.len() + t + 1`.
/// One pass over each KV head's cached rows serves every row's query heads; each row's result is
/// bit-identical to [`attention_online`] over its own prefix.
pub fn attention_rows_online(
    qs: &[Vec<f32>],
    kv: &KvCache,
    n_heads: usize,
    hd: usize,
    scale: f32,
) -> Vec<Vec<f32>> {
    attention_rows_online_isa(Isa::active(), qs, kv, n_heads, hd, scale)
}

/// [`attention_rows_online`] with the code of `isa` (one the CPU supports).
pub fn attention_rows_online_isa(
    isa: Isa,
    qs: &[Vec<f32>],
    kv: &KvCache,
    n_heads: usize,
    hd: usize,
    scale: f32,
) -> Vec<Vec<f32>> {
    let isa = isa.min(Isa::best());
    let rows = qs.len();
    let n0 = kv.len().saturating_sub(rows);
    let kv_heads = (kv.width / hd).max(1);
    let group = (n_heads / kv_heads).max(1);
    // Each task streams its KV head's rows once for a run of that head's query heads, of every
    // row: as few tasks as keep every thread busy (one per KV head on 2 threads, one per query
    // head on 16+).
    let tasks_per_kv = rayon::current_num_threads()
        .div_ceil(kv_heads)
        .clamp(1, group);
    let per_task = group.div_ceil(tasks_per_kv);
    let runs: Vec<(usize, usize)> = (0..kv_heads)
        .flat_map(|g| {
            (0..group)
                .step_by(per_task)
                .map(move |s| (g * group + s, g * group + (s + per_task).min(group)))
        })
        .collect();
    // Per task: `[rows, h1 - h0, hd]`.
    let mut outs: Vec<((usize, usize), Vec<f32>)> = runs.iter().map(|&r| (r, Vec::new())).collect();
    crate::team::for_each_mut(&mut outs, |((h0, h1), out)| {
        *out = {
            let (h0, h1) = (*h0, *h1);
            let width = (h1 - h0) * hd;
            let mut q = Vec::with_capacity(rows * width);
            let mut lens = Vec::with_capacity(rows * (h1 - h0));
            for (t, qt) in qs.iter().enumerate() {
                q.extend_from_slice(&qt[h0 * hd..h1 * hd]);
                lens.extend(std::iter::repeat_n(n0 + t + 1, h1 - h0));
            }
            head(isa, &q, &lens, kv, h0 / group, hd, scale)
        }
    });
    (0..rows)
        .map(|t| {
            let mut o = Vec::with_capacity(n_heads * hd);
            for ((h0, h1), out) in &outs {
                let width = (h1 - h0) * hd;
                o.extend_from_slice(&out[t * width..(t + 1) * width]);
            }
            o
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use redlite_model::backend::attention_two_pass;
    use redlite_model::KvType;

    fn random_cache(kv_type: KvType, nkv: usize, hd: usize, n: usize) -> (KvCache, Vec<f32>) {
        let mut kv = KvCache::with_type(nkv * hd, kv_type);
        let mut seed = 3u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        for _ in 0..n {
            let k: Vec<f32> = (0..nkv * hd).map(|_| 4.0 * next()).collect();
            let v: Vec<f32> = (0..nkv * hd).map(|_| next()).collect();
            kv.push(&k, &v);
        }
        let q: Vec<f32> = (0..8 * hd).map(|_| next()).collect();
        (kv, q)
    }

    fn max_rel(a: &[f32], b: &[f32]) -> f32 {
        let max_ref = a.iter().fold(0f32, |m, x| m.max(x.abs()));
        let max_d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        max_d / max_ref
    }

    #[test]
    fn online_softmax_matches_two_pass() {
        let (kv, q) = random_cache(KvType::F32, 2, 64, 300);
        let a = attention_two_pass(&q, &kv, 8, 64, 0.125);
        let b = attention_online(&q, &kv, 8, 64, 0.125);
        assert!(max_rel(&a, &b) < 1e-5, "{}", max_rel(&a, &b));
    }

    /// However the query heads are split into tasks (one head per task on many threads, a KV
    /// head's whole group on few), every head's result is the same bit for bit.
    #[test]
    fn head_grouping_does_not_change_bits() {
        for t in KvType::ALL {
            let (kv, q) = random_cache(t, 2, 64, 100);
            let run = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                pool.install(|| attention_online(&q, &kv, 8, 64, 0.125))
                    .iter()
                    .map(|x| x.to_bits())
                    .collect::<Vec<_>>()
            };
            let one_head_per_task = run(16);
            for threads in [1, 2, 3, 5] {
                assert!(run(threads) == one_head_per_task, "{t}, {threads} threads");
            }
        }
    }

    /// Same cache contents (already rounded to f16 / Q8_0): the fast readers must compute what
    /// the oracle computes on the dequantized rows, up to f32 summation order (as for f32).
    #[test]
    fn online_softmax_matches_two_pass_for_every_kv_type() {
        for t in [KvType::F16, KvType::Q8_0] {
            for isa in Isa::available() {
                let (kv, q) = random_cache(t, 2, 64, 300);
                let a = attention_two_pass(&q, &kv, 8, 64, 0.125);
                let b = attention_online_isa(isa, &q, &kv, 8, 64, 0.125);
                assert!(max_rel(&a, &b) < 1e-5, "{t} {isa:?}: {}", max_rel(&a, &b));
            }
        }
    }
    /// A run of rows in one call (each row over its own causal prefix) gives every row the bits
    /// of a one-row call over a cache truncated to that prefix, for every element type, ISA and
    /// thread count (the speculative verify's invariant).
    #[test]
    fn rows_in_one_pass_match_one_row_calls_bit_for_bit() {
        let (nkv, hd, rows, n) = (2, 64, 5, 40);
        for t in KvType::ALL {
            let (kv, _) = random_cache(t, nkv, hd, n);
            let qs: Vec<Vec<f32>> = (0..rows)
                .map(|r| random_cache(t, nkv, hd, 1 + r).1)
                .collect();
            for isa in Isa::available() {
                for threads in [1, 2, 16] {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .unwrap();
                    let many =
                        pool.install(|| attention_rows_online_isa(isa, &qs, &kv, 8, hd, 0.125));
                    for (r, (q, got)) in qs.iter().zip(&many).enumerate() {
                        let mut prefix = kv.clone();
                        prefix.truncate(n - rows + r + 1);
                        let one =
                            pool.install(|| attention_online_isa(isa, q, &prefix, 8, hd, 0.125));
                        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                        assert!(
                            bits(got) == bits(&one),
                            "{t} {isa:?} {threads} threads, row {r}"
                        );
                    }
                }
            }
        }
    }
    /// The softmax's exp stays within a few f32 ulps of the library's over the range it sees.
    #[test]
    fn exp_neg_matches_libm() {
        let mut worst = 0f32;
        for i in 0..=200_000 {
            let x = -87.0 * i as f32 / 200_000.0;
            let (want, got) = (x.exp(), exp_neg(x));
            worst = worst.max((got - want).abs() / want);
        }
        assert!(worst < 4e-7, "worst relative error {worst}");
        assert_eq!(exp_neg(0.0), 1.0);
        assert_eq!(exp_neg(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_neg(-100.0), 0.0);
    }
}
