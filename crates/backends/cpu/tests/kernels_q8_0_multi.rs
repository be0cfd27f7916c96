//! The multi-row Q8_0 matmul (the speculative verify pass and prefill of Q8_0 models) gives
//! every row bit for bit what the one-row matvec gives, at every kernel level: the 4-row kernel
//! and the lane kernel (from 3 rows at AVX-512 VNNI: groups of 16 rows, a last group of 9-15
//! rows, or of 3-8 rows in 256-bit vectors; 1-2 rows left over take the 4-row kernel).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use redlite_cpu::kernels::driver::{matmul, matmul_isa, matmul_many, matvec_isa};
use redlite_cpu::kernels::Isa;
use redlite_gguf::quant::GgmlType;

/// `blocks` random Q8_0 blocks: a small positive f16 scale, then 32 quants in −127..=127.
fn random_q8_0(rng: &mut StdRng, blocks: usize) -> Vec<u8> {
    let mut w = Vec::with_capacity(blocks * 34);
    for _ in 0..blocks {
        let d = half::f16::from_f32(rng.random_range(0.001f32..0.02));
        w.extend_from_slice(&d.to_bits().to_le_bytes());
        w.extend((0..32).map(|_| rng.random_range(-127i8..=127) as u8));
    }
    w
}

#[test]
fn q8_0_matmul_rows_match_matvec_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(7);
    // 600 rows × 384 columns: above the parallel threshold once n ≥ 2 (tasks split the rows).
    for (rows, cols) in [(5, 64), (7, 416), (600, 384)] {
        let w = random_q8_0(&mut rng, rows * cols / 32);
        let xs: Vec<f32> = (0..130 * cols)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        for isa in Isa::available() {
            for n in [
                2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 18, 19, 22, 23, 30, 31, 32, 33, 40, 47, 48, 49,
                64, 65, 110, 128, 130,
            ] {
                let mut ys = vec![0.0f32; n * rows];
                matmul_isa(
                    isa,
                    GgmlType::Q8_0,
                    &w,
                    rows,
                    cols,
                    &xs[..n * cols],
                    n,
                    &mut ys,
                )
                .unwrap();
                for j in 0..n {
                    let mut y = vec![0.0f32; rows];
                    let x = &xs[j * cols..][..cols];
                    matvec_isa(isa, GgmlType::Q8_0, &w, rows, cols, x, &mut y).unwrap();
                    for r in 0..rows {
                        assert_eq!(
                            ys[j * rows + r].to_bits(),
                            y[r].to_bits(),
                            "{} {rows}x{cols} n={n} row {j} out {r}",
                            isa.name()
                        );
                    }
                }
            }
        }
    }
}

/// Several weights over the same rows (`matmul_many`: the rows quantized and repacked once)
/// give each weight exactly what `matmul` gives it alone.
#[test]
fn q8_0_matmul_many_matches_matmul_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(9);
    let cols = 384;
    let shapes = [600usize, 7, 160];
    let ws: Vec<Vec<u8>> = shapes
        .iter()
        .map(|&rows| random_q8_0(&mut rng, rows * cols / 32))
        .collect();
    let xs: Vec<f32> = (0..130 * cols)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    for n in [1, 2, 3, 9, 16, 17, 32, 33, 64, 128, 130] {
        let x = &xs[..n * cols];
        let mut got: Vec<Vec<f32>> = shapes.iter().map(|&r| vec![0.0f32; n * r]).collect();
        {
            let products: Vec<(&[u8], usize)> = ws
                .iter()
                .zip(&shapes)
                .map(|(w, &r)| (w.as_slice(), r))
                .collect();
            let mut outs: Vec<&mut [f32]> = got.iter_mut().map(|g| g.as_mut_slice()).collect();
            matmul_many(GgmlType::Q8_0, &products, cols, x, n, &mut outs).unwrap();
        }
        for ((w, &rows), g) in ws.iter().zip(&shapes).zip(&got) {
            let mut want = vec![0.0f32; n * rows];
            matmul(GgmlType::Q8_0, w, rows, cols, x, n, &mut want).unwrap();
            let same = want.iter().zip(g).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "n={n} rows={rows}");
        }
    }
}

/// Time of an n-row Q8_0 matmul against n matvecs (n from `Q8_BENCH_N`, default 8; the shape
/// from `Q8_BENCH_SHAPE`, default `10240x384`, the demo model's lm_head; in cache). `RAYON_NUM_THREADS=1 cargo test --release -p
/// redlite-cpu --test kernels_q8_0_multi -- --ignored --nocapture`.
#[test]
#[ignore]
fn bench_q8_0_matmul_vs_matvec() {
    let mut rng = StdRng::seed_from_u64(9);
    let n = std::env::var("Q8_BENCH_N").map_or(8, |v| v.parse().expect("Q8_BENCH_N: a count"));
    let (rows, cols) = std::env::var("Q8_BENCH_SHAPE").map_or((10240, 384), |v| {
        let (r, c) = v.split_once('x').expect("Q8_BENCH_SHAPE: ROWSxCOLS");
        (r.parse().expect("rows"), c.parse().expect("cols"))
    });
    let w = random_q8_0(&mut rng, rows * cols / 32);
    let xs: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
    let isa = Isa::best();
    let mut ys = vec![0.0f32; n * rows];
    let mut y = vec![0.0f32; rows];
    let time = |f: &mut dyn FnMut()| {
        let mut best = f64::MAX;
        for _ in 0..30 {
            let t = std::time::Instant::now();
            f();
            best = best.min(t.elapsed().as_secs_f64());
        }
        best
    };
    let mm = time(&mut || {
        matmul_isa(isa, GgmlType::Q8_0, &w, rows, cols, &xs, n, &mut ys).unwrap();
    });
    let mv = time(&mut || {
        for j in 0..n {
            let x = &xs[j * cols..][..cols];
            matvec_isa(isa, GgmlType::Q8_0, &w, rows, cols, x, &mut y).unwrap();
        }
    });
    let blocks = (rows * cols / 32 * n) as f64;
    println!(
        "Q8_0 {rows}x{cols}, {n} rows: matmul {:.2} ms ({:.2} ns/block·row), {n} matvecs {:.2} ms ({:.2} ns/block·row)",
        mm * 1e3,
        mm * 1e9 / blocks,
        mv * 1e3,
        mv * 1e9 / blocks
    );
}
