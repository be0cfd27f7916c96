//! The GPU self-test: every kernel against a CPU reference on fresh random data.
//!
//! References are computed in f64 from the same inputs: weights through the reference
//! dequantizers of `redlite_gguf::quant`, the other kernels by their formulas (those of the
//! oracle in `redlite_model`). The error measure is `‖gpu − ref‖ / ‖ref‖` over the whole output,
//! except for the matrix-vector products, where it is `‖gpu − ref‖ / ‖ |W|·|x| ‖`: the scale of
//! f32 rounding in a dot product is the sum of the magnitudes of its terms, and a one-row case
//! whose terms happen to cancel would otherwise read as a large relative error (seen on the
//! H200: IQ4_NL 1×32, 5.9e-6 against ‖ref‖). A NaN anywhere (outputs are poisoned before each
//! launch) fails the check. Index outputs (router choice, argmax) must match exactly.

use cudarc::driver::CudaSlice;
use redlite_gguf::quant::dequantize_to_vec;
use redlite_gguf::GgmlType;
use redlite_model::kv_type::{f16_to_f32, f32_to_f16};
use redlite_model::KvType;

use crate::kernels::ALL_TYPES;
use crate::ops::{self, AttnDims, DeltaDims, ExpertSet, ExpertTensors};
use crate::{CudaError, Gpu};

/// Relative error allowed for kernels that compute in f32 (far above f32 rounding on these sizes,
/// far below any indexing or formula mistake).
pub const TOL_F32: f64 = 1e-5;
/// The prompt GEMMs' bound: f16 inputs (2^-11 relative rounding each, so ≤ 2^-10 ≈ 9.8e-4 of
/// Σ|w·x| per output) plus f32 accumulation.
pub const TOL_GEMM_F16: f64 = 1.2e-3;
/// Attention on the tensor cores (q, k, v and the probabilities rounded to f16, 2^-11 relative
/// each): the output's relative error norm, a few times that rounding.
pub const TOL_ATTN_F16: f64 = 2e-3;

/// One comparison.
#[derive(Debug, Clone)]
pub struct Check {
    pub kernel: String,
    pub case: String,
    /// Relative L2 error (or mismatch count for index outputs).
    pub err: f64,
    pub tol: f64,
    pub pass: bool,
    pub note: String,
}

/// SplitMix64: small, seedable, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
    pub fn normals(&mut self, n: usize, scale: f64) -> Vec<f32> {
        (0..n).map(|_| (self.normal() * scale) as f32).collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// f32 to f16 bits (round to nearest even), for test data only (normal, in-range values).
fn f16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    if exp <= 0 {
        return sign; // flush tiny values to zero: fine for test data
    }
    if exp >= 31 {
        return sign | 0x7bff;
    }
    let mant = b & 0x7f_ffff;
    let mut h = (sign as u32) | ((exp as u32) << 10) | (mant >> 13);
    let rest = mant & 0x1fff;
    if rest > 0x1000 || (rest == 0x1000 && (h & 1) == 1) {
        h += 1;
    }
    h as u16
}

/// Byte offsets of the f16 scales of one block, patched to sane values in random data.
fn scale_offsets(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q2K => &[80, 82],
        GgmlType::Q3K => &[108],
        GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q6K => &[208],
        GgmlType::IQ1M | GgmlType::Q8K => &[],
        _ => &[0],
    }
}

/// `rows × cols` random weights of type `ty` as raw GGUF bytes: random bits everywhere except the
/// scales, which get small positive values (so products stay finite and comparable).
pub fn random_weights(rng: &mut Rng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let n = rows * cols;
    match ty {
        GgmlType::F32 => (0..n)
            .flat_map(|_| (rng.normal() as f32).to_le_bytes())
            .collect(),
        GgmlType::F16 => (0..n)
            .flat_map(|_| f16_bits(rng.normal() as f32).to_le_bytes())
            .collect(),
        GgmlType::BF16 => (0..n)
            .flat_map(|_| (((rng.normal() as f32).to_bits() >> 16) as u16).to_le_bytes())
            .collect(),
        _ => {
            let (bb, nb) = (ty.block_bytes(), n / ty.block_elems());
            let mut out: Vec<u8> = (0..nb * bb).map(|_| rng.next_u64() as u8).collect();
            for block in out.chunks_exact_mut(bb) {
                for &off in scale_offsets(ty) {
                    let d = f16_bits((0.5e-3 + 1.5e-3 * rng.uniform()) as f32);
                    block[off..off + 2].copy_from_slice(&d.to_le_bytes());
                }
                match ty {
                    GgmlType::Q8K => {
                        let d = (0.5e-3 + 1.5e-3 * rng.uniform()) as f32;
                        block[0..4].copy_from_slice(&d.to_le_bytes());
                    }
                    GgmlType::IQ1M => {
                        // The f16 super-scale lives in the top nibbles of the 4 u16 scales at 48.
                        let d = f16_bits((0.5e-3 + 1.5e-3 * rng.uniform()) as f32);
                        for i in 0..4 {
                            let at = 48 + 2 * i;
                            let v = u16::from_le_bytes([block[at], block[at + 1]]);
                            let v = (v & 0x0fff) | (((d >> (4 * i)) & 0xf) << 12);
                            block[at..at + 2].copy_from_slice(&v.to_le_bytes());
                        }
                    }
                    _ => {}
                }
            }
            out
        }
    }
}

/// `‖a − b‖`, infinite when `a` has a NaN or the lengths differ.
pub fn abs_err(a: &[f32], b: &[f64]) -> f64 {
    if a.len() != b.len() || a.iter().any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - y).powi(2))
        .sum::<f64>()
        .sqrt()
}

/// `1 / sqrt(mean(x²) + eps)` in f64.
fn inv_rms64(x: &[f32], eps: f32) -> f64 {
    let ss: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    1.0 / (ss / x.len() as f64 + f64::from(eps)).sqrt()
}

/// One token of `matvec_res` in f64: `y = res + W · x` (W: `res.len()` rows of `x.len()`
/// dequantized values) and the next norm `y / rms(y) · nw`.
fn residual_and_norm64(
    res: &[f32],
    w: &[f32],
    x: &[f32],
    nw: &[f32],
    eps: f32,
) -> (Vec<f64>, Vec<f64>) {
    let cols = x.len();
    let y: Vec<f64> = res
        .iter()
        .enumerate()
        .map(|(r, &v)| f64::from(v) + dot64(&w[r * cols..(r + 1) * cols], x))
        .collect();
    let ss: f64 = y.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss / y.len() as f64 + f64::from(eps)).sqrt();
    let yn = y
        .iter()
        .zip(nw)
        .map(|(v, &g)| v * inv * f64::from(g))
        .collect();
    (y, yn)
}

/// The values the 8-bit activation kernels compute with: per 32 values d = max|v| / 127 and
/// q = rint(v / d) (as `stage_normed_q8` in matvec.cu, in f32), returned as d · q.
pub fn quantize_q8_blocks(v: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(v.len());
    for block in v.chunks(32) {
        let d = block.iter().fold(0.0f32, |m, x| m.max(x.abs())) / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        out.extend(block.iter().map(|&x| (x * id).round_ties_even() * d));
    }
    out
}

/// Byte-for-byte equality of two q8 rows (or sets of them): `what` and how many bytes differ
/// otherwise.
fn same_bytes(what: &str, a: &[u8], b: &[u8]) -> Result<(), CudaError> {
    let differ = a.iter().zip(b).filter(|(x, y)| x != y).count();
    if differ > 0 || a.len() != b.len() {
        return Err(CudaError::Invalid(format!(
            "{what}: {differ} of {} bytes differ",
            b.len()
        )));
    }
    Ok(())
}

/// A routed gate/up's outputs `(ids, weights, activations, their q8 rows)` against a reference
/// run's: `Err` naming `what` unless the ids are equal and the rest bit for bit.
type RouteOut<'a> = (&'a [i32], &'a [f32], &'a [f32], &'a [u8]);
fn same_route(what: &str, a: RouteOut, b: RouteOut) -> Result<(), CudaError> {
    if a.0 != b.0 {
        return Err(CudaError::Invalid(format!(
            "{what}: ids {:?}, reference {:?}",
            a.0, b.0
        )));
    }
    same_bits(&format!("{what}: weights differ"), a.1, b.1)?;
    same_bits(&format!("{what}: activations differ"), a.2, b.2)?;
    same_bytes(&format!("{what}: q8 rows differ"), a.3, b.3)
}

/// The fused route kernel's outputs (`f`) against the separate launches' (`s`), bit for bit:
/// router logits, the shared gate logit, then ids, weights, activations and their q8 rows.
fn same_fused_route(f: &ops::RouteGateUp, s: &ops::RouteGateUp) -> Result<(), CudaError> {
    same_bits("fused route: router logits differ", &f.0, &s.0)?;
    same_bits("fused route: shared gate logit differs", &f.1, &s.1)?;
    same_route(
        "fused route",
        (&f.2, &f.3, &f.4, &f.5),
        (&s.2, &s.3, &s.4, &s.5),
    )
}

/// How many values of `a` differ in any bit from `b`'s (pairwise over the shorter).
fn bits_differ(a: &[f32], b: &[f32]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

/// `Err` naming `what` (which ends in "differs from …") when `a` and `b` differ in any bit.
fn same_bits(what: &str, a: &[f32], b: &[f32]) -> Result<(), CudaError> {
    let differ = bits_differ(a, b);
    if differ > 0 || a.len() != b.len() {
        return Err(CudaError::Invalid(format!(
            "{what} in {differ} of {} outputs",
            a.len()
        )));
    }
    Ok(())
}

/// The `chosen` experts' gate, up and down bytes on the device.
fn upload_experts(
    gpu: &Gpu,
    parts: [&[Vec<u8>]; 3],
    chosen: &[usize],
) -> Result<[Vec<CudaSlice<u8>>; 3], CudaError> {
    let one = |part: &[Vec<u8>]| -> Result<Vec<CudaSlice<u8>>, CudaError> {
        chosen.iter().map(|&e| ops::upload(gpu, &part[e])).collect()
    };
    Ok([one(parts[0])?, one(parts[1])?, one(parts[2])?])
}

/// The bytes the q8 IQ2_XXS expert kernels read for IQ2_XXS experts `parts`: the same, or with
/// `IQ2_NIB` ([`crate::iq2_nib`]) their nibble copy.
fn q8_kernel_bytes(parts: &[Vec<u8>]) -> Vec<Vec<u8>> {
    if !crate::iq2_nib::enabled() {
        return parts.to_vec();
    }
    parts.iter().map(|p| crate::iq2_nib::repacked(p)).collect()
}

/// The [`ExpertSet`] of experts uploaded by [`upload_experts`], every part of type `ty`.
fn expert_set(ty: GgmlType, parts: &[Vec<CudaSlice<u8>>; 3]) -> ExpertSet<'_> {
    ExpertSet {
        gate_up_ty: ty,
        down_ty: ty,
        gate: parts[0].iter().collect(),
        up: parts[1].iter().collect(),
        down: parts[2].iter().collect(),
    }
}

/// `x` rounded to f16 (nearest even) and back: what an f16 KV cache holds.
fn round_f16(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| f16_to_f32(f32_to_f16(v))).collect()
}

/// `‖a − b‖ / ‖b‖`, infinite when `a` has a NaN or the lengths differ.
pub fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    if a.len() != b.len() || a.iter().any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        num += (f64::from(x) - y).powi(2);
        den += y * y;
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

fn dot64(w: &[f32], x: &[f32]) -> f64 {
    w.iter()
        .zip(x)
        .map(|(&a, &b)| f64::from(a) * f64::from(b))
        .sum()
}

/// `W · x[t]` in f64 for every token `x[t]` of `xs` and row of `wf` (`[rows][cols]`; outputs
/// `[n][rows]`), and the norm over the outputs of Σ|w·x| (at least the smallest positive f64): the
/// scale the kernels' rounding error is measured against.
fn products64(wf: &[f32], xs: &[f32], rows: usize, cols: usize) -> (Vec<f64>, f64) {
    let n = xs.len() / cols;
    let (mut out, mut magnitude) = (Vec::with_capacity(n * rows), 0.0f64);
    for x in xs.chunks_exact(cols) {
        for w in wf.chunks_exact(cols).take(rows) {
            out.push(dot64(w, x));
            let m: f64 = w
                .iter()
                .zip(x)
                .map(|(&a, &b)| (f64::from(a) * f64::from(b)).abs())
                .sum();
            magnitude += m * m;
        }
    }
    (out, magnitude.sqrt().max(f64::MIN_POSITIVE))
}

/// Softmax attention of one query row `qh` over cache positions `0..len` of KV head `g` (`kc`,
/// `vc`: `[position][nkv][head_dim]`), in f64.
fn attention_row64(
    qh: &[f32],
    kc: &[f32],
    vc: &[f32],
    (len, nkv, g): (usize, usize, usize),
    scale: f32,
) -> Vec<f64> {
    let hd = qh.len();
    let at = |j: usize| (j * nkv + g) * hd;
    let sc: Vec<f64> = (0..len)
        .map(|j| dot64(qh, &kc[at(j)..at(j) + hd]) * f64::from(scale))
        .collect();
    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let p: Vec<f64> = sc.iter().map(|s| (s - m).exp()).collect();
    let sum: f64 = p.iter().sum();
    let mut out = vec![0.0f64; hd];
    for (j, pj) in p.iter().enumerate() {
        for (i, o) in out.iter_mut().enumerate() {
            *o += pj / sum * f64::from(vc[at(j) + i]);
        }
    }
    out
}

fn silu64(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

struct Runner<'a> {
    gpu: &'a Gpu,
    rng: Rng,
    out: Vec<Check>,
}

impl Runner<'_> {
    fn record(&mut self, kernel: &str, case: String, r: Result<(f64, f64), CudaError>) {
        let (err, tol, note) = match r {
            Ok((err, tol)) => (err, tol, String::new()),
            Err(e) => (f64::INFINITY, 0.0, e.to_string()),
        };
        self.out.push(Check {
            kernel: kernel.to_string(),
            case,
            err,
            tol,
            pass: err <= tol,
            note,
        });
    }

    fn matvec(&mut self, ty: GgmlType) {
        let be = ty.block_elems();
        let cases: Vec<(usize, usize, usize)> = if be == 1 {
            vec![(5, 100, 2), (37, 2304, 1), (512, 4096, 1), (64, 1024, 3)]
        } else {
            vec![(1, be, 1), (37, 2304, 1), (512, 4096, 1), (64, 1024, 3)]
        };
        for (rows, cols, n) in cases {
            let bytes = random_weights(&mut self.rng, ty, rows, cols);
            let xs = self.rng.normals(n * cols, 1.0);
            let r = (|| {
                let w = ops::upload(self.gpu, &bytes)?;
                let y = ops::matvec(self.gpu, ty, &w, rows, cols, &xs, n)?;
                let wf =
                    dequantize_to_vec(ty, &bytes).map_err(|e| CudaError::Invalid(e.to_string()))?;
                let (reference, magnitude) = products64(&wf, &xs[..n * cols], rows, cols);
                Ok((abs_err(&y, &reference) / magnitude, TOL_F32))
            })();
            self.record(
                &format!("matvec {}", ty.name()),
                format!("{rows}x{cols} n={n}"),
                r,
            );
        }
    }

    /// `gemm_<type>` (prompts on the tensor cores) against f64: rows and tokens that end inside a
    /// tile, several column steps, once with a residual. Inputs are rounded to f16 (2^-11
    /// relative each), so every output is within ≈ 2^-10 of Σ|w·x| of the exact sum: the error
    /// norm is measured against that magnitude, like `matvec`, with [`TOL_GEMM_F16`] (f32 weights:
    /// `gemm_f32_simt`, f32 inputs, [`TOL_F32`]).
    fn gemm(&mut self, ty: GgmlType) {
        let be = ty.block_elems().max(32);
        for (rows, cols, n, residual) in [
            (64usize, be, 16usize, false),
            (100, 2048, 70, false),
            (37, 512, 130, true),
        ] {
            let bytes = random_weights(&mut self.rng, ty, rows, cols);
            let xs = self.rng.normals(n * cols, 1.0);
            let res = residual.then(|| self.rng.normals(n * rows, 1.0));
            // The own kernel and, when the library is there, the cuBLAS form of long prompts
            // (the same f16 inputs, or f32 for f32 weights; the library's summation order).
            let blas = crate::blas::available();
            for use_blas in [false, true] {
                if use_blas && !blas {
                    continue;
                }
                let r = (|| {
                    let w = ops::upload(self.gpu, &bytes)?;
                    let y = if use_blas {
                        ops::gemm_blas(self.gpu, ty, &w, (rows, cols), &xs, res.as_deref())?
                    } else {
                        ops::gemm(self.gpu, ty, &w, (rows, cols), &xs, res.as_deref())?
                    };
                    let wf = dequantize_to_vec(ty, &bytes)
                        .map_err(|e| CudaError::Invalid(e.to_string()))?;
                    let (mut reference, magnitude) = products64(&wf, &xs, rows, cols);
                    if let Some(res) = &res {
                        for (r, &b) in reference.iter_mut().zip(res) {
                            *r += f64::from(b);
                        }
                    }
                    let tol = if ty == GgmlType::F32 {
                        TOL_F32
                    } else {
                        TOL_GEMM_F16
                    };
                    Ok((abs_err(&y, &reference) / magnitude, tol))
                })();
                self.record(
                    &format!(
                        "gemm{} {}",
                        if use_blas { " cublas" } else { "" },
                        ty.name()
                    ),
                    format!(
                        "{rows}x{cols} n={n}{}",
                        if residual { " +residual" } else { "" }
                    ),
                    r,
                );
            }
        }
    }

    /// Random `ty` weights (`rows × cols`), `n` inputs and norm weights (none when `plain`) for the
    /// fused matvec checks.
    fn norm3_inputs(
        &mut self,
        ty: GgmlType,
        (rows, cols): (usize, usize),
        n: usize,
        plain: bool,
    ) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
        let bytes = random_weights(&mut self.rng, ty, rows, cols);
        let xs = self.rng.normals(n * cols, 1.0);
        let nw = if plain {
            Vec::new()
        } else {
            (0..cols).map(|_| 0.5 + self.rng.uniform() as f32).collect()
        };
        (bytes, xs, nw)
    }

    /// `matvec_norm3_q8_<type>` (8-bit activations; Q4_K, Q6_K) against f64 on the same activations,
    /// quantised here as the kernel does (per 32 values: d = max|v| / 127, q = rint(v / d)): 2048
    /// and 4096 columns, 1, 2 and 8 slices, with and without norm weights; token tiles of 2 and 4
    /// bit for bit the one-token kernel.
    fn matvec_norm3_q8(&mut self, ty: GgmlType) {
        let (rows, n, eps) = (67usize, 3usize, 1e-6f32);
        for (cols, parts, plain, rpw) in [
            (2048usize, 1usize, false, 1usize),
            (2048, 1, false, 8),
            (2048, 2, true, 3),
            (2048, 8, false, 16),
            (4096, 1, false, 8),
            (4096, 2, true, 1),
        ] {
            let (bytes, xs, nw) = self.norm3_inputs(ty, (rows, cols), n, plain);
            let r = (|| {
                let w = ops::upload(self.gpu, &bytes)?;
                let run = |rpw, tile| {
                    ops::matvec_norm3_q8(
                        self.gpu,
                        ty,
                        &w,
                        (rows, cols),
                        &xs,
                        &nw,
                        (eps, parts, rpw, tile),
                    )
                };
                let y = run(rpw, 1)?;
                for tile in [2usize, 4] {
                    let yt = run(1, tile)?;
                    let differ = yt
                        .iter()
                        .zip(&y)
                        .filter(|(a, b)| a.to_bits() != b.to_bits())
                        .count();
                    if differ > 0 {
                        let worst = yt
                            .iter()
                            .zip(&y)
                            .map(|(a, b)| (a - b).abs())
                            .fold(0.0f32, f32::max);
                        return Err(CudaError::Invalid(format!(
                            "matvec_norm3_tok_q8 with a tile of {tile} tokens differs from matvec_norm3_q8 \
                             in {differ} of {} outputs (largest difference {worst:e}, non-finite: {} / {})",
                            y.len(),
                            yt.iter().filter(|v| !v.is_finite()).count(),
                            y.iter().filter(|v| !v.is_finite()).count()
                        )));
                    }
                }
                let wf =
                    dequantize_to_vec(ty, &bytes).map_err(|e| CudaError::Invalid(e.to_string()))?;
                let mut reference = Vec::with_capacity(n * rows);
                for t in 0..n {
                    let x = &xs[t * cols..(t + 1) * cols];
                    let inv = if plain { 1.0 } else { inv_rms64(x, eps) };
                    let u: Vec<f32> = (0..cols)
                        .map(|i| nw.get(i).map_or(x[i], |&g| x[i] * g))
                        .collect();
                    let xq = quantize_q8_blocks(&u);
                    for r in 0..rows {
                        let row = &wf[r * cols..(r + 1) * cols];
                        reference.push(inv * dot64(row, &xq));
                    }
                }
                Ok((rel_err(&y, &reference), TOL_F32))
            })();
            self.record(
                &format!("matvec_norm3_q8 {}", ty.name()),
                format!(
                    "{rows}x{cols} n={n} parts={parts} rows/warp={rpw}{}, token tiles 2 and 4 bit-identical",
                    if plain { " no norm" } else { "" }
                ),
                r,
            );
        }
    }

    /// `matvec_res_q8_q4_k` against f64 on the same 8-bit activations: `y = residual + W · q8(x)`
    /// and the next norm; 256 rows of 1024 and 4096 columns, 1 and 2 slices, 1 to 8 rows per warp.
    fn matvec_res_q8(&mut self) {
        let (n, eps, rows) = (3usize, 1e-6f32, 256usize);
        for (cols, parts, rpw) in [
            (1024usize, 1usize, 1usize),
            (1024, 2, 3),
            (4096, 2, 2),
            (4096, 1, 8),
        ] {
            let bytes = random_weights(&mut self.rng, GgmlType::Q4K, rows, cols);
            let xs = self.rng.normals(n * cols, 1.0);
            let res = self.rng.normals(n * rows, 1.0);
            let nw: Vec<f32> = (0..rows).map(|_| 0.5 + self.rng.uniform() as f32).collect();
            let r = (|| {
                let w = ops::upload(self.gpu, &bytes)?;
                let (y, yn, xq) = ops::matvec_res_q8(
                    self.gpu,
                    &w,
                    (rows, cols),
                    &xs,
                    &res,
                    &nw,
                    (eps, parts, rpw),
                )?;
                // The same norm as a kernel of its own (`REDLITE_CUDA_RES_NORM_SPLIT`): the
                // same bits.
                let (yn2, xq2) = ops::res_norm_q8(self.gpu, &y, rows, &nw, eps)?;
                same_bits(
                    "res_norm_q8 differs from matvec_res's last block",
                    &yn2,
                    &yn,
                )?;
                same_bytes(
                    "res_norm_q8's q8 rows differ from matvec_res's last block's",
                    &xq2,
                    &xq,
                )?;
                // The epilogue's q8 rows are the quantisation of its own yn, bit for bit.
                let expect: Vec<u8> = yn.chunks(rows).flat_map(ops::q8_row).collect();
                same_bytes(
                    "matvec_res_q8: the q8 rows differ from the quantised yn",
                    &xq,
                    &expect,
                )?;
                let wf = dequantize_to_vec(GgmlType::Q4K, &bytes)
                    .map_err(|e| CudaError::Invalid(e.to_string()))?;
                let (mut ry, mut ryn) = (Vec::new(), Vec::new());
                for t in 0..n {
                    let xq = quantize_q8_blocks(&xs[t * cols..(t + 1) * cols]);
                    let res_t = &res[t * rows..(t + 1) * rows];
                    let (yt, ynt) = residual_and_norm64(res_t, &wf, &xq, &nw, eps);
                    ry.extend(yt);
                    ryn.extend(ynt);
                }
                Ok((rel_err(&y, &ry).max(rel_err(&yn, &ryn)), TOL_F32))
            })();
            self.record(
                "matvec_res_q8 Q4_K",
                format!(
                    "{rows}x{cols} n={n} parts={parts} rows/warp={rpw}, residual + next norm + its q8 rows (= res_norm_q8)"
                ),
                r,
            );
        }
    }

    /// `matvec_q8x_<type>` (Q4_K, Q6_K) on q8 rows made here (`ops::q8_row`) against f64 on the same 8-bit
    /// activations, and bit for bit `matvec_norm3_q8_<type>` without norm weights on the f32 rows.
    fn matvec_q8x(&mut self, ty: GgmlType) {
        let (rows, n) = (67usize, 3usize);
        for (cols, parts, rpw) in [(2048usize, 1usize, 4usize), (2048, 2, 1), (512, 1, 4)] {
            let bytes = random_weights(&mut self.rng, ty, rows, cols);
            let xs = self.rng.normals(n * cols, 1.0);
            let r = (|| {
                let w = ops::upload(self.gpu, &bytes)?;
                let xq: Vec<u8> = xs.chunks(cols).flat_map(ops::q8_row).collect();
                let y = ops::matvec_q8x(
                    self.gpu,
                    ty,
                    &w,
                    (rows, cols),
                    (&xq, None),
                    (parts, rpw, 1, false),
                )?;
                let staged = ops::matvec_norm3_q8(
                    self.gpu,
                    ty,
                    &w,
                    (rows, cols),
                    &xs,
                    &[],
                    (0.0, parts, rpw, 1),
                )?;
                same_bits("matvec_q8x differs from matvec_norm3_q8", &y, &staged)?;
                // With a norm: rms_norm_q8 then matvec_q8x = matvec_norm3_q8 with norm weights.
                let nw: Vec<f32> = (0..cols).map(|_| 0.5 + self.rng.uniform() as f32).collect();
                let (xqn, invs) = ops::rms_norm_q8(self.gpu, &xs, &nw, cols, 1e-6)?;
                // matvec_q8x of normed q8 rows in token tiles of `tile` (1: one token a block).
                let normed_mma = |(xq, invs): &(Vec<u8>, Vec<f32>), tile, mma| {
                    ops::matvec_q8x(
                        self.gpu,
                        ty,
                        &w,
                        (rows, cols),
                        (xq, Some(invs)),
                        (parts, rpw, tile, mma),
                    )
                };
                let normed = |q: &(Vec<u8>, Vec<f32>), tile| normed_mma(q, tile, false);
                let yn = normed(&(xqn, invs), 1)?;
                let staged_n = ops::matvec_norm3_q8(
                    self.gpu,
                    ty,
                    &w,
                    (rows, cols),
                    &xs,
                    &nw,
                    (1e-6, parts, rpw, 1),
                )?;
                same_bits(
                    "rms_norm_q8 + matvec_q8x differs from matvec_norm3_q8",
                    &yn,
                    &staged_n,
                )?;
                // Token tiles (`matvec_q8x_tok`, the verify rows): 11 tokens in tiles of 2 and 8
                // (a partial last tile) = the one-token kernel per token, bit for bit.
                let xs11 = self.rng.normals(11 * cols, 1.0);
                let q11 = ops::rms_norm_q8(self.gpu, &xs11, &nw, cols, 1e-6)?;
                let one = normed(&q11, 1)?;
                for tile in [2, 8] {
                    same_bits(
                        "matvec_q8x_tok differs from matvec_q8x",
                        &normed(&q11, tile)?,
                        &one,
                    )?;
                }
                // Q6_K rows in one slice with the q8 values in registers (`matvec_q8x_xr_q6_k`,
                // the verify's head): 11 tokens (a partial second block of 8) and 2.
                if ty == GgmlType::Q6K && parts == 1 {
                    let xr = ops::matvec_q8x_xr_q6k(self.gpu, &w, (rows, cols), (&q11.0, &q11.1))?;
                    same_bits("matvec_q8x_xr_q6_k differs from matvec_q8x", &xr, &one)?;
                    let b2 = 2 * ops::q8_row_bytes(cols);
                    let xr2 = ops::matvec_q8x_xr_q6k(
                        self.gpu,
                        &w,
                        (rows, cols),
                        (&q11.0[..b2], &q11.1[..2]),
                    )?;
                    same_bits(
                        "matvec_q8x_xr_q6_k (2 tokens) differs",
                        &xr2,
                        &one[..2 * rows],
                    )?;
                }
                // The tensor-core form (Q4_K): 11 tokens (a partial second tile) and one token.
                if ty == GgmlType::Q4K {
                    let q1 = (
                        q11.0[..ops::q8_row_bytes(cols)].to_vec(),
                        q11.1[..1].to_vec(),
                    );
                    same_bits(
                        "matvec_q8x_mma differs from matvec_q8x",
                        &normed_mma(&q11, 8, true)?,
                        &one,
                    )?;
                    same_bits(
                        "matvec_q8x_mma (one token) differs from matvec_q8x",
                        &normed_mma(&q1, 8, true)?,
                        &one[..rows],
                    )?;
                }
                let wf =
                    dequantize_to_vec(ty, &bytes).map_err(|e| CudaError::Invalid(e.to_string()))?;
                let mut reference = Vec::with_capacity(n * rows);
                for x in xs.chunks(cols) {
                    let xq = quantize_q8_blocks(x);
                    for r in 0..rows {
                        reference.push(dot64(&wf[r * cols..(r + 1) * cols], &xq));
                    }
                }
                Ok((rel_err(&y, &reference), TOL_F32))
            })();
            self.record(
                &format!("matvec_q8x {}", ty.name()),
                format!(
                    "{rows}x{cols} n={n} parts={parts} rows/warp={rpw}, = matvec_norm3_q8 bit for bit \
                     (also after rms_norm_q8), token tiles 2 and 8 (and Q4_K's tensor-core form) = \
                     one token bit for bit"
                ),
                r,
            );
        }
    }

    /// `matvec3_x_f32` (the router's decode product, x read in place) bit for bit
    /// `matvec_norm3_f32` without norm weights (x staged), and against f64.
    fn matvec3_x_f32(&mut self) {
        let (rows, n) = (67usize, 3usize);
        for (cols, parts, rpw) in [(2048usize, 1usize, 1usize), (2048, 4, 1), (512, 2, 2)] {
            let bytes = random_weights(&mut self.rng, GgmlType::F32, rows, cols);
            let xs = self.rng.normals(n * cols, 1.0);
            let r = (|| {
                let w = ops::upload(self.gpu, &bytes)?;
                let y = ops::matvec3_x_f32(self.gpu, &w, (rows, cols), &xs, (parts, rpw, 1))?;
                let (staged, _) = ops::matvec_fused(
                    self.gpu,
                    GgmlType::F32,
                    &w,
                    (rows, cols),
                    &xs,
                    &[],
                    None,
                    (1e-6, parts, rpw, 1),
                )?;
                same_bits("matvec3_x_f32 differs from matvec_norm3_f32", &y, &staged)?;
                if rpw == 1 {
                    // Token tiles (`matvec3_x_tok_f32`): 7 tokens in tiles of 2 and 4.
                    let xs7 = self.rng.normals(7 * cols, 1.0);
                    let one = ops::matvec3_x_f32(self.gpu, &w, (rows, cols), &xs7, (parts, 1, 1))?;
                    for tile in [2, 4] {
                        let tiled =
                            ops::matvec3_x_f32(self.gpu, &w, (rows, cols), &xs7, (parts, 1, tile))?;
                        same_bits("matvec3_x_tok_f32 differs from matvec3_x_f32", &tiled, &one)?;
                    }
                }
                let wf = dequantize_to_vec(GgmlType::F32, &bytes)
                    .map_err(|e| CudaError::Invalid(e.to_string()))?;
                let mut reference = Vec::with_capacity(n * rows);
                for x in xs.chunks(cols) {
                    for r in 0..rows {
                        reference.push(dot64(&wf[r * cols..(r + 1) * cols], x));
                    }
                }
                Ok((rel_err(&y, &reference), TOL_F32))
            })();
            self.record(
                "matvec3_x_f32",
                format!(
                    "{rows}x{cols} n={n} parts={parts} rows/warp={rpw}, = matvec_norm3_f32 bit for bit{}",
                    if rpw == 1 { ", token tiles 2 and 4 too" } else { "" }
                ),
                r,
            );
        }
    }

    /// `res_norm_router` (`REDLITE_CUDA_NORM_ROUTER`: the next norm and the router's logits in one
    /// launch) bit for bit `res_norm_q8` and then `matvec3_x_f32` on its output.
    fn res_norm_router(&mut self) {
        let eps = 1e-6f32;
        for (rows, r0, parts, rpw, early) in [
            (2048usize, 67usize, 4usize, 1usize, 1i32),
            (2048, 512, 4, 1, 1),
            (2048, 512, 4, 1, 0),
            (2048, 512, 4, 1, 2),
            (2048, 67, 4, 1, 2),
            (2048, 512, 4, 4, 1),
            (512, 33, 2, 2, 1),
            (4096, 40, 4, 1, 1),
        ] {
            let ys = self.rng.normals(rows, 1.0);
            let nw: Vec<f32> = (0..rows).map(|_| 0.5 + self.rng.uniform() as f32).collect();
            let b0 = random_weights(&mut self.rng, GgmlType::F32, r0, rows);
            let b1 = random_weights(&mut self.rng, GgmlType::F32, 1, rows);
            let r = (|| {
                let (w0, w1) = (ops::upload(self.gpu, &b0)?, ops::upload(self.gpu, &b1)?);
                let got = ops::res_norm_router(
                    self.gpu,
                    &ys,
                    &nw,
                    eps,
                    (&w0, r0),
                    (&w1, 1),
                    (parts, rpw, early),
                )?;
                let (yn2, xq2) = ops::res_norm_q8(self.gpu, &ys, rows, &nw, eps)?;
                same_bits(
                    "res_norm_router's yn differs from res_norm_q8's",
                    &got.yn,
                    &yn2,
                )?;
                same_bytes(
                    "res_norm_router's q8 row differs from res_norm_q8's",
                    &got.xq,
                    &xq2,
                )?;
                // Against the decode router's form (one row a warp group) whatever the kernel's.
                let e0 = ops::matvec3_x_f32(self.gpu, &w0, (r0, rows), &yn2, (parts, 1, 1))?;
                let e1 = ops::matvec3_x_f32(self.gpu, &w1, (1, rows), &yn2, (parts, 1, 1))?;
                same_bits(
                    "res_norm_router's logits differ from matvec3_x_f32's",
                    &got.y0,
                    &e0,
                )?;
                same_bits(
                    "res_norm_router's gate logit differs from matvec3_x_f32's",
                    &got.y1,
                    &e1,
                )?;
                Ok((0.0, TOL_F32))
            })();
            self.record(
                "res_norm_router",
                format!("{rows} values, {r0} + 1 rows, parts={parts} rows/warp={rpw} early={early}: = res_norm_q8 + matvec3_x_f32 bit for bit"),
                r,
            );
        }
    }

    /// Every IQ2_XXS part on 8-bit activations (`REDLITE_CUDA_Q8_MOE_DOWN`): the activations
    /// against f64 on the q8 input, their q8 rows bit for bit the quantisation of those f32
    /// activations, and the output against f64 on both q8 inputs.
    fn experts_q8_down(&mut self) {
        let ty = GgmlType::IQ2XXS;
        for (hidden, ff) in [(2048usize, 512usize), (512, 256)] {
            let (n_exp, chosen, weights) = (6usize, [1usize, 2, 4], [0.45f32, 0.35, 0.2]);
            let [gate, up, down] = self.random_experts(ty, (hidden, ff), n_exp);
            let x = self.rng.normals(hidden, 1.0);
            // The q8 kernels' bytes (IQ2_NIB: the nibble copy); the references read the IQ2_XXS ones.
            let [gq, uq, dq] = [&gate, &up, &down].map(|p| q8_kernel_bytes(p));
            let r = (|| {
                let parts = upload_experts(self.gpu, [&gq, &uq, &dq], &chosen)?;
                let set = expert_set(ty, &parts);
                let (y, act, actq) = ops::moe_experts_q8_down(
                    self.gpu,
                    &set,
                    &weights,
                    &ops::q8_row(&x),
                    (hidden, ff),
                )?;
                // The top-k inside the gate/up blocks (`moe_gate_up_route_q8q_iq2_xxs`): on
                // logits whose top 3 of 64 are the set's experts, moe_router_warp's ids and
                // weights and the activations above, bit for bit.
                let ne = 64usize;
                let logits: Vec<f32> = (0..ne)
                    .map(|e| {
                        let u = self.rng.uniform() as f32;
                        if e < chosen.len() {
                            4.0 + u
                        } else {
                            u - 2.0
                        }
                    })
                    .collect();
                let (ids_r, wts_r, act_r, actq_r) = ops::moe_gate_up_route_q8q(
                    self.gpu,
                    false,
                    &set,
                    &logits,
                    &ops::q8_row(&x),
                    (hidden, ff),
                )?;
                // The two-rows-a-warp form (`moe_gate_up_route2_q8q_iq2_xxs`): the same bits.
                let (ids_2, wts_2, act_2, actq_2) = ops::moe_gate_up_route_q8q(
                    self.gpu,
                    true,
                    &set,
                    &logits,
                    &ops::q8_row(&x),
                    (hidden, ff),
                )?;
                same_route(
                    "route2",
                    (&ids_2, &wts_2, &act_2, &actq_2),
                    (&ids_r, &wts_r, &act_r, &actq_r),
                )?;
                // The experts in slots of one buffer (every expert resident): the parts found at
                // the table's first entries + id · slot stride (`dstride`), the same bits as
                // through the table entries.
                let slot_logits: Vec<f32> = (0..n_exp)
                    .map(|_| 4.0 * self.rng.uniform() as f32)
                    .collect();
                let slots = |direct| {
                    ops::moe_route_down_q8_slots(
                        self.gpu,
                        [&gq[..], &uq[..], &dq[..]],
                        &slot_logits,
                        chosen.len(),
                        &ops::q8_row(&x),
                        (hidden, ff),
                        direct,
                    )
                };
                let (y_t, act_t, actq_t) = slots(false)?;
                let (y_d, act_d, actq_d) = slots(true)?;
                same_bits("direct expert parts: output differs", &y_d, &y_t)?;
                same_bits("direct expert parts: activations differ", &act_d, &act_t)?;
                same_bytes("direct expert parts: q8 rows differ", &actq_d, &actq_t)?;
                // The router, its top-k and the gate/up in one launch with a grid barrier
                // (`moe_route_gate_up_q8q_iq2_xxs`, the model's decode path): every output the
                // two launches' (`matvec3_x_f32`, `moe_gate_up_route2`) bit for bit.
                let router = self.rng.normals(n_exp * hidden, 0.05);
                let gate_vec = self.rng.normals(hidden, 0.05);
                let xq = ops::q8_row(&x);
                let route = |form| {
                    ops::moe_route_gate_up_slots(
                        self.gpu,
                        [&gq[..], &uq[..], &dq[..]],
                        &router,
                        &gate_vec,
                        (&x, &xq),
                        chosen.len(),
                        (hidden, ff),
                        form,
                    )
                };
                let separate = route(ops::RouteForm::Separate)?;
                // The fused kernel.
                same_fused_route(&route(ops::RouteForm::Fused)?, &separate)?;
                let kernel = ops::RouterKernel::warp(ne)
                    .ok_or_else(|| CudaError::Invalid("no warp router for this shape".into()))?;
                let (ids_ref, wts_ref) =
                    ops::moe_router(self.gpu, kernel, &logits, ne, chosen.len())?;
                if ids_r != ids_ref || ids_r != [0, 1, 2] {
                    return Err(CudaError::Invalid(format!(
                        "routed gate/up ids {ids_r:?}, moe_router_warp {ids_ref:?}"
                    )));
                }
                same_bits(
                    "routed gate/up weights differ from moe_router_warp",
                    &wts_r,
                    &wts_ref,
                )?;
                same_bits("routed gate/up activations differ", &act_r, &act)?;
                same_bytes("routed gate/up q8 rows differ", &actq_r, &actq)?;
                let expect: Vec<u8> = act.chunks(ff).flat_map(ops::q8_row).collect();
                same_bytes(
                    "moe_gate_up_tab_q8q: the q8 rows differ from its quantised activations",
                    &actq,
                    &expect,
                )?;
                let deq = |b: &[u8]| {
                    dequantize_to_vec(ty, b).map_err(|e| CudaError::Invalid(e.to_string()))
                };
                let xq = quantize_q8_blocks(&x);
                let (mut ref_act, mut reference) = (Vec::new(), vec![0.0f64; hidden]);
                for (i, &e) in chosen.iter().enumerate() {
                    let (g, u, d) = (deq(&gate[e])?, deq(&up[e])?, deq(&down[e])?);
                    for r in 0..ff {
                        let gv = dot64(&g[r * hidden..(r + 1) * hidden], &xq);
                        let uv = dot64(&u[r * hidden..(r + 1) * hidden], &xq);
                        ref_act.push(silu64(gv) * uv);
                    }
                    // The down rows against the kernel's own activations, quantised.
                    let aq = quantize_q8_blocks(&act[i * ff..(i + 1) * ff]);
                    for (r, o) in reference.iter_mut().enumerate() {
                        *o += f64::from(weights[i]) * dot64(&d[r * ff..(r + 1) * ff], &aq);
                    }
                }
                Ok((
                    rel_err(&y, &reference).max(rel_err(&act, &ref_act)),
                    TOL_F32,
                ))
            })();
            self.record(
                "experts q8 down IQ2_XXS",
                format!("k=3 of {n_exp}, {hidden}/{ff}, activations and their q8 rows, routed gate/up = moe_router_warp + gate/up bit for bit, direct parts = table bit for bit, fused route = router + route2 bit for bit"),
                r,
            );
        }
    }

    /// The routed experts of several tokens (a verify's rows) on 8-bit activations: the one-token
    /// kernels on a grid of tokens against f64, and the token-tile kernels
    /// (`moe_gate_up_tok_q8q_iq2_xxs`, `moe_down_combine_tok_q8_iq2_xxs`) bit for bit against them,
    /// tiles that leave a partial last tile, through the table and at direct slots.
    fn experts_q8_tokens(&mut self) {
        let ty = GgmlType::IQ2XXS;
        for (hidden, ff) in [(2048usize, 512usize), (512, 256)] {
            let (n_exp, n, k) = (6usize, 7usize, 3usize);
            let [gate, up, down] = self.random_experts(ty, (hidden, ff), n_exp);
            let x = self.rng.normals(n * hidden, 1.0);
            // The q8 kernels' bytes (IQ2_NIB: the nibble copy); the references read the IQ2_XXS ones.
            let [gq, uq, dq] = [&gate, &up, &down].map(|p| q8_kernel_bytes(p));
            let mut ids = Vec::new();
            for _ in 0..n {
                let mut row: Vec<i32> = Vec::new();
                while row.len() < k {
                    let e = self.rng.below(n_exp) as i32;
                    if !row.contains(&e) {
                        row.push(e);
                    }
                }
                ids.extend(row);
            }
            let weights: Vec<f32> = (0..n * k)
                .map(|_| 0.1 + self.rng.uniform() as f32)
                .collect();
            let tiles = [(1usize, 1usize), (2, 3), (4, 8), (3, 5)];
            let r = (|| {
                let xq: Vec<u8> = x.chunks(hidden).flat_map(ops::q8_row).collect();
                let parts = [&gq[..], &uq[..], &dq[..]];
                let run = |t, direct| {
                    ops::moe_experts_q8_tokens(
                        self.gpu,
                        parts,
                        &ids,
                        &weights,
                        &xq,
                        (hidden, ff),
                        t,
                        direct,
                    )
                };
                let (y, act, actq) = run((0, 0), false)?;
                for direct in [false, true] {
                    for &t in &tiles {
                        let (y_t, act_t, actq_t) = run(t, direct)?;
                        let what = format!("token tiles {t:?} (direct {direct})");
                        same_bits(&format!("{what}: activations differ"), &act_t, &act)?;
                        same_bytes(&format!("{what}: q8 rows differ"), &actq_t, &actq)?;
                        same_bits(&format!("{what}: outputs differ"), &y_t, &y)?;
                    }
                }
                let deq = |b: &[u8]| {
                    dequantize_to_vec(ty, b).map_err(|e| CudaError::Invalid(e.to_string()))
                };
                let (mut ref_act, mut reference) = (Vec::new(), Vec::new());
                let gl = 1.0 / (1.0 + (-0.25f64).exp());
                for t in 0..n {
                    let xq = quantize_q8_blocks(&x[t * hidden..(t + 1) * hidden]);
                    let mut out: Vec<f64> = (0..hidden)
                        .map(|i| ((t * hidden + i) % 7) as f64 * 0.25 + gl * 0.5)
                        .collect();
                    for c in 0..k {
                        let (e, w) = (ids[t * k + c] as usize, weights[t * k + c]);
                        let (g, u, d) = (deq(&gate[e])?, deq(&up[e])?, deq(&down[e])?);
                        for r in 0..ff {
                            let gv = dot64(&g[r * hidden..(r + 1) * hidden], &xq);
                            let uv = dot64(&u[r * hidden..(r + 1) * hidden], &xq);
                            ref_act.push(silu64(gv) * uv);
                        }
                        let at = (t * k + c) * ff;
                        let aq = quantize_q8_blocks(&act[at..at + ff]);
                        for (r, o) in out.iter_mut().enumerate() {
                            *o += f64::from(w) * dot64(&d[r * ff..(r + 1) * ff], &aq);
                        }
                    }
                    reference.extend(out);
                }
                Ok((
                    rel_err(&y, &reference).max(rel_err(&act, &ref_act)),
                    TOL_F32,
                ))
            })();
            self.record(
                "experts q8 tokens IQ2_XXS",
                format!(
                    "n={n} k={k} of {n_exp}, {hidden}/{ff}, one-token kernels on a grid against f64, token tiles {tiles:?} bit for bit, table and direct"
                ),
                r,
            );
        }
    }

    /// `swiglu_q8`: silu(gate) · up against f64, and its q8 rows bit for bit the quantisation of
    /// its own output (what `matvec_norm3_q8` would stage from it).
    fn swiglu_q8(&mut self) {
        let (n, len) = (3usize, 512usize);
        let g = self.rng.normals(n * len, 2.0);
        let u = self.rng.normals(n * len, 1.0);
        let r = (|| {
            let (out, xq) = ops::swiglu_q8(self.gpu, &g, &u, len)?;
            let expect: Vec<u8> = out.chunks(len).flat_map(ops::q8_row).collect();
            same_bytes(
                "swiglu_q8: the q8 rows differ from the quantised output",
                &xq,
                &expect,
            )?;
            let reference: Vec<f64> = g
                .iter()
                .zip(&u)
                .map(|(&a, &b)| silu64(f64::from(a)) * f64::from(b))
                .collect();
            Ok((rel_err(&out, &reference), TOL_F32))
        })();
        self.record(
            "swiglu_q8",
            format!("n={n} of {len}, q8 rows of its output"),
            r,
        );
    }

    /// The fused route kernel's top-k on a model-sized router (512 experts, top 10), where
    /// its block-wide selection (`TOPK_PAR`) sees many warps and its candidates: random logits,
    /// each logit four times (ties at the threshold, broken by the lower id) and each 128 times
    /// (more candidates than it holds: warp 0's rounds instead). Every output the separate
    /// kernels' (`matvec3_x_f32`, `moe_gate_up_route2_q8q_iq2_xxs`) bit for bit.
    fn route_topk_many(&mut self) {
        let ty = GgmlType::IQ2XXS;
        let (hidden, ff, ne, k) = (256usize, 64usize, 512usize, 10usize);
        let [gate, up, down] = self.random_experts(ty, (hidden, ff), ne);
        let x = self.rng.normals(hidden, 1.0);
        // The q8 kernels' bytes (IQ2_NIB: the nibble copy).
        let [gq, uq, dq] = [&gate, &up, &down].map(|p| q8_kernel_bytes(p));
        let xq = ops::q8_row(&x);
        let gate_vec = self.rng.normals(hidden, 0.05);
        let base = self.rng.normals(ne * hidden, 0.05);
        for copies in [1usize, 4, 128] {
            let distinct = ne / copies;
            let router: Vec<f32> = (0..ne)
                .flat_map(|e| base[(e % distinct) * hidden..(e % distinct + 1) * hidden].to_vec())
                .collect();
            let route = |gpu, form| {
                ops::moe_route_gate_up_slots(
                    gpu,
                    [&gq[..], &uq[..], &dq[..]],
                    &router,
                    &gate_vec,
                    (&x, &xq),
                    k,
                    (hidden, ff),
                    form,
                )
            };
            let r = (|| {
                let separate = route(self.gpu, ops::RouteForm::Separate)?;
                same_fused_route(&route(self.gpu, ops::RouteForm::Fused)?, &separate)?;
                Ok((0.0, 0.0))
            })();
            self.record(
                "moe_route_gate_up_q8q_iq2_xxs",
                format!(
                    "top-{k} of {ne}, each logit {copies}x, {hidden}/{ff}: = router + route2 bit for bit"
                ),
                r,
            );
        }
    }

    /// `n` random experts of type `ty`: gate and up `[ff][hidden]`, down `[hidden][ff]`.
    fn random_experts(
        &mut self,
        ty: GgmlType,
        (hidden, ff): (usize, usize),
        n: usize,
    ) -> [Vec<Vec<u8>>; 3] {
        let mut make = |rows, cols| -> Vec<Vec<u8>> {
            (0..n)
                .map(|_| random_weights(&mut self.rng, ty, rows, cols))
                .collect()
        };
        [make(ff, hidden), make(ff, hidden), make(hidden, ff)]
    }

    /// The routed experts with IQ2_XXS gate/up on a q8 row (`moe_gate_up_tab_q8_iq2_xxs`, then the
    /// f32 down kernel) against f64 on the same 8-bit activations; 2048 and 512 wide.
    fn experts_q8(&mut self) {
        let ty = GgmlType::IQ2XXS;
        for (hidden, ff) in [(2048usize, 512usize), (512, 256)] {
            let (n_exp, chosen, weights) = (6usize, [0usize, 3, 5], [0.5f32, 0.3, 0.2]);
            let [gate, up, down] = self.random_experts(ty, (hidden, ff), n_exp);
            let x = self.rng.normals(hidden, 1.0);
            // The q8 gate/up kernel's bytes (IQ2_NIB: the nibble copy; the f32 down kernel reads
            // IQ2_XXS); the references read the IQ2_XXS ones.
            let [gq, uq] = [&gate, &up].map(|p| q8_kernel_bytes(p));
            let r = (|| {
                let parts = upload_experts(self.gpu, [&gq, &uq, &down], &chosen)?;
                let set = expert_set(ty, &parts);
                let y =
                    ops::moe_experts_q8(self.gpu, &set, &weights, &ops::q8_row(&x), (hidden, ff))?;
                let deq = |b: &[u8]| {
                    dequantize_to_vec(ty, b).map_err(|e| CudaError::Invalid(e.to_string()))
                };
                let xq = quantize_q8_blocks(&x);
                let mut reference = vec![0.0f64; hidden];
                for (i, &e) in chosen.iter().enumerate() {
                    let (g, u, d) = (deq(&gate[e])?, deq(&up[e])?, deq(&down[e])?);
                    let act: Vec<f32> = (0..ff)
                        .map(|r| {
                            let gv = dot64(&g[r * hidden..(r + 1) * hidden], &xq);
                            let uv = dot64(&u[r * hidden..(r + 1) * hidden], &xq);
                            (silu64(gv) * uv) as f32
                        })
                        .collect();
                    for (r, o) in reference.iter_mut().enumerate() {
                        *o += f64::from(weights[i]) * dot64(&d[r * ff..(r + 1) * ff], &act);
                    }
                }
                Ok((rel_err(&y, &reference), TOL_F32))
            })();
            self.record(
                "experts q8 IQ2_XXS",
                format!("k=3 of {n_exp}, {hidden}/{ff}, gate/up on a q8 row"),
                r,
            );
        }
    }

    /// `matvec_norm3` (norm folded in) and `matvec_res` (residual and the next norm folded in)
    /// against f64, with rows cut into 1, 2 and 8 slices and 1 to 4 rows per warp (67 and 256 rows:
    /// blocks that end past the matrix, a warp left with one of its two rows); 3 tokens. With 2 slices `matvec_norm3` also runs without
    /// norm weights (the plain product the MoE router and shared expert use).
    fn matvec_fused(&mut self, ty: GgmlType) {
        let (rows, cols, n, eps) = (67usize, 2048usize, 3usize, 1e-6f32);
        for (parts, plain, rpw) in [
            (1usize, false, 1usize),
            (1, false, 2),
            (1, false, 3),
            (2, false, 1),
            (2, true, 1),
            (2, false, 4),
            (8, false, 1),
        ] {
            let (bytes, xs, nw) = self.norm3_inputs(ty, (rows, cols), n, plain);
            let r = (|| {
                let w = ops::upload(self.gpu, &bytes)?;
                let norm3 = |rpw: usize, tile: usize| {
                    ops::matvec_fused(
                        self.gpu,
                        ty,
                        &w,
                        (rows, cols),
                        &xs,
                        &nw,
                        None,
                        (eps, parts, rpw, tile),
                    )
                    .map(|(y, _)| y)
                };
                let y = norm3(rpw, 1)?;
                // The token-tile kernel (weights read once per tile): every output bit for bit
                // the one-token-per-block kernel's (a tile of 2 leaves a partial last tile).
                if rpw == 1 {
                    for tile in [2usize, 4] {
                        let yt = norm3(1, tile)?;
                        if yt.iter().zip(&y).any(|(a, b)| a.to_bits() != b.to_bits()) {
                            return Err(CudaError::Invalid(format!(
                                "matvec_norm3_tok with a tile of {tile} tokens differs from matvec_norm3"
                            )));
                        }
                    }
                }
                let wf =
                    dequantize_to_vec(ty, &bytes).map_err(|e| CudaError::Invalid(e.to_string()))?;
                let mut reference = Vec::with_capacity(n * rows);
                for t in 0..n {
                    let x = &xs[t * cols..(t + 1) * cols];
                    let inv = if plain { 1.0 } else { inv_rms64(x, eps) };
                    for r in 0..rows {
                        let row = &wf[r * cols..(r + 1) * cols];
                        reference.push(
                            (0..cols)
                                .map(|i| {
                                    let g = nw.get(i).map_or(1.0, |&v| f64::from(v));
                                    f64::from(row[i]) * f64::from(x[i]) * inv * g
                                })
                                .sum::<f64>(),
                        );
                    }
                }
                Ok((rel_err(&y, &reference), TOL_F32))
            })();
            self.record(
                &format!("matvec_norm3 {}", ty.name()),
                format!(
                    "{rows}x{cols} n={n} parts={parts} rows/warp={rpw}{}{}",
                    if plain { " no norm" } else { "" },
                    if rpw == 1 {
                        ", token tiles 2 and 4 bit-identical"
                    } else {
                        ""
                    }
                ),
                r,
            );
            if plain {
                continue;
            }
            // The output projection: rows = the residual's width.
            let (rows2, cols2) = (256usize, 1024usize);
            let bytes = random_weights(&mut self.rng, ty, rows2, cols2);
            let xs = self.rng.normals(n * cols2, 1.0);
            let res = self.rng.normals(n * rows2, 1.0);
            let nw: Vec<f32> = (0..rows2)
                .map(|_| 0.5 + self.rng.uniform() as f32)
                .collect();
            let r = (|| {
                let w = ops::upload(self.gpu, &bytes)?;
                let (y, yn) = ops::matvec_fused(
                    self.gpu,
                    ty,
                    &w,
                    (rows2, cols2),
                    &xs,
                    &nw,
                    Some(&res),
                    (eps, parts, rpw, 1),
                )?;
                if rpw == 1 {
                    // Token tiles (`matvec_res_tok`, no norm; with Q4_K also two rows a warp
                    // group, `matvec_res_tok2_q4_k`): the residual sums bit for bit.
                    let forms: &[(usize, &str)] = if ty == GgmlType::Q4K {
                        &[(1, "matvec_res_tok"), (2, "matvec_res_tok2_q4_k")]
                    } else {
                        &[(1, "matvec_res_tok")]
                    };
                    for tile in [2, 3] {
                        for &(tok_rows, name) in forms {
                            let (yt, _) = ops::matvec_fused(
                                self.gpu,
                                ty,
                                &w,
                                (rows2, cols2),
                                &xs,
                                &nw,
                                Some(&res),
                                (eps, parts, tok_rows, tile),
                            )?;
                            same_bits(&format!("{name} differs from matvec_res"), &yt, &y)?;
                        }
                    }
                }
                let wf =
                    dequantize_to_vec(ty, &bytes).map_err(|e| CudaError::Invalid(e.to_string()))?;
                let (mut ry, mut ryn) = (Vec::new(), Vec::new());
                for t in 0..n {
                    let x = &xs[t * cols2..(t + 1) * cols2];
                    let res_t = &res[t * rows2..(t + 1) * rows2];
                    let (yt, ynt) = residual_and_norm64(res_t, &wf, x, &nw, eps);
                    ry.extend(yt);
                    ryn.extend(ynt);
                }
                Ok((rel_err(&y, &ry).max(rel_err(&yn, &ryn)), TOL_F32))
            })();
            self.record(
                &format!("matvec_res {}", ty.name()),
                format!(
                    "{rows2}x{cols2} n={n} parts={parts} rows/warp={rpw}{}",
                    if rpw == 1 {
                        ", token tiles 2 and 3 bit-identical"
                    } else {
                        ""
                    }
                ),
                r,
            );
        }
    }

    /// `matvec_res_xr_q4_k` (the verify's output projections, activations in registers) against
    /// the one-token `matvec_res_q4_k`, bit for bit: a partial last row block (67 rows), a partial
    /// second token block (11 tokens), a lone last token (9), every slice count.
    fn matvec_res_xr(&mut self) {
        let ty = GgmlType::Q4K;
        for (rows, cols, n, parts) in [
            (67usize, 2048usize, 11usize, 1usize),
            (67, 2048, 11, 2),
            (67, 2048, 9, 4),
            (64, 4096, 8, 2),
            (64, 4096, 3, 8),
            (16, 512, 2, 1),
        ] {
            let bytes = random_weights(&mut self.rng, ty, rows, cols);
            let xs = self.rng.normals(n * cols, 1.0);
            let res = self.rng.normals(n * rows, 1.0);
            let nw = vec![1.0f32; rows];
            let r = (|| {
                let w = ops::upload(self.gpu, &bytes)?;
                let (one, _) = ops::matvec_fused(
                    self.gpu,
                    ty,
                    &w,
                    (rows, cols),
                    &xs,
                    &nw,
                    Some(&res),
                    (1e-6, parts, 1, 1),
                )?;
                let xr = ops::matvec_res_xr_q4k(self.gpu, &w, (rows, cols), &xs, &res, parts)?;
                same_bits("matvec_res_xr_q4_k differs from matvec_res_q4_k", &xr, &one)?;
                Ok((0.0, TOL_F32))
            })();
            self.record(
                "matvec_res_xr Q4_K",
                format!("{rows}x{cols} n={n} parts={parts}, bit-identical to matvec_res"),
                r,
            );
        }
    }

    fn embed(&mut self, ty: GgmlType) {
        let cols = if ty.block_elems() == 1 { 200 } else { 2304 };
        let rows = 50;
        let bytes = random_weights(&mut self.rng, ty, rows, cols);
        let ids: Vec<i32> = vec![0, 49, self.rng.below(rows) as i32, 7, 7];
        let r = (|| {
            let t = ops::upload(self.gpu, &bytes)?;
            let y = ops::embed(self.gpu, ty, &t, cols, &ids)?;
            let wf =
                dequantize_to_vec(ty, &bytes).map_err(|e| CudaError::Invalid(e.to_string()))?;
            let reference: Vec<f64> = ids
                .iter()
                .flat_map(|&i| {
                    wf[i as usize * cols..(i as usize + 1) * cols]
                        .iter()
                        .map(|&v| f64::from(v))
                })
                .collect();
            Ok((rel_err(&y, &reference), 1e-6))
        })();
        self.record(
            &format!("embed {}", ty.name()),
            format!("{} ids of {rows}x{cols}", ids.len()),
            r,
        );
    }

    fn experts(&mut self, ty: GgmlType) {
        let (n_exp, k, hidden, ff) = (8usize, 3usize, 512usize, 512usize);
        let gate: Vec<Vec<u8>> = (0..n_exp)
            .map(|_| random_weights(&mut self.rng, ty, ff, hidden))
            .collect();
        let up: Vec<Vec<u8>> = (0..n_exp)
            .map(|_| random_weights(&mut self.rng, ty, ff, hidden))
            .collect();
        let down: Vec<Vec<u8>> = (0..n_exp)
            .map(|_| random_weights(&mut self.rng, ty, hidden, ff))
            .collect();
        let chosen = [1usize, 4, 6];
        let weights = [0.5f32, 0.3, 0.2];
        let x = self.rng.normals(hidden, 1.0);
        let r = (|| {
            let parts = upload_experts(self.gpu, [&gate, &up, &down], &chosen)?;
            let set = expert_set(ty, &parts);
            // The pointer-array kernels and the table kernels the model runs, same reference.
            let y = ops::moe_experts(self.gpu, &set, &weights, &x, ff)?;
            let yt = ops::moe_experts_tab(self.gpu, &set, &weights, &x, ff)?;
            let deq =
                |b: &[u8]| dequantize_to_vec(ty, b).map_err(|e| CudaError::Invalid(e.to_string()));
            let mut reference = vec![0.0f64; hidden];
            for (i, &e) in chosen.iter().enumerate() {
                let (g, u, d) = (deq(&gate[e])?, deq(&up[e])?, deq(&down[e])?);
                let act: Vec<f32> = (0..ff)
                    .map(|r| {
                        let gv = dot64(&g[r * hidden..(r + 1) * hidden], &x);
                        let uv = dot64(&u[r * hidden..(r + 1) * hidden], &x);
                        (silu64(gv) * uv) as f32
                    })
                    .collect();
                for (r, o) in reference.iter_mut().enumerate() {
                    *o += f64::from(weights[i]) * dot64(&d[r * ff..(r + 1) * ff], &act);
                }
            }
            Ok((
                rel_err(&y, &reference).max(rel_err(&yt, &reference)),
                TOL_F32,
            ))
        })();
        self.record(
            &format!("experts {}", ty.name()),
            format!("k={k} of {n_exp}, {hidden}/{ff}, pointers + table"),
            r,
        );
    }

    /// Both router kernels (the block-wide one and the one-warp one the model runs, launched
    /// with 512 threads: its block-wide top-k, moe.cu's `TOPK_PAR`) on the model's shape and on
    /// an expert count that leaves lane slots empty; then logits on a 0.25 grid, so that many
    /// tie (the lower id first, as the reference).
    fn router(&mut self) {
        for (n_expert, k, ties) in [(512usize, 10usize, false), (60, 8, false), (512, 10, true)] {
            self.router_case(ops::RouterKernel::block(n_expert), n_expert, k, ties);
            if let Some(kernel) = ops::RouterKernel::warp(n_expert) {
                self.router_case(kernel, n_expert, k, ties);
            }
        }
    }

    fn router_case(&mut self, kernel: ops::RouterKernel, n_expert: usize, k: usize, ties: bool) {
        let tokens = 3usize;
        let mut logits = self.rng.normals(tokens * n_expert, 2.0);
        if ties {
            logits
                .iter_mut()
                .for_each(|v| *v = (*v * 4.0).round() / 4.0);
        }
        let r = (|| {
            let (idx, w) = ops::moe_router(self.gpu, kernel, &logits, n_expert, k)?;
            let mut ref_w = Vec::new();
            let mut mismatches = 0usize;
            for t in 0..tokens {
                let l = &logits[t * n_expert..(t + 1) * n_expert];
                let m = l
                    .iter()
                    .fold(f64::NEG_INFINITY, |a, &b| a.max(f64::from(b)));
                let p: Vec<f64> = l.iter().map(|&v| (f64::from(v) - m).exp()).collect();
                let s: f64 = p.iter().sum();
                let mut order: Vec<usize> = (0..n_expert).collect();
                order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
                let mut top: Vec<usize> = order[..k].to_vec();
                let total: f64 = top.iter().map(|&e| p[e] / s).sum();
                top.sort_unstable();
                for (j, &e) in top.iter().enumerate() {
                    if idx[t * k + j] != e as i32 {
                        mismatches += 1;
                    }
                    ref_w.push(p[e] / s / total);
                }
            }
            if mismatches > 0 {
                return Ok((mismatches as f64, 0.0));
            }
            Ok((rel_err(&w, &ref_w), TOL_F32))
        })();
        let ties = if ties { ", tied logits" } else { "" };
        self.record(
            kernel.name,
            format!("{tokens} tokens, top-{k} of {n_expert}{ties}"),
            r,
        );
    }

    fn norms(&mut self) {
        // RMSNorm.
        let (rows, n, eps) = (4usize, 2048usize, 1e-6f32);
        let x = self.rng.normals(rows * n, 1.0);
        let w = self.rng.normals(n, 1.0);
        let r = ops::rms_norm(self.gpu, &x, &w, n, eps).map(|y| {
            let reference: Vec<f64> = x
                .chunks_exact(n)
                .flat_map(|row| {
                    let ms = row.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / n as f64;
                    let inv = 1.0 / (ms + f64::from(eps)).sqrt();
                    row.iter()
                        .zip(&w)
                        .map(move |(&v, &g)| f64::from(v) * inv * f64::from(g))
                        .collect::<Vec<_>>()
                })
                .collect();
            (rel_err(&y, &reference), TOL_F32)
        });
        self.record("rms_norm", format!("{rows}x{n}"), r);

        // Gated RMSNorm (DeltaNet output).
        let (rows, n) = (32usize, 128usize);
        let o = self.rng.normals(rows * n, 0.1);
        let z = self.rng.normals(rows * n, 1.0);
        let w = self.rng.normals(n, 1.0);
        let r = ops::rms_norm_gated(self.gpu, &o, &w, &z, n, eps).map(|y| {
            let mut reference = Vec::new();
            for (orow, zrow) in o.chunks_exact(n).zip(z.chunks_exact(n)) {
                let ms = orow.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / n as f64;
                let inv = 1.0 / (ms + f64::from(eps)).sqrt();
                for i in 0..n {
                    reference.push(
                        f64::from(orow[i]) * inv * f64::from(w[i]) * silu64(f64::from(zrow[i])),
                    );
                }
            }
            (rel_err(&y, &reference), TOL_F32)
        });
        self.record("rms_norm_gated", format!("{rows}x{n}"), r);

        // L2 normalisation with a scale (DeltaNet q).
        let (rows, n) = (16usize, 128usize);
        let x = self.rng.normals(rows * n, 3.0);
        let scale = 1.0 / (n as f32).sqrt();
        let r = ops::l2_normalize(self.gpu, &x, n, 1e-6, scale).map(|y| {
            let reference: Vec<f64> = x
                .chunks_exact(n)
                .flat_map(|row| {
                    let ss = row.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>();
                    let inv = 1.0 / (ss + 1e-6).sqrt();
                    row.iter()
                        .map(move |&v| f64::from(v) * inv * f64::from(scale))
                        .collect::<Vec<_>>()
                })
                .collect();
            (rel_err(&y, &reference), TOL_F32)
        });
        self.record("l2_normalize", format!("{rows}x{n}"), r);

        // Element-wise kernels.
        let n = 10_007usize;
        let a = self.rng.normals(n, 1.0);
        let b = self.rng.normals(n, 2.0);
        let pairs = |f: &dyn Fn(f64, f64) -> f64| -> Vec<f64> {
            a.iter()
                .zip(&b)
                .map(|(&x, &y)| f(f64::from(x), f64::from(y)))
                .collect()
        };
        let r = ops::add(self.gpu, &a, &b).map(|y| (rel_err(&y, &pairs(&|x, y| x + y)), TOL_F32));
        self.record("add_inplace", format!("n={n}"), r);
        let r = ops::sigmoid_mul(self.gpu, &a, &b)
            .map(|y| (rel_err(&y, &pairs(&|x, g| x / (1.0 + (-g).exp()))), TOL_F32));
        self.record("sigmoid_mul", format!("n={n}"), r);
        let r = ops::swiglu(self.gpu, &a, &b)
            .map(|y| (rel_err(&y, &pairs(&|g, u| silu64(g) * u)), TOL_F32));
        self.record("swiglu", format!("n={n}"), r);
    }

    fn rope(&mut self) {
        let (heads, hd, rd, theta) = (16usize, 256usize, 64usize, 10_000_000.0f64);
        for (tokens, pos0) in [(1usize, 0usize), (3, 100), (2, 70_000)] {
            let x = self.rng.normals(tokens * heads * hd, 1.0);
            let r = ops::rope_neox(self.gpu, &x, heads, hd, rd, pos0, theta).map(|y| {
                let mut reference: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
                let half = rd / 2;
                for (i, head) in reference.chunks_exact_mut(hd).enumerate() {
                    let pos = (pos0 + i / heads) as f64;
                    for j in 0..half {
                        let angle = pos * theta.powf(-2.0 * j as f64 / rd as f64);
                        // The kernel rounds sin and cos to f32, as the oracle does.
                        let (s, c) = (f64::from(angle.sin() as f32), f64::from(angle.cos() as f32));
                        let (a, b) = (head[j], head[j + half]);
                        head[j] = a * c - b * s;
                        head[j + half] = b * c + a * s;
                    }
                }
                (rel_err(&y, &reference), TOL_F32)
            });
            self.record(
                "rope_neox",
                format!("{tokens}x{heads}x{hd}, rot {rd}, pos {pos0}"),
                r,
            );
        }
    }

    fn deltanet(&mut self) {
        let d = DeltaDims {
            nk: 16,
            nv: 32,
            dk: 128,
            dv: 128,
        };
        let kern = 4usize;
        let ch = 2 * d.nk * d.dk + d.nv * d.dv;

        // Conv step.
        let x = self.rng.normals(ch, 1.0);
        let state = self.rng.normals((kern - 1) * ch, 1.0);
        let w = self.rng.normals(kern * ch, 0.5);
        let r = ops::dn_conv_step(self.gpu, &x, &state, &w, kern).map(|(y, st)| {
            let mut reference = Vec::with_capacity(ch);
            for c in 0..ch {
                let mut acc = 0.0f64;
                for j in 0..kern - 1 {
                    acc += f64::from(w[c * kern + j]) * f64::from(state[j * ch + c]);
                }
                acc += f64::from(w[c * kern + kern - 1]) * f64::from(x[c]);
                reference.push(silu64(acc));
            }
            let mut ref_state: Vec<f64> = state[ch..].iter().map(|&v| f64::from(v)).collect();
            ref_state.extend(x.iter().map(|&v| f64::from(v)));
            (
                rel_err(&y, &reference).max(rel_err(&st, &ref_state)),
                TOL_F32,
            )
        });
        self.record("dn_conv_step", format!("{ch} ch, kernel {kern}"), r);

        // Gates.
        let r_ = d.nv / d.nk;
        let ba = self.rng.normals(2 * d.nv, 2.0);
        let a: Vec<f32> = (0..d.nv)
            .map(|_| -(self.rng.uniform() * 8.0 + 0.1) as f32)
            .collect();
        let dt = self.rng.normals(d.nv, 1.0);
        let r = ops::dn_gates(self.gpu, &ba, &a, &dt, r_).map(|(beta, g)| {
            let mut rb = Vec::new();
            let mut rg = Vec::new();
            for h in 0..d.nv {
                let (grp, j) = (h / r_, h % r_);
                rb.push(1.0 / (1.0 + (-f64::from(ba[grp * 2 * r_ + j])).exp()));
                let z = f64::from(ba[grp * 2 * r_ + r_ + j]) + f64::from(dt[h]);
                let sp = if z > 20.0 { z } else { z.exp().ln_1p() };
                rg.push(f64::from(a[h]) * sp);
            }
            (rel_err(&beta, &rb).max(rel_err(&g, &rg)), TOL_F32)
        });
        self.record("dn_gates", format!("{} V heads", d.nv), r);

        // Delta rule step, on L2-normalised q and k like the model's.
        let mut qkv = self.rng.normals(ch, 1.0);
        for head in qkv[..2 * d.nk * d.dk].chunks_exact_mut(d.dk) {
            let n = head.iter().map(|v| v * v).sum::<f32>().sqrt();
            head.iter_mut().for_each(|v| *v /= n);
        }
        let beta: Vec<f32> = (0..d.nv).map(|_| self.rng.uniform() as f32).collect();
        let g: Vec<f32> = (0..d.nv)
            .map(|_| -(self.rng.uniform() * 2.0) as f32)
            .collect();
        let s0 = self.rng.normals(d.nv * d.dk * d.dv, 0.1);
        let r = ops::dn_delta_step(self.gpu, &qkv, &beta, &g, &s0, d).map(|(o, s1)| {
            let mut ro = vec![0.0f64; d.nv * d.dv];
            let mut rs: Vec<f64> = s0.iter().map(|&v| f64::from(v)).collect();
            for h in 0..d.nv {
                let kh = h / (d.nv / d.nk);
                let q = &qkv[kh * d.dk..(kh + 1) * d.dk];
                let k = &qkv[d.nk * d.dk + kh * d.dk..d.nk * d.dk + (kh + 1) * d.dk];
                let v = &qkv[2 * d.nk * d.dk + h * d.dv..2 * d.nk * d.dk + (h + 1) * d.dv];
                let s = &mut rs[h * d.dk * d.dv..(h + 1) * d.dk * d.dv];
                let alpha = f64::from(g[h]).exp();
                s.iter_mut().for_each(|x| *x *= alpha);
                for j in 0..d.dv {
                    let m: f64 = (0..d.dk).map(|i| s[i * d.dv + j] * f64::from(k[i])).sum();
                    let delta = f64::from(beta[h]) * (f64::from(v[j]) - m);
                    for i in 0..d.dk {
                        s[i * d.dv + j] += f64::from(k[i]) * delta;
                    }
                    ro[h * d.dv + j] = (0..d.dk).map(|i| s[i * d.dv + j] * f64::from(q[i])).sum();
                }
            }
            (rel_err(&o, &ro).max(rel_err(&s1, &rs)), TOL_F32)
        });
        self.record(
            "dn_delta_step",
            format!("{}/{} heads, {}x{}", d.nk, d.nv, d.dk, d.dv),
            r,
        );
    }

    fn attention(&mut self) {
        let (heads, nkv, hd) = (16usize, 2usize, 256usize);
        let scale = 1.0 / (hd as f32).sqrt();
        for n in [1usize, 37, 1000] {
            let q = self.rng.normals(heads * hd, 1.0);
            let kc = self.rng.normals(n * nkv * hd, 1.0);
            let vc = self.rng.normals(n * nkv * hd, 1.0);
            let r = ops::attn_decode(self.gpu, &q, &kc, &vc, heads, nkv, hd, scale).map(|o| {
                let reference: Vec<f64> = (0..heads)
                    .flat_map(|h| {
                        let qh = &q[h * hd..(h + 1) * hd];
                        attention_row64(qh, &kc, &vc, (n, nkv, h / (heads / nkv)), scale)
                    })
                    .collect();
                (rel_err(&o, &reference), TOL_F32)
            });
            self.record(
                "attn_decode",
                format!("{heads}/{nkv} heads x{hd}, {n} positions"),
                r,
            );
        }
    }

    fn argmax(&mut self) {
        let (rows, n) = (3usize, 151_936usize);
        let mut x = self.rng.normals(rows * n, 3.0);
        // Row 1: a tie between two maxima in different slices; the lower index must win.
        let (a, b) = (1000 + self.rng.below(1000), 100_000 + self.rng.below(1000));
        x[n + a] = 100.0;
        x[n + b] = 100.0;
        // Row 2: a tie inside one slice, and a NaN (never the winner).
        let c = 50_000 + self.rng.below(100);
        x[2 * n + c] = 100.0;
        x[2 * n + c + 3] = 100.0;
        x[2 * n + 7] = f32::NAN;
        for slices in [1usize, 128] {
            let r = ops::argmax(self.gpu, &x, n, slices).map(|got| {
                let mut mismatches = 0;
                for (r, &g) in got.iter().enumerate() {
                    let row = &x[r * n..(r + 1) * n];
                    let mut best = 0;
                    for (i, &v) in row.iter().enumerate() {
                        if v > row[best] || row[best].is_nan() {
                            best = i;
                        }
                    }
                    if g != best as i32 {
                        mismatches += 1;
                    }
                }
                (f64::from(mismatches), 0.0)
            });
            self.record(
                "argmax",
                format!("{rows}x{n}, {slices} slices, with ties and a NaN"),
                r,
            );
        }
    }
}

/// `x · rsqrt(Σx² + eps) · scale` in f64.
fn l2_norm64(x: &[f32], eps: f64, scale: f64) -> Vec<f64> {
    let ss: f64 = x.iter().map(|&v| f64::from(v).powi(2)).sum();
    let inv = 1.0 / (ss + eps).sqrt();
    x.iter().map(|&v| f64::from(v) * inv * scale).collect()
}

/// RMSNorm with weight, then NeoX RoPE at `pos` (sine and cosine rounded to f32 like the kernel).
fn qk_norm_rope64(x: &[f32], w: &[f32], eps: f64, pos: usize, rd: usize, theta: f64) -> Vec<f64> {
    let n = x.len();
    let ms = x.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / n as f64;
    let inv = 1.0 / (ms + eps).sqrt();
    let mut h: Vec<f64> = x
        .iter()
        .zip(w)
        .map(|(&v, &g)| f64::from(v) * inv * f64::from(g))
        .collect();
    let half = rd / 2;
    for j in 0..half {
        let angle = pos as f64 * theta.powf(-2.0 * j as f64 / rd as f64);
        let (s, c) = (f64::from(angle.sin() as f32), f64::from(angle.cos() as f32));
        let (a, b) = (h[j], h[j + half]);
        h[j] = a * c - b * s;
        h[j + half] = b * c + a * s;
    }
    h
}

/// The engine sampler's draw (temperature, top-k, top-p, min-p) in f64, on one row.
fn sample_ref(l: &[f32], k: usize, temp: f64, top_p: f64, min_p: f64, u: f64) -> usize {
    let mut order: Vec<usize> = (0..l.len()).collect();
    order.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
    order.truncate(k);
    let top = f64::from(l[order[0]]);
    let p: Vec<f64> = order
        .iter()
        .map(|&i| ((f64::from(l[i]) - top) / temp).exp())
        .collect();
    let total: f64 = p.iter().sum();
    let mut keep = p.len();
    if top_p < 1.0 {
        let mut cum = 0.0;
        for (r, v) in p.iter().enumerate() {
            cum += v / total;
            if cum >= top_p {
                keep = r + 1;
                break;
            }
        }
    }
    if min_p > 0.0 {
        let mut r = 1;
        while r < keep && p[r] >= min_p * p[0] {
            r += 1;
        }
        keep = r;
    }
    let mass: f64 = p[..keep].iter().sum();
    let target = u * mass;
    let mut cum = 0.0;
    for r in 0..keep {
        cum += p[r];
        if target < cum {
            return order[r];
        }
    }
    order[keep - 1]
}

impl Runner<'_> {
    /// Routed experts with the choice as device data, several tokens at once.
    fn experts_ids(&mut self, ty: GgmlType) {
        let (n_exp, k, hidden, ff, n) = (8usize, 3usize, 256usize, 256usize, 3usize);
        let gate = random_weights(&mut self.rng, ty, n_exp * ff, hidden);
        let up = random_weights(&mut self.rng, ty, n_exp * ff, hidden);
        let down = random_weights(&mut self.rng, ty, n_exp * hidden, ff);
        let ids: Vec<i32> = vec![1, 4, 6, 0, 2, 7, 7, 3, 5];
        let weights: Vec<f32> = vec![0.5, 0.3, 0.2, 0.6, 0.3, 0.1, 0.4, 0.4, 0.2];
        let x = self.rng.normals(n * hidden, 1.0);
        let r = (|| {
            let t = ExpertTensors {
                ty,
                gate: &gate,
                up: &up,
                down: &down,
                n_exp,
            };
            let y = ops::moe_experts_ids(self.gpu, &t, &ids, &weights, &x, hidden, ff, k)?;
            let deq =
                |b: &[u8]| dequantize_to_vec(ty, b).map_err(|e| CudaError::Invalid(e.to_string()));
            let (g, u, d) = (deq(&gate)?, deq(&up)?, deq(&down)?);
            let mut reference = vec![0.0f64; n * hidden];
            for tk in 0..n {
                let xt = &x[tk * hidden..(tk + 1) * hidden];
                for j in 0..k {
                    let e = ids[tk * k + j] as usize;
                    let act: Vec<f32> = (0..ff)
                        .map(|r| {
                            let row = (e * ff + r) * hidden;
                            let gv = dot64(&g[row..row + hidden], xt);
                            let uv = dot64(&u[row..row + hidden], xt);
                            (silu64(gv) * uv) as f32
                        })
                        .collect();
                    for r in 0..hidden {
                        let row = (e * hidden + r) * ff;
                        reference[tk * hidden + r] +=
                            f64::from(weights[tk * k + j]) * dot64(&d[row..row + ff], &act);
                    }
                }
            }
            Ok((rel_err(&y, &reference), TOL_F32))
        })();
        self.record(
            &format!("experts_ids {}", ty.name()),
            format!("{n} tokens, k={k} of {n_exp}, {hidden}/{ff}"),
            r,
        );
    }

    fn moe_combine(&mut self) {
        let (n, hidden) = (3usize, 2048usize);
        let x = self.rng.normals(n * hidden, 1.0);
        let routed = self.rng.normals(n * hidden, 1.0);
        let shared = self.rng.normals(n * hidden, 1.0);
        let gl = self.rng.normals(n, 2.0);
        let r = ops::moe_combine(self.gpu, &x, &routed, &shared, &gl).map(|y| {
            let reference: Vec<f64> = (0..n * hidden)
                .map(|i| {
                    let s = 1.0 / (1.0 + (-f64::from(gl[i / hidden])).exp());
                    f64::from(x[i]) + f64::from(routed[i]) + s * f64::from(shared[i])
                })
                .collect();
            (rel_err(&y, &reference), TOL_F32)
        });
        self.record("moe_combine", format!("{n}x{hidden}"), r);
    }

    /// The DeltaNet chain of the prompt path over several tokens: conv, q/k norm, gates, and the
    /// delta rule in one launch, each against the token-by-token recurrence in f64.
    fn deltanet_seq(&mut self) {
        let d = DeltaDims {
            nk: 4,
            nv: 8,
            dk: 128,
            dv: 128,
        };
        let (kern, n) = (4usize, 7usize);
        let ch = 2 * d.nk * d.dk + d.nv * d.dv;

        // Conv over n tokens: dn_conv_seq, and the prompt form (dn_conv_prompt + dn_conv_shift)
        // over several token tiles.
        for (n, prompt) in [(n, false), (70, true)] {
            let x = self.rng.normals(n * ch, 1.0);
            let state = self.rng.normals((kern - 1) * ch, 1.0);
            let w = self.rng.normals(kern * ch, 0.5);
            let r = ops::dn_conv_seq(self.gpu, &x, &state, &w, ch, kern, prompt).map(|(y, st)| {
                let mut hist: Vec<f32> = state.clone();
                hist.extend_from_slice(&x);
                let mut reference = Vec::with_capacity(n * ch);
                for t in 0..n {
                    for c in 0..ch {
                        let acc: f64 = (0..kern)
                            .map(|j| f64::from(w[c * kern + j]) * f64::from(hist[(t + j) * ch + c]))
                            .sum();
                        reference.push(silu64(acc));
                    }
                }
                let ref_state: Vec<f64> = hist[n * ch..].iter().map(|&v| f64::from(v)).collect();
                (
                    rel_err(&y, &reference).max(rel_err(&st, &ref_state)),
                    TOL_F32,
                )
            });
            self.record(
                if prompt {
                    "dn_conv_prompt"
                } else {
                    "dn_conv_seq"
                },
                format!("{n} tokens, {ch} ch, kernel {kern}"),
                r,
            );
        }

        // q/k L2 norm in place.
        let raw = self.rng.normals(n * ch, 2.0);
        let q_scale = 1.0 / (d.dk as f32).sqrt();
        let r = ops::dn_qk_norm(self.gpu, &raw, ch, d.nk, d.dk, 1e-6, q_scale).map(|y| {
            let mut reference: Vec<f64> = raw.iter().map(|&v| f64::from(v)).collect();
            for t in 0..n {
                for row in 0..2 * d.nk {
                    let at = t * ch + row * d.dk;
                    let s = if row < d.nk { f64::from(q_scale) } else { 1.0 };
                    let v = l2_norm64(&raw[at..at + d.dk], 1e-6, s);
                    reference[at..at + d.dk].copy_from_slice(&v);
                }
            }
            (rel_err(&y, &reference), TOL_F32)
        });
        self.record(
            "dn_qk_norm",
            format!("{n} tokens, 2x{} heads x{}", d.nk, d.dk),
            r,
        );

        // Gates of n tokens.
        let r_ = d.nv / d.nk;
        let ba = self.rng.normals(n * 2 * d.nv, 2.0);
        let a: Vec<f32> = (0..d.nv)
            .map(|_| -(self.rng.uniform() * 8.0 + 0.1) as f32)
            .collect();
        let dt = self.rng.normals(d.nv, 1.0);
        let r = ops::dn_gates(self.gpu, &ba, &a, &dt, r_).map(|(beta, g)| {
            let (mut rb, mut rg) = (Vec::new(), Vec::new());
            for t in 0..n {
                let bat = &ba[t * 2 * d.nv..(t + 1) * 2 * d.nv];
                for h in 0..d.nv {
                    let (grp, j) = (h / r_, h % r_);
                    rb.push(1.0 / (1.0 + (-f64::from(bat[grp * 2 * r_ + j])).exp()));
                    let z = f64::from(bat[grp * 2 * r_ + r_ + j]) + f64::from(dt[h]);
                    let sp = if z > 20.0 { z } else { z.exp().ln_1p() };
                    rg.push(f64::from(a[h]) * sp);
                }
            }
            (rel_err(&beta, &rb).max(rel_err(&g, &rg)), TOL_F32)
        });
        self.record("dn_gates", format!("{n} tokens, {} V heads", d.nv), r);

        // The delta rule over n tokens in one launch: dn_delta_seq, and dn_delta_warp_<dk> on
        // this shape and on the tiny fixtures' (dk = dv = 64).
        self.delta_rule(d, n);
        self.delta_rule(
            DeltaDims {
                nk: 2,
                nv: 4,
                dk: 64,
                dv: 64,
            },
            n,
        );
    }

    /// `dn_delta_seq` and `dn_delta_warp_<dk>` over `n` tokens against an f64 reference.
    fn delta_rule(&mut self, d: DeltaDims, n: usize) {
        let ch = 2 * d.nk * d.dk + d.nv * d.dv;
        let mut qkv = self.rng.normals(n * ch, 1.0);
        for t in 0..n {
            for head in qkv[t * ch..t * ch + 2 * d.nk * d.dk].chunks_exact_mut(d.dk) {
                let norm = head.iter().map(|v| v * v).sum::<f32>().sqrt();
                head.iter_mut().for_each(|v| *v /= norm);
            }
        }
        let beta: Vec<f32> = (0..n * d.nv).map(|_| self.rng.uniform() as f32).collect();
        let g: Vec<f32> = (0..n * d.nv)
            .map(|_| -(self.rng.uniform() * 2.0) as f32)
            .collect();
        let s0 = self.rng.normals(d.nv * d.dk * d.dv, 0.1);
        let reference = || {
            let mut ro = vec![0.0f64; n * d.nv * d.dv];
            let mut rs: Vec<f64> = s0.iter().map(|&v| f64::from(v)).collect();
            for t in 0..n {
                let row = &qkv[t * ch..(t + 1) * ch];
                for h in 0..d.nv {
                    let kh = h / (d.nv / d.nk);
                    let q = &row[kh * d.dk..(kh + 1) * d.dk];
                    let k = &row[d.nk * d.dk + kh * d.dk..d.nk * d.dk + (kh + 1) * d.dk];
                    let v = &row[2 * d.nk * d.dk + h * d.dv..2 * d.nk * d.dk + (h + 1) * d.dv];
                    let s = &mut rs[h * d.dk * d.dv..(h + 1) * d.dk * d.dv];
                    let alpha = f64::from(g[t * d.nv + h]).exp();
                    s.iter_mut().for_each(|x| *x *= alpha);
                    for j in 0..d.dv {
                        let m: f64 = (0..d.dk).map(|i| s[i * d.dv + j] * f64::from(k[i])).sum();
                        let delta = f64::from(beta[t * d.nv + h]) * (f64::from(v[j]) - m);
                        for i in 0..d.dk {
                            s[i * d.dv + j] += f64::from(k[i]) * delta;
                        }
                        ro[(t * d.nv + h) * d.dv + j] =
                            (0..d.dk).map(|i| s[i * d.dv + j] * f64::from(q[i])).sum();
                    }
                }
            }
            (ro, rs)
        };
        let (ro, rs) = reference();
        for warp in [false, true] {
            if warp && ops::delta_warp_launch(d.nv, d.dk, d.dv).is_none() {
                continue;
            }
            let r = ops::dn_delta_seq(self.gpu, &qkv, &beta, &g, &s0, d, warp)
                .map(|(o, s1)| (rel_err(&o, &ro).max(rel_err(&s1, &rs)), TOL_F32));
            self.record(
                if warp {
                    "dn_delta_warp"
                } else {
                    "dn_delta_seq"
                },
                format!("{n} tokens, {}/{} heads, {}x{}", d.nk, d.nv, d.dk, d.dv),
                r,
            );
        }
    }

    /// `dn_fused_seq` (conv, q/k norm, gates, delta rule, gated norm in one launch) against an
    /// f64 reference of the five steps, on 1, 5 and 19 tokens (each run starts from the one before's
    /// states, so the carried conv window and delta state are checked too; 19 crosses
    /// `dn_fused_cols`' 16-token chunk; the longer runs also write the
    /// states after every token, the trace of a speculative verify, checked against the
    /// reference's and, for the last token, bit for bit against the carried states).
    fn deltanet_fused(&mut self) {
        let d = DeltaDims {
            nk: 4,
            nv: 8,
            dk: 128,
            dv: 128,
        };
        let (kern, eps, l2_eps) = (4usize, 1e-6f32, 1e-6f32);
        let ch = 2 * d.nk * d.dk + d.nv * d.dv;
        let r_ = d.nv / d.nk;
        let q_scale = 1.0 / (d.dk as f32).sqrt();
        let conv_w = self.rng.normals(kern * ch, 0.5);
        let a: Vec<f32> = (0..d.nv)
            .map(|_| -(self.rng.uniform() * 8.0 + 0.1) as f32)
            .collect();
        let dt = self.rng.normals(d.nv, 1.0);
        let norm_w: Vec<f32> = (0..d.dv).map(|_| 0.5 + self.rng.uniform() as f32).collect();
        let mut conv_state = self.rng.normals((kern - 1) * ch, 1.0);
        let mut s = self.rng.normals(d.nv * d.dk * d.dv, 0.1);
        for n in [1usize, 5, 19] {
            let qkv = self.rng.normals(n * ch, 1.0);
            let ba = self.rng.normals(n * 2 * d.nv, 2.0);
            let z = self.rng.normals(n * d.nv * d.dv, 1.0);
            let trace = n > 1;
            let run = |variant: (bool, bool)| {
                ops::dn_fused_seq(
                    self.gpu,
                    variant,
                    trace,
                    &qkv,
                    &conv_state,
                    &conv_w,
                    &ba,
                    (&a, &dt),
                    &s,
                    &z,
                    &norm_w,
                    d,
                    kern,
                    (l2_eps, q_scale, eps),
                )
            };
            let got = run((false, false));
            // dn_fused_cols (a V head's columns over several blocks; several tokens:
            // dn_fused_cols_rows, unless REDLITE_CUDA_DN_ROWS=0) and both kernels with their
            // weights and conv windows loaded before the wait, on the same inputs: every output
            // and trace the same bits as dn_fused_seq's.
            let cols_name = if n > 1 && std::env::var("REDLITE_CUDA_DN_ROWS").as_deref() != Ok("0")
            {
                "dn_fused_cols_rows"
            } else {
                "dn_fused_cols"
            };
            for (variant, name, what) in [
                ((false, true), "dn_fused_seq", "preloaded, "),
                ((true, false), cols_name, ""),
                ((true, true), cols_name, "preloaded, "),
            ] {
                let r = run(variant).and_then(|c| {
                    let g = got
                        .as_ref()
                        .map_err(|e| crate::CudaError::Invalid(e.to_string()))?;
                    same_bits("outputs differ", &c.y, &g.y)?;
                    same_bits("conv state differs", &c.conv, &g.conv)?;
                    same_bits("delta state differs", &c.state, &g.state)?;
                    same_bits("conv trace differs", &c.conv_trace, &g.conv_trace)?;
                    same_bits("state trace differs", &c.state_trace, &g.state_trace)?;
                    Ok((0.0, 0.0))
                });
                self.record(
                    name,
                    format!(
                        "{n} tokens, {}/{} heads, {}x{}{}, {what}vs dn_fused_seq bit for bit",
                        d.nk,
                        d.nv,
                        d.dk,
                        d.dv,
                        if trace { ", trace" } else { "" }
                    ),
                    r,
                );
            }
            // Reference in f64.
            let mut hist: Vec<f64> = conv_state.iter().map(|&v| f64::from(v)).collect();
            hist.extend(qkv.iter().map(|&v| f64::from(v)));
            let mut rs: Vec<f64> = s.iter().map(|&v| f64::from(v)).collect();
            let mut ry = Vec::with_capacity(n * d.nv * d.dv);
            let (mut r_st, mut r_ct) = (Vec::new(), Vec::new());
            for t in 0..n {
                let mut c_out: Vec<f64> = (0..ch)
                    .map(|c| {
                        silu64(
                            (0..kern)
                                .map(|j| f64::from(conv_w[c * kern + j]) * hist[(t + j) * ch + c])
                                .sum(),
                        )
                    })
                    .collect();
                for head in 0..2 * d.nk {
                    let v = &mut c_out[head * d.dk..(head + 1) * d.dk];
                    let inv =
                        1.0 / (v.iter().map(|x| x * x).sum::<f64>() + f64::from(l2_eps)).sqrt();
                    let sc = if head < d.nk { f64::from(q_scale) } else { 1.0 };
                    v.iter_mut().for_each(|x| *x = *x * inv * sc);
                }
                let bat = &ba[t * 2 * d.nv..(t + 1) * 2 * d.nv];
                for h in 0..d.nv {
                    let (kh, j) = (h / r_, h % r_);
                    let beta = 1.0 / (1.0 + (-f64::from(bat[kh * 2 * r_ + j])).exp());
                    let zz = f64::from(bat[kh * 2 * r_ + r_ + j]) + f64::from(dt[h]);
                    let g = f64::from(a[h]) * if zz > 20.0 { zz } else { zz.exp().ln_1p() };
                    let q = &c_out[kh * d.dk..(kh + 1) * d.dk];
                    let k = &c_out[(d.nk + kh) * d.dk..(d.nk + kh + 1) * d.dk];
                    let v = &c_out[2 * d.nk * d.dk + h * d.dv..2 * d.nk * d.dk + (h + 1) * d.dv];
                    let sh = &mut rs[h * d.dk * d.dv..(h + 1) * d.dk * d.dv];
                    sh.iter_mut().for_each(|x| *x *= g.exp());
                    let mut o = vec![0.0f64; d.dv];
                    for jj in 0..d.dv {
                        let m: f64 = (0..d.dk).map(|i| sh[i * d.dv + jj] * k[i]).sum();
                        let delta = beta * (v[jj] - m);
                        for i in 0..d.dk {
                            sh[i * d.dv + jj] += k[i] * delta;
                        }
                        o[jj] = (0..d.dk).map(|i| sh[i * d.dv + jj] * q[i]).sum();
                    }
                    let inv = 1.0
                        / (o.iter().map(|x| x * x).sum::<f64>() / d.dv as f64 + f64::from(eps))
                            .sqrt();
                    for jj in 0..d.dv {
                        let zv = f64::from(z[(t * d.nv + h) * d.dv + jj]);
                        ry.push(o[jj] * inv * f64::from(norm_w[jj]) * silu64(zv));
                    }
                }
                r_st.extend_from_slice(&rs);
                r_ct.extend_from_slice(&hist[(t + 1) * ch..(t + kern) * ch]);
            }
            let r_state: Vec<f64> = hist[n * ch..].to_vec();
            let r = got.map(|out| {
                let mut e = rel_err(&out.y, &ry)
                    .max(rel_err(&out.conv, &r_state))
                    .max(rel_err(&out.state, &rs));
                if trace {
                    e = e
                        .max(rel_err(&out.state_trace, &r_st))
                        .max(rel_err(&out.conv_trace, &r_ct));
                    let (sl, cl) = (out.state.len(), out.conv.len());
                    let same = |a: &[f32], b: &[f32]| {
                        a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
                    };
                    if !same(&out.state_trace[(n - 1) * sl..], &out.state)
                        || !same(&out.conv_trace[(n - 1) * cl..], &out.conv)
                    {
                        e = f64::INFINITY; // the last trace row must be the carried state
                    }
                }
                conv_state = out.conv;
                s = out.state;
                (e, TOL_F32)
            });
            self.record(
                "dn_fused_seq",
                format!(
                    "{n} tokens, {}/{} heads, {}x{}{}",
                    d.nk,
                    d.nv,
                    d.dk,
                    d.dv,
                    if trace { ", trace" } else { "" }
                ),
                r,
            );
        }
    }

    /// QK-norm + RoPE + KV write, then causal attention, for prompt runs and single steps.
    fn attention_seq(&mut self) {
        let d = AttnDims {
            heads: 16,
            nkv: 2,
            hd: 256,
            rope_dims: 64,
            theta: 10_000_000.0,
            eps: 1e-6,
        };
        let (hd, nkv, heads) = (d.hd, d.nkv, d.heads);
        let scale = 1.0 / (hd as f32).sqrt();
        for (n, pos0, ctx) in [
            (7usize, 0usize, 16usize),
            (1, 999, 1024),
            (5, 30, 40),
            (37, 20, 64),
        ] {
            let qg = self.rng.normals(n * heads * 2 * hd, 1.0);
            let kn = self.rng.normals(n * nkv * hd, 1.0);
            let vn = self.rng.normals(n * nkv * hd, 1.0);
            let qn: Vec<f32> = (0..hd).map(|_| 0.5 + self.rng.uniform() as f32).collect();
            let kw: Vec<f32> = (0..hd).map(|_| 0.5 + self.rng.uniform() as f32).collect();
            let kc0 = self.rng.normals(ctx * nkv * hd, 1.0);
            let vc0 = self.rng.normals(ctx * nkv * hd, 1.0);
            // RoPE's angles from the table or computed, the cache in f32 or f16.
            let gpu = self.gpu;
            let qk_prep = |table, kv| {
                ops::attn_qk_prep(gpu, &qg, &kn, &vn, &qn, &kw, &kc0, &vc0, pos0, d, table, kv)
            };
            let r = qk_prep(false, KvType::F32).map(|(q, gate, kc, vc)| {
                let eps = f64::from(d.eps);
                let (mut rq, mut rg) = (Vec::new(), Vec::new());
                let mut rk: Vec<f64> = kc0.iter().map(|&v| f64::from(v)).collect();
                let mut rv: Vec<f64> = vc0.iter().map(|&v| f64::from(v)).collect();
                for t in 0..n {
                    let pos = pos0 + t;
                    for h in 0..heads {
                        let at = (t * heads + h) * 2 * hd;
                        rq.extend(qk_norm_rope64(
                            &qg[at..at + hd],
                            &qn,
                            eps,
                            pos,
                            d.rope_dims,
                            d.theta,
                        ));
                        rg.extend(qg[at + hd..at + 2 * hd].iter().map(|&v| f64::from(v)));
                    }
                    for g in 0..nkv {
                        let at = (t * nkv + g) * hd;
                        let k =
                            qk_norm_rope64(&kn[at..at + hd], &kw, eps, pos, d.rope_dims, d.theta);
                        let c = (pos * nkv + g) * hd;
                        rk[c..c + hd].copy_from_slice(&k);
                        for i in 0..hd {
                            rv[c + i] = f64::from(vn[at + i]);
                        }
                    }
                }
                let e = rel_err(&q, &rq)
                    .max(rel_err(&gate, &rg))
                    .max(rel_err(&kc, &rk))
                    .max(rel_err(&vc, &rv));
                (e, TOL_F32)
            });
            self.record(
                "attn_qk_prep",
                format!(
                    "{n} tokens at {pos0}, {heads}/{nkv} heads x{hd}, rot {}",
                    d.rope_dims
                ),
                r,
            );
            // RoPE from rope_table's rows (the model's way) against the angles computed in the
            // kernel: every output bit for bit.
            let r = (|| {
                let (a, b) = (qk_prep(true, KvType::F32)?, qk_prep(false, KvType::F32)?);
                let n_diff =
                    bits_differ(&a.0, &b.0) + bits_differ(&a.1, &b.1) + bits_differ(&a.2, &b.2);
                // Values that differ (bound 0: bit-identical).
                Ok((n_diff as f64, 0.0))
            })();
            self.record(
                "attn_qk_prep rope_table",
                format!("{n} tokens at {pos0}, table vs computed angles, bit for bit"),
                r,
            );
            // The f16 cache: q and the gate as the f32 kernel's, the caches its values rounded
            // to f16, bit for bit.
            let r = (|| {
                let (a, b) = (qk_prep(true, KvType::F32)?, qk_prep(true, KvType::F16)?);
                let n_diff = bits_differ(&a.0, &b.0)
                    + bits_differ(&a.1, &b.1)
                    + bits_differ(&round_f16(&a.2), &b.2)
                    + bits_differ(&round_f16(&a.3), &b.3);
                // Values that differ (bound 0: bit-identical).
                Ok((n_diff as f64, 0.0))
            })();
            self.record(
                "attn_qk_prep_h",
                format!("{n} tokens at {pos0}, f16 cache vs the f32 kernel's rounded, bit for bit"),
                r,
            );

            let q = self.rng.normals(n * heads * hd, 1.0);
            let kc32 = self.rng.normals(ctx * nkv * hd, 1.0);
            let vc32 = self.rng.normals(ctx * nkv * hd, 1.0);
            let (kc16, vc16) = (round_f16(&kc32), round_f16(&vc32));
            // attn_causal, attn_prompt (a GQA group of rows per block) and its tensor-core form
            // (f16 inputs: TOL_ATTN_F16) on the same data; each on an f32 and an f16 cache (the
            // reference on the cache's values rounded to f16).
            for (kind, kv) in [
                ops::AttnKind::Causal,
                ops::AttnKind::Prompt,
                ops::AttnKind::PromptMma,
            ]
            .into_iter()
            .flat_map(|k| [(k, KvType::F32), (k, KvType::F16)])
            {
                let (kc, vc) = match kv {
                    KvType::F16 => (&kc16, &vc16),
                    _ => (&kc32, &vc32),
                };
                let r =
                    ops::attn_causal(self.gpu, &q, kc, vc, pos0, heads, nkv, hd, scale, kind, kv)
                        .map(|o| {
                            let reference: Vec<f64> = (0..n * heads)
                                .flat_map(|th| {
                                    let (t, h) = (th / heads, th % heads);
                                    let qh = &q[th * hd..(th + 1) * hd];
                                    let at = (pos0 + t + 1, nkv, h / (heads / nkv));
                                    attention_row64(qh, kc, vc, at, scale)
                                })
                                .collect();
                            let tol = if kind == ops::AttnKind::PromptMma {
                                TOL_ATTN_F16
                            } else {
                                TOL_F32
                            };
                            (rel_err(&o, &reference), tol)
                        });
                let name = match kind {
                    ops::AttnKind::Causal => "attn_causal",
                    ops::AttnKind::Prompt => "attn_prompt",
                    ops::AttnKind::PromptMma => "attn_prompt_mma",
                };
                self.record(
                    &ops::kv_kernel(name, kv).unwrap_or_default(),
                    format!("{n} tokens at {pos0}, {heads}/{nkv} heads x{hd}"),
                    r,
                );
            }
        }
        self.attention_split(d);
    }

    /// Decode attention split over the cache (`attn_split` + `attn_merge`), with and without the
    /// output gate, against the f64 softmax: short (one chunk) and long (many chunks, the last
    /// one partial).
    /// Each on an f32 and an f16 cache (`_h`; the reference on the values rounded to f16).
    fn attention_split(&mut self, d: AttnDims) {
        for kv in [KvType::F32, KvType::F16] {
            self.attention_split_kernel(d, None, kv);
            if ops::attn_split_gqa_fits(d.heads, d.nkv, d.hd) {
                self.attention_split_kernel(d, Some(2), kv);
                self.attention_split_kernel(d, Some(4), kv);
                self.attention_split_named(d, "attn_split_gqa4x", kv);
                if kv == KvType::F16 {
                    // 8 rows a warp step, and the next step's rows loaded ahead: f16 only.
                    self.attention_split_named(d, "attn_split_gqa8x", kv);
                    self.attention_split_named(d, "attn_split_gqa4xp", kv);
                    if ops::attn_split_takes("attn_split_gqa8xh3", d.heads, d.nkv, d.hd) {
                        self.attention_split_named(d, "attn_split_gqa8xh3", kv);
                    }
                    // On the tensor cores (Q and P in f16: the prompt kernels' tolerance).
                    if ops::attn_split_takes("attn_split_mma", d.heads, d.nkv, d.hd) {
                        self.attention_split_named(d, "attn_split_mma", kv);
                    }
                }
            }
        }
    }

    /// [`Self::attention_split`] through `attn_split` or (`gqa` = P) `attn_split_gqa{,4}`.
    fn attention_split_kernel(&mut self, d: AttnDims, gqa: Option<usize>, kv: KvType) {
        self.attention_split_named(d, gqa.map_or("attn_split", ops::attn_split_gqa_kernel), kv);
    }

    /// [`Self::attention_split`] through the split kernel `name` on a cache of `kv`.
    fn attention_split_named(&mut self, d: AttnDims, name: &str, kv: KvType) {
        let kernel = ops::kv_kernel(name, kv).unwrap_or_default();
        let round = |x: Vec<f32>| if kv == KvType::F16 { round_f16(&x) } else { x };
        let tol = if name.contains("mma") {
            TOL_ATTN_F16
        } else {
            TOL_F32
        };
        let (hd, nkv, heads) = (d.hd, d.nkv, d.heads);
        let scale = 1.0 / (hd as f32).sqrt();
        for (pos0, ctx, splits, gated) in [
            (0usize, 8usize, 4usize, false),
            (40, 64, 4, true),
            (4001, 4096, 64, true),
        ] {
            let q = self.rng.normals(heads * hd, 1.0);
            let kc = round(self.rng.normals(ctx * nkv * hd, 1.0));
            let vc = round(self.rng.normals(ctx * nkv * hd, 1.0));
            let gate = self.rng.normals(heads * hd, 2.0);
            let g_opt = gated.then_some(gate.as_slice());
            let r = ops::attn_split_merge_with(
                self.gpu,
                name,
                kv,
                &q,
                &kc,
                &vc,
                g_opt,
                pos0,
                (heads, nkv, hd),
                scale,
                (splits, 64),
            )
            .map(|o| {
                let len = pos0 + 1;
                let mut reference = vec![0.0f64; heads * hd];
                for h in 0..heads {
                    let g = h / (heads / nkv);
                    let qh = &q[h * hd..(h + 1) * hd];
                    let sc: Vec<f64> = (0..len)
                        .map(|j| {
                            dot64(qh, &kc[(j * nkv + g) * hd..(j * nkv + g + 1) * hd])
                                * f64::from(scale)
                        })
                        .collect();
                    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let p: Vec<f64> = sc.iter().map(|s| (s - m).exp()).collect();
                    let sum: f64 = p.iter().sum();
                    for i in 0..hd {
                        let a: f64 = p
                            .iter()
                            .enumerate()
                            .map(|(j, pj)| pj / sum * f64::from(vc[(j * nkv + g) * hd + i]))
                            .sum();
                        let gv = if gated {
                            1.0 / (1.0 + (-f64::from(gate[h * hd + i])).exp())
                        } else {
                            1.0
                        };
                        reference[h * hd + i] = a * gv;
                    }
                }
                (rel_err(&o, &reference), tol)
            });
            self.record(
                &kernel,
                format!(
                    "1 token at {pos0}, {splits} splits, {heads}/{nkv} heads x{hd}{}",
                    if gated { ", gated" } else { "" }
                ),
                r,
            );
        }
        self.attention_split_rows(d, name, kv);
    }

    /// Several rows in one `attn_split` + `attn_merge` (the verify pass of speculative decoding):
    /// row t bit for bit what a one-row call at `pos0 + t` computes.
    fn attention_split_rows(&mut self, d: AttnDims, name: &str, kv: KvType) {
        let (hd, nkv, heads) = (d.hd, d.nkv, d.heads);
        let scale = 1.0 / (hd as f32).sqrt();
        let (rows, pos0, ctx, splits) = (5usize, 1021usize, 4096usize, 64usize);
        let q = self.rng.normals(rows * heads * hd, 1.0);
        let kc = self.rng.normals(ctx * nkv * hd, 1.0);
        let vc = self.rng.normals(ctx * nkv * hd, 1.0);
        let gate = self.rng.normals(rows * heads * hd, 2.0);
        let dims = (heads, nkv, hd);
        let r = (|| {
            let all = ops::attn_split_merge_with(
                self.gpu,
                name,
                kv,
                &q,
                &kc,
                &vc,
                Some(&gate),
                pos0,
                dims,
                scale,
                (splits, 64),
            )?;
            let w = heads * hd;
            let mut differ = 0usize;
            for t in 0..rows {
                let one = ops::attn_split_merge_with(
                    self.gpu,
                    name,
                    kv,
                    &q[t * w..(t + 1) * w],
                    &kc,
                    &vc,
                    Some(&gate[t * w..(t + 1) * w]),
                    pos0 + t,
                    dims,
                    scale,
                    (splits, 64),
                )?;
                differ += one
                    .iter()
                    .zip(&all[t * w..(t + 1) * w])
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
            }
            // Values that differ from the one-row calls (bound 0: bit-identical).
            Ok((differ as f64, 0.0))
        })();
        self.record(
            &format!("{} rows", ops::kv_kernel(name, kv).unwrap_or_default()),
            format!("{rows} rows at {pos0}.., {splits} splits, {heads}/{nkv} heads x{hd}, vs one row each"),
            r,
        );
    }

    fn sample_topk(&mut self) {
        let (rows, vocab) = (4usize, 151_936usize);
        let x = self.rng.normals(rows * vocab, 3.0);
        let u: Vec<f32> = (0..rows).map(|_| self.rng.uniform() as f32).collect();
        for (k, temp, top_p, min_p) in [(40usize, 0.8f32, 0.95f32, 0.05f32), (64, 1.5, 1.0, 0.0)] {
            let r = ops::sample_topk(self.gpu, &x, vocab, k, temp, top_p, min_p, &u).map(|got| {
                let mut mismatches = 0;
                for (r, &g) in got.iter().enumerate() {
                    let want = sample_ref(
                        &x[r * vocab..(r + 1) * vocab],
                        k,
                        f64::from(temp),
                        f64::from(top_p),
                        f64::from(min_p),
                        f64::from(u[r]),
                    );
                    if g != want as i32 {
                        mismatches += 1;
                    }
                }
                (f64::from(mismatches), 0.0)
            });
            self.record(
                "sample_topk",
                format!("{rows}x{vocab}, k {k}, T {temp}, top-p {top_p}, min-p {min_p}"),
                r,
            );
        }
    }
}

/// Run every check with the given seed.
pub fn run(gpu: &Gpu, seed: u64) -> Vec<Check> {
    let mut r = Runner {
        gpu,
        rng: Rng::new(seed),
        out: Vec::new(),
    };
    for &ty in ALL_TYPES {
        r.matvec(ty);
    }
    for &ty in ALL_TYPES {
        r.embed(ty);
    }
    for &ty in ALL_TYPES {
        r.gemm(ty);
    }
    for &ty in ALL_TYPES {
        r.experts(ty);
    }
    r.router();
    r.norms();
    r.rope();
    r.deltanet();
    r.attention();
    r.argmax();
    // The device-resident model's multi-token kernels.
    for &ty in ALL_TYPES {
        r.experts_ids(ty);
    }
    r.moe_combine();
    r.deltanet_seq();
    r.deltanet_fused();
    r.attention_seq();
    for ty in [
        GgmlType::F32,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::IQ2XXS,
    ] {
        r.matvec_fused(ty);
        if ty == GgmlType::Q4K {
            r.matvec_res_xr();
        }
    }
    // The Q4_K 8-bit kernels the model runs, and the Q6_K ones (`REDLITE_CUDA_Q8_Q6K`).
    for ty in [GgmlType::Q4K, GgmlType::Q6K] {
        r.matvec_norm3_q8(ty);
        r.matvec_q8x(ty);
    }
    r.matvec_res_q8();
    r.experts_q8();
    r.experts_q8_down();
    r.route_topk_many();
    r.experts_q8_tokens();
    r.swiglu_q8();
    r.matvec3_x_f32();
    r.res_norm_router();
    r.sample_topk();
    r.out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_bits_round_trip_common_values() {
        for (x, h) in [
            (1.0f32, 0x3c00u16),
            (-2.0, 0xc000),
            (0.5, 0x3800),
            (65504.0, 0x7bff),
        ] {
            assert_eq!(f16_bits(x), h, "{x}");
        }
    }

    #[test]
    fn random_weights_dequantize_to_finite_values() {
        let mut rng = Rng::new(7);
        for &ty in ALL_TYPES {
            let cols = ty.block_elems().max(64) * 2;
            let b = random_weights(&mut rng, ty, 3, cols);
            let v = dequantize_to_vec(ty, &b).expect("dequantize");
            assert_eq!(v.len(), 3 * cols);
            assert!(v.iter().all(|x| x.is_finite()), "{}", ty.name());
            assert!(v.iter().any(|&x| x != 0.0), "{}", ty.name());
        }
    }

    #[test]
    fn rel_err_flags_nan() {
        assert_eq!(rel_err(&[f32::NAN], &[1.0]), f64::INFINITY);
        assert!(rel_err(&[1.0, 2.0], &[1.0, 2.0]) == 0.0);
        assert_eq!(abs_err(&[1.0, f32::INFINITY], &[1.0, 2.0]), f64::INFINITY);
        assert_eq!(abs_err(&[3.0, 0.0], &[0.0, 4.0]), 5.0);
    }
}
