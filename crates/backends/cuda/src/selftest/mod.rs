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
//!
//! The checks of each kernel family in its own file, as `ops/`: [`matvec`], [`moe`], [`norm`],
//! [`deltanet`], [`attention`], [`sampling`]; here the runner, the references' helpers and [`run`].

use cudarc::driver::CudaSlice;
use redlite_gguf::quant::dequantize_to_vec;
use redlite_gguf::GgmlType;
use redlite_model::kv_type::{f16_to_f32, f32_to_f16};
use redlite_model::KvType;

use crate::kernels::ALL_TYPES;
use crate::ops::{self, AttnDims, DeltaDims, ExpertSet, ExpertTensors};
use crate::{CudaError, Gpu};

mod attention;
mod deltanet;
mod matvec;
mod moe;
mod norm;
mod sampling;

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
