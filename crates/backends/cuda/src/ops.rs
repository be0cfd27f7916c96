//! Host-side wrappers of every kernel: upload the inputs, launch, download the outputs.
//!
//! Part 1 keeps activations on the host between kernels (simple and checkable); each wrapper is
//! one or two launches. Outputs are poisoned (all bits set: NaN for f32, -1 for i32) before the
//! launch, so an element a kernel fails to write shows up in every comparison.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};
use redlite_gguf::GgmlType;
use redlite_model::KvType;

use crate::kernels::type_suffix;
use crate::model::{MvfSplit, HEAD_XR_ROWS, MVF_MAX_ROWS, MVF_MAX_TILE, RES_XR_ROWS, XR_TOKENS};
use crate::{CudaError, Gpu};

/// Warps (output rows) per block of the matvec-style kernels.
pub const MATVEC_WARPS: u32 = 4;
/// Threads of the block-wide router kernel `moe_router` per token.
pub const ROUTER_THREADS: u32 = 256;
/// Blocks per token of the one-token norm kernels (`rms_norm_q8`, `res_norm_q8`) as the model runs
/// them: each sums all the squares and writes one slice of the q8 row.
pub const NORM_SLICES: usize = 8;
/// Threads per block of `moe_gate_up_tab_q8q_iq2_xxs` (32 rows a block): `REDLITE_CUDA_Q8Q_WARPS`
/// warps (8, 16 or 32; default 16: two rows a warp, two blocks an SM: 283.1 / 283.2 tok/s on the
/// H200 against 279.0 / 279.2 with 32 warps, one block an SM, and 276.9 with 8).
pub fn q8q_threads() -> u32 {
    32 * warps_from_env("REDLITE_CUDA_Q8Q_WARPS", &[8, 16, 32], 16)
}

/// Threads per block of `moe_gate_up_tab_q8q_iq2_xxs` in a call of `n` tokens: past
/// [`Q8Q_FEW_TOKENS`] (the verify's 8- and 16-row passes) `REDLITE_CUDA_Q8Q_TOK_WARPS` warps (4, 8
/// or 16; default 8: four blocks an SM; session 30 on the H200, 8 / 16 rows −2.3 / −2.1 % against
/// 16 warps, while every q8 kernel at 8 warps cost 2 rows 2.3 %), else [`q8q_threads`]. The same
/// bits whatever the warps.
pub fn q8q_threads_for(n: usize) -> u32 {
    if n > Q8Q_FEW_TOKENS {
        32 * warps_from_env("REDLITE_CUDA_Q8Q_TOK_WARPS", &[4, 8, 16], 8)
    } else {
        q8q_threads()
    }
}

/// Threads per block of `moe_gate_up_tok_q8q_iq2_xxs`: [`q8q_threads`], at most 512 (its launch
/// bound; `REDLITE_CUDA_Q8Q_WARPS=32` failed its launch with "invalid argument" in session 30).
pub fn q8q_tok_threads() -> u32 {
    q8q_threads().min(512)
}

/// Calls of up to this many tokens take [`q8q_threads`] in `moe_gate_up_tab_q8q_iq2_xxs`.
pub const Q8Q_FEW_TOKENS: usize = 4;

/// Warps from the variable `name` when it holds one of `allowed`, else `default`.
fn warps_from_env(name: &str, allowed: &[u32], default: u32) -> u32 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse::<u32>().ok())
        .filter(|w| allowed.contains(w))
        .unwrap_or(default)
}

/// Most experts the one-warp router kernel `moe_router_warp` takes (its `32 * ROUTER_VPL`).
pub const ROUTER_WARP_MAX_EXPERTS: usize = 512;
/// `moe_router_warp`'s block for its block-wide top-k: a thread an expert up to 512.
const ROUTER_PAR_THREADS: u32 = 512;

/// Which router kernel runs and how it is launched (per token: one block of `threads`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouterKernel {
    pub name: &'static str,
    pub threads: u32,
    /// Dynamic shared memory, bytes.
    pub shared: u32,
}

impl RouterKernel {
    /// The block-wide kernel: softmax and k rounds of a block argmax (any expert count).
    pub fn block(n_expert: usize) -> RouterKernel {
        RouterKernel {
            name: "moe_router",
            threads: ROUTER_THREADS,
            shared: (4 * n_expert) as u32,
        }
    }

    /// The one-warp kernel (probabilities in registers, no barrier per round), or `None` when
    /// `n_expert` is above what it holds. Launched with 512 threads, it takes the block-wide
    /// top-k (moe.cu's `TOPK_PAR`: the same outputs; session 34) where that applies, warp 0's
    /// rounds otherwise; `REDLITE_CUDA_ROUTER_PAR=0` launches one warp (the rounds always).
    pub fn warp(n_expert: usize) -> Option<RouterKernel> {
        let par = crate::model::env_switch("REDLITE_CUDA_ROUTER_PAR", true);
        (n_expert <= ROUTER_WARP_MAX_EXPERTS).then_some(RouterKernel {
            name: "moe_router_warp",
            threads: if par { ROUTER_PAR_THREADS } else { 32 },
            shared: 0,
        })
    }

    /// What the model runs: the one-warp kernel where it applies, unless
    /// `REDLITE_CUDA_ROUTER=block` asks for the block-wide one (for A/B measurements).
    pub fn for_model(n_expert: usize) -> RouterKernel {
        let block = std::env::var("REDLITE_CUDA_ROUTER").is_ok_and(|v| v == "block");
        match RouterKernel::warp(n_expert) {
            Some(w) if !block => w,
            _ => RouterKernel::block(n_expert),
        }
    }
}
/// gridDim.y limit: a longer batch is split.
const MAX_GRID_Y: usize = 65_535;

fn drv<T>(what: &str, r: Result<T, cudarc::driver::DriverError>) -> Result<T, CudaError> {
    r.map_err(|e| CudaError::driver(what, e))
}

/// Copy host data to a new device buffer.
pub fn upload<T: DeviceRepr>(gpu: &Gpu, data: &[T]) -> Result<CudaSlice<T>, CudaError> {
    drv("host-to-device copy", gpu.stream.clone_htod(data))
}

/// Copy a device buffer back (waits for the stream).
pub fn download<T: DeviceRepr>(gpu: &Gpu, data: &CudaSlice<T>) -> Result<Vec<T>, CudaError> {
    drv("device-to-host copy", gpu.stream.clone_dtoh(data))
}

/// A new device buffer of `len` elements with every byte 0xFF.
pub fn alloc_poisoned<T: DeviceRepr>(gpu: &Gpu, len: usize) -> Result<CudaSlice<T>, CudaError> {
    // SAFETY: the memory is fully written by the memset before anything reads it.
    let mut buf = drv("cuMemAlloc", unsafe { gpu.stream.alloc::<T>(len.max(1)) })?;
    let bytes = buf.num_bytes();
    let (ptr, _guard) = buf.device_ptr_mut(&gpu.stream);
    // SAFETY: `ptr` addresses `bytes` bytes owned by `buf`, ordered on this stream.
    drv("cuMemsetD8Async", unsafe {
        cudarc::driver::result::memset_d8_async(ptr, 0xff, bytes, gpu.stream.cu_stream())
    })?;
    drop(_guard);
    Ok(buf)
}

/// The device address of a buffer (for pointer tables).
pub fn device_address<T>(gpu: &Gpu, buf: &CudaSlice<T>) -> u64 {
    let (ptr, _guard) = buf.device_ptr(&gpu.stream);
    ptr
}

fn i32_arg(v: usize, what: &str) -> Result<i32, CudaError> {
    i32::try_from(v)
        .map_err(|_| CudaError::Invalid(format!("{what} = {v} does not fit a kernel int")))
}

fn cfg(grid: (u32, u32, u32), block: u32, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: shared,
    }
}

fn blocks(n: usize, per: u32) -> u32 {
    n.div_ceil(per as usize).max(1) as u32
}

/// Bytes of one row of `cols` values of type `ty`, or an error if `cols` is not whole blocks.
pub fn row_bytes(ty: GgmlType, cols: usize) -> Result<usize, CudaError> {
    if !cols.is_multiple_of(ty.block_elems()) {
        return Err(CudaError::Invalid(format!(
            "{} rows of {cols} values are not whole blocks of {}",
            ty.name(),
            ty.block_elems()
        )));
    }
    Ok(cols / ty.block_elems() * ty.block_bytes())
}

/// Launch a kernel with its arguments in declared order.
///
/// SAFETY (of the expansion): every kernel's arguments are pushed in its declared order with
/// matching types, and the buffers outlive the launch (they are dropped after the synchronizing
/// download).
macro_rules! launch {
    ($gpu:expr, $f:expr, $what:expr, $cfg:expr, [$($arg:expr),* $(,)?]) => {{
        let mut b = $gpu.stream.launch_builder($f);
        $( b.arg($arg); )*
        drv($what, unsafe { b.launch($cfg) }).map(|_| ())
    }};
}

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

/// The kernel-name suffix of a weight type the 8-bit-activation matvecs take (Q4_K, Q6_K).
fn q8_suffix(ty: GgmlType) -> Result<&'static str, CudaError> {
    match ty {
        GgmlType::Q4K => Ok("q4_k"),
        GgmlType::Q6K => Ok("q6_k"),
        _ => Err(CudaError::Invalid(format!(
            "8-bit-activation matvec of {}: Q4_K and Q6_K only",
            ty.name()
        ))),
    }
}

/// Shared-memory bytes of one staged 8-bit activation row (`Q8_ROW_BYTES` in matvec.cu): the
/// quants, an f32 scale per 32 values, an i32 sum per 16.
pub fn q8_row_bytes(cols: usize) -> usize {
    cols + cols / 32 * 4 + cols / 16 * 4
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

/// A q8 row as the kernels lay it out (`Q8_ROW_BYTES` in matvec.cu): per 32 values d = max|v| /
/// 127 and q = rint(v / d) (`q8_block32`), then the f32 scales, then the i32 sum of each 16 quants.
pub fn q8_row(v: &[f32]) -> Vec<u8> {
    let n = v.len();
    let (mut q, mut d, mut s16) = (Vec::with_capacity(n), Vec::new(), Vec::new());
    for block in v.chunks(32) {
        let db = block.iter().fold(0.0f32, |m, x| m.max(x.abs())) / 127.0;
        let id = if db > 0.0 { 1.0 / db } else { 0.0 };
        let qs: Vec<i32> = block
            .iter()
            .map(|&x| (x * id).round_ties_even() as i32)
            .collect();
        d.push(db);
        for half in qs.chunks(16) {
            s16.push(half.iter().sum::<i32>());
        }
        q.extend(qs.iter().map(|&v| v as i8 as u8));
    }
    let mut out = q;
    out.extend(d.iter().flat_map(|v| v.to_le_bytes()));
    out.extend(s16.iter().flat_map(|v| v.to_le_bytes()));
    out
}

/// `swiglu_q8` on `n` tokens of `len` values: `(silu(gate) · up, its q8 rows)`.
pub fn swiglu_q8(
    gpu: &Gpu,
    gate: &[f32],
    up: &[f32],
    len: usize,
) -> Result<(Vec<f32>, Vec<u8>), CudaError> {
    let n = check_rows(gate.len(), len, "swiglu_q8 gate")?;
    if up.len() != gate.len() || !len.is_multiple_of(32) {
        return Err(CudaError::Invalid("swiglu_q8: sizes".into()));
    }
    let (g, u) = (upload(gpu, gate)?, upload(gpu, up)?);
    let mut out = alloc_poisoned::<f32>(gpu, n * len)?;
    let mut xq = alloc_poisoned::<u8>(gpu, n * q8_row_bytes(len))?;
    let li = i32_arg(len, "len")?;
    launch!(
        gpu,
        gpu.func("swiglu_q8")?,
        "swiglu_q8",
        cfg((blocks(len, 256), n as u32, 1), 256, 0),
        [&g, &u, &mut out, &mut xq, &li]
    )?;
    Ok((download(gpu, &out)?, download(gpu, &xq)?))
}

/// The device buffers of one token's routed experts through the per-layer table kernels: the
/// table (`tab[3e + p]`: part p (gate, up, down) of expert e), ids `0..k`, the weights, the
/// output (zeros), a zero shared-expert output and gate logit, and the sizes as kernel arguments.
struct TabCall {
    tab: CudaSlice<u64>,
    ids: CudaSlice<i32>,
    weights: CudaSlice<f32>,
    out: CudaSlice<f32>,
    shared: CudaSlice<f32>,
    gl: CudaSlice<f32>,
    ff: i32,
    hidden: i32,
    k: i32,
}

fn tab_call(
    gpu: &Gpu,
    set: &ExpertSet,
    weights: &[f32],
    (hidden, ff): (usize, usize),
) -> Result<TabCall, CudaError> {
    let k = weights.len();
    let tab: Vec<u64> = (0..k)
        .flat_map(|e| [set.gate[e], set.up[e], set.down[e]].map(|b| device_address(gpu, b)))
        .collect();
    let ids: Vec<i32> = (0..k as i32).collect();
    Ok(TabCall {
        tab: upload(gpu, &tab)?,
        ids: upload(gpu, &ids)?,
        weights: upload(gpu, weights)?,
        out: upload(gpu, &vec![0.0f32; hidden])?,
        shared: upload(gpu, &vec![0.0f32; hidden])?,
        gl: upload(gpu, &[0.0f32])?,
        ff: i32_arg(ff, "ff")?,
        hidden: i32_arg(hidden, "hidden")?,
        k: i32_arg(k, "k")?,
    })
}

/// A down kernel of the per-layer table form (`moe_down_combine_tab_*`) on the activations `act`
/// (f32 values or q8 rows) of the call `c`, `grid_x` blocks of [`crate::expert_cache::moe_warps`]
/// warps, one token.
fn down_tab_launch<T: DeviceRepr>(
    gpu: &Gpu,
    name: &str,
    c: &mut TabCall,
    act: &CudaSlice<T>,
    grid_x: u32,
) -> Result<(), CudaError> {
    let warps = crate::expert_cache::moe_warps();
    launch!(
        gpu,
        gpu.func(name)?,
        name,
        cfg((grid_x, 1, 1), 32 * warps, 0),
        [&c.tab, &c.ids, &c.weights, act, &mut c.out, &c.shared, &c.gl, &c.hidden, &c.ff, &c.k]
    )
}

/// What [`moe_experts_q8_down`] returns: `Σ weight · down(act)`, the f32 activations `[k][ff]`
/// and their q8 rows.
pub type ExpertsQ8 = (Vec<f32>, Vec<f32>, Vec<u8>);

/// The routed experts of one token with every part IQ2_XXS, all on 8-bit activations:
/// `moe_gate_up_tab_q8q_iq2_xxs` on the q8 row `xq` (writing the activations and their q8
/// rows), then `moe_down_combine_tab_q8_iq2_xxs` on those rows.
pub fn moe_experts_q8_down(
    gpu: &Gpu,
    set: &ExpertSet,
    weights: &[f32],
    xq: &[u8],
    (hidden, ff): (usize, usize),
) -> Result<ExpertsQ8, CudaError> {
    let k = weights.len();
    if set.gate_up_ty != GgmlType::IQ2XXS
        || set.down_ty != GgmlType::IQ2XXS
        || set.gate.len() != k
        || xq.len() != q8_row_bytes(hidden)
        || !ff.is_multiple_of(32)
    {
        return Err(CudaError::Invalid(
            "experts (q8 down): IQ2_XXS parts and one q8 row".into(),
        ));
    }
    let mut c = tab_call(gpu, set, weights, (hidden, ff))?;
    let x_d = upload(gpu, xq)?;
    let mut act = alloc_poisoned::<f32>(gpu, k * ff)?;
    let mut actq = alloc_poisoned::<u8>(gpu, k * q8_row_bytes(ff))?;
    launch!(
        gpu,
        gpu.func("moe_gate_up_tab_q8q_iq2_xxs")?,
        "moe_gate_up_tab_q8q_iq2_xxs",
        cfg(((ff / 32) as u32, k as u32, 1), q8q_threads(), 0),
        [&c.tab, &c.ids, &x_d, &mut act, &mut actq, &c.ff, &c.hidden, &c.k, &0u64]
    )?;
    // Two warps per row, as the model runs it.
    down_q8_launch(gpu, &mut c, &actq, hidden, 0)?;
    Ok((
        download(gpu, &c.out)?,
        download(gpu, &act)?,
        download(gpu, &actq)?,
    ))
}

/// `moe_down_combine_tab_q8_iq2_xxs` on the q8 activation rows `actq` of the call `c`, two warps
/// per row as the model runs it, the parts through the table (`dstride` 0) or at the table's
/// first entries + id · `dstride`.
fn down_q8_launch(
    gpu: &Gpu,
    c: &mut TabCall,
    actq: &CudaSlice<u8>,
    hidden: usize,
    dstride: u64,
) -> Result<(), CudaError> {
    let warps = crate::expert_cache::moe_warps();
    let name = "moe_down_combine_tab_q8_iq2_xxs";
    launch!(
        gpu,
        gpu.func(name)?,
        name,
        cfg((blocks(hidden * 2, warps), 1, 1), 32 * warps, 0),
        [
            &c.tab, &c.ids, &c.weights, actq, &mut c.out, &c.shared, &c.gl, &c.hidden, &c.ff, &c.k,
            &dstride
        ]
    )
}

/// What [`moe_gate_up_route_q8q`] returns: expert ids and weights `[k]`, the activations
/// `[k][ff]` and their q8 rows.
pub type RoutedGateUp = (Vec<i32>, Vec<f32>, Vec<f32>, Vec<u8>);

/// `moe_gate_up_route_q8q_iq2_xxs` (with `pair`: `moe_gate_up_route2_q8q_iq2_xxs`, a warp's two
/// rows together) on one token: the top-`k` of the router `logits` (`n_expert` of them; the chosen
/// ids must be those of `set`'s experts, `0..k`) and the gate/up rows of each choice on the q8 row
/// `xq`.
pub fn moe_gate_up_route_q8q(
    gpu: &Gpu,
    pair: bool,
    set: &ExpertSet,
    logits: &[f32],
    xq: &[u8],
    (hidden, ff): (usize, usize),
) -> Result<RoutedGateUp, CudaError> {
    let k = set.gate.len();
    let ne = logits.len();
    if set.gate_up_ty != GgmlType::IQ2XXS
        || k == 0
        || k > 32
        || ne < k
        || ne > ROUTER_WARP_MAX_EXPERTS
        || xq.len() != q8_row_bytes(hidden)
        || !ff.is_multiple_of(32)
    {
        return Err(CudaError::Invalid("routed gate/up: sizes".into()));
    }
    let c = tab_call(gpu, set, &vec![0.0; k], (hidden, ff))?;
    let (l_d, x_d) = (upload(gpu, logits)?, upload(gpu, xq)?);
    let mut ids = alloc_poisoned::<i32>(gpu, k)?;
    let mut wts = alloc_poisoned::<f32>(gpu, k)?;
    let mut act = alloc_poisoned::<f32>(gpu, k * ff)?;
    let mut actq = alloc_poisoned::<u8>(gpu, k * q8_row_bytes(ff))?;
    let nei = i32_arg(ne, "experts")?;
    let name = if pair {
        "moe_gate_up_route2_q8q_iq2_xxs"
    } else {
        "moe_gate_up_route_q8q_iq2_xxs"
    };
    launch!(
        gpu,
        gpu.func(name)?,
        name,
        cfg(((ff / 32) as u32, k as u32, 1), q8q_threads(), 0),
        [
            &l_d, &nei, &c.tab, &mut ids, &mut wts, &x_d, &mut act, &mut actq, &c.ff, &c.hidden,
            &c.k, &0u64
        ]
    )?;
    Ok((
        download(gpu, &ids)?,
        download(gpu, &wts)?,
        download(gpu, &act)?,
        download(gpu, &actq)?,
    ))
}

/// What [`moe_route_down_q8_slots`] returns: `Σ weight · down(act)`, the activations `[k][ff]`
/// and their q8 rows.
pub type RoutedSlots = (Vec<f32>, Vec<f32>, Vec<u8>);

/// The routed experts of one token as the model runs them with every expert resident: the
/// experts' parts packed into slots of one buffer (the expert cache's layout, [`ExpertLayout`]),
/// a table pointing into them, then `moe_gate_up_route2_q8q_iq2_xxs` (top-`k` of `logits`) and
/// `moe_down_combine_tab_q8_iq2_xxs`, the parts found through the table (`dstride` 0) or at its
/// first entries + id · slot stride (`direct`). `parts[p][e]`: part p (gate, up, down) of expert
/// e, IQ2_XXS, `logits.len()` experts.
///
/// [`ExpertLayout`]: crate::expert_cache::ExpertLayout
pub fn moe_route_down_q8_slots(
    gpu: &Gpu,
    parts: [&[Vec<u8>]; 3],
    logits: &[f32],
    k: usize,
    xq: &[u8],
    (hidden, ff): (usize, usize),
    direct: bool,
) -> Result<RoutedSlots, CudaError> {
    let ne = logits.len();
    if parts.iter().any(|p| p.len() != ne)
        || k == 0
        || k > 32
        || ne < k
        || ne > ROUTER_WARP_MAX_EXPERTS
        || xq.len() != q8_row_bytes(hidden)
        || !ff.is_multiple_of(32)
    {
        return Err(CudaError::Invalid("routed experts in slots: sizes".into()));
    }
    let (_slots, tab, sb) = expert_slots(gpu, parts)?;
    let mut c = TabCall {
        tab,
        ids: alloc_poisoned::<i32>(gpu, k)?,
        weights: alloc_poisoned::<f32>(gpu, k)?,
        out: upload(gpu, &vec![0.0f32; hidden])?,
        shared: upload(gpu, &vec![0.0f32; hidden])?,
        gl: upload(gpu, &[0.0f32])?,
        ff: i32_arg(ff, "ff")?,
        hidden: i32_arg(hidden, "hidden")?,
        k: i32_arg(k, "k")?,
    };
    let (l_d, x_d) = (upload(gpu, logits)?, upload(gpu, xq)?);
    let mut act = alloc_poisoned::<f32>(gpu, k * ff)?;
    let mut actq = alloc_poisoned::<u8>(gpu, k * q8_row_bytes(ff))?;
    let nei = i32_arg(ne, "experts")?;
    let dstride = if direct { sb as u64 } else { 0 };
    let name = "moe_gate_up_route2_q8q_iq2_xxs";
    launch!(
        gpu,
        gpu.func(name)?,
        name,
        cfg(((ff / 32) as u32, k as u32, 1), q8q_threads(), 0),
        [
            &l_d,
            &nei,
            &c.tab,
            &mut c.ids,
            &mut c.weights,
            &x_d,
            &mut act,
            &mut actq,
            &c.ff,
            &c.hidden,
            &c.k,
            &dstride
        ]
    )?;
    down_q8_launch(gpu, &mut c, &actq, hidden, dstride)?;
    Ok((
        download(gpu, &c.out)?,
        download(gpu, &act)?,
        download(gpu, &actq)?,
    ))
}

/// The routed experts of `n` tokens (`ids` and `weights`: `[n][k]`, ids into `parts`' experts;
/// `xq`: the tokens' q8 rows) with every part IQ2_XXS, as a call of several tokens runs them:
/// `tiles = (0, 0)`: the one-token kernels on a grid of tokens (`moe_gate_up_tab_q8q_iq2_xxs`,
/// `moe_down_combine_tab_q8_iq2_xxs`); `(g, d)`: their token-tile forms
/// (`moe_gate_up_tok_q8q_iq2_xxs`, `moe_down_combine_tok_q8_iq2_xxs`) with g and d tokens a block.
/// The parts through the table, or (`direct`) at its first entries + id · slot stride. Returns
/// `(x + Σ weight · down, activations [n][k][ff], their q8 rows)` for `x` = the index pattern
/// written first (so that a missed row shows).
#[allow(clippy::too_many_arguments)]
pub fn moe_experts_q8_tokens(
    gpu: &Gpu,
    parts: [&[Vec<u8>]; 3],
    ids: &[i32],
    weights: &[f32],
    xq: &[u8],
    (hidden, ff): (usize, usize),
    tiles: (usize, usize),
    direct: bool,
) -> Result<RoutedSlots, CudaError> {
    let ne = parts[0].len();
    let n = xq.len() / q8_row_bytes(hidden).max(1);
    let k = ids.len().checked_div(n).unwrap_or(0);
    if parts.iter().any(|p| p.len() != ne)
        || n == 0
        || k == 0
        || ids.len() != n * k
        || weights.len() != n * k
        || xq.len() != n * q8_row_bytes(hidden)
        || ids.iter().any(|&i| i < 0 || i as usize >= ne)
        || !ff.is_multiple_of(32)
        || tiles.0 > crate::model::MOE_TOK_GU_MAX
        || tiles.1 > crate::model::MOE_TOK_DOWN_MAX
    {
        return Err(CudaError::Invalid(
            "routed experts of several tokens: sizes".into(),
        ));
    }
    let (_slots, tab, sb) = expert_slots(gpu, parts)?;
    let start: Vec<f32> = (0..n * hidden).map(|i| (i % 7) as f32 * 0.25).collect();
    let mut c = TabCall {
        tab,
        ids: upload(gpu, ids)?,
        weights: upload(gpu, weights)?,
        out: upload(gpu, &start)?,
        shared: upload(gpu, &vec![0.5f32; n * hidden])?,
        gl: upload(gpu, &vec![0.25f32; n])?,
        ff: i32_arg(ff, "ff")?,
        hidden: i32_arg(hidden, "hidden")?,
        k: i32_arg(k, "k")?,
    };
    let x_d = upload(gpu, xq)?;
    let mut act = alloc_poisoned::<f32>(gpu, n * k * ff)?;
    let mut actq = alloc_poisoned::<u8>(gpu, n * k * q8_row_bytes(ff))?;
    let dstride = if direct { sb as u64 } else { 0 };
    let ni = i32_arg(n, "tokens")?;
    if tiles.0 == 0 {
        let name = "moe_gate_up_tab_q8q_iq2_xxs";
        launch!(
            gpu,
            gpu.func(name)?,
            name,
            cfg(
                ((ff / 32) as u32, k as u32, n as u32),
                q8q_threads_for(n),
                0
            ),
            [&c.tab, &c.ids, &x_d, &mut act, &mut actq, &c.ff, &c.hidden, &c.k, &dstride]
        )?;
    } else {
        let name = "moe_gate_up_tok_q8q_iq2_xxs";
        let tile = i32_arg(tiles.0, "tile")?;
        launch!(
            gpu,
            gpu.func(name)?,
            name,
            cfg(
                ((ff / 32) as u32, k as u32, n.div_ceil(tiles.0) as u32),
                q8q_tok_threads(),
                0
            ),
            [
                &c.tab, &c.ids, &x_d, &mut act, &mut actq, &c.ff, &c.hidden, &c.k, &dstride, &ni,
                &tile
            ]
        )?;
    }
    // Two warps per row, as the model runs it.
    let warps = crate::expert_cache::moe_warps();
    let grid_x = blocks(hidden * 2, warps);
    if tiles.1 == 0 {
        let name = "moe_down_combine_tab_q8_iq2_xxs";
        launch!(
            gpu,
            gpu.func(name)?,
            name,
            cfg((grid_x, n as u32, 1), 32 * warps, 0),
            [
                &c.tab, &c.ids, &c.weights, &actq, &mut c.out, &c.shared, &c.gl, &c.hidden, &c.ff,
                &c.k, &dstride
            ]
        )?;
    } else {
        let name = "moe_down_combine_tok_q8_iq2_xxs";
        let tile = i32_arg(tiles.1, "tile")?;
        launch!(
            gpu,
            gpu.func(name)?,
            name,
            cfg((grid_x, n.div_ceil(tiles.1) as u32, 1), 32 * warps, 0),
            [
                &c.tab, &c.ids, &c.weights, &actq, &mut c.out, &c.shared, &c.gl, &c.hidden, &c.ff,
                &c.k, &dstride, &ni, &tile
            ]
        )?;
    }
    Ok((
        download(gpu, &c.out)?,
        download(gpu, &act)?,
        download(gpu, &actq)?,
    ))
}

/// Experts `parts[p][e]` (part p: gate, up, down) packed into the slots of one device buffer (the
/// expert cache's layout) and the table of their parts' addresses: `(slots, table, slot bytes)`.
fn expert_slots(
    gpu: &Gpu,
    parts: [&[Vec<u8>]; 3],
) -> Result<(CudaSlice<u8>, CudaSlice<u64>, usize), CudaError> {
    let ne = parts[0].len();
    let layout = crate::expert_cache::ExpertLayout::new(parts[0][0].len(), parts[2][0].len());
    let sb = layout.slot_bytes;
    let mut host = vec![0u8; ne * sb];
    for e in 0..ne {
        let slot = &mut host[e * sb..(e + 1) * sb];
        slot[..layout.gate_bytes].copy_from_slice(&parts[0][e]);
        slot[layout.up_off..layout.up_off + layout.gate_bytes].copy_from_slice(&parts[1][e]);
        slot[layout.down_off..layout.down_off + layout.down_bytes].copy_from_slice(&parts[2][e]);
    }
    let slots = upload(gpu, &host)?;
    let base = device_address(gpu, &slots);
    let offs = [0, layout.up_off as u64, layout.down_off as u64];
    let tab: Vec<u64> = (0..ne)
        .flat_map(|e| offs.map(|o| base + (e * sb) as u64 + o))
        .collect();
    Ok((slots, upload(gpu, &tab)?, sb))
}

/// What [`moe_route_gate_up_slots`] returns: the router's logits, the shared expert's gate
/// logit, the chosen ids and weights, the activations `[k][ff]` and their q8 rows.
pub type RouteGateUp = (Vec<f32>, Vec<f32>, Vec<i32>, Vec<f32>, Vec<f32>, Vec<u8>);

/// How [`moe_route_gate_up_slots`] launches the router and the routed gate/up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteForm {
    /// `matvec3_x_f32`, then `moe_gate_up_route2_q8q_iq2_xxs`.
    Separate,
    /// `moe_route_gate_up_q8q_iq2_xxs` (a grid barrier after the logits).
    Fused,
}

/// A one-token router and routed gate/up as the model runs them with every expert resident
/// (experts in slots, direct addresses): the f32 `router` `[ne][hidden]` and `gate_vec`
/// `[hidden]` on `xn` (the model's router split), the top-`k` of the logits, the gate/up rows on
/// `xq`, launched as `form` says.
#[allow(clippy::too_many_arguments)]
pub fn moe_route_gate_up_slots(
    gpu: &Gpu,
    parts: [&[Vec<u8>]; 3],
    router: &[f32],
    gate_vec: &[f32],
    (xn, xq): (&[f32], &[u8]),
    k: usize,
    (hidden, ff): (usize, usize),
    form: RouteForm,
) -> Result<RouteGateUp, CudaError> {
    let ne = parts[0].len();
    if parts.iter().any(|p| p.len() != ne)
        || k == 0
        || k > 32
        || ne < k
        || ne > ROUTER_WARP_MAX_EXPERTS
        || router.len() != ne * hidden
        || gate_vec.len() != hidden
        || xn.len() != hidden
        || xq.len() != q8_row_bytes(hidden)
        || !ff.is_multiple_of(32)
        || q8q_threads() != 512
    {
        return Err(CudaError::Invalid(
            "routed gate/up with its router: sizes".into(),
        ));
    }
    let (_slots, tab, sb) = expert_slots(gpu, parts)?;
    let bytes = |v: &[f32]| v.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>();
    let (w0, w1) = (upload(gpu, &bytes(router))?, upload(gpu, &bytes(gate_vec))?);
    let (xn_d, xq_d) = (upload(gpu, xn)?, upload(gpu, xq)?);
    let mut rlog = alloc_poisoned::<f32>(gpu, ne)?;
    let mut gl = alloc_poisoned::<f32>(gpu, 1)?;
    let mut ids = alloc_poisoned::<i32>(gpu, k)?;
    let mut wts = alloc_poisoned::<f32>(gpu, k)?;
    let mut act = alloc_poisoned::<f32>(gpu, k * ff)?;
    let mut actq = alloc_poisoned::<u8>(gpu, k * q8_row_bytes(ff))?;
    let parts_n = crate::model::mvf_parts(GgmlType::F32, hidden, 1);
    let (ci, pi, nei, one) = (
        i32_arg(hidden, "hidden")?,
        i32_arg(parts_n, "parts")?,
        i32_arg(ne, "experts")?,
        1i32,
    );
    let (ffi, ki, dstride) = (i32_arg(ff, "ff")?, i32_arg(k, "k")?, sb as u64);
    if form != RouteForm::Separate {
        let (name, grid) = ("moe_route_gate_up_q8q_iq2_xxs", ((ff / 32) * k) as u32);
        let mut counter = upload(gpu, &[0u64])?;
        let f = gpu.func(name)?;
        let mut b = gpu.stream.launch_builder(f);
        b.arg(&xn_d)
            .arg(&ci)
            .arg(&pi)
            .arg(&w0)
            .arg(&mut rlog)
            .arg(&nei)
            .arg(&w1)
            .arg(&mut gl)
            .arg(&one)
            .arg(&nei)
            .arg(&tab)
            .arg(&mut ids)
            .arg(&mut wts)
            .arg(&xq_d)
            .arg(&mut act)
            .arg(&mut actq)
            .arg(&ffi)
            .arg(&ci)
            .arg(&ki)
            .arg(&dstride)
            .arg(&mut counter);
        drv(name, unsafe { b.launch(cfg((grid, 1, 1), 512, 0)) })?;
    } else {
        let split = MvfSplit {
            parts: parts_n,
            rows: 1,
        };
        let (p, zero, zi) = (split.arg(), 0u64, 0i32);
        let rows_grid = blocks(ne, split.rows_per_block()) + blocks(1, split.rows_per_block());
        launch!(
            gpu,
            gpu.func("matvec3_x_f32")?,
            "matvec3_x_f32",
            cfg((rows_grid, 1, 1), 256, 0),
            [&xn_d, &ci, &p, &w0, &mut rlog, &nei, &w1, &mut gl, &one, &zero, &zero, &zi]
        )?;
        launch!(
            gpu,
            gpu.func("moe_gate_up_route2_q8q_iq2_xxs")?,
            "moe_gate_up_route2_q8q_iq2_xxs",
            cfg(((ff / 32) as u32, k as u32, 1), 512, 0),
            [
                &rlog, &nei, &tab, &mut ids, &mut wts, &xq_d, &mut act, &mut actq, &ffi, &ci, &ki,
                &dstride
            ]
        )?;
    }
    Ok((
        download(gpu, &rlog)?,
        download(gpu, &gl)?,
        download(gpu, &ids)?,
        download(gpu, &wts)?,
        download(gpu, &act)?,
        download(gpu, &actq)?,
    ))
}

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

/// The routed experts of one token as the model runs them on a q8 row of `x` (`xq`,
/// [`q8_row`]): `moe_gate_up_tab_q8_iq2_xxs` (IQ2_XXS gate and up), then
/// `moe_down_combine_tab_<down type>`; returns `Σ weight · down(act)`.
pub fn moe_experts_q8(
    gpu: &Gpu,
    set: &ExpertSet,
    weights: &[f32],
    xq: &[u8],
    (hidden, ff): (usize, usize),
) -> Result<Vec<f32>, CudaError> {
    let k = weights.len();
    if set.gate_up_ty != GgmlType::IQ2XXS || set.gate.len() != k || xq.len() != q8_row_bytes(hidden)
    {
        return Err(CudaError::Invalid(
            "experts (q8): IQ2_XXS gate/up and one q8 row".into(),
        ));
    }
    experts_tab_run(
        gpu,
        set,
        weights,
        xq,
        "moe_gate_up_tab_q8_iq2_xxs",
        (hidden, ff),
    )
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

/// Rows `ids` of an embedding table of type `ty` (`cols` values per row), dequantized.
pub fn embed(
    gpu: &Gpu,
    ty: GgmlType,
    table: &CudaSlice<u8>,
    cols: usize,
    ids: &[i32],
) -> Result<Vec<f32>, CudaError> {
    let name = format!("embed_{}", type_suffix(ty));
    let f = gpu.func(&name)?;
    let ids_d = upload(gpu, ids)?;
    let mut out = alloc_poisoned::<f32>(gpu, ids.len() * cols)?;
    let c = i32_arg(cols, "cols")?;
    launch!(
        gpu,
        f,
        &name,
        cfg((ids.len() as u32, 1, 1), 256, 0),
        [table, &ids_d, &mut out, &c]
    )?;
    download(gpu, &out)
}

/// Router of `tokens` tokens: softmax, top-k, renormalised weights, ascending expert ids, by
/// the kernel `kernel` (see [`RouterKernel`]).
pub fn moe_router(
    gpu: &Gpu,
    kernel: RouterKernel,
    logits: &[f32],
    n_expert: usize,
    k: usize,
) -> Result<(Vec<i32>, Vec<f32>), CudaError> {
    if k == 0 || k > 64 || k > n_expert || !logits.len().is_multiple_of(n_expert) {
        return Err(CudaError::Invalid(format!(
            "router: k = {k} of {n_expert} experts, {} logits",
            logits.len()
        )));
    }
    let tokens = logits.len() / n_expert;
    let f = gpu.func(kernel.name)?;
    let l = upload(gpu, logits)?;
    let mut idx = alloc_poisoned::<i32>(gpu, tokens * k)?;
    let mut w = alloc_poisoned::<f32>(gpu, tokens * k)?;
    let (ne, kk) = (i32_arg(n_expert, "experts")?, i32_arg(k, "k")?);
    launch!(
        gpu,
        f,
        "moe_router",
        cfg((tokens as u32, 1, 1), kernel.threads, kernel.shared),
        [&l, &ne, &kk, &mut idx, &mut w]
    )?;
    Ok((download(gpu, &idx)?, download(gpu, &w)?))
}

/// Device addresses and types of the chosen experts' weights.
pub struct ExpertSet<'a> {
    pub gate_up_ty: GgmlType,
    pub down_ty: GgmlType,
    pub gate: Vec<&'a CudaSlice<u8>>,
    pub up: Vec<&'a CudaSlice<u8>>,
    pub down: Vec<&'a CudaSlice<u8>>,
}

/// `Σ_e weight_e · down_e(silu(gate_e·x) ⊙ up_e·x)` over the chosen experts, summed in order.
pub fn moe_experts(
    gpu: &Gpu,
    set: &ExpertSet,
    weights: &[f32],
    x: &[f32],
    ff: usize,
) -> Result<Vec<f32>, CudaError> {
    let k = weights.len();
    let hidden = x.len();
    if set.gate.len() != k || set.up.len() != k || set.down.len() != k || k == 0 {
        return Err(CudaError::Invalid(format!(
            "experts: {k} weights for {} experts",
            set.gate.len()
        )));
    }
    let ptrs =
        |v: &[&CudaSlice<u8>]| -> Vec<u64> { v.iter().map(|s| device_address(gpu, s)).collect() };
    let gate_p = upload(gpu, &ptrs(&set.gate))?;
    let up_p = upload(gpu, &ptrs(&set.up))?;
    let down_p = upload(gpu, &ptrs(&set.down))?;
    let x_d = upload(gpu, x)?;
    let w_d = upload(gpu, weights)?;
    let mut act = alloc_poisoned::<f32>(gpu, k * ff)?;
    let mut out = alloc_poisoned::<f32>(gpu, hidden)?;
    let (ffi, hi, ki) = (
        i32_arg(ff, "ff")?,
        i32_arg(hidden, "hidden")?,
        i32_arg(k, "k")?,
    );
    let gu = format!("moe_gate_up_{}", type_suffix(set.gate_up_ty));
    launch!(
        gpu,
        gpu.func(&gu)?,
        &gu,
        cfg(
            (blocks(ff, MATVEC_WARPS), k as u32, 1),
            32 * MATVEC_WARPS,
            0
        ),
        [&gate_p, &up_p, &x_d, &mut act, &ffi, &hi]
    )?;
    let dn = format!("moe_down_{}", type_suffix(set.down_ty));
    launch!(
        gpu,
        gpu.func(&dn)?,
        &dn,
        cfg((blocks(hidden, MATVEC_WARPS), 1, 1), 32 * MATVEC_WARPS, 0),
        [&down_p, &act, &w_d, &mut out, &hi, &ffi, &ki]
    )?;
    download(gpu, &out)
}

/// The same sum through the device-resident model's kernels (`moe_gate_up_tab_<type>`, then
/// `moe_down_combine_tab_<type>` with a zero residual, a zero shared expert and its gate 0):
/// the chosen experts as the entries 0..k of a per-layer table of part addresses, as the GPU
/// expert cache builds it; warps per block as the model runs them.
pub fn moe_experts_tab(
    gpu: &Gpu,
    set: &ExpertSet,
    weights: &[f32],
    x: &[f32],
    ff: usize,
) -> Result<Vec<f32>, CudaError> {
    let k = weights.len();
    let hidden = x.len();
    if set.gate.len() != k || set.up.len() != k || set.down.len() != k || k == 0 {
        return Err(CudaError::Invalid(format!(
            "experts (table): {k} weights for {} experts",
            set.gate.len()
        )));
    }
    let gu = format!("moe_gate_up_tab_{}", type_suffix(set.gate_up_ty));
    experts_tab_run(gpu, set, weights, x, &gu, (hidden, ff))
}

/// The gate/up kernel `gu` on the input `x` (f32 values or a q8 row), then
/// `moe_down_combine_tab_<down type>`: `Σ weight · down(act)` of one token.
fn experts_tab_run<T: cudarc::driver::DeviceRepr>(
    gpu: &Gpu,
    set: &ExpertSet,
    weights: &[f32],
    x: &[T],
    gu: &str,
    (hidden, ff): (usize, usize),
) -> Result<Vec<f32>, CudaError> {
    let k = weights.len();
    let mut c = tab_call(gpu, set, weights, (hidden, ff))?;
    let x_d = upload(gpu, x)?;
    let mut act = alloc_poisoned::<f32>(gpu, k * ff)?;
    let warps = crate::expert_cache::moe_warps();
    launch!(
        gpu,
        gpu.func(gu)?,
        gu,
        cfg((blocks(ff, warps), k as u32, 1), 32 * warps, 0),
        [&c.tab, &c.ids, &x_d, &mut act, &c.ff, &c.hidden, &c.k]
    )?;
    let dn = format!("moe_down_combine_tab_{}", type_suffix(set.down_ty));
    down_tab_launch(gpu, &dn, &mut c, &act, blocks(hidden, warps))?;
    download(gpu, &c.out)
}

fn check_rows(len: usize, n: usize, what: &str) -> Result<usize, CudaError> {
    if n == 0 || !len.is_multiple_of(n) {
        return Err(CudaError::Invalid(format!(
            "{what}: {len} values are not rows of {n}"
        )));
    }
    Ok(len / n)
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

/// NeoX RoPE on `[tokens][heads][head_dim]`, token t at position `pos0 + t`.
pub fn rope_neox(
    gpu: &Gpu,
    x: &[f32],
    heads: usize,
    head_dim: usize,
    rope_dims: usize,
    pos0: usize,
    theta: f64,
) -> Result<Vec<f32>, CudaError> {
    let tokens = check_rows(x.len(), heads * head_dim, "rope")?;
    if rope_dims > head_dim || !rope_dims.is_multiple_of(2) {
        return Err(CudaError::Invalid(format!(
            "rope: {rope_dims} rotary dims of {head_dim}"
        )));
    }
    let mut xd = upload(gpu, x)?;
    let (hd, rd, p0) = (
        i32_arg(head_dim, "head_dim")?,
        i32_arg(rope_dims, "rope_dims")?,
        i32_arg(pos0, "pos")?,
    );
    launch!(
        gpu,
        gpu.func("rope_neox")?,
        "rope_neox",
        cfg((heads as u32, tokens as u32, 1), 64, 0),
        [&mut xd, &hd, &rd, &p0, &theta]
    )?;
    download(gpu, &xd)
}

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

/// Attention of one token over `n` cached positions: `q [heads][hd]`, caches `[n][nkv][hd]`.
#[allow(clippy::too_many_arguments)] // the kernel's own shape parameters
pub fn attn_decode(
    gpu: &Gpu,
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    heads: usize,
    nkv: usize,
    hd: usize,
    scale: f32,
) -> Result<Vec<f32>, CudaError> {
    let n = check_rows(kc.len(), nkv * hd, "attn k cache")?;
    if q.len() != heads * hd || vc.len() != kc.len() || !heads.is_multiple_of(nkv) {
        return Err(CudaError::Invalid("attn_decode: sizes".into()));
    }
    let (qd, kd, vd) = (upload(gpu, q)?, upload(gpu, kc)?, upload(gpu, vc)?);
    let mut scratch = alloc_poisoned::<f32>(gpu, heads * n)?;
    let mut o = alloc_poisoned::<f32>(gpu, heads * hd)?;
    let (ni, nkvi, hdi) = (i32_arg(n, "n")?, i32_arg(nkv, "nkv")?, i32_arg(hd, "hd")?);
    launch!(
        gpu,
        gpu.func("attn_decode")?,
        "attn_decode",
        cfg((heads as u32, 1, 1), 256, 0),
        [
            &qd,
            &kd,
            &vd,
            &mut scratch,
            &mut o,
            &ni,
            &nkvi,
            &hdi,
            &scale
        ]
    )?;
    download(gpu, &o)
}

/// Index of the largest value of each row of `n` (lowest index on ties), each row cut into
/// `slices` blocks (1 or more).
pub fn argmax(gpu: &Gpu, x: &[f32], n: usize, slices: usize) -> Result<Vec<i32>, CudaError> {
    let rows = check_rows(x.len(), n, "argmax")?;
    let xd = upload(gpu, x)?;
    let mut out = alloc_poisoned::<i32>(gpu, rows)?;
    let mut part = alloc_poisoned::<f32>(gpu, 2 * slices * rows)?;
    let mut counter = upload(gpu, &vec![0u32; rows])?;
    let ni = i32_arg(n, "n")?;
    launch!(
        gpu,
        gpu.func("argmax")?,
        "argmax",
        cfg((slices as u32, rows as u32, 1), 256, 0),
        [&xd, &ni, &mut out, &mut part, &mut counter]
    )?;
    download(gpu, &out)
}

// ----- the device-resident model's multi-token kernels -----

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

/// Shapes of gated attention.
#[derive(Debug, Clone, Copy)]
pub struct AttnDims {
    pub heads: usize,
    pub nkv: usize,
    pub hd: usize,
    pub rope_dims: usize,
    pub theta: f64,
    pub eps: f32,
}

/// The attention kernel `name` for a KV cache of type `kv`: `name` for f32, `name_h` for f16
/// (the attention kernels take no other cache type).
pub fn kv_kernel(name: &str, kv: KvType) -> Result<String, CudaError> {
    match kv {
        KvType::F32 => Ok(name.to_string()),
        KvType::F16 => Ok(format!("{name}_h")),
        other => Err(CudaError::Invalid(format!(
            "a {other} KV cache on the GPU (the CUDA attention kernels take f32 or f16)"
        ))),
    }
}

/// A K or V cache on the device in the element type `kv` (f32, or f16 rounded to nearest even).
enum KvDev {
    F32(CudaSlice<f32>),
    F16(CudaSlice<u16>),
}

impl KvDev {
    fn upload(gpu: &Gpu, data: &[f32], kv: KvType) -> Result<KvDev, CudaError> {
        kv_kernel("", kv)?;
        Ok(if kv == KvType::F16 {
            let bits: Vec<u16> = data
                .iter()
                .map(|&x| redlite_model::kv_type::f32_to_f16(x))
                .collect();
            KvDev::F16(upload(gpu, &bits)?)
        } else {
            KvDev::F32(upload(gpu, data)?)
        })
    }

    fn address(&self, gpu: &Gpu) -> u64 {
        match self {
            KvDev::F32(b) => device_address(gpu, b),
            KvDev::F16(b) => device_address(gpu, b),
        }
    }

    /// The values as f32 (f16 widened exactly).
    fn download(&self, gpu: &Gpu) -> Result<Vec<f32>, CudaError> {
        match self {
            KvDev::F32(b) => download(gpu, b),
            KvDev::F16(b) => Ok(download(gpu, b)?
                .into_iter()
                .map(redlite_model::kv_type::f16_to_f32)
                .collect()),
        }
    }
}

/// `attn_qk_prep` on `n` tokens at positions `pos0..`: returns `(q, gate, k cache, v cache)`
/// with the caches `[ctx][nkv][hd]` (positions outside `pos0..pos0 + n` keep `kc0` / `vc0`);
/// RoPE's angles from `rope_table`'s rows when `table` (as the model runs it), else computed
/// in the kernel. The caches are of type `kv` on the device (`attn_qk_prep_h` for f16; `kc0`,
/// `vc0` rounded to it), returned as f32.
#[allow(clippy::too_many_arguments)]
#[allow(clippy::type_complexity)]
pub fn attn_qk_prep(
    gpu: &Gpu,
    qg: &[f32],
    kn: &[f32],
    vn: &[f32],
    q_norm: &[f32],
    k_norm: &[f32],
    kc0: &[f32],
    vc0: &[f32],
    pos0: usize,
    d: AttnDims,
    table: bool,
    kv: KvType,
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>), CudaError> {
    let n = check_rows(qg.len(), d.heads * 2 * d.hd, "attn_qk_prep q")?;
    let ctx = check_rows(kc0.len(), d.nkv * d.hd, "attn_qk_prep cache")?;
    if kn.len() != n * d.nkv * d.hd
        || vn.len() != kn.len()
        || vc0.len() != kc0.len()
        || pos0 + n > ctx
        || d.hd > 512
        || q_norm.len() != d.hd
        || k_norm.len() != d.hd
    {
        return Err(CudaError::Invalid("attn_qk_prep: sizes".into()));
    }
    let (qgd, knd, vnd) = (upload(gpu, qg)?, upload(gpu, kn)?, upload(gpu, vn)?);
    let (qnd, knd2) = (upload(gpu, q_norm)?, upload(gpu, k_norm)?);
    let (kc, vc) = (KvDev::upload(gpu, kc0, kv)?, KvDev::upload(gpu, vc0, kv)?);
    let (kca, vca) = (kc.address(gpu), vc.address(gpu));
    let pos = upload(gpu, &[i32_arg(pos0, "pos")?])?;
    let mut q = alloc_poisoned::<f32>(gpu, n * d.heads * d.hd)?;
    let mut gate = alloc_poisoned::<f32>(gpu, n * d.heads * d.hd)?;
    let (hi, nkvi, hdi, rdi) = (
        i32_arg(d.heads, "heads")?,
        i32_arg(d.nkv, "nkv")?,
        i32_arg(d.hd, "hd")?,
        i32_arg(d.rope_dims, "rope dims")?,
    );
    // The table of every cache position, as the model keeps it.
    let half = d.rope_dims / 2;
    let cs = if table && half > 0 {
        let mut cs = alloc_poisoned::<f32>(gpu, 2 * ctx * half)?;
        let ci = i32_arg(ctx, "positions")?;
        launch!(
            gpu,
            gpu.func("rope_table")?,
            "rope_table",
            cfg((ctx as u32, half.div_ceil(32) as u32, 1), 32, 0),
            [&mut cs, &ci, &rdi, &d.theta]
        )?;
        Some(cs)
    } else {
        None
    };
    let cs_ptr = cs.as_ref().map_or(0u64, |c| device_address(gpu, c));
    let name = kv_kernel("attn_qk_prep", kv)?;
    launch!(
        gpu,
        gpu.func(&name)?,
        &name,
        cfg(((d.heads + d.nkv) as u32, n as u32, 1), 128, 0),
        [
            &qgd, &knd, &vnd, &mut q, &mut gate, &kca, &vca, &qnd, &knd2, &pos, &hi, &nkvi, &hdi,
            &rdi, &d.theta, &d.eps, &cs_ptr
        ]
    )?;
    Ok((
        download(gpu, &q)?,
        download(gpu, &gate)?,
        kc.download(gpu)?,
        vc.download(gpu)?,
    ))
}

/// Causal attention of `n` query tokens at positions `pos0..` (`q [n][heads][hd]`) over caches
/// `[ctx][nkv][hd]` that hold positions `0..pos0 + n`, on the device as `kv` (rounded to it).
#[allow(clippy::too_many_arguments)]
pub fn attn_causal(
    gpu: &Gpu,
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    pos0: usize,
    heads: usize,
    nkv: usize,
    hd: usize,
    scale: f32,
    kind: AttnKind,
    kv: KvType,
) -> Result<Vec<f32>, CudaError> {
    let n = check_rows(q.len(), heads * hd, "attn_causal q")?;
    if (kind == AttnKind::Prompt && !attn_prompt_fits(heads, nkv, hd))
        || (kind == AttnKind::PromptMma && attn_prompt_mma(heads, nkv, hd).is_none())
    {
        return Err(CudaError::Invalid("attn_prompt: sizes".into()));
    }
    let ctx = check_rows(kc.len(), nkv * hd, "attn_causal cache")?;
    if vc.len() != kc.len()
        || pos0 + n > ctx
        || !hd.is_multiple_of(32)
        || hd > 512
        || !heads.is_multiple_of(nkv)
    {
        return Err(CudaError::Invalid("attn_causal: sizes".into()));
    }
    let qd = upload(gpu, q)?;
    let (kcd, vcd) = (KvDev::upload(gpu, kc, kv)?, KvDev::upload(gpu, vc, kv)?);
    let (kd, vd) = (kcd.address(gpu), vcd.address(gpu));
    let pos = upload(gpu, &[i32_arg(pos0, "pos")?])?;
    let mut o = alloc_poisoned::<f32>(gpu, q.len())?;
    let (nkvi, hdi) = (i32_arg(nkv, "nkv")?, i32_arg(hd, "hd")?);
    let (ntok, headsi) = (i32_arg(n, "tokens")?, i32_arg(heads, "heads")?);
    if kind == AttnKind::PromptMma {
        let (name, grid, block, shared) =
            attn_prompt_mma(heads, nkv, hd).map_or(Default::default(), |f| f(n));
        let name = kv_kernel(name, kv)?;
        launch!(
            gpu,
            gpu.func(&name)?,
            &name,
            cfg(grid, block, shared),
            [&qd, &kd, &vd, &0u64, &mut o, &pos, &ntok, &headsi, &nkvi, &scale]
        )?;
    } else if kind == AttnKind::Prompt {
        let (grid, block, shared) = attn_prompt_launch(n, heads, nkv, hd);
        let name = kv_kernel("attn_prompt", kv)?;
        launch!(
            gpu,
            gpu.func(&name)?,
            &name,
            cfg(grid, block, shared),
            [&qd, &kd, &vd, &0u64, &mut o, &pos, &ntok, &headsi, &nkvi, &hdi, &scale]
        )?;
    } else {
        let name = kv_kernel("attn_causal", kv)?;
        launch!(
            gpu,
            gpu.func(&name)?,
            &name,
            cfg((heads as u32, n as u32, 1), 128, 0),
            [&qd, &kd, &vd, &0u64, &mut o, &pos, &nkvi, &hdi, &scale]
        )?;
    }
    download(gpu, &o)
}

/// Which causal attention kernel [`attn_causal`] runs: one block per head and token, a GQA group
/// per block (`attn_prompt`), or that on the tensor cores (`attn_prompt_mma_<hd>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKind {
    Causal,
    Prompt,
    PromptMma,
}

/// `attn_prompt_mma_<hd>` for these heads (head_dim 64, 128 or 256; `heads / nkv` dividing 32):
/// its name and its launch for `n` tokens `(grid, block, dynamic shared bytes)`, or `None`.
#[allow(clippy::type_complexity)]
pub fn attn_prompt_mma(
    heads: usize,
    nkv: usize,
    hd: usize,
) -> Option<impl Fn(usize) -> (&'static str, (u32, u32, u32), u32, u32)> {
    let name = match hd {
        64 => "attn_prompt_mma_64",
        128 => "attn_prompt_mma_128",
        256 => "attn_prompt_mma_256",
        _ => return None,
    };
    if !attn_prompt_fits(heads, nkv, hd) {
        return None;
    }
    let per_block = 32 / (heads / nkv);
    // Q [32][hd + 8], K [16][hd + 8], Vᵀ [hd][16 + 8] in f16.
    let shared = (2 * (32 * (hd + 8) + 16 * (hd + 8) + hd * 24)) as u32;
    Some(move |n: usize| {
        (
            name,
            (nkv as u32, n.div_ceil(per_block) as u32, 1),
            64,
            shared,
        )
    })
}

/// Whether `attn_prompt` takes these heads: `heads / nkv` query heads per KV head dividing 32,
/// head_dim a multiple of 32 up to 256.
pub fn attn_prompt_fits(heads: usize, nkv: usize, hd: usize) -> bool {
    nkv > 0
        && heads.is_multiple_of(nkv)
        && (32usize).is_multiple_of(heads / nkv)
        && hd.is_multiple_of(32)
        && hd <= 256
}

/// `attn_prompt`'s launch for `n` tokens: `(grid, block, dynamic shared bytes)`.
pub fn attn_prompt_launch(
    n: usize,
    heads: usize,
    nkv: usize,
    hd: usize,
) -> ((u32, u32, u32), u32, u32) {
    let per_block = 32 / (heads / nkv);
    (
        (nkv as u32, n.div_ceil(per_block) as u32, 1),
        256,
        (2 * 16 * hd * 4) as u32,
    )
}

/// Whether `attn_split_gqa` (warps over positions, every query head of a KV head per warp) takes
/// this attention shape: heads / nkv in {1, 2, 4, 8} and hd / 32 in {2, 4, 8}.
pub fn attn_split_gqa_fits(heads: usize, nkv: usize, hd: usize) -> bool {
    nkv > 0
        && heads.is_multiple_of(nkv)
        && matches!(heads / nkv, 1 | 2 | 4 | 8)
        && hd.is_multiple_of(32)
        && matches!(hd / 32, 2 | 4 | 8)
}

/// The `attn_split_gqa` kernel with `p` positions per warp step (2 or 4).
pub fn attn_split_gqa_kernel(p: usize) -> &'static str {
    if p >= 4 {
        "attn_split_gqa4"
    } else {
        "attn_split_gqa"
    }
}

/// Blocks a KV head's query heads take in the split kernel `name` (with or without its `_h`): 2
/// for `attn_split_gqa8xh3` (half the heads a block, so grid.x is twice the KV heads
/// and a block half the warps), else 1.
pub fn attn_split_head_blocks(name: &str) -> usize {
    match name.trim_end_matches("_h") {
        "attn_split_gqa8xh3" => 2,
        _ => 1,
    }
}

/// A split kernel's blocks across and threads a block, `(grid.x, block)`, for `heads` query heads
/// over `nkv` KV heads when a KV head's heads take `head_blocks` blocks: one warp a query head.
pub fn attn_split_block(heads: usize, nkv: usize, head_blocks: usize) -> (u32, u32) {
    let nkv = nkv.max(1);
    (
        (head_blocks * nkv) as u32,
        (32 * (heads / nkv) / head_blocks.max(1)) as u32,
    )
}

/// Chunks of a split kernel's one-wave grid: `per_sm` blocks an SM (its occupancy) on `sms` SMs
/// over `nkv` KV heads of `head_blocks` blocks each.
pub fn attn_one_wave_splits(per_sm: usize, sms: usize, nkv: usize, head_blocks: usize) -> usize {
    (per_sm.max(1) * sms / (nkv * head_blocks).max(1)).max(1)
}

/// The launch of split kernel `f` (named `name`) for `heads` query heads over `nkv` KV heads on
/// `sms` SMs, as the model runs it: `(grid.x, block threads, chunks)`, the chunks filling one wave
/// of the blocks an SM holds (its occupancy).
pub fn attn_split_wave(
    f: &cudarc::driver::CudaFunction,
    name: &str,
    heads: usize,
    nkv: usize,
    sms: usize,
) -> Result<(u32, u32, usize), CudaError> {
    let hb = attn_split_head_blocks(name);
    let (gx, threads) = attn_split_block(heads, nkv, hb);
    let per_sm = f
        .occupancy_max_active_blocks_per_multiprocessor(threads, 0, None)
        .map_err(|e| CudaError::driver("occupancy", e))?;
    Ok((
        gx,
        threads,
        attn_one_wave_splits(per_sm as usize, sms, nkv, hb),
    ))
}

/// Whether the split kernel `name` takes this shape: `attn_split_gqa8xh3` only head_dim 256
/// with 8 query heads a KV head; `attn_split_mma` head_dim 64, 128 or 256 with at most 8;
/// the others what [`attn_split_gqa_fits`] allows.
pub fn attn_split_takes(name: &str, heads: usize, nkv: usize, hd: usize) -> bool {
    if name.starts_with("attn_split_mma") {
        // The tensor-core forms: head_dim 64, 128 or 256, at most 8 query heads a KV head.
        return matches!(hd, 64 | 128 | 256)
            && nkv > 0
            && heads.is_multiple_of(nkv)
            && heads <= 8 * nkv;
    }
    attn_split_head_blocks(name) == 1 || (hd == 256 && nkv > 0 && heads == 8 * nkv)
}

/// Decode attention of `rows` tokens (q is `[rows][heads][hd]`), row t at `pos0 + t`, split over
/// the cache by the kernel `split` (`attn_split`, or where the shape fits [`attn_split_gqa_fits`]
/// `attn_split_gqa`, `attn_split_gqa4` or `attn_split_gqa4x`) into `splits` chunks, then
/// `attn_merge`, with the output gate when `gate` is given: `[rows][heads][hd]`. The caches are of
/// type `kv` on the device (the split kernel's `_h` form for f16; `kc`, `vc` rounded to it).
#[allow(clippy::too_many_arguments)]
pub fn attn_split_merge_with(
    gpu: &Gpu,
    split: &str,
    kv: KvType,
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    gate: Option<&[f32]>,
    pos0: usize,
    (heads, nkv, hd): (usize, usize, usize),
    scale: f32,
    (splits, min_chunk): (usize, usize),
) -> Result<Vec<f32>, CudaError> {
    let ctx = check_rows(kc.len(), nkv * hd, "attn_split cache")?;
    let rows = check_rows(q.len(), heads * hd, "attn_split q")?;
    if rows == 0
        || vc.len() != kc.len()
        || pos0 + rows > ctx
        || !hd.is_multiple_of(32)
        || hd > 512
        || !heads.is_multiple_of(nkv)
        || heads / nkv > 32
        || !(1..=512).contains(&splits)
        || gate.is_some_and(|g| g.len() != q.len())
    {
        return Err(CudaError::Invalid("attn_split: sizes".into()));
    }
    let qd = upload(gpu, q)?;
    let (kcd, vcd) = (KvDev::upload(gpu, kc, kv)?, KvDev::upload(gpu, vc, kv)?);
    let (kd, vd) = (kcd.address(gpu), vcd.address(gpu));
    let gd = upload(gpu, gate.unwrap_or(&[0.0]))?;
    let gate_ptr = if gate.is_some() {
        device_address(gpu, &gd)
    } else {
        0u64
    };
    let pos = upload(gpu, &[i32_arg(pos0, "pos")?])?;
    let mut part = alloc_poisoned::<f32>(gpu, rows * heads * splits * (hd + 2))?;
    let mut o = alloc_poisoned::<f32>(gpu, q.len())?;
    let (hi, nkvi, hdi) = (
        i32_arg(heads, "heads")?,
        i32_arg(nkv, "nkv")?,
        i32_arg(hd, "hd")?,
    );
    let (si, mci) = (i32_arg(splits, "splits")?, i32_arg(min_chunk, "min chunk")?);
    if split != "attn_split"
        && !(attn_split_gqa_fits(heads, nkv, hd) && attn_split_takes(split, heads, nkv, hd))
    {
        return Err(CudaError::Invalid(format!("{split}: shape")));
    }
    let kernel = kv_kernel(split, kv)?;
    let (gx, block) = attn_split_block(heads, nkv, attn_split_head_blocks(split));
    launch!(
        gpu,
        gpu.func(&kernel)?,
        &kernel,
        cfg((gx, splits as u32, rows as u32), block, 0),
        [&qd, &kd, &vd, &mut part, &pos, &hi, &nkvi, &hdi, &scale, &mci]
    )?;
    launch!(
        gpu,
        gpu.func("attn_merge")?,
        "attn_merge",
        cfg((heads as u32, hd.div_ceil(32) as u32, rows as u32), 256, 0),
        [&part, &gate_ptr, &mut o, &pos, &si, &hdi, &mci]
    )?;
    download(gpu, &o)
}

/// Whole expert tensors (`n_exp` experts of type `ty`, one after another) for the id kernels.
pub struct ExpertTensors<'a> {
    pub ty: GgmlType,
    pub gate: &'a [u8],
    pub up: &'a [u8],
    pub down: &'a [u8],
    pub n_exp: usize,
}

/// The routed experts of `n` tokens with the choice as device data: `ids`, `weights` `[n][k]`,
/// `x [n][hidden]`; returns `[n][hidden]`.
#[allow(clippy::too_many_arguments)]
pub fn moe_experts_ids(
    gpu: &Gpu,
    t: &ExpertTensors,
    ids: &[i32],
    weights: &[f32],
    x: &[f32],
    hidden: usize,
    ff: usize,
    k: usize,
) -> Result<Vec<f32>, CudaError> {
    let n = check_rows(x.len(), hidden, "moe_experts_ids x")?;
    let gu_bytes = row_bytes(t.ty, hidden)? * ff;
    let dn_bytes = row_bytes(t.ty, ff)? * hidden;
    if ids.len() != n * k
        || weights.len() != n * k
        || t.gate.len() != t.n_exp * gu_bytes
        || t.up.len() != t.gate.len()
        || t.down.len() != t.n_exp * dn_bytes
        || ids.iter().any(|&i| i < 0 || i as usize >= t.n_exp)
    {
        return Err(CudaError::Invalid("moe_experts_ids: sizes or ids".into()));
    }
    let (gd, ud, dd) = (
        upload(gpu, t.gate)?,
        upload(gpu, t.up)?,
        upload(gpu, t.down)?,
    );
    let (idd, wd, xd) = (upload(gpu, ids)?, upload(gpu, weights)?, upload(gpu, x)?);
    let mut act = alloc_poisoned::<f32>(gpu, n * k * ff)?;
    let mut out = alloc_poisoned::<f32>(gpu, n * hidden)?;
    let (ffi, hi, ki) = (
        i32_arg(ff, "ff")?,
        i32_arg(hidden, "hidden")?,
        i32_arg(k, "k")?,
    );
    let (gus, dns) = (gu_bytes as u64, dn_bytes as u64);
    let gu = format!("moe_gate_up_ids_{}", type_suffix(t.ty));
    launch!(
        gpu,
        gpu.func(&gu)?,
        &gu,
        cfg(
            (blocks(ff, MATVEC_WARPS), k as u32, n as u32),
            32 * MATVEC_WARPS,
            0
        ),
        [&gd, &ud, &gus, &idd, &xd, &mut act, &ffi, &hi, &ki]
    )?;
    let dn = format!("moe_down_ids_{}", type_suffix(t.ty));
    launch!(
        gpu,
        gpu.func(&dn)?,
        &dn,
        cfg(
            (blocks(hidden, MATVEC_WARPS), n as u32, 1),
            32 * MATVEC_WARPS,
            0
        ),
        [&dd, &dns, &idd, &wd, &act, &mut out, &hi, &ffi, &ki]
    )?;
    download(gpu, &out)
}

/// `x + routed + sigmoid(gate_logit[t]) · shared` per token (`[n][hidden]`, `gate_logit [n]`).
pub fn moe_combine(
    gpu: &Gpu,
    x: &[f32],
    routed: &[f32],
    shared: &[f32],
    gate_logit: &[f32],
) -> Result<Vec<f32>, CudaError> {
    let n = gate_logit.len();
    let hidden = check_rows(x.len(), n.max(1), "moe_combine")?;
    if routed.len() != x.len() || shared.len() != x.len() || n == 0 {
        return Err(CudaError::Invalid("moe_combine: sizes".into()));
    }
    let mut xd = upload(gpu, x)?;
    let (rd, sd, gd) = (
        upload(gpu, routed)?,
        upload(gpu, shared)?,
        upload(gpu, gate_logit)?,
    );
    let hi = i32_arg(hidden, "hidden")?;
    launch!(
        gpu,
        gpu.func("moe_combine")?,
        "moe_combine",
        cfg((blocks(hidden, 256), n as u32, 1), 256, 0),
        [&mut xd, &rd, &sd, &gd, &hi]
    )?;
    download(gpu, &xd)
}

/// On-device sampling of each row of `vocab` logits with the draw `u[row]`.
#[allow(clippy::too_many_arguments)]
pub fn sample_topk(
    gpu: &Gpu,
    logits: &[f32],
    vocab: usize,
    k: usize,
    temperature: f32,
    top_p: f32,
    min_p: f32,
    u: &[f32],
) -> Result<Vec<i32>, CudaError> {
    let rows = check_rows(logits.len(), vocab, "sample_topk")?;
    if k == 0
        || k > 64
        || k > vocab
        || u.len() != rows
        || temperature.is_nan()
        || temperature <= 0.0
    {
        return Err(CudaError::Invalid(
            "sample_topk: k, draws or temperature".into(),
        ));
    }
    let (ld, ud) = (upload(gpu, logits)?, upload(gpu, u)?);
    let mut out = alloc_poisoned::<i32>(gpu, rows)?;
    let (vi, ki, inv_t) = (
        i32_arg(vocab, "vocab")?,
        i32_arg(k, "k")?,
        1.0 / temperature,
    );
    launch!(
        gpu,
        gpu.func("sample_topk")?,
        "sample_topk",
        cfg((rows as u32, 1, 1), 1024, 0),
        [&ld, &vi, &ki, &inv_t, &top_p, &min_p, &ud, &mut out]
    )?;
    download(gpu, &out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The q8 row's layout (`Q8_ROW_BYTES`): quants, an f32 scale per 32, an i32 sum per 16.
    #[test]
    fn q8_row_layout() {
        let x: Vec<f32> = (0..64).map(|i| i as f32 - 20.0).collect();
        let r = q8_row(&x);
        assert_eq!(r.len(), q8_row_bytes(64));
        // Block 0: max |u| = 20 → d = 20 / 127, u = -20 → -127; block 1: max 43 → 43 → 127.
        assert_eq!(r[0] as i8, -127);
        assert_eq!(r[63] as i8, 127);
        let d0 = f32::from_le_bytes(r[64..68].try_into().unwrap());
        assert_eq!(d0, 20.0 / 127.0);
        let s16 = |i: usize| i32::from_le_bytes(r[72 + 4 * i..76 + 4 * i].try_into().unwrap());
        let sum0: i32 = r[..16].iter().map(|&v| v as i8 as i32).sum();
        assert_eq!(s16(0), sum0);
        assert_eq!(
            (0..4).map(s16).sum::<i32>(),
            r[..64].iter().map(|&v| v as i8 as i32).sum::<i32>()
        );
    }

    /// The prompt attention kernels' launches for the full-size heads (16 query heads over 2 KV
    /// heads of 256) and the tiny fixtures' shapes: 32 query rows per block, static shared memory
    /// within the 48 KiB a launch gets without opting in.
    #[test]
    fn prompt_attention_launches_fit() {
        for (heads, nkv, hd) in [
            (16usize, 2usize, 256usize),
            (4, 2, 64),
            (8, 8, 128),
            (32, 1, 64),
        ] {
            assert!(attn_prompt_fits(heads, nkv, hd));
            let ((gx, gy, _), block, shared) = attn_prompt_launch(100, heads, nkv, hd);
            assert_eq!((gx as usize, block), (nkv, 256));
            assert_eq!(gy as usize, 100usize.div_ceil(32 / (heads / nkv)));
            assert!(shared <= 48 * 1024);
            let launch = attn_prompt_mma(heads, nkv, hd).expect("tensor-core form");
            let (name, (mx, my, _), mblock, mshared) = launch(100);
            assert!(name.ends_with(&format!("_{hd}")));
            assert_eq!((mx, my, mblock), (gx, gy, 64));
            assert!(
                mshared <= 48 * 1024,
                "{name}: {mshared} bytes of shared memory"
            );
        }
        // 3 query heads per KV head do not divide the 32 rows of a block; head_dim 96 has no
        // tensor-core kernel; 512 is over the SIMT kernel's registers.
        assert!(!attn_prompt_fits(6, 2, 128));
        assert!(attn_prompt_mma(4, 2, 96).is_none());
        assert!(!attn_prompt_fits(4, 2, 512));
    }
    /// One wave of a split kernel's blocks: the model's 66 chunks for one 8-warp block an SM on
    /// the H200's 132 SMs over 2 KV heads, 99 for `8xh3`'s three half-head blocks.
    #[test]
    fn one_wave_splits() {
        assert_eq!(attn_one_wave_splits(1, 132, 2, 1), 66);
        assert_eq!(attn_one_wave_splits(4, 132, 2, 2), 132);
        assert_eq!(attn_one_wave_splits(3, 132, 2, 2), 99);
        assert_eq!(attn_one_wave_splits(0, 1, 4, 2), 1);
        assert_eq!(attn_split_head_blocks("attn_split_gqa8xh3_h"), 2);
        assert_eq!(attn_split_head_blocks("attn_split_gqa4xp_h"), 1);
        assert_eq!(attn_split_block(16, 2, 1), (2, 256));
        assert_eq!(attn_split_block(16, 2, 2), (4, 128));
        assert!(attn_split_takes("attn_split_gqa8xh3", 16, 2, 256));
        assert!(!attn_split_takes("attn_split_gqa8xh3", 16, 4, 256));
        assert!(!attn_split_takes("attn_split_gqa8xh3_h", 8, 2, 256));
        assert!(attn_split_takes("attn_split_gqa4xp_h", 8, 2, 64));
        assert!(attn_split_takes("attn_split_mma_h", 16, 2, 256));
        assert!(attn_split_takes("attn_split_mma_h", 4, 2, 64));
        assert!(!attn_split_takes("attn_split_mma_h", 32, 2, 256));
        assert!(!attn_split_takes("attn_split_mma_h", 16, 2, 96));
    }
}
