//! Self-test of the draw (`ops::sampling`): argmax and top-k sampling.

use super::*;

impl Runner<'_> {
    pub(super) fn argmax(&mut self) {
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

    pub(super) fn sample_topk(&mut self) {
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

/// The engine sampler's draw (temperature, top-k, top-p, min-p) in f64, on one row.
pub(super) fn sample_ref(l: &[f32], k: usize, temp: f64, top_p: f64, min_p: f64, u: f64) -> usize {
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
