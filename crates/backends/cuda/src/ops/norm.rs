//! RMSNorm in each form (`norm.cu`: with the q8 row, the residual, the router) and the
//! element-wise kernels.

use super::*;

/// Blocks per token of the one-token norm kernels (`rms_norm_q8`, `res_norm_q8`) as the model runs
/// them: each sums all the squares and writes one slice of the q8 row. 16 since session 55 (8
/// before): +0.3 % decode on an H100 alone, +1.9 % with two rows a warp group in the q8 kernels
/// (`q8_rows_from_env`); the same bits for any count.
pub const NORM_SLICES: usize = 16;
/// `rms_norm_q8` on `n` rows of `cols`: `(the q8 rows of x · nw, 1 / rms(x) per row)`.
pub fn rms_norm_q8(
    gpu: &Gpu,
    xs: &[f32],
    nw: &[f32],
    cols: usize,
    eps: f32,
) -> Result<(Vec<u8>, Vec<f32>), CudaError> {
    let n = check_rows(xs.len(), cols, "rms_norm_q8 x")?;
    if nw.len() != cols || !cols.is_multiple_of(32) {
        return Err(CudaError::Invalid("rms_norm_q8: sizes".into()));
    }
    let (x, nwd) = (upload(gpu, xs)?, upload(gpu, nw)?);
    let mut xq = alloc_poisoned::<u8>(gpu, n * q8_row_bytes(cols))?;
    let mut invs = alloc_poisoned::<f32>(gpu, n)?;
    let c = i32_arg(cols, "cols")?;
    launch!(
        gpu,
        gpu.func("rms_norm_q8")?,
        "rms_norm_q8",
        cfg((NORM_SLICES as u32, n as u32, 1), 256, 0),
        [&x, &nwd, &eps, &c, &mut xq, &mut invs]
    )?;
    Ok((download(gpu, &xq)?, download(gpu, &invs)?))
}

/// `res_norm_q8` on `n` rows of `rows` values (`ys`): `(rms_norm(y) · nw, its q8 rows)`, as
/// `matvec_res`'s last block writes them.
pub fn res_norm_q8(
    gpu: &Gpu,
    ys: &[f32],
    rows: usize,
    nw: &[f32],
    eps: f32,
) -> Result<(Vec<f32>, Vec<u8>), CudaError> {
    let n = check_rows(ys.len(), rows, "res_norm_q8 y")?;
    if nw.len() != rows || !rows.is_multiple_of(32) {
        return Err(CudaError::Invalid("res_norm_q8: sizes".into()));
    }
    let (y, nwd) = (upload(gpu, ys)?, upload(gpu, nw)?);
    let mut yn = alloc_poisoned::<f32>(gpu, n * rows)?;
    let mut xq = alloc_poisoned::<u8>(gpu, n * q8_row_bytes(rows))?;
    let r = i32_arg(rows, "rows")?;
    launch!(
        gpu,
        gpu.func("res_norm_q8")?,
        "res_norm_q8",
        cfg((NORM_SLICES as u32, n as u32, 1), 256, 0),
        [&y, &r, &nwd, &mut yn, &eps, &mut xq]
    )?;
    Ok((download(gpu, &yn)?, download(gpu, &xq)?))
}

/// What [`res_norm_router`] writes: the norm's output and its q8 row, the two matrices' products.
pub struct NormRouterOut {
    pub yn: Vec<f32>,
    pub xq: Vec<u8>,
    pub y0: Vec<f32>,
    pub y1: Vec<f32>,
}

/// The grid of `res_norm_router` for `row_blocks` blocks of router rows and the norm's `slices`:
/// the direct form (`early` 2) takes `slices` more blocks that only write the norm (the kernel's
/// last ones); the other forms write the slices from their first blocks.
pub(crate) fn res_norm_router_blocks(row_blocks: u32, slices: u32, early: i32) -> u32 {
    if early == 2 {
        row_blocks + slices
    } else {
        row_blocks.max(slices)
    }
}

/// `res_norm_router`: [`res_norm_q8`] of `ys` (one token, `rows` values) and, on its output, the
/// F32 products of `w0` (`r0` rows) and `w1` (`r1` rows) with `(parts, rows_per_warp)` split (`early`
/// 1: the one-row form's weights loaded before the wait; 2: also its direct form, `NORM_SLICES`
/// more blocks for the norm's slices), as `matvec3_x_f32` computes them.
#[allow(clippy::too_many_arguments)]
pub fn res_norm_router(
    gpu: &Gpu,
    ys: &[f32],
    nw: &[f32],
    eps: f32,
    (w0, r0): (&CudaSlice<u8>, usize),
    (w1, r1): (&CudaSlice<u8>, usize),
    (parts, rows_per_warp, early): (usize, usize, i32),
) -> Result<NormRouterOut, CudaError> {
    let rows = ys.len();
    if nw.len() != rows
        || !rows.is_multiple_of(32)
        || !(1..=8).contains(&parts)
        || !parts.is_power_of_two()
        || !(1..=MVF_MAX_ROWS).contains(&rows_per_warp)
    {
        return Err(CudaError::Invalid("res_norm_router: sizes".into()));
    }
    let split = MvfSplit {
        parts,
        rows: rows_per_warp,
    };
    let (y, nwd) = (upload(gpu, ys)?, upload(gpu, nw)?);
    let mut yn = alloc_poisoned::<f32>(gpu, rows)?;
    let mut xq = alloc_poisoned::<u8>(gpu, q8_row_bytes(rows))?;
    let mut y0 = alloc_poisoned::<f32>(gpu, r0.max(1))?;
    let mut y1 = alloc_poisoned::<f32>(gpu, r1.max(1))?;
    let (r, p) = (i32_arg(rows, "rows")?, split.arg());
    let (ri0, ri1) = (i32_arg(r0, "rows0")?, i32_arg(r1, "rows1")?);
    let (slices, zero, zi, pre) = (NORM_SLICES as i32, 0u64, 0i32, early);
    let rows_grid = blocks(r0, split.rows_per_block()) + blocks(r1, split.rows_per_block());
    let grid = res_norm_router_blocks(rows_grid, NORM_SLICES as u32, early);
    launch!(
        gpu,
        gpu.func("res_norm_router")?,
        "res_norm_router",
        cfg((grid, 1, 1), 256, 4 * rows as u32),
        [
            &y, &r, &nwd, &mut yn, &eps, &mut xq, &slices, &p, &pre, w0, &mut y0, &ri0, w1,
            &mut y1, &ri1, &zero, &zero, &zi
        ]
    )?;
    let (mut l0, mut l1) = (download(gpu, &y0)?, download(gpu, &y1)?);
    l0.truncate(r0);
    l1.truncate(r1);
    Ok(NormRouterOut {
        yn: download(gpu, &yn)?,
        xq: download(gpu, &xq)?,
        y0: l0,
        y1: l1,
    })
}

/// RMSNorm of each row of `n` values with weight `w`.
pub fn rms_norm(
    gpu: &Gpu,
    x: &[f32],
    w: &[f32],
    n: usize,
    eps: f32,
) -> Result<Vec<f32>, CudaError> {
    let rows = check_rows(x.len(), n, "rms_norm")?;
    let (xd, wd) = (upload(gpu, x)?, upload(gpu, w)?);
    let mut y = alloc_poisoned::<f32>(gpu, x.len())?;
    let ni = i32_arg(n, "n")?;
    launch!(
        gpu,
        gpu.func("rms_norm")?,
        "rms_norm",
        cfg((rows as u32, 1, 1), 256, 0),
        [&xd, &wd, &mut y, &ni, &eps]
    )?;
    download(gpu, &y)
}

/// `RMSNorm(o)·w ⊙ silu(z)` per row of `n`.
pub fn rms_norm_gated(
    gpu: &Gpu,
    o: &[f32],
    w: &[f32],
    z: &[f32],
    n: usize,
    eps: f32,
) -> Result<Vec<f32>, CudaError> {
    let rows = check_rows(o.len(), n, "rms_norm_gated")?;
    let (od, wd, zd) = (upload(gpu, o)?, upload(gpu, w)?, upload(gpu, z)?);
    let mut y = alloc_poisoned::<f32>(gpu, o.len())?;
    let ni = i32_arg(n, "n")?;
    launch!(
        gpu,
        gpu.func("rms_norm_gated")?,
        "rms_norm_gated",
        cfg((rows as u32, 1, 1), 128, 0),
        [&od, &wd, &zd, &mut y, &ni, &eps]
    )?;
    download(gpu, &y)
}

/// L2-normalise each row of `n`, then scale.
pub fn l2_normalize(
    gpu: &Gpu,
    x: &[f32],
    n: usize,
    eps: f32,
    scale: f32,
) -> Result<Vec<f32>, CudaError> {
    let rows = check_rows(x.len(), n, "l2_normalize")?;
    let mut xd = upload(gpu, x)?;
    let ni = i32_arg(n, "n")?;
    launch!(
        gpu,
        gpu.func("l2_normalize")?,
        "l2_normalize",
        cfg((rows as u32, 1, 1), 128, 0),
        [&mut xd, &ni, &eps, &scale]
    )?;
    download(gpu, &xd)
}

fn elementwise(
    gpu: &Gpu,
    name: &str,
    a: &[f32],
    b_in: &[f32],
    out_separate: bool,
) -> Result<Vec<f32>, CudaError> {
    if a.len() != b_in.len() {
        return Err(CudaError::Invalid(format!(
            "{name}: lengths {} and {}",
            a.len(),
            b_in.len()
        )));
    }
    let n = i32_arg(a.len(), "n")?;
    let mut ad = upload(gpu, a)?;
    let bd = upload(gpu, b_in)?;
    let c = cfg((blocks(a.len(), 256), 1, 1), 256, 0);
    if out_separate {
        let mut out = alloc_poisoned::<f32>(gpu, a.len())?;
        launch!(gpu, gpu.func(name)?, name, c, [&ad, &bd, &mut out, &n])?;
        download(gpu, &out)
    } else {
        launch!(gpu, gpu.func(name)?, name, c, [&mut ad, &bd, &n])?;
        download(gpu, &ad)
    }
}

/// `a + b` (the residual add kernel, in place on a copy of `a`).
pub fn add(gpu: &Gpu, a: &[f32], b: &[f32]) -> Result<Vec<f32>, CudaError> {
    elementwise(gpu, "add_inplace", a, b, false)
}

/// `a ⊙ sigmoid(gate)`.
pub fn sigmoid_mul(gpu: &Gpu, a: &[f32], gate: &[f32]) -> Result<Vec<f32>, CudaError> {
    elementwise(gpu, "sigmoid_mul", a, gate, false)
}

/// `silu(gate) ⊙ up`.
pub fn swiglu(gpu: &Gpu, gate: &[f32], up: &[f32]) -> Result<Vec<f32>, CudaError> {
    elementwise(gpu, "swiglu", gate, up, true)
}
