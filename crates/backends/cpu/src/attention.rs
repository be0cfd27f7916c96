//! Attention decode on the CPU: one pass over the KV cache per query head with an online softmax
//! (running maximum and normaliser, values accumulated as they stream by), heads in parallel,
//! compiled for the widest vector unit present.

use rayon::prelude::*;
use redlite_model::state::KvCache;

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

/// One query head against KV head `g`: `Σ_j softmax(q·k_j·scale)_j · v_j` in one pass.
#[inline(always)]
fn head_online(q: &[f32], kv: &KvCache, g: usize, hd: usize, scale: f32) -> Vec<f32> {
    let mut acc = vec![0.0f32; hd];
    let (mut max, mut norm) = (f32::NEG_INFINITY, 0.0f32);
    for j in 0..kv.len() {
        let s = dot16(q, &kv.key(j)[g * hd..(g + 1) * hd]) * scale;
        if s > max {
            let c = (max - s).exp();
            for a in acc.iter_mut() {
                *a *= c;
            }
            norm *= c;
            max = s;
        }
        let p = (s - max).exp();
        norm += p;
        for (a, v) in acc.iter_mut().zip(&kv.value(j)[g * hd..(g + 1) * hd]) {
            *a += p * v;
        }
    }
    let inv = 1.0 / norm;
    acc.iter_mut().for_each(|a| *a *= inv);
    acc
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn head_avx512(q: &[f32], kv: &KvCache, g: usize, hd: usize, scale: f32) -> Vec<f32> {
    head_online(q, kv, g, hd, scale)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn head_avx2(q: &[f32], kv: &KvCache, g: usize, hd: usize, scale: f32) -> Vec<f32> {
    head_online(q, kv, g, hd, scale)
}

fn head(q: &[f32], kv: &KvCache, g: usize, hd: usize, scale: f32) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    {
        if Isa::active() >= Isa::Avx512 {
            // SAFETY: `Isa::active` only reports AVX-512 when the CPU supports it.
            return unsafe { head_avx512(q, kv, g, hd, scale) };
        }
        if Isa::active() >= Isa::Avx2 {
            // SAFETY: as above, for AVX2 + FMA.
            return unsafe { head_avx2(q, kv, g, hd, scale) };
        }
    }
    head_online(q, kv, g, hd, scale)
}

/// Every query head of one token (`q` is `[n_heads, hd]`), heads in parallel.
pub fn attention_online(
    q: &[f32],
    kv: &KvCache,
    n_heads: usize,
    hd: usize,
    scale: f32,
) -> Vec<f32> {
    let group = n_heads / (kv.width / hd).max(1);
    (0..n_heads)
        .into_par_iter()
        .map(|h| head(&q[h * hd..(h + 1) * hd], kv, h / group.max(1), hd, scale))
        .collect::<Vec<_>>()
        .concat()
}

#[cfg(test)]
mod tests {
    use super::*;
    use redlite_model::backend::attention_two_pass;

    #[test]
    fn online_softmax_matches_two_pass() {
        let (nh, nkv, hd, n) = (8, 2, 64, 300);
        let mut kv = KvCache::new(nkv * hd);
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
        let q: Vec<f32> = (0..nh * hd).map(|_| next()).collect();
        let a = attention_two_pass(&q, &kv, nh, hd, 0.125);
        let b = attention_online(&q, &kv, nh, hd, 0.125);
        let max_ref = a.iter().fold(0f32, |m, x| m.max(x.abs()));
        let max_d = a
            .iter()
            .zip(&b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(max_d / max_ref < 1e-5, "{max_d} / {max_ref}");
    }
}
