//! Matrix-vector products (`matvec.cu`): f32 activations, q8 rows, token tiles, the fused
//! norm/residual forms and the activations-in-registers verify forms.

use super::*;

/// `ys[t] = W · xs[t]` for `n` rows, W of type `ty` on the device (`rows × cols`).
pub fn matvec(
    gpu: &Gpu,
    ty: GgmlType,
    w: &CudaSlice<u8>,
    rows: usize,
    cols: usize,
    xs: &[f32],
    n: usize,
) -> Result<Vec<f32>, CudaError> {
    if xs.len() < n * cols {
        return Err(CudaError::Invalid(format!(
            "matvec: {} inputs for {n} rows of {cols}",
            xs.len()
        )));
    }
    let name = format!("matvec_{}", type_suffix(ty));
    let f = gpu.func(&name)?;
    let x = upload(gpu, &xs[..n * cols])?;
    let mut y = alloc_poisoned::<f32>(gpu, n * rows)?;
    let (r, c) = (i32_arg(rows, "rows")?, i32_arg(cols, "cols")?);
    let mut t0 = 0;
    while t0 < n {
        let nt = (n - t0).min(MAX_GRID_Y);
        let xv = x.slice(t0 * cols..(t0 + nt) * cols);
        let mut yv = y.slice_mut(t0 * rows..(t0 + nt) * rows);
        launch!(
            gpu,
            f,
            &name,
            cfg(
                (blocks(rows, MATVEC_WARPS), nt as u32, 1),
                32 * MATVEC_WARPS,
                0
            ),
            [w, &xv, &mut yv, &r, &c]
        )?;
        t0 += nt;
    }
    download(gpu, &y)
}

/// `matvec_norm3_q8_q4_k` (`tile` 1) or `matvec_norm3_tok_q8_q4_k` on `n` tokens: `W · rms_norm(x,
/// nw)` (`nw` empty: `W · x`) for a Q4_K matrix with the normalised input quantised per 32 values
/// to 8 bits, each row cut into `parts` slices, `rows_per_warp` rows per group of warps (one-token
/// kernel only).
pub fn matvec_norm3_q8(
    gpu: &Gpu,
    ty: GgmlType,
    w: &CudaSlice<u8>,
    (rows, cols): (usize, usize),
    xs: &[f32],
    nw: &[f32],
    (eps, parts, rows_per_warp, tile): (f32, usize, usize, usize),
) -> Result<Vec<f32>, CudaError> {
    let n = check_rows(xs.len(), cols, "matvec_norm3_q8 x")?;
    let suffix = q8_suffix(ty)?;
    if (!nw.is_empty() && nw.len() != cols)
        || !cols.is_multiple_of(256)
        || !(1..=8).contains(&parts)
        || !parts.is_power_of_two()
        || !(1..=MVF_MAX_TILE).contains(&tile)
        || tile * q8_row_bytes(cols) > 48 * 1024
    {
        return Err(CudaError::Invalid("matvec_norm3_q8: sizes".into()));
    }
    if !(1..=16).contains(&rows_per_warp) || (tile > 1 && rows_per_warp != 1) {
        return Err(CudaError::Invalid("matvec_norm3_q8: rows per warp".into()));
    }
    let split = MvfSplit {
        parts,
        rows: rows_per_warp,
    };
    let (x, nwd) = (upload(gpu, xs)?, upload(gpu, nw)?);
    let (r, c, p) = (
        i32_arg(rows, "rows")?,
        i32_arg(cols, "cols")?,
        split.arg() | (tile << 16) as i32,
    );
    let grid_x = blocks(rows, split.rows_per_block());
    let mut y = alloc_poisoned::<f32>(gpu, n * rows)?;
    let (zero, zi, ni) = (0u64, 0i32, i32_arg(n, "tokens")?);
    let (name, conf) = if tile > 1 {
        let grid = (grid_x, n.div_ceil(tile) as u32, 1);
        let shared = (tile * q8_row_bytes(cols)) as u32;
        (
            format!("matvec_norm3_tok_q8_{suffix}"),
            cfg(grid, 256, shared),
        )
    } else {
        let grid = (grid_x, n as u32, 1);
        (
            format!("matvec_norm3_q8_{suffix}"),
            cfg(grid, 256, q8_row_bytes(cols) as u32),
        )
    };
    let f = gpu.func(&name)?;
    // The token-tile kernel takes the token count after `split`; no norm weights: a null pointer.
    match (tile > 1, nw.is_empty()) {
        (true, true) => launch!(
            gpu,
            f,
            &name,
            conf,
            [&x, &zero, &eps, &c, &p, &ni, w, &mut y, &r, &zero, &zero, &zi, &zero, &zero, &zi]
        )?,
        (true, false) => launch!(
            gpu,
            f,
            &name,
            conf,
            [&x, &nwd, &eps, &c, &p, &ni, w, &mut y, &r, &zero, &zero, &zi, &zero, &zero, &zi]
        )?,
        (false, true) => launch!(
            gpu,
            f,
            &name,
            conf,
            [&x, &zero, &eps, &c, &p, w, &mut y, &r, &zero, &zero, &zi, &zero, &zero, &zi]
        )?,
        (false, false) => launch!(
            gpu,
            f,
            &name,
            conf,
            [&x, &nwd, &eps, &c, &p, w, &mut y, &r, &zero, &zero, &zi, &zero, &zero, &zi]
        )?,
    }
    download(gpu, &y)
}

/// What [`matvec_res_q8`] returns: the residual sums, their next norm, its q8 rows.
pub type ResQ8 = (Vec<f32>, Vec<f32>, Vec<u8>);

/// `matvec_res_q8_q4_k` on `n` tokens: `(residual + W · q8(x), rms_norm(residual + W · q8(x), nw),
/// the q8 rows of that norm)` for a Q4_K matrix, the input quantised per 32 values to 8 bits,
/// `(parts, rows_per_warp)` split; the last part is what the epilogue writes for the MoE's 8-bit
/// kernels (`n` rows of [`q8_row_bytes`]).
pub fn matvec_res_q8(
    gpu: &Gpu,
    w: &CudaSlice<u8>,
    (rows, cols): (usize, usize),
    xs: &[f32],
    residual: &[f32],
    nw: &[f32],
    (eps, parts, rows_per_warp): (f32, usize, usize),
) -> Result<ResQ8, CudaError> {
    let n = check_rows(xs.len(), cols, "matvec_res_q8 x")?;
    if nw.len() != rows
        || !rows.is_multiple_of(32)
        || residual.len() != n * rows
        || !cols.is_multiple_of(256)
        || !(1..=8).contains(&parts)
        || !parts.is_power_of_two()
        || !(1..=16).contains(&rows_per_warp)
    {
        return Err(CudaError::Invalid("matvec_res_q8: sizes".into()));
    }
    let split = MvfSplit {
        parts,
        rows: rows_per_warp,
    };
    let (x, nwd) = (upload(gpu, xs)?, upload(gpu, nw)?);
    let mut y = upload(gpu, residual)?;
    let mut yn = alloc_poisoned::<f32>(gpu, n * rows)?;
    let mut counter = upload(gpu, &vec![0u32; n])?;
    let mut xq = alloc_poisoned::<u8>(gpu, n * q8_row_bytes(rows))?;
    let (r, c, p) = (i32_arg(rows, "rows")?, i32_arg(cols, "cols")?, split.arg());
    let conf = cfg(
        (blocks(rows, split.rows_per_block()), n as u32, 1),
        256,
        q8_row_bytes(cols) as u32,
    );
    launch!(
        gpu,
        gpu.func("matvec_res_q8_q4_k")?,
        "matvec_res_q8",
        conf,
        [
            w,
            &x,
            &mut y,
            &r,
            &c,
            &p,
            &nwd,
            &mut yn,
            &mut counter,
            &eps,
            &mut xq
        ]
    )?;
    Ok((download(gpu, &y)?, download(gpu, &yn)?, download(gpu, &xq)?))
}

/// `matvec_q8x_q4_k`: `invs[t] · (W · xq[t])` (`invs` `None`: 1) for `n` q8 rows (`xq`: `n` rows of
/// [`q8_row_bytes`]`(cols)`) of a Q4_K matrix, `(parts, rows_per_warp)` split, in token tiles of
/// `tile` (1: the one-token kernel); `mma` takes `matvec_q8x_mma_q4_k` instead (Q4_K; tiles of 8,
/// rows per warp unused).
pub fn matvec_q8x(
    gpu: &Gpu,
    ty: GgmlType,
    w: &CudaSlice<u8>,
    (rows, cols): (usize, usize),
    (xq, invs): (&[u8], Option<&[f32]>),
    (parts, rows_per_warp, tile, mma): (usize, usize, usize, bool),
) -> Result<Vec<f32>, CudaError> {
    let n = check_rows(xq.len(), q8_row_bytes(cols), "matvec_q8x xq")?;
    if !cols.is_multiple_of(256)
        || !(1..=8).contains(&parts)
        || !(1..=16).contains(&rows_per_warp)
        || !(1..=8).contains(&tile)
        || (mma && (ty != GgmlType::Q4K || crate::model::q8x_mma_smem(cols).is_none()))
    {
        return Err(CudaError::Invalid("matvec_q8x: sizes".into()));
    }
    let split = MvfSplit {
        parts,
        rows: rows_per_warp,
    };
    let xd = upload(gpu, xq)?;
    let invs_d = match invs {
        Some(v) if v.len() == n => Some(upload(gpu, v)?),
        Some(_) => return Err(CudaError::Invalid("matvec_q8x: one 1/rms per row".into())),
        None => None,
    };
    let (r, c) = (i32_arg(rows, "rows")?, i32_arg(cols, "cols")?);
    let (p, ni) = (split.arg() | (tile << 16) as i32, i32_arg(n, "tokens")?);
    let mut y = alloc_poisoned::<f32>(gpu, n * rows)?;
    let (zero, zi) = (0u64, 0i32);
    // No scales: a null pointer (the kernel's 1).
    let iv = invs_d.as_ref().map_or(0u64, |iv| device_address(gpu, iv));
    if mma {
        let f = gpu.func("matvec_q8x_mma_q4_k")?;
        crate::model::q8x_mma_opt_in(f)?;
        let smem = crate::model::q8x_mma_smem(cols).unwrap_or(0);
        let conf = cfg((blocks(rows, 16), n.div_ceil(8) as u32, 1), 256, smem);
        let pi = i32_arg(parts, "parts")?;
        launch!(
            gpu,
            f,
            "matvec_q8x_mma",
            conf,
            [&xd, &iv, &c, &pi, &ni, w, &mut y, &r, &zero, &zero, &zi, &zero, &zero, &zi]
        )?;
        return download(gpu, &y);
    }
    let conf = cfg(
        (
            blocks(rows, split.rows_per_block()),
            n.div_ceil(tile) as u32,
            1,
        ),
        256,
        0,
    );
    // tile 1: the one-token kernel (grid.y = tokens); more: `matvec_q8x_tok_<type>`.
    let name = match tile {
        1 => format!("matvec_q8x_{}", q8_suffix(ty)?),
        _ => format!("matvec_q8x_tok_{}", q8_suffix(ty)?),
    };
    let f = gpu.func(&name)?;
    if tile == 1 {
        launch!(
            gpu,
            f,
            "matvec_q8x",
            conf,
            [&xd, &iv, &c, &p, w, &mut y, &r, &zero, &zero, &zi, &zero, &zero, &zi]
        )?;
    } else {
        launch!(
            gpu,
            f,
            "matvec_q8x_tok",
            conf,
            [&xd, &iv, &c, &p, &ni, w, &mut y, &r, &zero, &zero, &zi, &zero, &zero, &zi]
        )?;
    }
    download(gpu, &y)
}

/// `matvec3_x_f32`: `W · x[t]` for `n` rows of an f32 matrix, x read in place, `(parts,
/// rows_per_warp)` split (the router's decode product).
pub fn matvec3_x_f32(
    gpu: &Gpu,
    w: &CudaSlice<u8>,
    (rows, cols): (usize, usize),
    xs: &[f32],
    (parts, rows_per_warp, tile): (usize, usize, usize),
) -> Result<Vec<f32>, CudaError> {
    let n = check_rows(xs.len(), cols, "matvec3_x_f32 x")?;
    if !(1..=8).contains(&parts)
        || !parts.is_power_of_two()
        || !(1..=MVF_MAX_ROWS).contains(&rows_per_warp)
        || !(1..=MVF_MAX_TILE).contains(&tile)
        || (tile > 1 && rows_per_warp != 1)
    {
        return Err(CudaError::Invalid("matvec3_x_f32: sizes".into()));
    }
    let split = MvfSplit {
        parts,
        rows: rows_per_warp,
    };
    let x = upload(gpu, xs)?;
    let (r, c) = (i32_arg(rows, "rows")?, i32_arg(cols, "cols")?);
    let (p, ni) = (split.arg() | (tile << 16) as i32, i32_arg(n, "tokens")?);
    let mut y = alloc_poisoned::<f32>(gpu, n * rows)?;
    let (zero, zi) = (0u64, 0i32);
    let conf = cfg(
        (
            blocks(rows, split.rows_per_block()),
            n.div_ceil(tile) as u32,
            1,
        ),
        256,
        0,
    );
    if tile == 1 {
        launch!(
            gpu,
            gpu.func("matvec3_x_f32")?,
            "matvec3_x_f32",
            conf,
            [&x, &c, &p, w, &mut y, &r, &zero, &zero, &zi, &zero, &zero, &zi]
        )?;
    } else {
        // The token tiles (`matvec3_x_tok_f32`, the verify pass's router).
        launch!(
            gpu,
            gpu.func("matvec3_x_tok_f32")?,
            "matvec3_x_tok_f32",
            conf,
            [&x, &c, &p, &ni, w, &mut y, &r, &zero, &zero, &zi, &zero, &zero, &zi]
        )?;
    }
    download(gpu, &y)
}

/// The fused matvecs of the device-resident model on `n` tokens (`xs [n][cols]`, one matrix `W`
/// of type `ty` on the device, each row cut into `parts` slices, `rows_per_warp` consecutive rows
/// per group of warps, 8 warps per block):
/// `matvec_norm3_<type>` gives `W · rms_norm(x, nw)`; with `residual` (`[n][rows]`),
/// `matvec_res_<type>` gives `(residual + W · x, rms_norm(residual + W · x, nw))` instead.
#[allow(clippy::too_many_arguments)]
pub fn matvec_fused(
    gpu: &Gpu,
    ty: GgmlType,
    w: &CudaSlice<u8>,
    (rows, cols): (usize, usize),
    xs: &[f32],
    nw: &[f32],
    residual: Option<&[f32]>,
    (eps, parts, rows_per_warp, tile): (f32, usize, usize, usize),
) -> Result<(Vec<f32>, Vec<f32>), CudaError> {
    let n = check_rows(xs.len(), cols, "matvec_fused x")?;
    let norm_len = if residual.is_some() { rows } else { cols };
    // No norm weights (norm3 only): the plain product W · x[t], the norm left out.
    let plain = residual.is_none() && nw.is_empty();
    // Token tiles of two rows a warp group: `matvec_res_tok2_q4_k` only.
    let two_rows = residual.is_some() && ty == GgmlType::Q4K;
    if (nw.len() != norm_len && !plain)
        || !(1..=8).contains(&parts)
        || !parts.is_power_of_two()
        || !(1..=MVF_MAX_ROWS).contains(&rows_per_warp)
        || !(1..=MVF_MAX_TILE).contains(&tile)
        || (tile > 1 && 4 * tile * cols > 48 * 1024)
        || (tile > 1 && rows_per_warp != 1 && !(rows_per_warp == 2 && two_rows))
        || residual.is_some_and(|r| r.len() != n * rows)
        || 4 * cols > 48 * 1024
    {
        return Err(CudaError::Invalid("matvec_fused: sizes".into()));
    }
    let split = MvfSplit {
        parts,
        rows: rows_per_warp,
    };
    let rpb = split.rows_per_block();
    let (x, nwd) = (upload(gpu, xs)?, upload(gpu, nw)?);
    let (r, c, p) = (
        i32_arg(rows, "rows")?,
        i32_arg(cols, "cols")?,
        split.arg() | (tile << 16) as i32,
    );
    let grid = (blocks(rows, rpb), n as u32, 1);
    let sfx = type_suffix(ty);
    match residual {
        None if tile > 1 => {
            // The token-tile kernel: weights read once per tile of `tile` tokens.
            let mut y = alloc_poisoned::<f32>(gpu, n * rows)?;
            let (zero, zi, ni) = (0u64, 0i32, i32_arg(n, "tokens")?);
            let f = gpu.func(&format!("matvec_norm3_tok_{sfx}"))?;
            let conf = cfg(
                (grid.0, n.div_ceil(tile) as u32, 1),
                256,
                (4 * tile * cols) as u32,
            );
            if plain {
                launch!(
                    gpu,
                    f,
                    "matvec_norm3_tok",
                    conf,
                    [
                        &x, &zero, &eps, &c, &p, &ni, w, &mut y, &r, &zero, &zero, &zi, &zero,
                        &zero, &zi
                    ]
                )?;
            } else {
                launch!(
                    gpu,
                    f,
                    "matvec_norm3_tok",
                    conf,
                    [
                        &x, &nwd, &eps, &c, &p, &ni, w, &mut y, &r, &zero, &zero, &zi, &zero,
                        &zero, &zi
                    ]
                )?;
            }
            Ok((download(gpu, &y)?, Vec::new()))
        }
        None => {
            let mut y = alloc_poisoned::<f32>(gpu, n * rows)?;
            let (zero, zi) = (0u64, 0i32);
            let f = gpu.func(&format!("matvec_norm3_{sfx}"))?;
            let conf = cfg(grid, 256, (4 * cols) as u32);
            if plain {
                launch!(
                    gpu,
                    f,
                    "matvec_norm3",
                    conf,
                    [
                        &x, &zero, &eps, &c, &p, w, &mut y, &r, &zero, &zero, &zi, &zero, &zero,
                        &zi
                    ]
                )?;
            } else {
                launch!(
                    gpu,
                    f,
                    "matvec_norm3",
                    conf,
                    [&x, &nwd, &eps, &c, &p, w, &mut y, &r, &zero, &zero, &zi, &zero, &zero, &zi]
                )?;
            }
            Ok((download(gpu, &y)?, Vec::new()))
        }
        Some(res) if tile > 1 => {
            // `matvec_res_tok_<type>`: y[t] += W · x[t] in token tiles, no norm.
            let mut y = upload(gpu, res)?;
            let ni = i32_arg(n, "tokens")?;
            let name = if rows_per_warp == 2 {
                "matvec_res_tok2_q4_k".to_string()
            } else {
                format!("matvec_res_tok_{sfx}")
            };
            launch!(
                gpu,
                gpu.func(&name)?,
                "matvec_res_tok",
                cfg((grid.0, n.div_ceil(tile) as u32, 1), 256, 0),
                [w, &x, &mut y, &r, &c, &p, &ni]
            )?;
            Ok((download(gpu, &y)?, Vec::new()))
        }
        Some(res) => {
            let mut y = upload(gpu, res)?;
            let mut yn = alloc_poisoned::<f32>(gpu, n * rows)?;
            let mut counter = upload(gpu, &vec![0u32; n])?;
            launch!(
                gpu,
                gpu.func(&format!("matvec_res_{sfx}"))?,
                "matvec_res",
                cfg(grid, 256, 0),
                [
                    w,
                    &x,
                    &mut y,
                    &r,
                    &c,
                    &p,
                    &nwd,
                    &mut yn,
                    &mut counter,
                    &eps,
                    &0u64
                ]
            )?;
            let left = download(gpu, &counter)?;
            if left.iter().any(|&v| v != 0) {
                return Err(CudaError::Invalid(format!(
                    "matvec_res left its block counters at {left:?}"
                )));
            }
            Ok((download(gpu, &y)?, download(gpu, &yn)?))
        }
    }
}

/// `invs[t] · (W · xq[t])` for the `n` q8 rows of `xq` through `matvec_q8x_xr_q6_k` (Q6_K rows
/// in one slice, 16 rows × 8 tokens a block): the one-token `matvec_q8x_q6_k`'s outputs (parts 1),
/// bit for bit.
pub fn matvec_q8x_xr_q6k(
    gpu: &Gpu,
    w: &CudaSlice<u8>,
    (rows, cols): (usize, usize),
    (xq, invs): (&[u8], &[f32]),
) -> Result<Vec<f32>, CudaError> {
    let n = check_rows(xq.len(), q8_row_bytes(cols), "matvec_q8x_xr xq")?;
    if !cols.is_multiple_of(256)
        || invs.len() != n
        || w.len() < rows * row_bytes(GgmlType::Q6K, cols)?
    {
        return Err(CudaError::Invalid("matvec_q8x_xr: sizes".into()));
    }
    let split = MvfSplit { parts: 1, rows: 1 };
    let (xd, iv) = (upload(gpu, xq)?, upload(gpu, invs)?);
    let (r, c) = (i32_arg(rows, "rows")?, i32_arg(cols, "cols")?);
    let (p, ni) = (split.arg(), i32_arg(n, "tokens")?);
    let mut y = alloc_poisoned::<f32>(gpu, n * rows)?;
    let (zero, zi) = (0u64, 0i32);
    let grid = (blocks(rows, HEAD_XR_ROWS), n.div_ceil(XR_TOKENS) as u32, 1);
    launch!(
        gpu,
        gpu.func("matvec_q8x_xr_q6_k")?,
        "matvec_q8x_xr",
        cfg(grid, 256, 0),
        [&xd, &iv, &c, &p, &ni, w, &mut y, &r, &zero, &zero, &zi, &zero, &zero, &zi]
    )?;
    download(gpu, &y)
}

/// `residual[t] + W · x[t]` for the `n` tokens of `xs` (`[n][cols]`) through
/// `matvec_res_xr_q4_k` (Q4_K rows, 8 rows × 8 tokens a block, each row cut into `parts` slices
/// as the one-token `matvec_res_q4_k` cuts it): that kernel's outputs, bit for bit.
pub fn matvec_res_xr_q4k(
    gpu: &Gpu,
    w: &CudaSlice<u8>,
    (rows, cols): (usize, usize),
    xs: &[f32],
    residual: &[f32],
    parts: usize,
) -> Result<Vec<f32>, CudaError> {
    let n = check_rows(xs.len(), cols, "matvec_res_xr x")?;
    if !(1..=8).contains(&parts)
        || !parts.is_power_of_two()
        || residual.len() != n * rows
        || w.len() < rows * row_bytes(GgmlType::Q4K, cols)?
    {
        return Err(CudaError::Invalid("matvec_res_xr: sizes".into()));
    }
    let split = MvfSplit { parts, rows: 1 };
    let (x, mut y) = (upload(gpu, xs)?, upload(gpu, residual)?);
    let (r, c, p, ni) = (
        i32_arg(rows, "rows")?,
        i32_arg(cols, "cols")?,
        split.arg(),
        i32_arg(n, "tokens")?,
    );
    let grid = (blocks(rows, RES_XR_ROWS), n.div_ceil(XR_TOKENS) as u32, 1);
    launch!(
        gpu,
        gpu.func("matvec_res_xr_q4_k")?,
        "matvec_res_xr",
        cfg(grid, 256, 0),
        [w, &x, &mut y, &r, &c, &p, &ni]
    )?;
    download(gpu, &y)
}
