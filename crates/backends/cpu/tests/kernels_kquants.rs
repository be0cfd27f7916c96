//! Kernel tests against the ggml fixtures in `shared/reference/quant` (four levels up: this crate sits
//! at `crates/backends/cpu`) and the scalar reference
//! dequantizers of `redlite-gguf`.

use redlite_cpu::kernels::q8::{quantize_row_q8_0, quantize_row_q8_k, BlockQ8K, BlockQ8_0};
use std::path::PathBuf;

mod cpu_time;
use cpu_time::thread_cpu_ns;

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

/// `Q8_K.src.f32` → `quantize_row_q8_K_ref` → `Q8_K.quant`, byte for byte (bsums included).
#[test]
fn q8_k_quantizer_matches_ggml_bitwise() {
    let src = read_f32("Q8_K.src.f32");
    let want = read_fixture("Q8_K.quant");
    assert_eq!(src.len(), 16 * 512);
    assert_eq!(want.len(), src.len() / 256 * 292);
    let mut blocks = vec![BlockQ8K::ZERO; src.len() / 256];
    quantize_row_q8_k(&src, &mut blocks);
    for (i, (b, w)) in blocks.iter().zip(want.chunks_exact(292)).enumerate() {
        assert_eq!(&b.to_bytes()[..], w, "Q8_K block {i} differs from ggml");
    }
}

/// `Q8_0.src.f32` → `quantize_row_q8_0_ref` → `Q8_0.quant`, byte for byte.
#[test]
fn q8_0_quantizer_matches_ggml_bitwise() {
    let src = read_f32("Q8_0.src.f32");
    let want = read_fixture("Q8_0.quant");
    assert_eq!(want.len(), src.len() / 32 * 34);
    let mut blocks = vec![BlockQ8_0::ZERO; src.len() / 32];
    quantize_row_q8_0(&src, &mut blocks);
    for (i, (b, w)) in blocks.iter().zip(want.chunks_exact(34)).enumerate() {
        assert_eq!(&b.to_bytes()[..], w, "Q8_0 block {i} differs from ggml");
    }
}

/// The dispatched (SIMD) activation quantizers are bit-identical to the scalar ones, also on
/// ties, signed zeros, subnormals, huge values, infinities and NaN.
#[test]
fn quantizers_simd_equal_scalar() {
    use redlite_cpu::kernels::q8::{quantize_row_q8_0_scalar, quantize_row_q8_k_scalar};
    use redlite_cpu::kernels::selftest::random_activations;
    let mut rows: Vec<Vec<f32>> = Vec::new();
    for (i, scale) in [1.0f32, 1e-30, 1e30, 3e38, 1e-41].iter().enumerate() {
        rows.push(
            random_activations(512, i as u64)
                .iter()
                .map(|v| v * scale)
                .collect(),
        );
    }
    // Ties for both rounding rules, ± extremes of equal magnitude, zeros.
    let mut ties: Vec<f32> = (0..512).map(|i| (i as f32 - 256.0) * 0.5).collect();
    ties[3] = -128.0;
    ties[7] = 128.0;
    rows.push(ties);
    let mut t2: Vec<f32> = (0..512).map(|i| ((i % 7) as f32 - 3.0) / 63.5).collect();
    t2[0] = 2.0 / 63.5 * 63.5;
    t2[1] = -2.0;
    rows.push(t2);
    rows.push(vec![0.0; 512]);
    rows.push(
        (0..512)
            .map(|i| if i % 2 == 0 { -0.0 } else { 0.0 })
            .collect(),
    );
    for special in [
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MIN_POSITIVE / 4.0,
    ] {
        for pos in [0usize, 5, 31, 32, 200, 255, 300] {
            let mut r = random_activations(512, pos as u64);
            r[pos] = special;
            rows.push(r);
        }
    }
    let nan_row = vec![f32::NAN; 512];
    rows.push(nan_row);
    for (i, x) in rows.iter().enumerate() {
        let (mut a, mut b) = (vec![BlockQ8K::ZERO; 2], vec![BlockQ8K::ZERO; 2]);
        quantize_row_q8_k(x, &mut a);
        quantize_row_q8_k_scalar(x, &mut b);
        for (u, v) in a.iter().zip(&b) {
            assert_eq!(u.to_bytes()[..], v.to_bytes()[..], "Q8_K row {i}");
        }
        let (mut a, mut b) = (vec![BlockQ8_0::ZERO; 16], vec![BlockQ8_0::ZERO; 16]);
        quantize_row_q8_0(x, &mut a);
        quantize_row_q8_0_scalar(x, &mut b);
        for (u, v) in a.iter().zip(&b) {
            assert_eq!(u.to_bytes()[..], v.to_bytes()[..], "Q8_0 row {i}");
        }
    }
}

/// The built-in self-test: every kernel at every supported ISA level against the reference
/// dequantizers, SIMD vs scalar, and matmul rows bit-identical to matvec.
#[test]
fn selftest_passes() {
    let results = redlite_cpu::kernels::selftest::selftest_all();
    let mut failed = 0;
    for r in &results {
        println!("{r}");
        if !r.passed {
            failed += 1;
        }
    }
    assert!(!results.is_empty());
    assert_eq!(
        failed, 0,
        "{failed} self-test comparisons failed (see the output)"
    );
}

/// Matvec throughput (weight GB/s) on 4096-column matrices of 8192 rows, cycling through enough
/// distinct matrices (≥ 1 GiB in all) that nothing stays in cache, against a plain parallel read
/// of the same bytes. Not a test: run with
/// `cargo test --release -p redlite-cpu --test kernels_kquants bench -- --ignored --nocapture`
/// (`REDLITE_BENCH_TYPES=Q4_K,Q6_K` picks the types, `RAYON_NUM_THREADS` the threads).
#[test]
#[ignore]
fn bench_matvec_throughput() {
    use rayon::prelude::*;
    use redlite_cpu::kernels::driver::{matvec_isa, num_threads};
    use redlite_cpu::kernels::selftest::{random_activations, random_weights};
    use redlite_cpu::kernels::Isa;
    use redlite_gguf::quant::GgmlType;
    use std::time::Instant;

    let (rows, cols) = (8192usize, 4096usize);
    let types = std::env::var("REDLITE_BENCH_TYPES").unwrap_or("Q4_K,Q6_K,Q5_K,Q8_0,F16".into());
    println!("threads: {}, levels: {:?}", num_threads(), Isa::available());
    let x = random_activations(cols, 7);
    let mut y = vec![0.0f32; rows];
    for name in types.split(',') {
        let Some(ty) = GgmlType::from_name(name.trim()) else {
            println!("unknown type {name}");
            continue;
        };
        let one = random_weights(ty, rows, cols, 11);
        let copies = (1usize << 30).div_ceil(one.len()).max(2);
        let mut all = Vec::with_capacity(one.len() * copies);
        for c in 0..copies {
            // Distinct bytes per copy (a scale-free byte in each block would do; flip the last).
            all.extend_from_slice(&one);
            let n = all.len();
            all[n - 1] ^= c as u8;
        }
        let mats: Vec<&[u8]> = all.chunks_exact(one.len()).collect();
        let gbs = |secs: f64, reps: usize| (one.len() * reps) as f64 / secs / 1e9;

        // Plain parallel read: sum of u64 words, split like matvec.
        let read = |m: &[u8]| -> u64 {
            m.par_chunks(1 << 16)
                .map(|c| {
                    c.chunks_exact(8)
                        .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
                        .fold(0u64, u64::wrapping_add)
                })
                .reduce(|| 0, u64::wrapping_add)
        };
        let mut sink = 0u64;
        for m in &mats {
            sink = sink.wrapping_add(read(m)); // warm-up: touch everything once
        }
        let reps = mats.len() * 2;
        let t = Instant::now();
        for r in 0..reps {
            sink = sink.wrapping_add(read(mats[r % mats.len()]));
        }
        let read_gbs = gbs(t.elapsed().as_secs_f64(), reps);
        print!(
            "{:<5} {:>6.1} MB/matrix  plain read {:>7.1} GB/s",
            ty.name(),
            one.len() as f64 / 1e6,
            read_gbs
        );
        for isa in Isa::available() {
            let t = Instant::now();
            for r in 0..reps {
                matvec_isa(isa, ty, mats[r % mats.len()], rows, cols, &x, &mut y).unwrap();
            }
            print!(
                "  {} {:>7.1} GB/s",
                isa.name(),
                gbs(t.elapsed().as_secs_f64(), reps)
            );
        }
        println!("  (sink {})", sink % 10);
    }
}

/// Single-thread kernel speed with the weights in cache (32 rows × 4096, re-read many times):
/// the compute cost of each kernel, in ns per 256 elements and in GB/s of weight bytes.
/// `cargo test --release -p redlite-cpu --test kernels_kquants bench_hot -- --ignored --nocapture`
#[test]
#[ignore]
fn bench_hot_kernels() {
    use redlite_cpu::kernels::selftest::{random_activations, random_weights};
    use redlite_cpu::kernels::{lookup_exact, Isa, RowDot};
    use redlite_gguf::quant::GgmlType;
    use std::time::Instant;

    let (rows, cols) = (32usize, 4096usize);
    let x = random_activations(cols, 5);
    let mut xk = vec![BlockQ8K::ZERO; cols / 256];
    quantize_row_q8_k(&x, &mut xk);
    let mut x0 = vec![BlockQ8_0::ZERO; cols / 32];
    quantize_row_q8_0(&x, &mut x0);
    let types = std::env::var("REDLITE_BENCH_TYPES")
        .unwrap_or("Q4_K,Q5_K,Q6_K,Q8_0,Q4_0,Q2_K,Q3_K,F32,F16,BF16".into());
    for name in types.split(',') {
        let Some(ty) = GgmlType::from_name(name.trim()) else {
            continue;
        };
        let w = random_weights(ty, rows, cols, 3);
        let rb = w.len() / rows;
        print!("{:<5}", ty.name());
        for isa in Isa::available() {
            let Some(k) = lookup_exact(ty, isa) else {
                print!("  {:>6} {:>22}", isa.name(), "-");
                continue;
            };
            let call = |wr: &[u8]| match k {
                RowDot::Q8K(f) => f(wr, &xk),
                RowDot::Q8_0(f) => f(wr, &x0),
                RowDot::F32(f) => f(wr, &x),
            };
            // Best of 5 runs of at least 40 ms each.
            let mut sink = 0.0f32;
            let mut best = f64::INFINITY;
            let mut reps = 1usize;
            for _ in 0..5 {
                loop {
                    let (t, cpu) = (Instant::now(), thread_cpu_ns());
                    for _ in 0..reps {
                        for wr in w.chunks_exact(rb) {
                            sink += call(std::hint::black_box(wr));
                        }
                    }
                    // This thread's CPU time where available: steady on a busy machine.
                    let s = match (cpu, thread_cpu_ns()) {
                        (Some(a), Some(b)) => (b - a) as f64 * 1e-9,
                        _ => t.elapsed().as_secs_f64(),
                    };
                    if s < 0.04 {
                        reps *= 2;
                        continue;
                    }
                    best = best.min(s / reps as f64);
                    break;
                }
            }
            let (s, reps) = (best, 1usize);
            let per256 = s * 1e9 / (reps * rows * cols / 256) as f64;
            let gbs = (reps * w.len()) as f64 / s / 1e9;
            print!(
                "  {:>6} {:>6.1} ns/256 {:>5.1} GB/s",
                isa.name(),
                per256,
                gbs
            );
            std::hint::black_box(sink);
        }
        println!();
    }
}

/// Dequantized values of `n` activations as the kernel of `ty` sees them (f64, exact).
fn seen_activations(ty: redlite_gguf::quant::GgmlType, x: &[f32]) -> Vec<f64> {
    use redlite_cpu::kernels::{lookup, Isa, RowDot};
    match lookup(ty, Isa::Scalar).expect("kernel") {
        RowDot::Q8K(_) => {
            let mut q = vec![BlockQ8K::ZERO; x.len() / 256];
            quantize_row_q8_k(x, &mut q);
            q.iter()
                .flat_map(|b| b.qs.iter().map(move |&v| f64::from(b.d) * f64::from(v)))
                .collect()
        }
        RowDot::Q8_0(_) => {
            let mut q = vec![BlockQ8_0::ZERO; x.len() / 32];
            quantize_row_q8_0(x, &mut q);
            q.iter()
                .flat_map(|b| {
                    b.qs.iter()
                        .map(move |&v| f64::from(b.scale()) * f64::from(v))
                })
                .collect()
        }
        RowDot::F32(_) => x.iter().map(|&v| f64::from(v)).collect(),
    }
}

/// Checks `matvec` at every ISA level on a matrix of `rows` rows against `wf` (its dequantized
/// values, from ggml): within 1e-5 of `Σ|w·x|` of the exact dot with the activations the kernel
/// sees (non-finite results must match in kind), and bit-identical to the scalar level.
fn check_matrix(
    what: &str,
    ty: redlite_gguf::quant::GgmlType,
    w: &[u8],
    wf: &[f32],
    rows: usize,
    x: &[f32],
) {
    use redlite_cpu::kernels::driver::matvec_isa;
    use redlite_cpu::kernels::Isa;
    let cols = x.len();
    let seen = seen_activations(ty, x);
    let mut scalar = vec![0.0f32; rows];
    matvec_isa(Isa::Scalar, ty, w, rows, cols, x, &mut scalar).unwrap();
    for isa in Isa::available() {
        let mut y = vec![0.0f32; rows];
        matvec_isa(isa, ty, w, rows, cols, x, &mut y).unwrap();
        for r in 0..rows {
            let wr = &wf[r * cols..(r + 1) * cols];
            let exact: f64 = wr.iter().zip(&seen).map(|(&a, b)| f64::from(a) * b).sum();
            let scale: f64 = wr
                .iter()
                .zip(&seen)
                .map(|(&a, b)| (f64::from(a) * b).abs())
                .sum();
            let got = f64::from(y[r]);
            if exact.is_finite() && scale.is_finite() {
                let err = (got - exact).abs() / scale.max(f64::MIN_POSITIVE);
                assert!(
                    err <= 1e-5,
                    "{what} {} row {r}: got {got}, exact {exact}, rel err {err:.3e}",
                    isa.name()
                );
            } else {
                assert!(
                    if exact.is_nan() {
                        got.is_nan()
                    } else {
                        got == exact
                    },
                    "{what} {} row {r}: got {got}, exact {exact}",
                    isa.name()
                );
            }
            assert!(
                y[r].to_bits() == scalar[r].to_bits() || (y[r].is_nan() && scalar[r].is_nan()),
                "{what} {} row {r}: {} differs from scalar {}",
                isa.name(),
                y[r],
                scalar[r]
            );
        }
    }
}

/// Every kernel on ggml's fixture blocks (real blocks from model files plus synthetic edge
/// cases: zero block, max/negative/subnormal scales, all-0xFF) one block per row, and on the
/// ggml-quantized `<T>.quant` matrices (16 × 512), against ggml's own dequantization.
#[test]
fn kernels_match_ggml_fixtures() {
    use redlite_gguf::quant::{dequantize_to_vec, GgmlType};
    let x_all = read_f32("Q8_K.src.f32");
    for name in [
        "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "Q8_0", "Q4_0", "F16", "BF16",
    ] {
        let ty = GgmlType::from_name(name).unwrap();
        // The sampled blocks, with ggml's dequantization: one block (or 256 floats) per row.
        let blocks = read_fixture(&format!("{name}.blocks"));
        let wf = read_f32(&format!("{name}.f32"));
        let cols = ty.block_elems().max(256);
        let rows = wf.len() / cols;
        check_matrix(
            &format!("{name}.blocks"),
            ty,
            &blocks,
            &wf,
            rows,
            &x_all[..cols],
        );
        // ggml's quantization of 16 × 512 random normals.
        let q = read_fixture(&format!("{name}.quant"));
        let qf = dequantize_to_vec(ty, &q).unwrap();
        check_matrix(
            &format!("{name}.quant"),
            ty,
            &q,
            &qf,
            16,
            &x_all[1000..1512],
        );
    }
}

/// Float kernels at lengths that are not multiples of the vector widths: every level
/// bit-identical to scalar.
#[test]
fn float_kernels_any_length() {
    use redlite_cpu::kernels::selftest::{random_activations, random_weights};
    use redlite_cpu::kernels::{lookup_exact, Isa, RowDot};
    use redlite_gguf::quant::GgmlType;
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
        for n in [1usize, 7, 15, 16, 17, 63, 64, 65, 100, 129, 1000] {
            let w = random_weights(ty, 1, n, n as u64);
            let x = random_activations(n, 99);
            let run = |isa| match lookup_exact(ty, isa) {
                Some(RowDot::F32(f)) => Some(f(&w, &x)),
                _ => None,
            };
            let scalar = run(Isa::Scalar).unwrap();
            for isa in Isa::available() {
                if let Some(v) = run(isa) {
                    assert_eq!(v.to_bits(), scalar.to_bits(), "{ty:?} n={n} {}", isa.name());
                }
            }
        }
    }
}

/// Activation quantization speed (ns per 4096 values), single thread.
/// `cargo test --release -p redlite-cpu --test kernels_kquants bench_quant -- --ignored --nocapture`
#[test]
#[ignore]
fn bench_quantize_activations() {
    use redlite_cpu::kernels::selftest::random_activations;
    use std::time::Instant;
    let x = random_activations(4096, 1);
    let mut qk = vec![BlockQ8K::ZERO; 16];
    let mut q0 = vec![BlockQ8_0::ZERO; 128];
    let time = |f: &mut dyn FnMut()| {
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let t = Instant::now();
            for _ in 0..1000 {
                f();
            }
            best = best.min(t.elapsed().as_secs_f64() / 1000.0);
        }
        best * 1e9
    };
    let tk = time(&mut || quantize_row_q8_k(std::hint::black_box(&x), &mut qk));
    let t0 = time(&mut || quantize_row_q8_0(std::hint::black_box(&x), &mut q0));
    println!("quantize 4096 values: Q8_K {tk:.0} ns, Q8_0 {t0:.0} ns");
}

/// Latency of decode-sized products (µs per call, matrix in cache after the first call, so
/// this is the per-call cost: activation quantization, thread hand-off, compute), and matmul
/// throughput for a few batch sizes. Not a test:
/// `cargo test --release -p redlite-cpu --test kernels_kquants bench_shapes -- --ignored --nocapture`
#[test]
#[ignore]
fn bench_shapes() {
    use redlite_cpu::kernels::driver::{matmul, matvec, num_threads};
    use redlite_cpu::kernels::selftest::{random_activations, random_weights};
    use redlite_gguf::quant::GgmlType;
    use std::time::Instant;
    println!("threads: {}", num_threads());
    fn best_of(f: &mut dyn FnMut()) -> f64 {
        let mut best = f64::INFINITY;
        for _ in 0..7 {
            let t = Instant::now();
            let mut reps = 0;
            while t.elapsed().as_secs_f64() < 0.02 {
                f();
                reps += 1;
            }
            best = best.min(t.elapsed().as_secs_f64() / reps as f64);
        }
        best
    }
    for ty in [GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q8_0] {
        for (rows, cols) in [
            (512usize, 2048usize),
            (2048, 2048),
            (4096, 2048),
            (2048, 4096),
        ] {
            let w = random_weights(ty, rows, cols, 1);
            let x = random_activations(cols, 2);
            let mut y = vec![0.0f32; rows];
            let s = best_of(&mut || matvec(ty, &w, rows, cols, &x, &mut y).unwrap());
            // The same calls made from inside the pool (as an engine running its decode loop
            // on a pool thread would): no cold job injection, no wake-up of the caller.
            let (tx, rx) = std::sync::mpsc::channel();
            let (w2, x2) = (w.clone(), x.clone());
            rayon::spawn(move || {
                let mut y = vec![0.0f32; rows];
                let s = best_of(&mut || matvec(ty, &w2, rows, cols, &x2, &mut y).unwrap());
                let _ = tx.send(s);
            });
            let s_in = rx.recv().unwrap();
            println!(
                "{:<5} matvec {rows:>5}x{cols:<5} {:>8.1} us  {:>6.1} GB/s   from a pool thread {:>8.1} us",
                ty.name(),
                s * 1e6,
                w.len() as f64 / s / 1e9,
                s_in * 1e6
            );
        }
        let (rows, cols) = (8192usize, 4096usize);
        let w = random_weights(ty, rows, cols, 1);
        for n in [1usize, 4, 16, 64] {
            let xs = random_activations(cols * n, 3);
            let mut ys = vec![0.0f32; rows * n];
            let s = best_of(&mut || matmul(ty, &w, rows, cols, &xs, n, &mut ys).unwrap());
            println!(
                "{:<5} matmul {rows}x{cols} n={n:<3} {:>9.1} us  {:>7.1} us/token  weights {:>6.1} GB/s",
                ty.name(),
                s * 1e6,
                s * 1e6 / n as f64,
                w.len() as f64 / s / 1e9
            );
        }
    }
}

/// Single-thread Q4_K (or `REDLITE_BENCH_TYPES`) row-kernel speed on a matrix streamed once per
/// run: `REDLITE_BENCH_MIB` MiB (default 64: beyond the caches; 16 fits in L3) of rows of
/// `REDLITE_BENCH_COLS` columns (default 4096), the kernel that `matvec` runs per row at every
/// level, timed by this thread's CPU time (robust to other processes), best of 10. Prints ns per
/// 256-weight block. Also the rows kernel where the type has one (two rows per call).
/// `REDLITE_BENCH_COLS=2048 cargo test --release -p redlite-cpu --test kernels_kquants bench_stream -- --ignored --nocapture`
#[test]
#[ignore]
fn bench_stream_rows() {
    use redlite_cpu::kernels::selftest::{random_activations, random_weights};
    use redlite_cpu::kernels::{lookup_exact, lookup_rows, Isa, RowDot};
    use redlite_gguf::quant::GgmlType;
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(d)
    };
    let cols = env("REDLITE_BENCH_COLS", 4096);
    let mib = env("REDLITE_BENCH_MIB", 64);
    let x = random_activations(cols, 5);
    let mut xk = vec![BlockQ8K::ZERO; cols / 256];
    quantize_row_q8_k(&x, &mut xk);
    let types = std::env::var("REDLITE_BENCH_TYPES").unwrap_or("Q4_K".into());
    let best = |f: &dyn Fn() -> f32| {
        let mut best = f64::INFINITY;
        let mut sink = 0.0f32;
        for _ in 0..10 {
            let t = thread_cpu_ns().unwrap_or(0);
            sink += f();
            best = best.min((thread_cpu_ns().unwrap_or(0) - t) as f64 * 1e-9);
        }
        std::hint::black_box(sink);
        best
    };
    for name in types.split(',') {
        let Some(ty) = GgmlType::from_name(name.trim()) else {
            continue;
        };
        let rb = ty.row_bytes(cols as u64).unwrap() as usize;
        let rows = (mib << 20) / rb;
        let w = random_weights(ty, rows, cols, 3);
        let blocks = (rows * cols / 256) as f64;
        println!(
            "{}: {rows} × {cols}, {:.1} MB",
            ty.name(),
            w.len() as f64 / 1e6
        );
        for isa in Isa::available() {
            let Some(RowDot::Q8K(k)) = lookup_exact(ty, isa) else {
                continue;
            };
            let t = best(&|| w.chunks_exact(rb).map(|r| k(r, &xk)).sum::<f32>());
            println!(
                "  {:7} row kernel:  {:5.2} ns per block, {:6.2} GB/s",
                isa.name(),
                t * 1e9 / blocks,
                w.len() as f64 / t / 1e9
            );
        }
        #[cfg(target_arch = "x86_64")]
        if let (GgmlType::Q4K, Some(k), Some(f)) = (
            ty,
            redlite_cpu::kernels::q4k_paired_kernel(),
            redlite_cpu::kernels::q4k_paired_rows_kernel(),
        ) {
            let xp = redlite_cpu::kernels::q4k_paired_q8k(&xk);
            let t = best(&|| w.chunks_exact(rb).map(|r| k(r, &xp)).sum::<f32>());
            println!(
                "  paired  row kernel:  {:5.2} ns per block, {:6.2} GB/s",
                t * 1e9 / blocks,
                w.len() as f64 / t / 1e9
            );
            let out = std::cell::RefCell::new(vec![0.0f32; rows]);
            let t = best(&|| {
                let mut out = out.borrow_mut();
                f(&w, rb, &xp, &mut out);
                out.iter().sum::<f32>()
            });
            println!(
                "  paired  rows kernel: {:5.2} ns per block, {:6.2} GB/s",
                t * 1e9 / blocks,
                w.len() as f64 / t / 1e9
            );
        }
        // The decode tiles (what `bench kernel` and small files run for one-row Q4_K/Q6_K
        // products): one thread, then both halves of the groups on two threads.
        #[cfg(target_arch = "x86_64")]
        if let Some(tiles) =
            redlite_cpu::kernels::tiles_x86::DecodeTiles::repack(ty, &w, rows, cols)
        {
            let pairs = redlite_cpu::kernels::tiles_x86::pair_sums(&xk);
            let groups = rows / 16;
            let run = |g0: usize, g1: usize| {
                let mut out = vec![0.0f32; 16];
                let mut s = 0.0f32;
                for g in g0..g1 {
                    tiles.matvec_groups(g, &xk, &pairs, &mut out);
                    s += out[0];
                }
                s
            };
            let t = best(&|| run(0, groups));
            println!(
                "  tiles   1 thread:   {:5.2} ns per block",
                t * 1e9 / (groups * 16 * cols / 256) as f64
            );
            let halves = [(0, groups / 2), (groups / 2, groups / 2 * 2)];
            let best2 = two_thread_secs(&|i| {
                let (a, b) = halves[i];
                std::hint::black_box(run(a, b));
            });
            println!(
                "  tiles   2 threads: {:5.2} ns per block per thread",
                best2 * 1e9 / (groups / 2 * 16 * cols / 256) as f64
            );
        }
        // Both halves of the matrix at once on two threads (the 2-thread matvec's memory
        // traffic): each thread's CPU time per block, the slower thread's, best of 10.
        #[cfg(target_arch = "x86_64")]
        let paired = redlite_cpu::kernels::q4k_paired_kernel().filter(|_| ty == GgmlType::Q4K);
        #[cfg(not(target_arch = "x86_64"))]
        let paired: Option<fn(&[u8], &[BlockQ8K]) -> f32> = None;
        let best_kernel = match lookup_exact(ty, Isa::best()) {
            Some(RowDot::Q8K(k)) => Some(k),
            _ => None,
        };
        for (label, k, x) in [
            ("paired ", paired, {
                #[cfg(target_arch = "x86_64")]
                {
                    redlite_cpu::kernels::q4k_paired_q8k(&xk)
                }
                #[cfg(not(target_arch = "x86_64"))]
                {
                    xk.clone()
                }
            }),
            ("best   ", best_kernel, xk.clone()),
        ] {
            let Some(k) = k else { continue };
            let half = rows / 2 * rb;
            let parts = [&w[..half], &w[half..2 * half]];
            let best2 = two_thread_secs(&|i| {
                let s: f32 = parts[i].chunks_exact(rb).map(|r| k(r, &x)).sum();
                std::hint::black_box(s);
            });
            let ns = best2 * 1e9 / (half / rb * cols / 256) as f64;
            println!(
                "  {label} 2 threads: {ns:5.2} ns per block per thread, {:6.2} GB/s together",
                2.0 * half as f64 / best2 / 1e9
            );
        }
        if let Some(f) = lookup_rows(ty, Isa::best()) {
            let out = std::cell::RefCell::new(vec![0.0f32; rows]);
            let t = best(&|| {
                let mut out = out.borrow_mut();
                f(&w, rb, &xk, &mut out);
                out.iter().sum::<f32>()
            });
            println!(
                "  {:7} rows kernel: {:5.2} ns per block, {:6.2} GB/s",
                Isa::best().name(),
                t * 1e9 / blocks,
                w.len() as f64 / t / 1e9
            );
        }
    }
}

/// The Q4_K kernels of every level (and the paired-activation kernels at AVX-512 VNNI, rows form
/// included) give the scalar kernel's result bit for bit for every row length of 1 to 11 blocks
/// (the four-block steps and each remainder).
#[test]
fn q4k_kernels_match_scalar_every_length() {
    use redlite_cpu::kernels::selftest::{random_activations, random_weights};
    use redlite_cpu::kernels::{lookup_exact, Isa, RowDot};
    use redlite_gguf::quant::GgmlType;
    let Some(RowDot::Q8K(scalar)) = lookup_exact(GgmlType::Q4K, Isa::Scalar) else {
        panic!("no scalar Q4_K kernel");
    };
    for nb in 1..=11usize {
        let (rows, cols) = (5usize, 256 * nb);
        let w = random_weights(GgmlType::Q4K, rows, cols, nb as u64);
        let x = random_activations(cols, 100 + nb as u64);
        let mut xk = vec![BlockQ8K::ZERO; nb];
        quantize_row_q8_k(&x, &mut xk);
        let rb = w.len() / rows;
        let want: Vec<u32> = w
            .chunks_exact(rb)
            .map(|r| scalar(r, &xk).to_bits())
            .collect();
        for isa in Isa::available() {
            if let Some(RowDot::Q8K(k)) = lookup_exact(GgmlType::Q4K, isa) {
                let got: Vec<u32> = w.chunks_exact(rb).map(|r| k(r, &xk).to_bits()).collect();
                assert_eq!(got, want, "{} blocks, {}", nb, isa.name());
            }
        }
        #[cfg(target_arch = "x86_64")]
        if let (Some(k), Some(f)) = (
            redlite_cpu::kernels::q4k_paired_kernel(),
            redlite_cpu::kernels::q4k_paired_rows_kernel(),
        ) {
            let xp = redlite_cpu::kernels::q4k_paired_q8k(&xk);
            let got: Vec<u32> = w.chunks_exact(rb).map(|r| k(r, &xp).to_bits()).collect();
            assert_eq!(got, want, "{nb} blocks, paired");
            let mut out = vec![0.0f32; rows];
            f(&w, rb, &xp, &mut out);
            let got: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "{nb} blocks, paired rows");
        }
    }
}

/// `work(0)` and `work(1)` on two threads at once: the slower thread's CPU time, best of 10.
fn two_thread_secs(work: &(dyn Fn(usize) + Sync)) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..10 {
        let worst = std::thread::scope(|sc| {
            let parts: Vec<_> = (0..2)
                .map(|i| {
                    sc.spawn(move || {
                        let t = thread_cpu_ns().unwrap_or(0);
                        work(i);
                        (thread_cpu_ns().unwrap_or(0) - t) as f64 * 1e-9
                    })
                })
                .collect();
            parts
                .into_iter()
                .map(|p| p.join().unwrap())
                .fold(0.0, f64::max)
        });
        best = best.min(worst);
    }
    best
}
