//! Kernel tests against the ggml fixtures in `shared/reference/quant` (four levels up: this crate sits
//! at `crates/backends/cpu`) and the scalar reference
//! dequantizers of `redlite-gguf`.

use redlite_cpu::kernels::q8::{quantize_row_q8_0, quantize_row_q8_k, BlockQ8K, BlockQ8_0};
use std::path::PathBuf;

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
                    let t = Instant::now();
                    for _ in 0..reps {
                        for wr in w.chunks_exact(rb) {
                            sink += call(std::hint::black_box(wr));
                        }
                    }
                    let s = t.elapsed().as_secs_f64();
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
