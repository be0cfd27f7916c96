//! Tests of the i-quant row kernels (`redlite_cpu::kernels::iquants*`):
//! (a) every kernel against an f64 dot product of the reference-dequantized weights
//!     (`redlite_gguf::quant::dequantize`) with the dequantized Q8 activations, on random blocks;
//! (b) every SIMD level the CPU supports against the scalar kernel: bit for bit, since all of them
//!     reduce a block to an exact integer sum and then run the same f32 operations;
//! (c) the kernels over the real and synthetic blocks of `shared/reference/quant/<T>.blocks`,
//!     checked against ggml's own dequantization of those blocks (`<T>.f32`).
//!
//! The integer part of every kernel is exact, so the only error is f32 rounding of block sums and
//! of the accumulation: the bound is 1e-5 relative to the exact result.
//!
//! `cargo test -p redlite-cpu --release --test kernels_iquants -- --ignored --nocapture` runs the
//! bandwidth measurement.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use redlite_cpu::kernels::iquants::{
    vec_dot_iq1_m_q8_k_scalar, vec_dot_iq1_s_q8_k_scalar, vec_dot_iq2_s_q8_k_scalar,
    vec_dot_iq2_xs_q8_k_scalar, vec_dot_iq2_xxs_q8_k_scalar, vec_dot_iq3_s_q8_k_scalar,
    vec_dot_iq3_xxs_q8_k_scalar, vec_dot_iq4_nl_q8_0_scalar, vec_dot_iq4_xs_q8_k_scalar,
};
use redlite_cpu::kernels::q8::{quantize_row_q8_0, quantize_row_q8_k, BlockQ8K, BlockQ8_0};
use redlite_cpu::kernels::{lookup_exact, Isa, RowDot};
use redlite_gguf::quant::{dequantize, GgmlType};
use std::path::PathBuf;

mod cpu_time;
use cpu_time::{process_cpu_ns, thread_cpu_ns};

/// Relative error bound of a kernel against the exact (f64) dot product.
const REL_TOL: f64 = 1e-5;

/// Activations of one row in both Q8 formats.
struct Acts {
    q8k: Vec<BlockQ8K>,
    q80: Vec<BlockQ8_0>,
}

/// One weight type under test.
struct Case {
    ty: GgmlType,
    name: &'static str,
    /// Elements per block.
    qk: usize,
    /// Bytes per block.
    bytes: usize,
    /// Byte offsets of the f16 scale(s) to patch in random blocks (not IQ1_M).
    scale_at: &'static [usize],
    /// The scalar reference kernel.
    scalar: fn(usize, &[u8], &Acts) -> f32,
}

macro_rules! q8k {
    ($f:path) => {
        |n: usize, w: &[u8], a: &Acts| $f(n, w, &a.q8k)
    };
}

const CASES: &[Case] = &[
    Case {
        ty: GgmlType::IQ2XXS,
        name: "IQ2_XXS",
        qk: 256,
        bytes: 66,
        scale_at: &[0],
        scalar: q8k!(vec_dot_iq2_xxs_q8_k_scalar),
    },
    Case {
        ty: GgmlType::IQ2XS,
        name: "IQ2_XS",
        qk: 256,
        bytes: 74,
        scale_at: &[0],
        scalar: q8k!(vec_dot_iq2_xs_q8_k_scalar),
    },
    Case {
        ty: GgmlType::IQ2S,
        name: "IQ2_S",
        qk: 256,
        bytes: 82,
        scale_at: &[0],
        scalar: q8k!(vec_dot_iq2_s_q8_k_scalar),
    },
    Case {
        ty: GgmlType::IQ3XXS,
        name: "IQ3_XXS",
        qk: 256,
        bytes: 98,
        scale_at: &[0],
        scalar: q8k!(vec_dot_iq3_xxs_q8_k_scalar),
    },
    Case {
        ty: GgmlType::IQ3S,
        name: "IQ3_S",
        qk: 256,
        bytes: 110,
        scale_at: &[0],
        scalar: q8k!(vec_dot_iq3_s_q8_k_scalar),
    },
    Case {
        ty: GgmlType::IQ1S,
        name: "IQ1_S",
        qk: 256,
        bytes: 50,
        scale_at: &[0],
        scalar: q8k!(vec_dot_iq1_s_q8_k_scalar),
    },
    Case {
        ty: GgmlType::IQ1M,
        name: "IQ1_M",
        qk: 256,
        bytes: 56,
        scale_at: &[],
        scalar: q8k!(vec_dot_iq1_m_q8_k_scalar),
    },
    Case {
        ty: GgmlType::IQ4XS,
        name: "IQ4_XS",
        qk: 256,
        bytes: 136,
        scale_at: &[0],
        scalar: q8k!(vec_dot_iq4_xs_q8_k_scalar),
    },
    Case {
        ty: GgmlType::IQ4NL,
        name: "IQ4_NL",
        qk: 32,
        bytes: 18,
        scale_at: &[0],
        scalar: |n, w, a| vec_dot_iq4_nl_q8_0_scalar(n, w, &a.q80),
    },
];

fn fixture_dir() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../../shared/reference/quant"
    ))
}

fn read_fixture(name: &str) -> Vec<u8> {
    let path = fixture_dir().join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("reading fixture {}: {e}", path.display()))
}

fn read_f32(name: &str) -> Vec<f32> {
    read_fixture(name)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Random activations: mostly N(0,1)-like values with a few outliers, quantized to both formats.
fn random_acts(rng: &mut StdRng, n: usize) -> Acts {
    let x: Vec<f32> = (0..n)
        .map(|_| {
            // Sum of uniforms: cheap, roughly normal.
            let v: f32 = (0..4).map(|_| rng.random_range(-1.0f32..1.0)).sum();
            if rng.random_range(0..64) == 0 {
                v * 8.0
            } else {
                v
            }
        })
        .collect();
    acts_from(&x)
}

fn acts_from(x: &[f32]) -> Acts {
    let mut q8k = vec![BlockQ8K::ZERO; x.len() / 256];
    quantize_row_q8_k(x, &mut q8k);
    let mut q80 = vec![BlockQ8_0::ZERO; x.len() / 32];
    quantize_row_q8_0(x, &mut q80);
    Acts { q8k, q80 }
}

/// The activations the kernel of `case` sees, dequantized exactly (f64 products of scale and q).
fn exact_acts(case: &Case, a: &Acts) -> Vec<f64> {
    if case.qk == 32 {
        a.q80
            .iter()
            .flat_map(|b| {
                let d = f64::from(b.scale());
                b.qs.iter().map(move |&q| d * f64::from(q))
            })
            .collect()
    } else {
        a.q8k
            .iter()
            .flat_map(|b| b.qs.iter().map(move |&q| f64::from(b.d) * f64::from(q)))
            .collect()
    }
}

fn dot_f64(w: &[f32], x: &[f64]) -> f64 {
    assert_eq!(w.len(), x.len());
    w.iter().zip(x).map(|(&a, &b)| f64::from(a) * b).sum()
}

/// A random f16 in [2^-10, 2^-6): small positive scales, as real files have.
fn small_f16(rng: &mut StdRng) -> u16 {
    half::f16::from_f32(rng.random_range(0.001f32..0.015)).to_bits()
}

/// `nb` random blocks of `case`'s type: random bytes with the f16 scale fields patched.
fn random_blocks(rng: &mut StdRng, case: &Case, nb: usize) -> Vec<u8> {
    let mut w = vec![0u8; nb * case.bytes];
    rng.fill(&mut w[..]);
    for b in w.chunks_exact_mut(case.bytes) {
        for &at in case.scale_at {
            b[at..at + 2].copy_from_slice(&small_f16(rng).to_le_bytes());
        }
        if case.ty == GgmlType::IQ1M {
            // d lives in the top nibbles of the four scale u16s (bytes 49, 51, 53, 55).
            let d = small_f16(rng);
            for k in 0..4 {
                let nib = ((d >> (4 * k)) & 15) as u8;
                b[49 + 2 * k] = (b[49 + 2 * k] & 0x0F) | (nib << 4);
            }
        }
    }
    w
}

fn dequant(case: &Case, w: &[u8]) -> Vec<f32> {
    let mut out = vec![0.0f32; w.len() / case.bytes * case.qk];
    dequantize(case.ty, w, &mut out)
        .unwrap_or_else(|e| panic!("{}: reference dequantization failed: {e}", case.name));
    out
}

/// Runs a dispatch-table kernel on one row.
fn run_row_dot(k: RowDot, w: &[u8], a: &Acts) -> f32 {
    match k {
        RowDot::Q8K(f) => f(w, &a.q8k),
        RowDot::Q8_0(f) => f(w, &a.q80),
        RowDot::F32(_) => panic!("an i-quant kernel must take Q8 activations"),
    }
}

fn check_close(what: &str, got: f32, want: f64) {
    let err = (f64::from(got) - want).abs();
    assert!(
        err <= REL_TOL * want.abs(),
        "{what}: got {got:e}, exact {want:e}, relative error {:e}",
        err / want.abs()
    );
}

/// (b): a SIMD kernel returns the scalar kernel's result bit for bit (both reduce each block to
/// an exact integer sum, then run the same f32 operations in the same order).
fn check_same(what: &str, got: f32, scalar: f32) {
    assert_eq!(
        got.to_bits(),
        scalar.to_bits(),
        "{what}: {got:e} vs scalar {scalar:e}"
    );
}

/// The SIMD levels (above scalar) this CPU supports that have a kernel of their own for `ty`.
fn simd_kernels(ty: GgmlType) -> Vec<(Isa, RowDot)> {
    Isa::available()
        .into_iter()
        .filter(|&isa| isa != Isa::Scalar)
        .filter_map(|isa| lookup_exact(ty, isa).map(|k| (isa, k)))
        .collect()
}

/// (a) + (b) on random blocks: rows of 1, 3 and 16 super-blocks (IQ4_NL: 8, 24, 128 blocks).
#[test]
fn random_blocks_match_exact_dot_at_every_level() {
    let mut rng = StdRng::seed_from_u64(0x1d5);
    for case in CASES {
        let simd = simd_kernels(case.ty);
        let scalar_entry = lookup_exact(case.ty, Isa::Scalar)
            .unwrap_or_else(|| panic!("{}: no scalar", case.name));
        for (row, &elems) in [256usize, 768, 4096, 4096, 4096].iter().enumerate() {
            let nb = elems / case.qk;
            let w = random_blocks(&mut rng, case, nb);
            let a = random_acts(&mut rng, elems);
            let want = dot_f64(&dequant(case, &w), &exact_acts(case, &a));
            let got = (case.scalar)(elems, &w, &a);
            check_close(&format!("{} row {row} scalar", case.name), got, want);
            let via_table = run_row_dot(scalar_entry, &w, &a);
            assert_eq!(
                got.to_bits(),
                via_table.to_bits(),
                "{}: table entry",
                case.name
            );
            for &(isa, k) in &simd {
                let what = format!("{} row {row} {}", case.name, isa.name());
                check_same(&what, run_row_dot(k, &w, &a), got);
            }
        }
    }
}

/// Every sub-block scale and sign path: single-block rows whose activations are all +1 except one
/// −1 at a moving position; exact comparison per block.
#[test]
fn single_block_rows_with_sparse_sign_flips() {
    let mut rng = StdRng::seed_from_u64(7);
    for case in CASES {
        let simd = simd_kernels(case.ty);
        let qk = if case.qk == 32 { 256 } else { case.qk };
        let w = random_blocks(&mut rng, case, qk / case.qk);
        let deq = dequant(case, &w);
        for pos in (0..qk).step_by(7) {
            let mut x = vec![0.5f32; qk];
            x[pos] = -1.0;
            let a = acts_from(&x);
            let want = dot_f64(&deq, &exact_acts(case, &a));
            let got = (case.scalar)(qk, &w, &a);
            check_close(&format!("{} flip {pos} scalar", case.name), got, want);
            for &(isa, k) in &simd {
                let what = format!("{} flip {pos} {}", case.name, isa.name());
                check_same(&what, run_row_dot(k, &w, &a), got);
            }
        }
    }
}

/// Activations with −128 in Q8_K (ggml's own Q8_K rounding never makes it, but the format allows
/// it): SIMD kernels must not lose the sign of −(−128).
#[test]
fn q8_k_minus_128_is_handled_exactly() {
    let mut rng = StdRng::seed_from_u64(11);
    for case in CASES.iter().filter(|c| c.qk == 256) {
        let w = random_blocks(&mut rng, case, 2);
        let mut a = random_acts(&mut rng, 512);
        for b in &mut a.q8k {
            for q in b.qs.iter_mut().step_by(3) {
                *q = -128;
            }
        }
        let want = dot_f64(&dequant(case, &w), &exact_acts(case, &a));
        let got = (case.scalar)(512, &w, &a);
        check_close(&format!("{} −128 scalar", case.name), got, want);
        for (isa, k) in simd_kernels(case.ty) {
            let what = format!("{} −128 {}", case.name, isa.name());
            check_same(&what, run_row_dot(k, &w, &a), got);
        }
    }
}

/// (c) The fixture blocks (real blocks from the model files, then all-zero, max-scale,
/// negative-scale, subnormal-scale and all-0xFF synthetic blocks), against ggml's dequantization
/// of them: each block alone, and all 64 as one row.
#[test]
fn fixture_blocks_match_ggml_dequantization() {
    let mut rng = StdRng::seed_from_u64(3);
    for case in CASES {
        let w = read_fixture(&format!("{}.blocks", case.name));
        let deq = read_f32(&format!("{}.f32", case.name));
        let nb = w.len() / case.bytes;
        assert_eq!(nb, 64, "{}: fixture block count", case.name);
        assert_eq!(deq.len(), nb * case.qk);
        // Our reference dequantizer agrees with ggml's, bit for bit.
        let ours = dequant(case, &w);
        assert!(
            ours.iter()
                .zip(&deq)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{}: redlite dequantization differs from the fixture",
            case.name
        );
        let simd = simd_kernels(case.ty);
        let n = nb * case.qk;
        let a = random_acts(&mut rng, n);
        let xa = exact_acts(case, &a);
        // The whole row.
        let want = dot_f64(&deq, &xa);
        let got = (case.scalar)(n, &w, &a);
        check_close(&format!("{} fixture row scalar", case.name), got, want);
        for &(isa, k) in &simd {
            let what = format!("{} fixture row {}", case.name, isa.name());
            check_same(&what, run_row_dot(k, &w, &a), got);
        }
        // Block by block (IQ4_NL: groups of 8 blocks, one Q8_K-sized span).
        let per = if case.qk == 32 { 8 } else { 1 };
        for i in (0..nb).step_by(per) {
            let span = per * case.qk;
            let wb = &w[i * case.bytes..(i + per) * case.bytes];
            let xs = &xa[i * case.qk..i * case.qk + span];
            let want = dot_f64(&deq[i * case.qk..i * case.qk + span], xs);
            let sub = Acts {
                q8k: a.q8k[i * case.qk / 256..(i * case.qk + span).div_ceil(256)].to_vec(),
                q80: a.q80[i * case.qk / 32..(i * case.qk + span) / 32].to_vec(),
            };
            let got = (case.scalar)(span, wb, &sub);
            if want == 0.0 {
                assert_eq!(got, 0.0, "{} fixture block {i} scalar", case.name);
            } else {
                check_close(
                    &format!("{} fixture block {i} scalar", case.name),
                    got,
                    want,
                );
            }
            for &(isa, k) in &simd {
                let what = format!("{} fixture block {i} {}", case.name, isa.name());
                check_same(&what, run_row_dot(k, wb, &sub), got);
            }
        }
    }
}

/// The kernels never read past a short slice: they stop at the shorter of the two rows.
#[test]
fn dispatch_entries_stop_at_the_shorter_slice() {
    let mut rng = StdRng::seed_from_u64(5);
    for case in CASES {
        let elems = 1024;
        let w = random_blocks(&mut rng, case, elems / case.qk);
        let a = random_acts(&mut rng, elems);
        let half = Acts {
            q8k: a.q8k[..a.q8k.len() / 2].to_vec(),
            q80: a.q80[..a.q80.len() / 2].to_vec(),
        };
        let want = (case.scalar)(elems / 2, &w[..w.len() / 2], &half);
        for isa in Isa::available() {
            if let Some(k) = lookup_exact(case.ty, isa) {
                let what = format!("{} short activations {}", case.name, isa.name());
                check_same(&what, run_row_dot(k, &w, &half), want);
            }
        }
    }
}

/// On a CPU with everything the AVX-512 kernels need, the hot types get one.
#[cfg(target_arch = "x86_64")]
#[test]
fn avx512_kernels_are_registered_when_supported() {
    use redlite_cpu::kernels::iquants_avx512;
    let hot = [
        GgmlType::IQ2XXS,
        GgmlType::IQ3XXS,
        GgmlType::IQ3S,
        GgmlType::IQ1M,
        GgmlType::IQ4XS,
    ];
    for ty in hot {
        let got = lookup_exact(ty, Isa::Avx512).is_some();
        let want = iquants_avx512::supported() && Isa::Avx512.supported();
        assert_eq!(got, want, "{ty:?}: AVX-512 kernel registered = {got}");
    }
    if !iquants_avx512::supported() {
        eprintln!(
            "note: this CPU lacks AVX-512 VBMI/VNNI; the AVX-512 i-quant kernels were not run"
        );
    }
}

/// The multi-row AVX-512 IQ2_XXS kernel gives each activation row what the single-row kernel
/// gives it (same blocks, same f32 operations per row: bit-identical).
#[cfg(target_arch = "x86_64")]
#[test]
fn iq2_xxs_multi_row_matches_single_rows() {
    use redlite_cpu::kernels::iquants_avx512::{
        supported, vec_dot_iq2_xxs_q8_k_avx512, vec_dot_iq2_xxs_q8_k_avx512_multi,
    };
    if !supported() {
        eprintln!("note: no AVX-512 VBMI/VNNI here; multi-row IQ2_XXS kernel not run");
        return;
    }
    let mut rng = StdRng::seed_from_u64(17);
    let case = &CASES[0];
    let n = 2048;
    let w = random_blocks(&mut rng, case, n / 256);
    let acts: Vec<Acts> = (0..4).map(|_| random_acts(&mut rng, n)).collect();
    let deq = dequant(case, &w);
    for rows in 0..=4 {
        let xs: Vec<&[BlockQ8K]> = acts[..rows].iter().map(|a| &a.q8k[..]).collect();
        let mut out = [f32::NAN; 4];
        // SAFETY: `supported()` holds.
        unsafe { vec_dot_iq2_xxs_q8_k_avx512_multi(n, &w, &xs, &mut out) };
        for (r, a) in acts[..rows].iter().enumerate() {
            // SAFETY: `supported()` holds.
            let single = unsafe { vec_dot_iq2_xxs_q8_k_avx512(n, &w, &a.q8k) };
            assert_eq!(out[r].to_bits(), single.to_bits(), "{rows} rows, row {r}");
            check_close(
                "IQ2_XXS multi-row",
                out[r],
                dot_f64(&deq, &exact_acts(case, a)),
            );
        }
        assert!(
            out[rows..].iter().all(|v| v.is_nan()),
            "wrote past the rows"
        );
    }
}

/// The IQ2_XXS kernel for activations from our own Q8_K quantizer (no −128; the fused MoE decode
/// uses it) returns the scalar kernel's result bit for bit, for rows of 1..=9 blocks (odd counts
/// end on a half pair).
#[test]
fn iq2_xxs_kernel_without_minus_128_matches_scalar() {
    use redlite_cpu::kernels::iquants_avx512::kernel_without_minus_128;
    let Some(k) = kernel_without_minus_128(GgmlType::IQ2XXS) else {
        eprintln!("note: no AVX-512 VBMI/VNNI here; IQ2_XXS kernel without the −128 check not run");
        return;
    };
    iq2_xxs_rows_match_scalar(29, |w, a| k(w, &a.q8k));
}

/// `kernel` against the scalar IQ2_XXS kernel, bit for bit, on random rows of 1..=9 blocks (odd
/// counts end on a half pair), four rows each.
fn iq2_xxs_rows_match_scalar(seed: u64, kernel: impl Fn(&[u8], &Acts) -> f32) {
    let mut rng = StdRng::seed_from_u64(seed);
    let case = &CASES[0];
    for nb in 1..=9 {
        for _ in 0..4 {
            let w = random_blocks(&mut rng, case, nb);
            let a = random_acts(&mut rng, nb * 256);
            let want = (case.scalar)(nb * 256, &w, &a);
            check_same(&format!("IQ2_XXS {nb} blocks"), kernel(&w, &a), want);
        }
    }
}

/// The IQ2_XXS kernel on interleaved activations (the fused MoE decode's) gives the scalar
/// kernel's value on the activations in their usual order, bit for bit.
#[test]
#[cfg(target_arch = "x86_64")]
fn iq2_xxs_interleaved_kernel_matches_scalar() {
    use redlite_cpu::kernels::iquants_avx512::{
        interleave_q8k_for_iq2_xxs, iq2_xxs_interleaved_kernel,
    };
    let Some(k) = iq2_xxs_interleaved_kernel() else {
        eprintln!("note: no AVX-512 VBMI/VNNI here; interleaved IQ2_XXS kernel not run");
        return;
    };
    iq2_xxs_rows_match_scalar(31, |w, a| k(w, &interleave_q8k_for_iq2_xxs(&a.q8k)));
}

/// The IQ2_XXS kernel on element-major activations (GFNI; the decode kernel where the CPU has
/// it) gives the scalar kernel's value on the activations in their usual order, bit for bit.
#[test]
#[cfg(target_arch = "x86_64")]
fn iq2_xxs_element_major_kernel_matches_scalar() {
    use redlite_cpu::kernels::iquants_avx512::{element_major_q8k, iq2_xxs_element_major_kernel};
    let Some(k) = iq2_xxs_element_major_kernel() else {
        eprintln!("note: no AVX-512 VBMI/VNNI/GFNI here; element-major IQ2_XXS kernel not run");
        return;
    };
    iq2_xxs_rows_match_scalar(37, |w, a| k(w, &element_major_q8k(&a.q8k)));
}

/// The element-major kernel over several rows per call gives each row the scalar kernel's
/// value, bit for bit (rows of 1..=9 blocks, 1..=5 rows per call).
#[test]
#[cfg(target_arch = "x86_64")]
fn iq2_xxs_element_major_rows_kernel_matches_scalar() {
    use redlite_cpu::kernels::iquants_avx512::{
        element_major_q8k, iq2_xxs_element_major_rows_kernel,
    };
    let Some(k) = iq2_xxs_element_major_rows_kernel() else {
        eprintln!("note: no AVX-512 VBMI/VNNI/GFNI here; element-major IQ2_XXS rows not run");
        return;
    };
    let mut rng = StdRng::seed_from_u64(41);
    let case = &CASES[0];
    for nb in 1..=9 {
        for rows in 1..=5 {
            let w = random_blocks(&mut rng, case, nb * rows);
            let a = random_acts(&mut rng, nb * 256);
            let mut out = vec![f32::NAN; rows];
            k(&w, nb * case.bytes, &element_major_q8k(&a.q8k), &mut out);
            for (r, got) in out.iter().enumerate() {
                let row = &w[r * nb * case.bytes..(r + 1) * nb * case.bytes];
                let want = (case.scalar)(nb * 256, row, &a);
                check_same(&format!("IQ2_XXS rows, {nb} blocks, row {r}"), *got, want);
            }
        }
    }
}

/// Batched products (`matmul`, which uses the multi-row kernels where a type has them) give every
/// activation row exactly what `matvec` gives it, for every row count around the group size and
/// at every ISA level.
#[test]
fn matmul_rows_match_matvec_bit_for_bit() {
    use redlite_cpu::kernels::driver::{matmul_isa, matvec_isa};
    let mut rng = StdRng::seed_from_u64(23);
    // Q4_K (multi-row kernel in `kquants_multi_x86`) along with the i-quants; its random blocks
    // get small f16 scales at bytes 0 and 2 like the i-quants' d.
    let q4k = Case {
        ty: GgmlType::Q4K,
        name: "Q4_K",
        qk: 256,
        bytes: 144,
        scale_at: &[0, 2],
        scalar: q8k!(vec_dot_iq2_xxs_q8_k_scalar), // unused here
    };
    // Q6_K (multi-row kernel in `kquants_multi_x86`): its f16 d is the last two bytes.
    let q6k = Case {
        ty: GgmlType::Q6K,
        name: "Q6_K",
        qk: 256,
        bytes: 210,
        scale_at: &[208],
        scalar: q8k!(vec_dot_iq2_xxs_q8_k_scalar), // unused here
    };
    for case in CASES.iter().filter(|c| c.qk == 256).chain([&q4k, &q6k]) {
        // 37 weight rows: two whole 16-row tiles of the Q4_K tile GEMM and a partial one.
        let (rows, cols) = (37, 1024);
        let w = random_blocks(&mut rng, case, rows * cols / 256);
        let xs: Vec<f32> = (0..59 * cols)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        for isa in Isa::available() {
            // Up to the 8-row groups with every remainder, past the 16-row groups, and the
            // tile GEMMs (Q4_K from 24 rows, IQ2_XXS from 56) with whole and partial groups of 4.
            for n in (2..=9).chain([16, 17, 21, 24, 35, 40, 56, 59]) {
                let mut ys = vec![0.0f32; n * rows];
                matmul_isa(isa, case.ty, &w, rows, cols, &xs[..n * cols], n, &mut ys).unwrap();
                for j in 0..n {
                    let mut y = vec![0.0f32; rows];
                    matvec_isa(
                        isa,
                        case.ty,
                        &w,
                        rows,
                        cols,
                        &xs[j * cols..][..cols],
                        &mut y,
                    )
                    .unwrap();
                    for r in 0..rows {
                        assert_eq!(
                            ys[j * rows + r].to_bits(),
                            y[r].to_bits(),
                            "{} {} n={n} row {j} out {r}",
                            case.name,
                            isa.name()
                        );
                    }
                }
            }
        }
    }
}

/// Batched product cost per weight block and activation row, `matmul` (multi-row kernels where
/// the type has one) against `n` separate `matvec` calls, on a 2048 × 4096 matrix (in L3: the
/// kernels' compute rate), medians of alternating runs, timed by the process's CPU time (robust
/// to other processes on a busy machine). Run with `RAYON_NUM_THREADS=1
/// cargo test -p redlite-cpu --release --test kernels_iquants bench_matmul -- --ignored --nocapture`.
#[test]
#[ignore = "benchmark"]
fn bench_matmul_rows() {
    use redlite_cpu::kernels::driver::{matmul_isa, matvec_isa};
    let mut rng = StdRng::seed_from_u64(29);
    // Activation rows: `REDLITE_BENCH_N`, default 8.
    let n = std::env::var("REDLITE_BENCH_N")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or(8);
    // Columns: `REDLITE_BENCH_COLS`, default 4096.
    let cols = std::env::var("REDLITE_BENCH_COLS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|&c: &usize| c > 0 && c % 256 == 0)
        .unwrap_or(4096);
    let rows = 2048;
    // Types: `REDLITE_BENCH_TYPES` (comma-separated, e.g. `Q4K`), default all three; timed
    // repetitions: `REDLITE_BENCH_REPS`, default 9 (more for a profiler).
    let only = std::env::var("REDLITE_BENCH_TYPES").unwrap_or_default();
    let reps = std::env::var("REDLITE_BENCH_REPS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|&r: &usize| r > 0)
        .unwrap_or(9);
    let xs: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
    for (ty, bytes, scale_at) in [
        (GgmlType::IQ2XXS, 66, &[0, 2][..]),
        (GgmlType::Q4K, 144, &[0, 2][..]),
        (GgmlType::Q6K, 210, &[208][..]),
    ] {
        if !only.is_empty() && !only.split(',').any(|t| t.trim() == format!("{ty:?}")) {
            continue;
        }
        let case = Case {
            ty,
            name: "",
            qk: 256,
            bytes,
            scale_at,
            scalar: q8k!(vec_dot_iq2_xxs_q8_k_scalar),
        };
        let w = random_blocks(&mut rng, &case, rows * cols / 256);
        let isa = Isa::best();
        let per_block = |secs: f64| secs * 1e9 / (rows * cols / 256 * n) as f64;
        let (mut tm, mut tv) = (vec![], vec![]);
        let mut ys = vec![0.0f32; n * rows];
        for _ in 0..reps {
            let t = process_cpu_ns();
            matmul_isa(isa, ty, &w, rows, cols, &xs, n, &mut ys).unwrap();
            tm.push(per_block((process_cpu_ns() - t) as f64 * 1e-9));
            let t = process_cpu_ns();
            for j in 0..n {
                matvec_isa(
                    isa,
                    ty,
                    &w,
                    rows,
                    cols,
                    &xs[j * cols..][..cols],
                    &mut ys[..rows],
                )
                .unwrap();
            }
            tv.push(per_block((process_cpu_ns() - t) as f64 * 1e-9));
        }
        tm.sort_by(f64::total_cmp);
        tv.sort_by(f64::total_cmp);
        println!(
            "{ty:?}: matmul n={n}: {:.2} ns per block and row; {n} matvecs: {:.2} (medians)",
            tm[reps / 2],
            tv[reps / 2]
        );
    }
}

/// Matrix-vector bandwidth of every i-quant type on a matrix larger than the caches (64 MiB of
/// weights per type, see `REDLITE_BENCH_MIB` below), single-threaded, against a plain read of
/// the same bytes. Run with
/// `cargo test -p redlite-cpu --release --test kernels_iquants -- --ignored --nocapture`.
#[test]
#[ignore = "benchmark"]
fn bench_bandwidth() {
    use std::time::Instant;
    // Row length (`REDLITE_BENCH_COLS`, default 4096; the 80B experts have 2048 and 512).
    let cols: usize = std::env::var("REDLITE_BENCH_COLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4096);
    let mut rng = StdRng::seed_from_u64(1);
    let a = random_acts(&mut rng, cols);
    // Matrix size per type in MiB (`REDLITE_BENCH_MIB`, default 64: well beyond the caches; a
    // size that fits in L2 measures the kernels' compute rate instead). Single-threaded rates are
    // followed by a run on every core.
    let mib: usize = std::env::var("REDLITE_BENCH_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let reps = 10;
    // The best of `reps` runs, timed by this thread's on-CPU time where available (robust to
    // other processes on a busy machine), else by wall time.
    let best = |f: &dyn Fn() -> f32| {
        let mut best = f64::INFINITY;
        let mut sink = 0.0f32;
        for _ in 0..reps {
            let (t, c) = (Instant::now(), thread_cpu_ns());
            sink += f();
            let secs = match (c, thread_cpu_ns()) {
                (Some(a), Some(b)) => (b - a) as f64 * 1e-9,
                _ => t.elapsed().as_secs_f64(),
            };
            best = best.min(secs);
        }
        std::hint::black_box(sink);
        best
    };
    // Types to measure (`REDLITE_BENCH_TYPES=IQ2_XXS,IQ4_XS`; default all).
    let only = std::env::var("REDLITE_BENCH_TYPES").unwrap_or_default();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Wall time of the best of `reps` runs of `f` over `threads` contiguous row ranges at once.
    let best_parallel = |rows: usize, f: &(dyn Fn(std::ops::Range<usize>) -> f32 + Sync)| {
        let mut best = f64::INFINITY;
        for _ in 0..reps {
            let t = Instant::now();
            std::thread::scope(|sc| {
                let per = rows.div_ceil(threads);
                let parts: Vec<_> = (0..threads)
                    .map(|i| sc.spawn(move || f(i * per..((i + 1) * per).min(rows))))
                    .collect();
                let sum: f32 = parts.into_iter().map(|p| p.join().unwrap()).sum();
                std::hint::black_box(sum);
            });
            best = best.min(t.elapsed().as_secs_f64());
        }
        best
    };
    for case in CASES {
        let name = case.name;
        if !only.is_empty() && !only.split(',').any(|t| t.trim().eq_ignore_ascii_case(name)) {
            continue;
        }
        let row_bytes = cols / case.qk * case.bytes;
        let rows = (mib << 20) / row_bytes;
        let w = random_blocks(&mut rng, case, rows * cols / case.qk);
        let total = (rows * row_bytes) as f64;
        println!("{name}: {rows} × {cols} matrix, {:.1} MB", total / 1e6);
        let plain = best(&|| {
            let mut acc = 0u64;
            for c in w.chunks_exact(8) {
                acc ^= u64::from_le_bytes(c.try_into().unwrap());
            }
            acc as f32
        });
        println!(
            "  plain read (xor of u64): {:6.2} GB/s",
            total / plain / 1e9
        );
        for isa in Isa::available() {
            let Some(k) = lookup_exact(case.ty, isa) else {
                continue;
            };
            let t = best(&|| {
                let mut s = 0.0f32;
                for r in w.chunks_exact(row_bytes) {
                    s += run_row_dot(k, r, &a);
                }
                s
            });
            println!(
                "  {:7} kernel: {:6.2} GB/s, {:5.1} ns per 256 weights",
                isa.name(),
                total / t / 1e9,
                t * 1e9 / (rows * cols / 256) as f64
            );
        }
        #[cfg(target_arch = "x86_64")]
        if case.ty == GgmlType::IQ2XXS && redlite_cpu::kernels::iquants_avx512::supported() {
            use redlite_cpu::kernels::iquants_avx512::vec_dot_iq2_xxs_q8_k_avx512_multi;
            let more: Vec<Acts> = (0..3).map(|_| random_acts(&mut rng, cols)).collect();
            let xs = [&a.q8k[..], &more[0].q8k, &more[1].q8k, &more[2].q8k];
            let t = best(&|| {
                let mut out = [0.0f32; 4];
                let mut s = 0.0f32;
                for r in w.chunks_exact(row_bytes) {
                    // SAFETY: `supported()` holds.
                    unsafe { vec_dot_iq2_xxs_q8_k_avx512_multi(cols, r, &xs, &mut out) };
                    s += out.iter().sum::<f32>();
                }
                s
            });
            println!(
                "  avx512 ×4 activation rows: {:6.2} GB/s, {:5.1} ns per 256 weights per row",
                total / t / 1e9,
                t * 1e9 / (rows * cols / 256 * 4) as f64
            );
            use redlite_cpu::kernels::iquants_avx512::{
                interleave_q8k_for_iq2_xxs, iq2_xxs_interleaved_kernel, kernel_without_minus_128,
            };
            // The fused MoE decode's kernels: without the −128 check, and on interleaved
            // activations.
            let twin = kernel_without_minus_128(case.ty);
            let interleaved = iq2_xxs_interleaved_kernel();
            let xi = interleave_q8k_for_iq2_xxs(&a.q8k);
            let element_major =
                redlite_cpu::kernels::iquants_avx512::iq2_xxs_element_major_kernel();
            let xe = redlite_cpu::kernels::iquants_avx512::element_major_q8k(&a.q8k);
            for (label, k, x) in [
                ("without -128 check", twin, &a.q8k[..]),
                ("interleaved acts  ", interleaved, &xi[..]),
                ("element-major acts", element_major, &xe[..]),
            ] {
                let Some(k) = k else { continue };
                let t = best(&|| w.chunks_exact(row_bytes).map(|r| k(r, x)).sum::<f32>());
                println!(
                    "  avx512 {label}: {:6.2} GB/s, {:5.2} ns per 256 weights",
                    total / t / 1e9,
                    t * 1e9 / (rows * cols / 256) as f64
                );
            }
            if let Some(k) =
                redlite_cpu::kernels::iquants_avx512::iq2_xxs_element_major_rows_kernel()
            {
                let t = best(&|| {
                    let mut out = vec![0.0f32; 64];
                    let mut s = 0.0f32;
                    for ws in w.chunks(64 * row_bytes) {
                        let n = ws.len() / row_bytes;
                        k(ws, row_bytes, &xe, &mut out[..n]);
                        s += out[..n].iter().sum::<f32>();
                    }
                    s
                });
                println!(
                    "  avx512 element-major, 64 rows per call: {:6.2} GB/s, {:5.2} ns per 256 weights",
                    total / t / 1e9,
                    t * 1e9 / (rows * cols / 256) as f64
                );
            }
        }
        if threads > 1 {
            let plain = best_parallel(rows, &|r| {
                let mut acc = 0u64;
                for c in w[r.start * row_bytes..r.end * row_bytes].chunks_exact(8) {
                    acc ^= u64::from_le_bytes(c.try_into().unwrap());
                }
                acc as f32
            });
            let isa = Isa::best();
            let k = redlite_cpu::kernels::lookup(case.ty, isa).expect("i-quant kernel");
            let t = best_parallel(rows, &|r| {
                let mut s = 0.0f32;
                for row in w[r.start * row_bytes..r.end * row_bytes].chunks_exact(row_bytes) {
                    s += run_row_dot(k, row, &a);
                }
                s
            });
            println!(
                "  {threads} threads (wall time): plain read {:6.2} GB/s, best kernel {:6.2} GB/s",
                total / plain / 1e9,
                total / t / 1e9
            );
        }
    }
}

/// The float weight types through `matmul` (multi-row float kernel at AVX-512) equal `matvec` of
/// each row bit for bit, at every level, with column counts that leave 16- and 1-element tails.
#[test]
fn float_matmul_rows_match_matvec_bit_for_bit() {
    use redlite_cpu::kernels::driver::{matmul_isa, matvec_isa};
    let mut rng = StdRng::seed_from_u64(31);
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
        for cols in [1000, 2048] {
            let rows = 7;
            let vals: Vec<f32> = (0..rows * cols)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let w: Vec<u8> = match ty {
                GgmlType::F32 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
                GgmlType::F16 => vals
                    .iter()
                    .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                    .collect(),
                _ => vals
                    .iter()
                    .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                    .collect(),
            };
            let xs: Vec<f32> = (0..9 * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
            for isa in Isa::available() {
                for n in 2..=9 {
                    let mut ys = vec![0.0f32; n * rows];
                    matmul_isa(isa, ty, &w, rows, cols, &xs[..n * cols], n, &mut ys).unwrap();
                    for j in 0..n {
                        let mut y = vec![0.0f32; rows];
                        let x = &xs[j * cols..][..cols];
                        matvec_isa(isa, ty, &w, rows, cols, x, &mut y).unwrap();
                        for r in 0..rows {
                            assert_eq!(
                                ys[j * rows + r].to_bits(),
                                y[r].to_bits(),
                                "{ty:?} {} cols {cols} n={n} row {j} out {r}",
                                isa.name()
                            );
                        }
                    }
                }
            }
        }
    }
}
