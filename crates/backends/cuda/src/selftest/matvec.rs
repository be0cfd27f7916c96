//! Self-test of the matrix-vector products and GEMMs (`ops::matvec`, `ops::gemm`) and the
//! embedding rows, against f64 products of the reference dequantization.

use super::*;

impl Runner<'_> {
    pub(super) fn matvec(&mut self, ty: GgmlType) {
        let be = ty.block_elems();
        let cases: Vec<(usize, usize, usize)> = if be == 1 {
            vec![(5, 100, 2), (37, 2304, 1), (512, 4096, 1), (64, 1024, 3)]
        } else {
            vec![(1, be, 1), (37, 2304, 1), (512, 4096, 1), (64, 1024, 3)]
        };
        for (rows, cols, n) in cases {
            let bytes = random_weights(&mut self.rng, ty, rows, cols);
            let xs = self.rng.normals(n * cols, 1.0);
            let r = (|| {
                let w = ops::upload(self.gpu, &bytes)?;
                let y = ops::matvec(self.gpu, ty, &w, rows, cols, &xs, n)?;
                let wf =
                    dequantize_to_vec(ty, &bytes).map_err(|e| CudaError::Invalid(e.to_string()))?;
                let (reference, magnitude) = products64(&wf, &xs[..n * cols], rows, cols);
                Ok((abs_err(&y, &reference) / magnitude, TOL_F32))
            })();
            self.record(
                &format!("matvec {}", ty.name()),
                format!("{rows}x{cols} n={n}"),
                r,
            );
        }
    }

    /// `gemm_<type>` (prompts on the tensor cores) against f64: rows and tokens that end inside a
    /// tile, several column steps, once with a residual. Inputs are rounded to f16 (2^-11
    /// relative each), so every output is within ≈ 2^-10 of Σ|w·x| of the exact sum: the error
    /// norm is measured against that magnitude, like `matvec`, with [`TOL_GEMM_F16`] (f32 weights:
    /// `gemm_f32_simt`, f32 inputs, [`TOL_F32`]).
    pub(super) fn gemm(&mut self, ty: GgmlType) {
        let be = ty.block_elems().max(32);
        for (rows, cols, n, residual) in [
            (64usize, be, 16usize, false),
            (100, 2048, 70, false),
            (37, 512, 130, true),
        ] {
            let bytes = random_weights(&mut self.rng, ty, rows, cols);
            let xs = self.rng.normals(n * cols, 1.0);
            let res = residual.then(|| self.rng.normals(n * rows, 1.0));
            // The own kernel and, when the library is there, the cuBLAS form of long prompts
            // (the same f16 inputs, or f32 for f32 weights; the library's summation order).
            let blas = crate::blas::available();
            for use_blas in [false, true] {
                if use_blas && !blas {
                    continue;
                }
                let r = (|| {
                    let w = ops::upload(self.gpu, &bytes)?;
                    let y = if use_blas {
                        ops::gemm_blas(self.gpu, ty, &w, (rows, cols), &xs, res.as_deref())?
                    } else {
                        ops::gemm(self.gpu, ty, &w, (rows, cols), &xs, res.as_deref())?
                    };
                    let wf = dequantize_to_vec(ty, &bytes)
                        .map_err(|e| CudaError::Invalid(e.to_string()))?;
                    let (mut reference, magnitude) = products64(&wf, &xs, rows, cols);
                    if let Some(res) = &res {
                        for (r, &b) in reference.iter_mut().zip(res) {
                            *r += f64::from(b);
                        }
                    }
                    let tol = if ty == GgmlType::F32 {
                        TOL_F32
                    } else {
                        TOL_GEMM_F16
                    };
                    Ok((abs_err(&y, &reference) / magnitude, tol))
                })();
                self.record(
                    &format!(
                        "gemm{} {}",
                        if use_blas { " cublas" } else { "" },
                        ty.name()
                    ),
                    format!(
                        "{rows}x{cols} n={n}{}",
                        if residual { " +residual" } else { "" }
                    ),
                    r,
                );
            }
        }
    }

    /// Random `ty` weights (`rows × cols`), `n` inputs and norm weights (none when `plain`) for the
    /// fused matvec checks.
    pub(super) fn norm3_inputs(
        &mut self,
        ty: GgmlType,
        (rows, cols): (usize, usize),
        n: usize,
        plain: bool,
    ) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
        let bytes = random_weights(&mut self.rng, ty, rows, cols);
        let xs = self.rng.normals(n * cols, 1.0);
        let nw = if plain {
            Vec::new()
        } else {
            (0..cols).map(|_| 0.5 + self.rng.uniform() as f32).collect()
        };
        (bytes, xs, nw)
    }

    /// `matvec_norm3_q8_<type>` (8-bit activations; Q4_K, Q6_K) against f64 on the same activations,
    /// quantised here as the kernel does (per 32 values: d = max|v| / 127, q = rint(v / d)): 2048
    /// and 4096 columns, 1, 2 and 8 slices, with and without norm weights; token tiles of 2 and 4
    /// bit for bit the one-token kernel.
    pub(super) fn matvec_norm3_q8(&mut self, ty: GgmlType) {
        let (rows, n, eps) = (67usize, 3usize, 1e-6f32);
        for (cols, parts, plain, rpw) in [
            (2048usize, 1usize, false, 1usize),
            (2048, 1, false, 8),
            (2048, 2, true, 3),
            (2048, 8, false, 16),
            (4096, 1, false, 8),
            (4096, 2, true, 1),
        ] {
            let (bytes, xs, nw) = self.norm3_inputs(ty, (rows, cols), n, plain);
            let r = (|| {
                let w = ops::upload(self.gpu, &bytes)?;
                let run = |rpw, tile| {
                    ops::matvec_norm3_q8(
                        self.gpu,
                        ty,
                        &w,
                        (rows, cols),
                        &xs,
                        &nw,
                        (eps, parts, rpw, tile),
                    )
                };
                let y = run(rpw, 1)?;
                for tile in [2usize, 4] {
                    let yt = run(1, tile)?;
                    let differ = yt
                        .iter()
                        .zip(&y)
                        .filter(|(a, b)| a.to_bits() != b.to_bits())
                        .count();
                    if differ > 0 {
                        let worst = yt
                            .iter()
                            .zip(&y)
                            .map(|(a, b)| (a - b).abs())
                            .fold(0.0f32, f32::max);
                        return Err(CudaError::Invalid(format!(
                            "matvec_norm3_tok_q8 with a tile of {tile} tokens differs from matvec_norm3_q8 \
                             in {differ} of {} outputs (largest difference {worst:e}, non-finite: {} / {})",
                            y.len(),
                            yt.iter().filter(|v| !v.is_finite()).count(),
                            y.iter().filter(|v| !v.is_finite()).count()
                        )));
                    }
                }
                let wf =
                    dequantize_to_vec(ty, &bytes).map_err(|e| CudaError::Invalid(e.to_string()))?;
                let mut reference = Vec::with_capacity(n * rows);
                for t in 0..n {
                    let x = &xs[t * cols..(t + 1) * cols];
                    let inv = if plain { 1.0 } else { inv_rms64(x, eps) };
                    let u: Vec<f32> = (0..cols)
                        .map(|i| nw.get(i).map_or(x[i], |&g| x[i] * g))
                        .collect();
                    let xq = quantize_q8_blocks(&u);
                    for r in 0..rows {
                        let row = &wf[r * cols..(r + 1) * cols];
                        reference.push(inv * dot64(row, &xq));
                    }
                }
                Ok((rel_err(&y, &reference), TOL_F32))
            })();
            self.record(
                &format!("matvec_norm3_q8 {}", ty.name()),
                format!(
                    "{rows}x{cols} n={n} parts={parts} rows/warp={rpw}{}, token tiles 2 and 4 bit-identical",
                    if plain { " no norm" } else { "" }
                ),
                r,
            );
        }
    }

    /// `matvec_res_q8_q4_k` against f64 on the same 8-bit activations: `y = residual + W · q8(x)`
    /// and the next norm; 256 rows of 1024 and 4096 columns, 1 and 2 slices, 1 to 8 rows per warp.
    pub(super) fn matvec_res_q8(&mut self) {
        let (n, eps, rows) = (3usize, 1e-6f32, 256usize);
        for (cols, parts, rpw) in [
            (1024usize, 1usize, 1usize),
            (1024, 2, 3),
            (4096, 2, 2),
            (4096, 1, 8),
        ] {
            let bytes = random_weights(&mut self.rng, GgmlType::Q4K, rows, cols);
            let xs = self.rng.normals(n * cols, 1.0);
            let res = self.rng.normals(n * rows, 1.0);
            let nw: Vec<f32> = (0..rows).map(|_| 0.5 + self.rng.uniform() as f32).collect();
            let r = (|| {
                let w = ops::upload(self.gpu, &bytes)?;
                let (y, yn, xq) = ops::matvec_res_q8(
                    self.gpu,
                    &w,
                    (rows, cols),
                    &xs,
                    &res,
                    &nw,
                    (eps, parts, rpw),
                )?;
                // The same norm as a kernel of its own (`REDLITE_CUDA_RES_NORM_SPLIT`): the
                // same bits.
                let (yn2, xq2) = ops::res_norm_q8(self.gpu, &y, rows, &nw, eps)?;
                same_bits(
                    "res_norm_q8 differs from matvec_res's last block",
                    &yn2,
                    &yn,
                )?;
                same_bytes(
                    "res_norm_q8's q8 rows differ from matvec_res's last block's",
                    &xq2,
                    &xq,
                )?;
                // The epilogue's q8 rows are the quantisation of its own yn, bit for bit.
                let expect: Vec<u8> = yn.chunks(rows).flat_map(ops::q8_row).collect();
                same_bytes(
                    "matvec_res_q8: the q8 rows differ from the quantised yn",
                    &xq,
                    &expect,
                )?;
                let wf = dequantize_to_vec(GgmlType::Q4K, &bytes)
                    .map_err(|e| CudaError::Invalid(e.to_string()))?;
                let (mut ry, mut ryn) = (Vec::new(), Vec::new());
                for t in 0..n {
                    let xq = quantize_q8_blocks(&xs[t * cols..(t + 1) * cols]);
                    let res_t = &res[t * rows..(t + 1) * rows];
                    let (yt, ynt) = residual_and_norm64(res_t, &wf, &xq, &nw, eps);
                    ry.extend(yt);
                    ryn.extend(ynt);
                }
                Ok((rel_err(&y, &ry).max(rel_err(&yn, &ryn)), TOL_F32))
            })();
            self.record(
                "matvec_res_q8 Q4_K",
                format!(
                    "{rows}x{cols} n={n} parts={parts} rows/warp={rpw}, residual + next norm + its q8 rows (= res_norm_q8)"
                ),
                r,
            );
        }
    }

    /// `matvec_q8x_<type>` (Q4_K, Q6_K) on q8 rows made here (`ops::q8_row`) against f64 on the same 8-bit
    /// activations, and bit for bit `matvec_norm3_q8_<type>` without norm weights on the f32 rows.
    pub(super) fn matvec_q8x(&mut self, ty: GgmlType) {
        let (rows, n) = (67usize, 3usize);
        for (cols, parts, rpw) in [(2048usize, 1usize, 4usize), (2048, 2, 1), (512, 1, 4)] {
            let bytes = random_weights(&mut self.rng, ty, rows, cols);
            let xs = self.rng.normals(n * cols, 1.0);
            let r = (|| {
                let w = ops::upload(self.gpu, &bytes)?;
                let xq: Vec<u8> = xs.chunks(cols).flat_map(ops::q8_row).collect();
                let y = ops::matvec_q8x(
                    self.gpu,
                    ty,
                    &w,
                    (rows, cols),
                    (&xq, None),
                    (parts, rpw, 1, false),
                )?;
                let staged = ops::matvec_norm3_q8(
                    self.gpu,
                    ty,
                    &w,
                    (rows, cols),
                    &xs,
                    &[],
                    (0.0, parts, rpw, 1),
                )?;
                same_bits("matvec_q8x differs from matvec_norm3_q8", &y, &staged)?;
                // With a norm: rms_norm_q8 then matvec_q8x = matvec_norm3_q8 with norm weights.
                let nw: Vec<f32> = (0..cols).map(|_| 0.5 + self.rng.uniform() as f32).collect();
                let (xqn, invs) = ops::rms_norm_q8(self.gpu, &xs, &nw, cols, 1e-6)?;
                // matvec_q8x of normed q8 rows in token tiles of `tile` (1: one token a block).
                let normed_mma = |(xq, invs): &(Vec<u8>, Vec<f32>), tile, mma| {
                    ops::matvec_q8x(
                        self.gpu,
                        ty,
                        &w,
                        (rows, cols),
                        (xq, Some(invs)),
                        (parts, rpw, tile, mma),
                    )
                };
                let normed = |q: &(Vec<u8>, Vec<f32>), tile| normed_mma(q, tile, false);
                let yn = normed(&(xqn, invs), 1)?;
                let staged_n = ops::matvec_norm3_q8(
                    self.gpu,
                    ty,
                    &w,
                    (rows, cols),
                    &xs,
                    &nw,
                    (1e-6, parts, rpw, 1),
                )?;
                same_bits(
                    "rms_norm_q8 + matvec_q8x differs from matvec_norm3_q8",
                    &yn,
                    &staged_n,
                )?;
                // Token tiles (`matvec_q8x_tok`, the verify rows): 11 tokens in tiles of 2 and 8
                // (a partial last tile) = the one-token kernel per token, bit for bit.
                let xs11 = self.rng.normals(11 * cols, 1.0);
                let q11 = ops::rms_norm_q8(self.gpu, &xs11, &nw, cols, 1e-6)?;
                let one = normed(&q11, 1)?;
                for tile in [2, 8] {
                    same_bits(
                        "matvec_q8x_tok differs from matvec_q8x",
                        &normed(&q11, tile)?,
                        &one,
                    )?;
                }
                // Q6_K rows in one slice with the q8 values in registers (`matvec_q8x_xr_q6_k`,
                // the verify's head): 11 tokens (a partial second block of 8) and 2.
                if ty == GgmlType::Q6K && parts == 1 {
                    let xr = ops::matvec_q8x_xr_q6k(self.gpu, &w, (rows, cols), (&q11.0, &q11.1))?;
                    same_bits("matvec_q8x_xr_q6_k differs from matvec_q8x", &xr, &one)?;
                    let b2 = 2 * ops::q8_row_bytes(cols);
                    let xr2 = ops::matvec_q8x_xr_q6k(
                        self.gpu,
                        &w,
                        (rows, cols),
                        (&q11.0[..b2], &q11.1[..2]),
                    )?;
                    same_bits(
                        "matvec_q8x_xr_q6_k (2 tokens) differs",
                        &xr2,
                        &one[..2 * rows],
                    )?;
                }
                // The tensor-core form (Q4_K): 11 tokens (a partial second tile) and one token.
                if ty == GgmlType::Q4K {
                    let q1 = (
                        q11.0[..ops::q8_row_bytes(cols)].to_vec(),
                        q11.1[..1].to_vec(),
                    );
                    same_bits(
                        "matvec_q8x_mma differs from matvec_q8x",
                        &normed_mma(&q11, 8, true)?,
                        &one,
                    )?;
                    same_bits(
                        "matvec_q8x_mma (one token) differs from matvec_q8x",
                        &normed_mma(&q1, 8, true)?,
                        &one[..rows],
                    )?;
                }
                let wf =
                    dequantize_to_vec(ty, &bytes).map_err(|e| CudaError::Invalid(e.to_string()))?;
                let mut reference = Vec::with_capacity(n * rows);
                for x in xs.chunks(cols) {
                    let xq = quantize_q8_blocks(x);
                    for r in 0..rows {
                        reference.push(dot64(&wf[r * cols..(r + 1) * cols], &xq));
                    }
                }
                Ok((rel_err(&y, &reference), TOL_F32))
            })();
            self.record(
                &format!("matvec_q8x {}", ty.name()),
                format!(
                    "{rows}x{cols} n={n} parts={parts} rows/warp={rpw}, = matvec_norm3_q8 bit for bit \
                     (also after rms_norm_q8), token tiles 2 and 8 (and Q4_K's tensor-core form) = \
                     one token bit for bit"
                ),
                r,
            );
        }
    }

    /// `matvec3_x_f32` (the router's decode product, x read in place) bit for bit
    /// `matvec_norm3_f32` without norm weights (x staged), and against f64.
    pub(super) fn matvec3_x_f32(&mut self) {
        let (rows, n) = (67usize, 3usize);
        for (cols, parts, rpw) in [(2048usize, 1usize, 1usize), (2048, 4, 1), (512, 2, 2)] {
            let bytes = random_weights(&mut self.rng, GgmlType::F32, rows, cols);
            let xs = self.rng.normals(n * cols, 1.0);
            let r = (|| {
                let w = ops::upload(self.gpu, &bytes)?;
                let y = ops::matvec3_x_f32(self.gpu, &w, (rows, cols), &xs, (parts, rpw, 1))?;
                let (staged, _) = ops::matvec_fused(
                    self.gpu,
                    GgmlType::F32,
                    &w,
                    (rows, cols),
                    &xs,
                    &[],
                    None,
                    (1e-6, parts, rpw, 1),
                )?;
                same_bits("matvec3_x_f32 differs from matvec_norm3_f32", &y, &staged)?;
                if rpw == 1 {
                    // Token tiles (`matvec3_x_tok_f32`): 7 tokens in tiles of 2 and 4.
                    let xs7 = self.rng.normals(7 * cols, 1.0);
                    let one = ops::matvec3_x_f32(self.gpu, &w, (rows, cols), &xs7, (parts, 1, 1))?;
                    for tile in [2, 4] {
                        let tiled =
                            ops::matvec3_x_f32(self.gpu, &w, (rows, cols), &xs7, (parts, 1, tile))?;
                        same_bits("matvec3_x_tok_f32 differs from matvec3_x_f32", &tiled, &one)?;
                    }
                }
                let wf = dequantize_to_vec(GgmlType::F32, &bytes)
                    .map_err(|e| CudaError::Invalid(e.to_string()))?;
                let mut reference = Vec::with_capacity(n * rows);
                for x in xs.chunks(cols) {
                    for r in 0..rows {
                        reference.push(dot64(&wf[r * cols..(r + 1) * cols], x));
                    }
                }
                Ok((rel_err(&y, &reference), TOL_F32))
            })();
            self.record(
                "matvec3_x_f32",
                format!(
                    "{rows}x{cols} n={n} parts={parts} rows/warp={rpw}, = matvec_norm3_f32 bit for bit{}",
                    if rpw == 1 { ", token tiles 2 and 4 too" } else { "" }
                ),
                r,
            );
        }
    }

    /// `matvec_norm3` (norm folded in) and `matvec_res` (residual and the next norm folded in)
    /// against f64, with rows cut into 1, 2 and 8 slices and 1 to 4 rows per warp (67 and 256 rows:
    /// blocks that end past the matrix, a warp left with one of its two rows); 3 tokens. With 2 slices `matvec_norm3` also runs without
    /// norm weights (the plain product the MoE router and shared expert use).
    pub(super) fn matvec_fused(&mut self, ty: GgmlType) {
        let (rows, cols, n, eps) = (67usize, 2048usize, 3usize, 1e-6f32);
        for (parts, plain, rpw) in [
            (1usize, false, 1usize),
            (1, false, 2),
            (1, false, 3),
            (2, false, 1),
            (2, true, 1),
            (2, false, 4),
            (8, false, 1),
        ] {
            let (bytes, xs, nw) = self.norm3_inputs(ty, (rows, cols), n, plain);
            let r = (|| {
                let w = ops::upload(self.gpu, &bytes)?;
                let norm3 = |rpw: usize, tile: usize| {
                    ops::matvec_fused(
                        self.gpu,
                        ty,
                        &w,
                        (rows, cols),
                        &xs,
                        &nw,
                        None,
                        (eps, parts, rpw, tile),
                    )
                    .map(|(y, _)| y)
                };
                let y = norm3(rpw, 1)?;
                // The token-tile kernel (weights read once per tile): every output bit for bit
                // the one-token-per-block kernel's (a tile of 2 leaves a partial last tile).
                if rpw == 1 {
                    for tile in [2usize, 4] {
                        let yt = norm3(1, tile)?;
                        if yt.iter().zip(&y).any(|(a, b)| a.to_bits() != b.to_bits()) {
                            return Err(CudaError::Invalid(format!(
                                "matvec_norm3_tok with a tile of {tile} tokens differs from matvec_norm3"
                            )));
                        }
                    }
                }
                let wf =
                    dequantize_to_vec(ty, &bytes).map_err(|e| CudaError::Invalid(e.to_string()))?;
                let mut reference = Vec::with_capacity(n * rows);
                for t in 0..n {
                    let x = &xs[t * cols..(t + 1) * cols];
                    let inv = if plain { 1.0 } else { inv_rms64(x, eps) };
                    for r in 0..rows {
                        let row = &wf[r * cols..(r + 1) * cols];
                        reference.push(
                            (0..cols)
                                .map(|i| {
                                    let g = nw.get(i).map_or(1.0, |&v| f64::from(v));
                                    f64::from(row[i]) * f64::from(x[i]) * inv * g
                                })
                                .sum::<f64>(),
                        );
                    }
                }
                Ok((rel_err(&y, &reference), TOL_F32))
            })();
            self.record(
                &format!("matvec_norm3 {}", ty.name()),
                format!(
                    "{rows}x{cols} n={n} parts={parts} rows/warp={rpw}{}{}",
                    if plain { " no norm" } else { "" },
                    if rpw == 1 {
                        ", token tiles 2 and 4 bit-identical"
                    } else {
                        ""
                    }
                ),
                r,
            );
            if plain {
                continue;
            }
            // The output projection: rows = the residual's width.
            let (rows2, cols2) = (256usize, 1024usize);
            let bytes = random_weights(&mut self.rng, ty, rows2, cols2);
            let xs = self.rng.normals(n * cols2, 1.0);
            let res = self.rng.normals(n * rows2, 1.0);
            let nw: Vec<f32> = (0..rows2)
                .map(|_| 0.5 + self.rng.uniform() as f32)
                .collect();
            let r = (|| {
                let w = ops::upload(self.gpu, &bytes)?;
                let (y, yn) = ops::matvec_fused(
                    self.gpu,
                    ty,
                    &w,
                    (rows2, cols2),
                    &xs,
                    &nw,
                    Some(&res),
                    (eps, parts, rpw, 1),
                )?;
                if rpw == 1 {
                    // Token tiles (`matvec_res_tok`, no norm; with Q4_K also two rows a warp
                    // group, `matvec_res_tok2_q4_k`): the residual sums bit for bit.
                    let forms: &[(usize, &str)] = if ty == GgmlType::Q4K {
                        &[(1, "matvec_res_tok"), (2, "matvec_res_tok2_q4_k")]
                    } else {
                        &[(1, "matvec_res_tok")]
                    };
                    for tile in [2, 3] {
                        for &(tok_rows, name) in forms {
                            let (yt, _) = ops::matvec_fused(
                                self.gpu,
                                ty,
                                &w,
                                (rows2, cols2),
                                &xs,
                                &nw,
                                Some(&res),
                                (eps, parts, tok_rows, tile),
                            )?;
                            same_bits(&format!("{name} differs from matvec_res"), &yt, &y)?;
                        }
                    }
                }
                let wf =
                    dequantize_to_vec(ty, &bytes).map_err(|e| CudaError::Invalid(e.to_string()))?;
                let (mut ry, mut ryn) = (Vec::new(), Vec::new());
                for t in 0..n {
                    let x = &xs[t * cols2..(t + 1) * cols2];
                    let res_t = &res[t * rows2..(t + 1) * rows2];
                    let (yt, ynt) = residual_and_norm64(res_t, &wf, x, &nw, eps);
                    ry.extend(yt);
                    ryn.extend(ynt);
                }
                Ok((rel_err(&y, &ry).max(rel_err(&yn, &ryn)), TOL_F32))
            })();
            self.record(
                &format!("matvec_res {}", ty.name()),
                format!(
                    "{rows2}x{cols2} n={n} parts={parts} rows/warp={rpw}{}",
                    if rpw == 1 {
                        ", token tiles 2 and 3 bit-identical"
                    } else {
                        ""
                    }
                ),
                r,
            );
        }
    }

    /// `matvec_res_xr_q4_k` (the verify's output projections, activations in registers) against
    /// the one-token `matvec_res_q4_k`, bit for bit: a partial last row block (67 rows), a partial
    /// second token block (11 tokens), a lone last token (9), every slice count.
    pub(super) fn matvec_res_xr(&mut self) {
        let ty = GgmlType::Q4K;
        for (rows, cols, n, parts) in [
            (67usize, 2048usize, 11usize, 1usize),
            (67, 2048, 11, 2),
            (67, 2048, 9, 4),
            (64, 4096, 8, 2),
            (64, 4096, 3, 8),
            (16, 512, 2, 1),
        ] {
            let bytes = random_weights(&mut self.rng, ty, rows, cols);
            let xs = self.rng.normals(n * cols, 1.0);
            let res = self.rng.normals(n * rows, 1.0);
            let nw = vec![1.0f32; rows];
            let r = (|| {
                let w = ops::upload(self.gpu, &bytes)?;
                let (one, _) = ops::matvec_fused(
                    self.gpu,
                    ty,
                    &w,
                    (rows, cols),
                    &xs,
                    &nw,
                    Some(&res),
                    (1e-6, parts, 1, 1),
                )?;
                let xr = ops::matvec_res_xr_q4k(self.gpu, &w, (rows, cols), &xs, &res, parts)?;
                same_bits("matvec_res_xr_q4_k differs from matvec_res_q4_k", &xr, &one)?;
                Ok((0.0, TOL_F32))
            })();
            self.record(
                "matvec_res_xr Q4_K",
                format!("{rows}x{cols} n={n} parts={parts}, bit-identical to matvec_res"),
                r,
            );
        }
    }

    pub(super) fn embed(&mut self, ty: GgmlType) {
        let cols = if ty.block_elems() == 1 { 200 } else { 2304 };
        let rows = 50;
        let bytes = random_weights(&mut self.rng, ty, rows, cols);
        let ids: Vec<i32> = vec![0, 49, self.rng.below(rows) as i32, 7, 7];
        let r = (|| {
            let t = ops::upload(self.gpu, &bytes)?;
            let y = ops::embed(self.gpu, ty, &t, cols, &ids)?;
            let wf =
                dequantize_to_vec(ty, &bytes).map_err(|e| CudaError::Invalid(e.to_string()))?;
            let reference: Vec<f64> = ids
                .iter()
                .flat_map(|&i| {
                    wf[i as usize * cols..(i as usize + 1) * cols]
                        .iter()
                        .map(|&v| f64::from(v))
                })
                .collect();
            Ok((rel_err(&y, &reference), 1e-6))
        })();
        self.record(
            &format!("embed {}", ty.name()),
            format!("{} ids of {rows}x{cols}", ids.len()),
            r,
        );
    }
}
