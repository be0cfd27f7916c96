//! Run-time self-check of every kernel against the reference dequantizers of `redlite-gguf`.
//!
//! For every weight type with a kernel and every ISA level the CPU supports that has its own
//! kernel for the type, on fresh pseudo-random data (random block bytes with the f16 scale fields
//! patched to small positive values), for `cols` ∈ {256, 512, 2048, 4096}:
//!
//! * [`Check::OracleQ8`]: the kernel against the f64 dot product of the dequantized weight row
//!   with the *dequantized 8-bit activations* (what the kernel multiplies). The integer part is
//!   exact, so only the f32 block scaling and accumulation differ. Error measure:
//!   `|got − exact| / Σ|w_i·x_i|` (the error relative to the magnitude of the terms, which stays
//!   meaningful when the sum cancels), limit [`ORACLE_Q8_TOL`].
//! * [`Check::OracleF32`]: the same against the original f32 activations; the difference is the
//!   8-bit activation quantization error (~1e-2 is normal, more when the few rows' dot products
//!   happen to cancel). Measure: `‖got − exact‖₂ / ‖exact‖₂` over the rows. Report only: this
//!   error is inherent to quantizing activations (ggml does the same); it passes when finite.
//! * [`Check::MatmulBitIdentical`]: every row of `matmul` over 5 activation rows equals `matvec`
//!   of that row bit for bit (error = number of differing outputs); 5 exercises both a full group
//!   and a remainder of the multi-row kernels.
//! * [`Check::VsScalar`]: a SIMD kernel against the scalar kernel of the same type, bit for bit
//!   (error = number of differing outputs): every level computes the same exact integer block
//!   sums and the same f32 operations in the same order. The same for the level's rows kernel
//!   ([`lookup_rows`](super::lookup_rows), variant `rows`), on an even and an odd row count.

use super::driver::{matmul_isa, matvec_isa};
use super::q8::{quantize_row_q8_0, quantize_row_q8_k};
use super::q8::{BlockQ8K, BlockQ8_0, QK8_0, QK_K};
use super::{lookup_alternates, lookup_exact, Isa, RowDot};
use redlite_gguf::quant::random::QuantRng;
use redlite_gguf::quant::{dequantize, GgmlType, TYPE_TRAITS};
use std::fmt;

/// Limit of the kernel-vs-exact error (relative to `Σ|w·x|`).
pub const ORACLE_Q8_TOL: f64 = 1e-5;

/// The column counts checked.
pub const SELFTEST_COLS: [usize; 4] = [256, 512, 2048, 4096];
/// Rows per checked matrix.
pub const SELFTEST_ROWS: usize = 4;
/// Activation rows of the matmul-vs-matvec check.
const MATMUL_N: usize = 5;

/// What a [`SelftestResult`] compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Check {
    OracleQ8,
    OracleF32,
    MatmulBitIdentical,
    VsScalar,
}

/// One comparison's outcome.
#[derive(Clone, Debug)]
pub struct SelftestResult {
    pub ty: GgmlType,
    pub isa: Isa,
    /// `""` for the kernel the dispatch picks, `"alternate"` for another kernel of the same
    /// level (see [`lookup_alternates`](super::lookup_alternates)).
    pub variant: &'static str,
    pub check: Check,
    pub rows: usize,
    pub cols: usize,
    /// The measured error (see [`Check`] for each measure).
    pub error: f64,
    /// The limit it is held to (infinite for the report-only [`Check::OracleF32`]).
    pub tolerance: f64,
    pub passed: bool,
}

impl fmt::Display for SelftestResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<8} {:<17} {:<19} {}x{:<5} err {:.3e} (limit {:.0e}) {}",
            self.ty.name(),
            format!(
                "{}{}{}",
                self.isa.name(),
                if self.variant.is_empty() { "" } else { " " },
                self.variant
            ),
            format!("{:?}", self.check),
            self.rows,
            self.cols,
            self.error,
            self.tolerance,
            if self.passed { "ok" } else { "FAIL" }
        )
    }
}

/// SplitMix64: a small deterministic generator (the crate has no run-time `rand` dependency).
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller).
    fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// `rows` random rows of `cols` elements of type `ty` (raw GGUF bytes).
pub fn random_weights(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed);
    let n = rows * cols;
    match ty {
        GgmlType::F32 => (0..n)
            .flat_map(|_| (rng.normal() as f32).to_le_bytes())
            .collect(),
        GgmlType::F16 => (0..n)
            .flat_map(|_| half::f16::from_f64(rng.normal()).to_le_bytes())
            .collect(),
        GgmlType::BF16 => (0..n)
            .flat_map(|_| half::bf16::from_f64(rng.normal()).to_le_bytes())
            .collect(),
        // Quantized types: random bytes with sane scales (shared with make-model).
        _ => redlite_gguf::quant::random::random_blocks(
            ty,
            n / ty.block_elems(),
            &mut QuantRng::new(seed),
        ),
    }
}

/// `n` random activations: standard normal, with a few larger outliers (as real hidden states).
pub fn random_activations(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed);
    (0..n)
        .map(|i| {
            let v = rng.normal();
            (if i % 97 == 13 { 8.0 * v } else { v }) as f32
        })
        .collect()
}

/// The activations the kernel actually sees, dequantized to f64.
fn seen_activations(kernel: RowDot, x: &[f32]) -> Vec<f64> {
    let mut out = vec![0.0f32; x.len()];
    match kernel {
        RowDot::Q8K(_) => {
            let mut q = vec![BlockQ8K::ZERO; x.len() / QK_K];
            quantize_row_q8_k(x, &mut q);
            // d·q is exact in f64; the f32 product of `dequantize_q8_k` may round, so redo it.
            return q
                .iter()
                .flat_map(|b| b.qs.iter().map(move |&v| f64::from(b.d) * f64::from(v)))
                .collect();
        }
        RowDot::Q8_0(_) => {
            let mut q = vec![BlockQ8_0::ZERO; x.len() / QK8_0];
            quantize_row_q8_0(x, &mut q);
            return q
                .iter()
                .flat_map(|b| {
                    b.qs.iter()
                        .map(move |&v| f64::from(b.scale()) * f64::from(v))
                })
                .collect();
        }
        RowDot::F32(_) => out.copy_from_slice(x),
    }
    out.into_iter().map(f64::from).collect()
}

/// Calls one kernel on one weight row with freshly quantized activations.
/// Outputs of the rows kernel `f` on activations `q` that differ in any bit from `scalar_out`,
/// over every row of `w` and over all but the last (an odd count: the single-row remainder).
fn rows_differ(
    f: super::RowsDot,
    w: &[u8],
    row_bytes: usize,
    q: &[BlockQ8K],
    scalar_out: &[f32],
) -> usize {
    let rows = w.len() / row_bytes.max(1);
    [rows, rows.saturating_sub(1)]
        .iter()
        .map(|&n| {
            let mut out = vec![0.0f32; n];
            f(&w[..n * row_bytes], row_bytes, q, &mut out);
            out.iter()
                .zip(scalar_out)
                .filter(|(g, s)| g.to_bits() != s.to_bits())
                .count()
        })
        .sum()
}

fn call(kernel: RowDot, w: &[u8], x: &[f32]) -> f32 {
    match kernel {
        RowDot::Q8K(f) => {
            let mut q = vec![BlockQ8K::ZERO; x.len() / QK_K];
            quantize_row_q8_k(x, &mut q);
            f(w, &q)
        }
        RowDot::Q8_0(f) => {
            let mut q = vec![BlockQ8_0::ZERO; x.len() / QK8_0];
            quantize_row_q8_0(x, &mut q);
            f(w, &q)
        }
        RowDot::F32(f) => f(w, x),
    }
}

/// Runs every check, calling `report` once per comparison.
pub fn selftest(report: &mut dyn FnMut(SelftestResult)) {
    let mut seed = 0x5eed_0000u64;
    for t in TYPE_TRAITS {
        let ty = t.ty;
        let Some(scalar) = lookup_exact(ty, Isa::Scalar) else {
            continue;
        };
        for cols in SELFTEST_COLS {
            if !cols.is_multiple_of(t.block_elems) {
                continue;
            }
            seed += 1;
            selftest_shape(ty, scalar, SELFTEST_ROWS, cols, seed, report);
        }
    }
}

/// Runs [`selftest`] and collects the results.
pub fn selftest_all() -> Vec<SelftestResult> {
    let mut out = Vec::new();
    selftest(&mut |r| out.push(r));
    out
}

fn selftest_shape(
    ty: GgmlType,
    scalar: RowDot,
    rows: usize,
    cols: usize,
    seed: u64,
    report: &mut dyn FnMut(SelftestResult),
) {
    let w = random_weights(ty, rows, cols, seed);
    let xs = random_activations(MATMUL_N * cols, seed ^ 0xa5a5);
    let x = &xs[..cols];
    let row_bytes = w.len() / rows;
    let wf: Vec<f64> = {
        let mut v = vec![0.0f32; rows * cols];
        // The buffer is sized from the type table, so this cannot fail.
        if dequantize(ty, &w, &mut v).is_err() {
            v.fill(f32::NAN);
        }
        v.into_iter().map(f64::from).collect()
    };
    let seen = seen_activations(scalar, x);
    let xf: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(p, q)| p * q).sum::<f64>();
    let abs_dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(p, q)| (p * q).abs()).sum::<f64>();

    let scalar_out: Vec<f32> = w
        .chunks_exact(row_bytes)
        .map(|wr| call(scalar, wr, x))
        .collect();
    let result = |isa, check, error: f64, tolerance| SelftestResult {
        ty,
        isa,
        variant: "",
        check,
        rows,
        cols,
        error,
        tolerance,
        passed: error <= tolerance, // NaN fails
    };

    for isa in Isa::available() {
        let Some(kernel) = lookup_exact(ty, isa) else {
            continue;
        };
        let got: Vec<f32> = w
            .chunks_exact(row_bytes)
            .map(|wr| call(kernel, wr, x))
            .collect();

        // (a) against the exact dot with the activations the kernel sees.
        let mut err_q8 = 0.0f64;
        // (b) against the original f32 activations.
        let (mut num, mut den) = (0.0f64, 0.0f64);
        // SIMD vs scalar: bit for bit.
        let mut differ_scalar = 0usize;
        for (r, &g) in got.iter().enumerate() {
            let wr = &wf[r * cols..(r + 1) * cols];
            let scale = abs_dot(wr, &seen).max(f64::MIN_POSITIVE);
            err_q8 = err_q8.max((f64::from(g) - dot(wr, &seen)).abs() / scale);
            let exact = dot(wr, &xf);
            num += (f64::from(g) - exact).powi(2);
            den += exact * exact;
            if g.to_bits() != scalar_out[r].to_bits() {
                differ_scalar += 1;
            }
        }
        report(result(isa, Check::OracleQ8, err_q8, ORACLE_Q8_TOL));
        let rel_f32 = (num / den.max(f64::MIN_POSITIVE)).sqrt();
        report(SelftestResult {
            passed: rel_f32.is_finite(),
            ..result(isa, Check::OracleF32, rel_f32, f64::INFINITY)
        });
        if isa != Isa::Scalar {
            report(result(isa, Check::VsScalar, differ_scalar as f64, 0.0));
        }
        // Kernels of this level that the dispatch does not pick here (AVX-512 without VNNI).
        for alt in lookup_alternates(ty, isa) {
            let differ = w
                .chunks_exact(row_bytes)
                .zip(&scalar_out)
                .filter(|(wr, s)| call(alt, wr, x).to_bits() != s.to_bits())
                .count();
            report(SelftestResult {
                variant: "alternate",
                ..result(isa, Check::VsScalar, differ as f64, 0.0)
            });
        }

        // The IQ2_XXS decode kernel on element-major activations (matvec's and the fused MoE
        // decode's at this level) vs scalar, bit for bit.
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx512 && ty == GgmlType::IQ2XXS {
            if let Some(k) = super::iquants_avx512::iq2_xxs_element_major_kernel() {
                let mut q = vec![BlockQ8K::ZERO; cols / QK_K];
                quantize_row_q8_k(x, &mut q);
                let xe = super::iquants_avx512::element_major_q8k(&q);
                let differ = w
                    .chunks_exact(row_bytes)
                    .zip(&scalar_out)
                    .filter(|(wr, s)| k(wr, &xe).to_bits() != s.to_bits())
                    .count();
                report(SelftestResult {
                    variant: "element-major",
                    ..result(isa, Check::VsScalar, differ as f64, 0.0)
                });
            }
        }

        // The Q4_K kernel and rows kernel on paired activations (matvec's at this level with
        // VNNI) vs scalar, bit for bit; the rows kernel over all rows and all but the last.
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx512 && ty == GgmlType::Q4K {
            use super::kquants_x86::{q4k_paired_kernel, q4k_paired_q8k, q4k_paired_rows_kernel};
            if let (Some(k), Some(f)) = (q4k_paired_kernel(), q4k_paired_rows_kernel()) {
                let mut q = vec![BlockQ8K::ZERO; cols / QK_K];
                quantize_row_q8_k(x, &mut q);
                let xp = q4k_paired_q8k(&q);
                let differ = w
                    .chunks_exact(row_bytes)
                    .zip(&scalar_out)
                    .filter(|(wr, s)| k(wr, &xp).to_bits() != s.to_bits())
                    .count()
                    + rows_differ(f, &w, row_bytes, &xp, &scalar_out);
                report(SelftestResult {
                    variant: "paired",
                    ..result(isa, Check::VsScalar, differ as f64, 0.0)
                });
            }
        }

        // The rows kernel of this level (matvec's and the fused decode's), over all rows and
        // over all but the last (an odd count: the single-row remainder), vs scalar bit for bit.
        if let Some(f) = super::lookup_rows(ty, isa) {
            let mut q = vec![BlockQ8K::ZERO; cols / QK_K];
            quantize_row_q8_k(x, &mut q);
            let differ = rows_differ(f, &w, row_bytes, &q, &scalar_out);
            report(SelftestResult {
                variant: "rows",
                ..result(isa, Check::VsScalar, differ as f64, 0.0)
            });
        }

        // The decode tiles (small files' one-row products) vs scalar, bit for bit.
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx512 {
            use super::tiles_x86::{pair_sums, DecodeTiles, Q80Act};
            if let Some(tiles) = DecodeTiles::repack(ty, &w, rows, cols) {
                let mut out = vec![0.0f32; rows];
                if let Some(t) = tiles.q8_0() {
                    let mut q = vec![BlockQ8_0::ZERO; cols / QK8_0];
                    quantize_row_q8_0(x, &mut q);
                    t.matmul_groups(0, &[&Q80Act::new(&q)], &mut [&mut out]);
                    // Several rows at once vs the scalar kernel row by row, bit for bit.
                    let mut qs = vec![BlockQ8_0::ZERO; MATMUL_N * cols / QK8_0];
                    for (xr, qr) in xs.chunks_exact(cols).zip(qs.chunks_exact_mut(cols / QK8_0)) {
                        quantize_row_q8_0(xr, qr);
                    }
                    let acts: Vec<Q80Act> =
                        qs.chunks_exact(cols / QK8_0).map(Q80Act::new).collect();
                    let acts: Vec<&Q80Act> = acts.iter().collect();
                    let mut ys = vec![0.0f32; MATMUL_N * rows];
                    let mut outs: Vec<&mut [f32]> = ys.chunks_exact_mut(rows).collect();
                    t.matmul_groups(0, &acts, &mut outs);
                    let mut differ = 0;
                    for (xr, yr) in xs.chunks_exact(cols).zip(ys.chunks_exact(rows)) {
                        let mut want = vec![0.0f32; rows];
                        let ok = matvec_isa(Isa::Scalar, ty, &w, rows, cols, xr, &mut want);
                        differ += yr
                            .iter()
                            .zip(&want)
                            .filter(|(g, s)| ok.is_err() || g.to_bits() != s.to_bits())
                            .count();
                    }
                    report(SelftestResult {
                        variant: "tiles rows",
                        ..result(isa, Check::VsScalar, differ as f64, 0.0)
                    });
                } else {
                    let mut q = vec![BlockQ8K::ZERO; cols / QK_K];
                    quantize_row_q8_k(x, &mut q);
                    tiles.matvec_groups(0, &q, &pair_sums(&q), &mut out);
                }
                let differ = out
                    .iter()
                    .zip(&scalar_out)
                    .filter(|(g, s)| g.to_bits() != s.to_bits())
                    .count();
                report(SelftestResult {
                    variant: "tiles",
                    ..result(isa, Check::VsScalar, differ as f64, 0.0)
                });
            }
        }

        // matmul over MATMUL_N activation rows vs matvec of each, bit for bit.
        let mut ys = vec![0.0f32; MATMUL_N * rows];
        let mut differing = 0usize;
        let ok = matmul_isa(isa, ty, &w, rows, cols, &xs, MATMUL_N, &mut ys).is_ok();
        for j in 0..MATMUL_N {
            let mut y = vec![0.0f32; rows];
            let ok_v = matvec_isa(
                isa,
                ty,
                &w,
                rows,
                cols,
                &xs[j * cols..(j + 1) * cols],
                &mut y,
            );
            for r in 0..rows {
                if !ok || ok_v.is_err() || y[r].to_bits() != ys[j * rows + r].to_bits() {
                    differing += 1;
                }
            }
        }
        report(result(
            isa,
            Check::MatmulBitIdentical,
            differing as f64,
            0.0,
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::super::q8::{dequantize_q8_0, dequantize_q8_k};
    use super::*;

    #[test]
    fn random_weights_have_the_right_size() {
        for t in TYPE_TRAITS {
            let w = random_weights(t.ty, 2, 256, 1);
            assert_eq!(
                w.len(),
                2 * 256 / t.block_elems * t.block_bytes,
                "{}",
                t.name
            );
        }
    }

    #[test]
    fn seen_activations_match_dequantizers() {
        let x = random_activations(512, 3);
        let mut q = vec![BlockQ8K::ZERO; 2];
        quantize_row_q8_k(&x, &mut q);
        let mut f = vec![0.0f32; 512];
        dequantize_q8_k(&q, &mut f);
        let seen = seen_activations(RowDot::Q8K(|_, _| 0.0), &x);
        for (a, b) in f.iter().zip(&seen) {
            assert!((f64::from(*a) - b).abs() <= 1e-6 * b.abs());
        }
        let mut q0 = vec![BlockQ8_0::ZERO; 16];
        quantize_row_q8_0(&x, &mut q0);
        dequantize_q8_0(&q0, &mut f);
        let seen = seen_activations(RowDot::Q8_0(|_, _| 0.0), &x);
        for (a, b) in f.iter().zip(&seen) {
            assert!((f64::from(*a) - b).abs() <= 1e-6 * b.abs());
        }
    }
}
