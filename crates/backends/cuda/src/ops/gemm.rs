//! The prompt GEMMs (`gemm.cu`): tensor-core tiles on the quantized weights and cuBLAS on
//! dequantized ones.

use super::*;

/// The inputs of [`gemm`] and [`gemm_blas`] on the device: `(n, x, y)` with `y` holding `acc`
/// (the residual form) or poison.
fn gemm_io(
    gpu: &Gpu,
    (rows, cols): (usize, usize),
    xs: &[f32],
    acc: Option<&[f32]>,
    what: &str,
) -> Result<(usize, CudaSlice<f32>, CudaSlice<f32>), CudaError> {
    let n = check_rows(xs.len(), cols, what)?;
    if !cols.is_multiple_of(32) || acc.is_some_and(|a| a.len() != n * rows) {
        return Err(CudaError::Invalid(format!(
            "{what}: {cols} columns (a multiple of 32 wanted) or a residual of the wrong length"
        )));
    }
    let y = match acc {
        Some(a) => upload(gpu, a)?,
        None => alloc_poisoned::<f32>(gpu, n * rows)?,
    };
    Ok((n, upload(gpu, xs)?, y))
}

/// `gemm_<type>` (the prompt GEMM on the tensor cores, f16 inputs; f32 weights: `gemm_f32_simt`,
/// f32 inputs): `ys[t] = W · xs[t]` for `n`
/// rows, plus `ys[t]`'s previous value when `acc` is given (`[n][rows]`, the residual form).
/// `cols` a multiple of 32.
pub fn gemm(
    gpu: &Gpu,
    ty: GgmlType,
    w: &CudaSlice<u8>,
    (rows, cols): (usize, usize),
    xs: &[f32],
    acc: Option<&[f32]>,
) -> Result<Vec<f32>, CudaError> {
    let (n, x, mut y) = gemm_io(gpu, (rows, cols), xs, acc, "gemm")?;
    // As the model: f32 weights through the f32 kernel, the rest on the tensor cores.
    let (name, threads) = match ty {
        GgmlType::F32 => ("gemm_f32_simt".to_string(), 256),
        _ => (format!("gemm_{}", type_suffix(ty)), 128),
    };
    let f = gpu.func(&name)?;
    let (r, c, nn) = (
        i32_arg(rows, "rows")?,
        i32_arg(cols, "cols")?,
        i32_arg(n, "tokens")?,
    );
    let accumulate = i32::from(acc.is_some());
    launch!(
        gpu,
        f,
        &name,
        cfg(
            (rows.div_ceil(64) as u32, n.div_ceil(64) as u32, 1),
            threads,
            0
        ),
        [w, &x, &mut y, &r, &c, &nn, &accumulate]
    )?;
    download(gpu, &y)
}

/// The long-prompt form of [`gemm`] (`model/launch.rs`, `gemm_blas`): `W` decoded whole into f16
/// (`dequant_f16_<type>`), `xs` rounded to f16 (`f32_to_f16`), then cublasGemmEx with f32
/// accumulation; `acc` as in [`gemm`]; f32 weights (the router) in f32 as they are. `cols` a
/// multiple of 32.
pub fn gemm_blas(
    gpu: &Gpu,
    ty: GgmlType,
    w: &CudaSlice<u8>,
    (rows, cols): (usize, usize),
    xs: &[f32],
    acc: Option<&[f32]>,
) -> Result<Vec<f32>, CudaError> {
    let (n, x, mut y) = gemm_io(gpu, (rows, cols), xs, acc, "gemm_blas")?;
    let blas = crate::blas::Blas::new(gpu.stream.clone())?;
    // Quantized weights: W and X staged as f16 first.
    let staged = if ty == GgmlType::F32 {
        None
    } else {
        let mut wh = alloc_poisoned::<u16>(gpu, rows * cols)?;
        let mut xh = alloc_poisoned::<u16>(gpu, n * cols)?;
        let (r, c) = (i32_arg(rows, "rows")?, i32_arg(cols, "cols")?);
        let name = format!("dequant_f16_{}", type_suffix(ty));
        let groups = rows * cols / 16;
        launch!(
            gpu,
            gpu.func(&name)?,
            &name,
            cfg((groups.div_ceil(256) as u32, 1, 1), 256, 0),
            [w, &mut wh, &r, &c]
        )?;
        let len4 = i32_arg(n * cols / 4, "activations")?;
        launch!(
            gpu,
            gpu.func("f32_to_f16")?,
            "f32_to_f16",
            cfg(((n * cols / 4).div_ceil(256) as u32, 1, 1), 256, 0),
            [&x, &mut xh, &len4]
        )?;
        Some((wh, xh))
    };
    {
        let ((wp, _gw), (xp, _gx)) = match &staged {
            Some((wh, xh)) => (wh.device_ptr(&gpu.stream), xh.device_ptr(&gpu.stream)),
            None => (w.device_ptr(&gpu.stream), x.device_ptr(&gpu.stream)),
        };
        let (yp, _gy) = y.device_ptr_mut(&gpu.stream);
        if staged.is_some() {
            blas.gemm_f16((wp, xp, yp), (rows, cols, n), acc.is_some())?;
        } else {
            blas.gemm_f32((wp, xp, yp), (rows, cols, n), acc.is_some())?;
        }
    }
    download(gpu, &y)
}
