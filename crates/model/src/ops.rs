//! The elementary f32 operations of the oracle, written as plain loops so each reads like its formula.

/// A dense row-major matrix `[rows, cols]`: `y = W·x` takes `x` of length `cols` to `y` of length `rows`.
/// GGUF stores a linear layer `[in, out]` with `ne0 = in` contiguous, which is exactly this layout.
#[derive(Debug, Clone)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl Matrix {
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// `y = W·x`.
    pub fn matvec(&self, x: &[f32]) -> Vec<f32> {
        assert_eq!(x.len(), self.cols, "matvec: input length");
        (0..self.rows).map(|r| dot(self.row(r), x)).collect()
    }
}

/// Σ a_i·b_i, summed left to right.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut s = 0.0f32;
    for i in 0..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// RMSNorm: `y = x · rsqrt(mean(x²) + eps) · w`. GGUF files already fold the `1 +` of
/// Qwen3-Next's zero-centred norms into `w`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut y = vec![0.0f32; x.len()];
    rms_norm_into(x, w, eps, &mut y);
    y
}

/// [`rms_norm`] into `y` (no allocation).
pub fn rms_norm_into(x: &[f32], w: &[f32], eps: f32, y: &mut [f32]) {
    let inv = inv_rms(x, eps);
    for ((y, &v), &g) in y.iter_mut().zip(x).zip(w) {
        *y = v * inv * g;
    }
}

/// `1 / sqrt(mean(x²) + eps)`.
pub fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ms = sum_squares(x) / x.len() as f32;
    1.0 / (ms + eps).sqrt()
}

/// `Σ x_i²` as 16 lane sums (lane `l` adds `x_l², x_{l+16}², …`; independent chains that
/// vectorise, where one left-to-right chain waits on each add), then the lanes and the tail
/// (`len % 16` values) added left to right.
pub fn sum_squares(x: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l += v * v;
        }
    }
    let mut s = 0.0f32;
    for l in lanes {
        s += l;
    }
    for v in chunks.remainder() {
        s += v * v;
    }
    s
}

/// L2-normalise in place: `x · rsqrt(Σx² + eps)`.
pub fn l2_normalize(x: &mut [f32], eps: f32) {
    let ss = sum_squares(x);
    let inv = 1.0 / (ss + eps).sqrt();
    for v in x {
        *v *= inv;
    }
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `ln(1 + eˣ)`, linear above 20 as PyTorch's `softplus` is.
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Softmax in place, max-subtracted.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// `y += a·x`.
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// Rotary position embedding, NeoX pairing ("rotate_half"), on the first `rope_dims` values of one head:
/// value `i` pairs with value `i + rope_dims/2`, rotated by `pos · θ^(−2i/rope_dims)`.
/// The angles are computed in f64 and rounded once.
pub fn rope_neox(head: &mut [f32], pos: usize, rope_dims: usize, theta: f64) {
    rope_neox_with(head, &rope_angles(pos, rope_dims, theta));
}

/// `(sin, cos)` of each rotated pair's angle at position `pos` ([`rope_neox`]'s), computed once
/// for all the heads of a position.
pub fn rope_angles(pos: usize, rope_dims: usize, theta: f64) -> Vec<(f32, f32)> {
    (0..rope_dims / 2)
        .map(|i| {
            let inv_freq = theta.powf(-2.0 * i as f64 / rope_dims as f64);
            let angle = pos as f64 * inv_freq;
            (angle.sin() as f32, angle.cos() as f32)
        })
        .collect()
}

/// [`rope_neox`] with the position's angles from [`rope_angles`].
pub fn rope_neox_with(head: &mut [f32], angles: &[(f32, f32)]) {
    let half = angles.len();
    for (i, &(sin, cos)) in angles.iter().enumerate() {
        let (a, b) = (head[i], head[i + half]);
        head[i] = a * cos - b * sin;
        head[i + half] = b * cos + a * sin;
    }
}

/// Indices of the `k` largest values, largest first (ties: lower index first): a selection of
/// the `k` first in that order, then a sort of those alone (linear in `x.len()`, the router's
/// 512 probabilities a layer), which gives what sorting all of `x` and keeping `k` gives.
pub fn top_k(x: &[f32], k: usize) -> Vec<usize> {
    if k == 0 {
        return Vec::new();
    }
    let order = |&a: &usize, &b: &usize| x[b].total_cmp(&x[a]).then(a.cmp(&b));
    let mut idx: Vec<usize> = (0..x.len()).collect();
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, order);
        idx.truncate(k);
    }
    idx.sort_unstable_by(order);
    idx
}

#[cfg(test)]
mod tests {
    use super::top_k;

    /// The selection gives what sorting every index by (value descending, index ascending) and
    /// keeping the first `k` gives, ties and infinities included.
    #[test]
    fn top_k_is_the_head_of_the_full_sort() {
        let mut seed = 7u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as u32
        };
        for n in [1usize, 2, 9, 64, 512] {
            // Few distinct values, so ties are common.
            let mut x: Vec<f32> = (0..n).map(|_| (next() % 17) as f32 - 8.0).collect();
            x[n / 2] = f32::NEG_INFINITY;
            x[0] = f32::INFINITY;
            let mut all: Vec<usize> = (0..n).collect();
            all.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
            for k in [0, 1, 2, 10, n - 1, n, n + 3] {
                assert_eq!(top_k(&x, k), all[..k.min(n)].to_vec(), "n {n} k {k}");
            }
        }
    }
}
