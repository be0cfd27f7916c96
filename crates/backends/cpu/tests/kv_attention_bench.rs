//! Speed of decode attention over each KV element type at the full-size head layout (16 query
//! heads, 2 KV heads of 256), ignored (a measurement, not a check):
//! `cargo test --release -p redlite-cpu --test kv_attention_bench -- --ignored --nocapture`
//! Prints the median time of one token's attention over `ctx` cached positions per ISA, and the
//! KV bytes it streams.

use std::time::Instant;

use redlite_cpu::attention::attention_online_isa;
use redlite_cpu::kernels::Isa;
use redlite_model::state::KvCache;
use redlite_model::KvType;

#[test]
#[ignore = "timing; run by hand"]
fn kv_attention_speed() {
    let (n_heads, kv_heads, hd) = (16, 2, 256);
    let scale = 1.0 / (hd as f32).sqrt();
    let mut seed = 1u64;
    let mut next = move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    };
    let q: Vec<f32> = (0..n_heads * hd).map(|_| next()).collect();
    // REDLITE_BENCH_CTX=N measures one context length instead of 4096 and 32768.
    let ctxs: Vec<usize> = match std::env::var("REDLITE_BENCH_CTX") {
        Ok(v) => vec![v.parse().expect("REDLITE_BENCH_CTX: a number")],
        Err(_) => vec![4096, 32768],
    };
    for ctx in ctxs {
        let rows: Vec<(Vec<f32>, Vec<f32>)> = (0..ctx)
            .map(|_| {
                let k = (0..kv_heads * hd).map(|_| 4.0 * next()).collect();
                let v = (0..kv_heads * hd).map(|_| next()).collect();
                (k, v)
            })
            .collect();
        for kv_type in KvType::ALL {
            let mut kv = KvCache::with_type(kv_heads * hd, kv_type);
            for (k, v) in &rows {
                kv.push(k, v);
            }
            let mb = 2.0 * kv_type.bytes_for((ctx * kv_heads * hd) as u64) as f64 / 1e6;
            for isa in Isa::available() {
                let mut times: Vec<f64> = (0..15)
                    .map(|_| {
                        let t = Instant::now();
                        std::hint::black_box(attention_online_isa(
                            isa, &q, &kv, n_heads, hd, scale,
                        ));
                        t.elapsed().as_secs_f64() * 1e3
                    })
                    .collect();
                times.sort_by(f64::total_cmp);
                println!(
                    "ctx {ctx:>6} {kv_type:>5} {:>7}: {:7.3} ms median ({mb:.1} MB of K+V per layer)",
                    isa.name(),
                    times[times.len() / 2]
                );
            }
        }
    }
}
