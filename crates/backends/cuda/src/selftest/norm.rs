//! Self-test of the RMSNorm kernels (`ops::norm`), the router-fused one included.

use super::*;

impl Runner<'_> {
    /// `res_norm_router` (`REDLITE_CUDA_NORM_ROUTER`: the next norm and the router's logits in one
    /// launch) bit for bit `res_norm_q8` and then `matvec3_x_f32` on its output.
    pub(super) fn res_norm_router(&mut self) {
        let eps = 1e-6f32;
        for (rows, r0, parts, rpw, early) in [
            (2048usize, 67usize, 4usize, 1usize, 1i32),
            (2048, 512, 4, 1, 1),
            (2048, 512, 4, 1, 0),
            (2048, 512, 4, 1, 2),
            (2048, 67, 4, 1, 2),
            (2048, 512, 4, 4, 1),
            (512, 33, 2, 2, 1),
            (4096, 40, 4, 1, 1),
        ] {
            let ys = self.rng.normals(rows, 1.0);
            let nw: Vec<f32> = (0..rows).map(|_| 0.5 + self.rng.uniform() as f32).collect();
            let b0 = random_weights(&mut self.rng, GgmlType::F32, r0, rows);
            let b1 = random_weights(&mut self.rng, GgmlType::F32, 1, rows);
            let r = (|| {
                let (w0, w1) = (ops::upload(self.gpu, &b0)?, ops::upload(self.gpu, &b1)?);
                let got = ops::res_norm_router(
                    self.gpu,
                    &ys,
                    &nw,
                    eps,
                    (&w0, r0),
                    (&w1, 1),
                    (parts, rpw, early),
                )?;
                let (yn2, xq2) = ops::res_norm_q8(self.gpu, &ys, rows, &nw, eps)?;
                same_bits(
                    "res_norm_router's yn differs from res_norm_q8's",
                    &got.yn,
                    &yn2,
                )?;
                same_bytes(
                    "res_norm_router's q8 row differs from res_norm_q8's",
                    &got.xq,
                    &xq2,
                )?;
                // Against the decode router's form (one row a warp group) whatever the kernel's.
                let e0 = ops::matvec3_x_f32(self.gpu, &w0, (r0, rows), &yn2, (parts, 1, 1))?;
                let e1 = ops::matvec3_x_f32(self.gpu, &w1, (1, rows), &yn2, (parts, 1, 1))?;
                same_bits(
                    "res_norm_router's logits differ from matvec3_x_f32's",
                    &got.y0,
                    &e0,
                )?;
                same_bits(
                    "res_norm_router's gate logit differs from matvec3_x_f32's",
                    &got.y1,
                    &e1,
                )?;
                Ok((0.0, TOL_F32))
            })();
            self.record(
                "res_norm_router",
                format!("{rows} values, {r0} + 1 rows, parts={parts} rows/warp={rpw} early={early}: = res_norm_q8 + matvec3_x_f32 bit for bit"),
                r,
            );
        }
    }

    pub(super) fn norms(&mut self) {
        // RMSNorm.
        let (rows, n, eps) = (4usize, 2048usize, 1e-6f32);
        let x = self.rng.normals(rows * n, 1.0);
        let w = self.rng.normals(n, 1.0);
        let r = ops::rms_norm(self.gpu, &x, &w, n, eps).map(|y| {
            let reference: Vec<f64> = x
                .chunks_exact(n)
                .flat_map(|row| {
                    let ms = row.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / n as f64;
                    let inv = 1.0 / (ms + f64::from(eps)).sqrt();
                    row.iter()
                        .zip(&w)
                        .map(move |(&v, &g)| f64::from(v) * inv * f64::from(g))
                        .collect::<Vec<_>>()
                })
                .collect();
            (rel_err(&y, &reference), TOL_F32)
        });
        self.record("rms_norm", format!("{rows}x{n}"), r);

        // Gated RMSNorm (DeltaNet output).
        let (rows, n) = (32usize, 128usize);
        let o = self.rng.normals(rows * n, 0.1);
        let z = self.rng.normals(rows * n, 1.0);
        let w = self.rng.normals(n, 1.0);
        let r = ops::rms_norm_gated(self.gpu, &o, &w, &z, n, eps).map(|y| {
            let mut reference = Vec::new();
            for (orow, zrow) in o.chunks_exact(n).zip(z.chunks_exact(n)) {
                let ms = orow.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / n as f64;
                let inv = 1.0 / (ms + f64::from(eps)).sqrt();
                for i in 0..n {
                    reference.push(
                        f64::from(orow[i]) * inv * f64::from(w[i]) * silu64(f64::from(zrow[i])),
                    );
                }
            }
            (rel_err(&y, &reference), TOL_F32)
        });
        self.record("rms_norm_gated", format!("{rows}x{n}"), r);

        // L2 normalisation with a scale (DeltaNet q).
        let (rows, n) = (16usize, 128usize);
        let x = self.rng.normals(rows * n, 3.0);
        let scale = 1.0 / (n as f32).sqrt();
        let r = ops::l2_normalize(self.gpu, &x, n, 1e-6, scale).map(|y| {
            let reference: Vec<f64> = x
                .chunks_exact(n)
                .flat_map(|row| {
                    let ss = row.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>();
                    let inv = 1.0 / (ss + 1e-6).sqrt();
                    row.iter()
                        .map(move |&v| f64::from(v) * inv * f64::from(scale))
                        .collect::<Vec<_>>()
                })
                .collect();
            (rel_err(&y, &reference), TOL_F32)
        });
        self.record("l2_normalize", format!("{rows}x{n}"), r);

        // Element-wise kernels.
        let n = 10_007usize;
        let a = self.rng.normals(n, 1.0);
        let b = self.rng.normals(n, 2.0);
        let pairs = |f: &dyn Fn(f64, f64) -> f64| -> Vec<f64> {
            a.iter()
                .zip(&b)
                .map(|(&x, &y)| f(f64::from(x), f64::from(y)))
                .collect()
        };
        let r = ops::add(self.gpu, &a, &b).map(|y| (rel_err(&y, &pairs(&|x, y| x + y)), TOL_F32));
        self.record("add_inplace", format!("n={n}"), r);
        let r = ops::sigmoid_mul(self.gpu, &a, &b)
            .map(|y| (rel_err(&y, &pairs(&|x, g| x / (1.0 + (-g).exp()))), TOL_F32));
        self.record("sigmoid_mul", format!("n={n}"), r);
        let r = ops::swiglu(self.gpu, &a, &b)
            .map(|y| (rel_err(&y, &pairs(&|g, u| silu64(g) * u)), TOL_F32));
        self.record("swiglu", format!("n={n}"), r);
    }
}
