//! The routed-expert part of a decode step on a real file, one thread, timed by this thread's
//! CPU time (robust to other processes on a shared machine): for `REDLITE_BENCH_STEPS` random
//! (layer, 10 experts) draws, gate and up of the 10 experts in one `matvec_batch`, then their
//! downs, read in place from the file's memory map as the backend does. Prints ns per IQ2_XXS
//! block (or whatever type the experts have) and GB/s of expert bytes.
//!
//! `REDLITE_BENCH_MODEL=/work/full.gguf REDLITE_PARALLEL_MIN_KB=1000000 cargo test --release \
//!  -p redlite-cpu --test moe_decode_bench -- --ignored --nocapture`
//! (`REDLITE_PARALLEL_MIN_KB` keeps the products on this thread).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use redlite_cpu::kernels::fused::{matvec_batch, Product};
use redlite_gguf::GgufFile;

mod cpu_time;
use cpu_time::thread_cpu_ns;

/// One layer's stacked expert tensor: its bytes and the shape of one expert.
#[derive(Clone, Copy)]
struct Stack<'a> {
    ty: redlite_gguf::GgmlType,
    bytes: &'a [u8],
    rows: usize,
    cols: usize,
}

impl<'a> Stack<'a> {
    fn expert(&self, e: usize) -> Product<'a> {
        let n = self.bytes.len() / self.experts();
        Product {
            ty: self.ty,
            w: &self.bytes[e * n..(e + 1) * n],
            rows: self.rows,
            cols: self.cols,
            input: 0,
            tiles: None,
        }
    }

    fn experts(&self) -> usize {
        self.bytes.len() / (self.ty.row_bytes(self.cols as u64).unwrap() as usize * self.rows)
    }
}

fn stack<'a>(f: &'a GgufFile, name: &str) -> Option<Stack<'a>> {
    let t = f.tensor(name)?;
    Some(Stack {
        ty: t.ty,
        bytes: f.tensor_data(t),
        rows: t.dims[1] as usize,
        cols: t.dims[0] as usize,
    })
}

#[test]
#[ignore = "benchmark on a model file (REDLITE_BENCH_MODEL)"]
fn bench_moe_decode() {
    let Ok(path) = std::env::var("REDLITE_BENCH_MODEL") else {
        println!("set REDLITE_BENCH_MODEL");
        return;
    };
    let steps: usize = std::env::var("REDLITE_BENCH_STEPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400);
    let f = GgufFile::open(&path).expect("model file");
    // Map every page now, as the backend does at load (else first touches are page faults).
    // SAFETY: the range is the file's live read-only mapping.
    let map = f.bytes();
    unsafe {
        libc::madvise(
            map.as_ptr() as *mut libc::c_void,
            map.len(),
            libc::MADV_POPULATE_READ,
        )
    };
    let mut layers = Vec::new();
    for l in 0.. {
        let (Some(g), Some(u), Some(d)) = (
            stack(&f, &format!("blk.{l}.ffn_gate_exps.weight")),
            stack(&f, &format!("blk.{l}.ffn_up_exps.weight")),
            stack(&f, &format!("blk.{l}.ffn_down_exps.weight")),
        ) else {
            break;
        };
        layers.push((g, u, d));
    }
    assert!(!layers.is_empty(), "no expert tensors in {path}");
    // `REDLITE_BENCH_LAYERS=N`: only the first N layers.
    if let Some(n) = std::env::var("REDLITE_BENCH_LAYERS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        layers.truncate(n.max(1));
    }
    // `REDLITE_BENCH_OWNED=N`: the first N layers' experts copied into heap memory (to compare
    // with the memory map).
    let owned_n: usize = std::env::var("REDLITE_BENCH_OWNED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    if owned_n > 0 {
        // Leaked copies: the bench process ends after this test.
        let leak = |b: &[u8]| -> &'static [u8] { Box::leak(b.to_vec().into_boxed_slice()) };
        let re = |s: &Stack| Stack {
            bytes: leak(s.bytes),
            ..*s
        };
        layers = layers
            .iter()
            .take(owned_n)
            .map(|(g, u, d)| (re(g), re(u), re(d)))
            .collect();
    }
    let mut rng = StdRng::seed_from_u64(7);
    let (g0, _, d0) = &layers[0];
    let x: Vec<f32> = (0..g0.cols).map(|_| rng.random_range(-1.0..1.0)).collect();
    let h: Vec<Vec<f32>> = (0..10)
        .map(|_| (0..d0.cols).map(|_| rng.random_range(-1.0..1.0)).collect())
        .collect();
    let (mut ns_gu, mut ns_down, mut bytes_gu, mut bytes_down) = (0u64, 0u64, 0usize, 0usize);
    let mut outs = vec![Vec::new(); 20];
    let mut down_outs = vec![Vec::new(); 10];
    for _ in 0..steps {
        let (g, u, d) = &layers[rng.random_range(0..layers.len())];
        let mut chosen = Vec::new();
        while chosen.len() < 10 {
            let e = rng.random_range(0..g.experts());
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        let gu: Vec<Product> = chosen
            .iter()
            .flat_map(|&e| [g.expert(e), u.expert(e)])
            .collect();
        let t0 = thread_cpu_ns().unwrap_or(0);
        matvec_batch(&gu, &[&x], &mut outs).unwrap();
        let t1 = thread_cpu_ns().unwrap_or(0);
        let downs: Vec<Product> = chosen
            .iter()
            .enumerate()
            .map(|(i, &e)| Product {
                input: i,
                ..d.expert(e)
            })
            .collect();
        let inputs: Vec<&[f32]> = h.iter().map(|v| v.as_slice()).collect();
        let t2 = thread_cpu_ns().unwrap_or(0);
        matvec_batch(&downs, &inputs, &mut down_outs).unwrap();
        let t3 = thread_cpu_ns().unwrap_or(0);
        ns_gu += t1 - t0;
        ns_down += t3 - t2;
        bytes_gu += gu.iter().map(|p| p.w.len()).sum::<usize>();
        bytes_down += downs.iter().map(|p| p.w.len()).sum::<usize>();
        std::hint::black_box(&outs);
    }
    let block = g0.ty.row_bytes(256).unwrap() as f64;
    for (what, ns, bytes) in [("gate+up", ns_gu, bytes_gu), ("down", ns_down, bytes_down)] {
        println!(
            "{what:8} {:6.2} ns per {} block, {:6.2} GB/s ({} steps, {:.0} MB)",
            ns as f64 / (bytes as f64 / block),
            g0.ty,
            bytes as f64 / ns as f64,
            steps,
            bytes as f64 / 1e6
        );
    }
}
