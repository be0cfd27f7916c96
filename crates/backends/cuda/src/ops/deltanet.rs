//! The Gated DeltaNet kernels (`deltanet.cu`): the causal conv, the gates, the delta rule (one
//! token, a sequence), q/k normalisation and the fused forms.

use super::*;

/// One DeltaNet conv step: returns `(silu(conv) output, new state)`.
pub fn dn_conv_step(
    gpu: &Gpu,
    x: &[f32],
    state: &[f32],
    w: &[f32],
    kern: usize,
) -> Result<(Vec<f32>, Vec<f32>), CudaError> {
    let ch = x.len();
    if state.len() != (kern - 1) * ch || w.len() != kern * ch {
        return Err(CudaError::Invalid(
            "dn_conv_step: state or weight size".into(),
        ));
    }
    let (xd, wd) = (upload(gpu, x)?, upload(gpu, w)?);
    let mut sd = upload(gpu, state)?;
    let mut y = alloc_poisoned::<f32>(gpu, ch)?;
    let (chi, ki) = (i32_arg(ch, "ch")?, i32_arg(kern, "kern")?);
    launch!(
        gpu,
        gpu.func("dn_conv_step")?,
        "dn_conv_step",
        cfg((blocks(ch, 128), 1, 1), 128, 0),
        [&xd, &mut sd, &wd, &mut y, &chi, &ki]
    )?;
    Ok((download(gpu, &y)?, download(gpu, &sd)?))
}

/// DeltaNet gates of `ba.len() / (2·nv)` tokens: `(β, g)`, `[tokens][nv]` each.
pub fn dn_gates(
    gpu: &Gpu,
    ba: &[f32],
    a: &[f32],
    dt_bias: &[f32],
    r: usize,
) -> Result<(Vec<f32>, Vec<f32>), CudaError> {
    let nv = a.len();
    if nv == 0
        || !ba.len().is_multiple_of(2 * nv)
        || ba.is_empty()
        || dt_bias.len() != nv
        || r == 0
        || !nv.is_multiple_of(r)
    {
        return Err(CudaError::Invalid("dn_gates: sizes".into()));
    }
    let tokens = ba.len() / (2 * nv);
    let (bad, ad, dd) = (upload(gpu, ba)?, upload(gpu, a)?, upload(gpu, dt_bias)?);
    let mut beta = alloc_poisoned::<f32>(gpu, tokens * nv)?;
    let mut g = alloc_poisoned::<f32>(gpu, tokens * nv)?;
    let (nvi, ri) = (i32_arg(nv, "nv")?, i32_arg(r, "r")?);
    launch!(
        gpu,
        gpu.func("dn_gates")?,
        "dn_gates",
        cfg((blocks(nv, 64), tokens as u32, 1), 64, 0),
        [&bad, &ad, &dd, &mut beta, &mut g, &nvi, &ri]
    )?;
    Ok((download(gpu, &beta)?, download(gpu, &g)?))
}

/// Shapes of the DeltaNet recurrence.
#[derive(Debug, Clone, Copy)]
pub struct DeltaDims {
    pub nk: usize,
    pub nv: usize,
    pub dk: usize,
    pub dv: usize,
}

/// One token of the delta rule for every V head: returns `(o [nv][dv], new state)`.
pub fn dn_delta_step(
    gpu: &Gpu,
    qkv: &[f32],
    beta: &[f32],
    g: &[f32],
    state: &[f32],
    d: DeltaDims,
) -> Result<(Vec<f32>, Vec<f32>), CudaError> {
    if qkv.len() != 2 * d.nk * d.dk + d.nv * d.dv
        || state.len() != d.nv * d.dk * d.dv
        || d.dv > 1024
        || !d.nv.is_multiple_of(d.nk)
    {
        return Err(CudaError::Invalid(format!("dn_delta_step: sizes {d:?}")));
    }
    let (qd, bd, gd) = (upload(gpu, qkv)?, upload(gpu, beta)?, upload(gpu, g)?);
    let mut sd = upload(gpu, state)?;
    let mut o = alloc_poisoned::<f32>(gpu, d.nv * d.dv)?;
    let (nki, dki, dvi) = (
        i32_arg(d.nk, "nk")?,
        i32_arg(d.dk, "dk")?,
        i32_arg(d.dv, "dv")?,
    );
    let block = (d.dv as u32).div_ceil(32) * 32;
    launch!(
        gpu,
        gpu.func("dn_delta_step")?,
        "dn_delta_step",
        cfg((d.nv as u32, 1, 1), block, (8 * d.dk) as u32),
        [&qd, &bd, &gd, &mut sd, &mut o, &nki, &dki, &dvi]
    )?;
    Ok((download(gpu, &o)?, download(gpu, &sd)?))
}

/// The DeltaNet conv over `x.len() / ch` tokens: returns `(silu(conv) [n][ch], new state)`.
pub fn dn_conv_seq(
    gpu: &Gpu,
    x: &[f32],
    state: &[f32],
    w: &[f32],
    ch: usize,
    kern: usize,
    prompt: bool,
) -> Result<(Vec<f32>, Vec<f32>), CudaError> {
    let n = check_rows(x.len(), ch, "dn_conv_seq")?;
    if kern == 0 || kern > 8 || state.len() != (kern - 1) * ch || w.len() != kern * ch {
        return Err(CudaError::Invalid(
            "dn_conv_seq: state or weight size".into(),
        ));
    }
    let (xd, wd) = (upload(gpu, x)?, upload(gpu, w)?);
    // One spare float: a kernel of width 1 has an empty state.
    let mut sd = upload(gpu, &[state, &[0.0]].concat())?;
    let mut y = alloc_poisoned::<f32>(gpu, x.len())?;
    let (ni, chi, ki) = (i32_arg(n, "n")?, i32_arg(ch, "ch")?, i32_arg(kern, "kern")?);
    if prompt {
        // The prompt form: outputs by (channel, token tile) blocks, then the state shift.
        launch!(
            gpu,
            gpu.func("dn_conv_prompt")?,
            "dn_conv_prompt",
            cfg((blocks(ch, 128), n.div_ceil(32) as u32, 1), 128, 0),
            [&xd, &sd, &wd, &mut y, &ni, &chi, &ki]
        )?;
        launch!(
            gpu,
            gpu.func("dn_conv_shift")?,
            "dn_conv_shift",
            cfg((blocks(ch, 128), 1, 1), 128, 0),
            [&xd, &mut sd, &ni, &chi, &ki]
        )?;
    } else {
        launch!(
            gpu,
            gpu.func("dn_conv_seq")?,
            "dn_conv_seq",
            cfg((blocks(ch, 128), 1, 1), 128, 0),
            [&xd, &mut sd, &wd, &mut y, &ni, &chi, &ki]
        )?;
    }
    let mut st = download(gpu, &sd)?;
    st.truncate(state.len());
    Ok((download(gpu, &y)?, st))
}

/// L2 norm of the q and k heads of every token of a conv output `[n][ch]`, q scaled.
pub fn dn_qk_norm(
    gpu: &Gpu,
    qkv: &[f32],
    ch: usize,
    nk: usize,
    dk: usize,
    eps: f32,
    q_scale: f32,
) -> Result<Vec<f32>, CudaError> {
    let n = check_rows(qkv.len(), ch, "dn_qk_norm")?;
    if 2 * nk * dk > ch {
        return Err(CudaError::Invalid(
            "dn_qk_norm: q and k exceed the row".into(),
        ));
    }
    let mut xd = upload(gpu, qkv)?;
    let (chi, nki, dki) = (i32_arg(ch, "ch")?, i32_arg(nk, "nk")?, i32_arg(dk, "dk")?);
    launch!(
        gpu,
        gpu.func("dn_qk_norm")?,
        "dn_qk_norm",
        cfg(((2 * nk) as u32, n as u32, 1), 128, 0),
        [&mut xd, &chi, &nki, &dki, &eps, &q_scale]
    )?;
    download(gpu, &xd)
}

/// Launch shape of `dn_delta_seq`: `(grid, block, shared bytes)` (32 state columns per block, a
/// warp per 32 state rows).
pub fn delta_seq_launch(nv: usize, dk: usize, dv: usize) -> ((u32, u32, u32), u32, u32) {
    let block = 32 * dk.div_ceil(32) as u32;
    (
        (nv as u32, dv.div_ceil(32) as u32, 1),
        block,
        4 * (2 * dk as u32 + block),
    )
}

/// `dn_delta_warp_<dk>` for these shapes (dk 64 or 128, dv a multiple of 32): its name and grid
/// (blocks of 128 threads, static shared memory), or `None`.
pub fn delta_warp_launch(nv: usize, dk: usize, dv: usize) -> Option<(String, (u32, u32, u32))> {
    ((dk == 64 || dk == 128) && dv > 0 && dv.is_multiple_of(32)).then(|| {
        (
            format!("dn_delta_warp_{dk}"),
            (nv as u32, dv.div_ceil(32) as u32, 1),
        )
    })
}

/// The delta rule over `n` tokens (conv rows `[n][ch]`, β and g `[n][nv]`) by `dn_delta_seq`, or
/// by `dn_delta_warp_<dk>` with `warp`: returns `(o [n][nv][dv], new state)`.
pub fn dn_delta_seq(
    gpu: &Gpu,
    qkv: &[f32],
    beta: &[f32],
    g: &[f32],
    state: &[f32],
    d: DeltaDims,
    warp: bool,
) -> Result<(Vec<f32>, Vec<f32>), CudaError> {
    let ch = 2 * d.nk * d.dk + d.nv * d.dv;
    let n = check_rows(qkv.len(), ch, "dn_delta_seq")?;
    if beta.len() != n * d.nv
        || g.len() != n * d.nv
        || state.len() != d.nv * d.dk * d.dv
        || d.dk > 1024
        || !d.nv.is_multiple_of(d.nk)
    {
        return Err(CudaError::Invalid(format!("dn_delta_seq: sizes {d:?}")));
    }
    let (qd, bd, gd) = (upload(gpu, qkv)?, upload(gpu, beta)?, upload(gpu, g)?);
    let mut sd = upload(gpu, state)?;
    let mut o = alloc_poisoned::<f32>(gpu, n * d.nv * d.dv)?;
    let (ni, chi, nki, dki, dvi) = (
        i32_arg(n, "n")?,
        i32_arg(ch, "ch")?,
        i32_arg(d.nk, "nk")?,
        i32_arg(d.dk, "dk")?,
        i32_arg(d.dv, "dv")?,
    );
    if warp {
        let (name, grid) = delta_warp_launch(d.nv, d.dk, d.dv)
            .ok_or_else(|| CudaError::Invalid(format!("dn_delta_warp: sizes {d:?}")))?;
        launch!(
            gpu,
            gpu.func(&name)?,
            &name,
            cfg(grid, 128, 0),
            [&qd, &bd, &gd, &mut sd, &mut o, &ni, &chi, &nki, &dvi]
        )?;
    } else {
        let (grid, block, shared) = delta_seq_launch(d.nv, d.dk, d.dv);
        launch!(
            gpu,
            gpu.func("dn_delta_seq")?,
            "dn_delta_seq",
            cfg(grid, block, shared),
            [&qd, &bd, &gd, &mut sd, &mut o, &ni, &chi, &nki, &dki, &dvi]
        )?;
    }
    Ok((download(gpu, &o)?, download(gpu, &sd)?))
}

/// `dn_fused_seq`'s launch for these shapes: `(block threads, dynamic shared bytes)`, or `None`
/// when the shape does not fit the kernel (dk a multiple of 32, at most 1024 threads).
pub fn dn_fused_launch(d: DeltaDims) -> Option<(u32, u32)> {
    if d.nk == 0 || d.dk == 0 || !d.dk.is_multiple_of(32) || !d.nv.is_multiple_of(d.nk) {
        return None;
    }
    let r = d.nv / d.nk;
    let threads = 32 * r * d.dv.div_ceil(32) * (d.dk / 32);
    let shared = 4 * (2 * d.dk + 2 * r * d.dv + threads + 3 * r);
    (threads <= 1024 && shared <= 48 * 1024).then_some((threads as u32, shared as u32))
}

/// `dn_fused_cols`' block limit (`DNC_MAX_THREADS` in deltanet.cu: its launch bound, which
/// leaves it the registers to hold its state rows without spilling).
const DNC_MAX_THREADS: usize = 256;

/// `dn_fused_cols`' tokens per chunk (`DNC_CHUNK` in deltanet.cu): their conv outputs, gates and
/// q/k norms are computed ahead of the recurrence and held in shared memory.
const DNC_CHUNK: usize = 16;

/// `dn_fused_cols`' launch for these shapes: `(grid, block threads, dynamic shared bytes)`, or
/// `None` when the shape does not fit it (dk and dv multiples of 32, dk at most
/// `DNC_MAX_THREADS`).
pub fn dn_cols_launch(d: DeltaDims) -> Option<(u32, u32, u32)> {
    let fits = d.nk > 0
        && d.dk > 0
        && d.dv > 0
        && d.dk.is_multiple_of(32)
        && d.dv.is_multiple_of(32)
        && d.nv.is_multiple_of(d.nk)
        && d.dk <= DNC_MAX_THREADS;
    let threads = d.dk;
    let shared = 4 * (DNC_CHUNK * (2 * d.dk + 32) + 4 * threads + 2 * DNC_CHUNK);
    fits.then_some(((d.nv * d.dv / 32) as u32, threads as u32, shared as u32))
}

/// What [`dn_fused_seq`] returns.
pub struct DnFusedOut {
    /// `[n][nv][dv]`.
    pub y: Vec<f32>,
    /// The conv state and the delta state after the last token.
    pub conv: Vec<f32>,
    pub state: Vec<f32>,
    /// With `trace`: the conv states and delta states after every token (`[n][..]` each).
    pub conv_trace: Vec<f32>,
    pub state_trace: Vec<f32>,
}

/// The DeltaNet core of `n` tokens in one launch (`dn_fused_seq`, or with `cols` `dn_fused_cols`:
/// a V head's columns over several blocks): conv, q/k L2 norm, gates, delta rule and gated norm;
/// with `trace`, also the states after every token. `pre`: the conv weights and windows, gate
/// parameters and norm weights loaded before the wait (`early` bit 1).
#[allow(clippy::too_many_arguments)]
pub fn dn_fused_seq(
    gpu: &Gpu,
    (cols, pre): (bool, bool),
    trace: bool,
    qkv: &[f32],
    conv_state: &[f32],
    conv_w: &[f32],
    ba: &[f32],
    (a, dt_bias): (&[f32], &[f32]),
    state: &[f32],
    z: &[f32],
    norm_w: &[f32],
    d: DeltaDims,
    kern: usize,
    (l2_eps, q_scale, rms_eps): (f32, f32, f32),
) -> Result<DnFusedOut, CudaError> {
    let ch = 2 * d.nk * d.dk + d.nv * d.dv;
    let n = check_rows(qkv.len(), ch, "dn_fused_seq")?;
    let Some((threads, shared)) = dn_fused_launch(d) else {
        return Err(CudaError::Invalid(format!("dn_fused_seq: shape {d:?}")));
    };
    if conv_state.len() != (kern - 1) * ch
        || conv_w.len() != kern * ch
        || ba.len() != n * 2 * d.nv
        || a.len() != d.nv
        || dt_bias.len() != d.nv
        || state.len() != d.nv * d.dk * d.dv
        || z.len() != n * d.nv * d.dv
        || norm_w.len() != d.dv
        || !(1..=8).contains(&kern)
    {
        return Err(CudaError::Invalid(format!("dn_fused_seq: sizes {d:?}")));
    }
    let (qd, cwd, bad) = (upload(gpu, qkv)?, upload(gpu, conv_w)?, upload(gpu, ba)?);
    let (ad, dtd, zd, nwd) = (
        upload(gpu, a)?,
        upload(gpu, dt_bias)?,
        upload(gpu, z)?,
        upload(gpu, norm_w)?,
    );
    let mut csd = upload(gpu, conv_state)?;
    let mut sd = upload(gpu, state)?;
    let mut y = alloc_poisoned::<f32>(gpu, n * d.nv * d.dv)?;
    let (ni, chi, nki, dki, dvi) = (
        i32_arg(n, "n")?,
        i32_arg(ch, "ch")?,
        i32_arg(d.nk, "nk")?,
        i32_arg(d.dk, "dk")?,
        i32_arg(d.dv, "dv")?,
    );
    let (ri, ki) = (i32_arg(d.nv / d.nk, "r")?, i32_arg(kern, "kern")?);
    // Several tokens take dn_fused_cols_rows, as in the model (REDLITE_CUDA_DN_ROWS=0: not).
    let rows_kernel = n > 1 && std::env::var("REDLITE_CUDA_DN_ROWS").as_deref() != Ok("0");
    let name = if cols && rows_kernel {
        "dn_fused_cols_rows"
    } else if cols {
        "dn_fused_cols"
    } else {
        "dn_fused_seq"
    };
    let f = gpu.func(name)?;
    let conf = match dn_cols_launch(d).filter(|_| cols) {
        Some((grid, threads, shared)) => cfg((grid, 1, 1), threads, shared),
        None if cols => return Err(CudaError::Invalid(format!("dn_fused_cols: shape {d:?}"))),
        None => cfg((d.nk as u32, 1, 1), threads, shared),
    };
    // dn_fused_cols' gated-norm rows and barrier counters.
    let mut o = alloc_poisoned::<f32>(gpu, n * d.nv * d.dv)?;
    let mut counter = upload(gpu, &vec![0u64; d.nk])?;
    let (mut st, mut ct) = if trace {
        (
            alloc_poisoned::<f32>(gpu, n * state.len())?,
            alloc_poisoned::<f32>(gpu, n * conv_state.len())?,
        )
    } else {
        (
            alloc_poisoned::<f32>(gpu, 1)?,
            alloc_poisoned::<f32>(gpu, 1)?,
        )
    };
    // The state loaded before pdl_enter, as the model launches it (the same bits either way).
    let early = 1i32 | if pre { 2 } else { 0 };
    // The trace pointers (null without), then dn_fused_cols' two extra arguments.
    let null = 0u64;
    let mut b = gpu.stream.launch_builder(f);
    b.arg(&qd)
        .arg(&mut csd)
        .arg(&cwd)
        .arg(&bad)
        .arg(&ad)
        .arg(&dtd);
    b.arg(&mut sd).arg(&zd).arg(&nwd).arg(&mut y);
    b.arg(&ni)
        .arg(&chi)
        .arg(&nki)
        .arg(&dki)
        .arg(&dvi)
        .arg(&ri)
        .arg(&ki);
    b.arg(&l2_eps).arg(&q_scale).arg(&rms_eps);
    if trace {
        b.arg(&mut st).arg(&mut ct);
    } else {
        b.arg(&null).arg(&null);
    }
    b.arg(&early);
    if cols {
        b.arg(&mut o).arg(&mut counter);
    }
    // SAFETY: the arguments are dn_fused_seq's (dn_fused_cols': and o, counter), in order, each
    // buffer sized for n tokens of these shapes (checked above).
    drv(name, unsafe { b.launch(conf) })?;
    let traced = |b: &CudaSlice<f32>| -> Result<Vec<f32>, CudaError> {
        if trace {
            download(gpu, b)
        } else {
            Ok(Vec::new())
        }
    };
    Ok(DnFusedOut {
        y: download(gpu, &y)?,
        conv: download(gpu, &csd)?,
        state: download(gpu, &sd)?,
        conv_trace: traced(&ct)?,
        state_trace: traced(&st)?,
    })
}
