//! `bench kernel` and `bench gemm` on the GPU: the dense product kernel the model runs
//! (`matvec_norm3_<type>` without norm weights, rows cut over warps as the model cuts them) on
//! random weights of one type, next to the device's read bandwidth measured in the same run
//! (`read_sum` over a buffer far larger than L2). `tokens = 1` is the decode matrix-vector
//! product (GB/s of weights against the read bandwidth); `tokens > 1` the prompt product as the
//! prefill runs it now (TFLOPS). The matrices together span `working_set` bytes, cycled through so
//! every call reads its weights from memory.
//!
//! One-token calls run the kernel decode runs for the type: `matvec_q8x_<type>` on a q8 row
//! (`rms_norm_q8` writes it once) for Q4_K and Q6_K ([`Acts::Q8`]), `matvec_norm3_<type>` on f32
//! activations otherwise; launched back to back with programmatic dependent launch as decode
//! launches them (each call's blocks prefetch their weights while the call before drains).

use std::sync::Arc;

use cudarc::driver::{result as cu, sys, LaunchConfig, PushKernelArg};
use redlite_gguf::GgmlType;

use crate::kernels::type_suffix;
use crate::model::{
    launch_ex, mvf_parts, mvf_rows_from_env, q8_rows_from_env, MvfSplit, A, MVF_MAX_ROWS,
    MVF_THREADS,
};
use crate::ops::{q8_row_bytes, row_bytes};
use crate::selftest::{random_weights, Rng};
use crate::{CudaError, Gpu};

/// The activations a one-token call takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acts {
    /// f32, staged by every block (`matvec_norm3_<type>`).
    F32,
    /// A q8 row written once, read in place (`matvec_q8x_<type>`; Q4_K and Q6_K, one token).
    Q8,
}

impl Acts {
    /// What decode uses for a `ty` matrix `cols` wide (the defaults of `CudaModel`).
    pub fn for_decode(ty: GgmlType, cols: usize) -> Acts {
        if matches!(ty, GgmlType::Q4K | GgmlType::Q6K) && cols.is_multiple_of(256) {
            Acts::Q8
        } else {
            Acts::F32
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Acts::F32 => "f32",
            Acts::Q8 => "q8",
        }
    }
}

/// What to run.
#[derive(Debug, Clone, Copy)]
pub struct KernelBenchOptions {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    /// Activation rows per call (1: matrix-vector).
    pub tokens: usize,
    /// Bytes of weights cycled through (at least one matrix).
    pub working_set: usize,
    /// Timed passes over all matrices (the median is reported).
    pub reps: usize,
    /// Activations of one-token calls (calls of several tokens take f32).
    pub acts: Acts,
    /// Launch with programmatic dependent launch (as decode does on compute capability ≥ 9.0).
    pub pdl: bool,
    /// The row split `(lane_iters, rows per warp group)` instead of decode's default for its
    /// matrices (4 and the kernel's rows; decode's lm_head runs `(8, 4)`).
    pub split: Option<(usize, usize)>,
}

/// One measurement.
#[derive(Debug, Clone)]
pub struct KernelBenchResult {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub tokens: usize,
    /// Warps per row (`mvf_parts`, lane iterations 4 as the model unless the split is given).
    pub parts: usize,
    /// Consecutive rows a warp group takes.
    pub warp_rows: usize,
    /// The kernel timed.
    pub kernel: String,
    pub matrices: usize,
    /// Median time of one call, seconds.
    pub call_s: f64,
    /// Weight bytes per second.
    pub gbps: f64,
    /// 2 · rows · cols · tokens per second, in TFLOPS.
    pub tflops: f64,
}

fn drv(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> CudaError {
    move |e| CudaError::driver(what, e)
}

/// Device memory freed when dropped.
struct DevBuf(u64);

impl DevBuf {
    fn new(bytes: usize) -> Result<DevBuf, CudaError> {
        // SAFETY: plain allocation, freed once in `drop`.
        Ok(DevBuf(
            unsafe { cu::malloc_sync(bytes.max(16)) }.map_err(drv("allocating"))?,
        ))
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by `malloc_sync`, freed once.
        let _ = unsafe { cu::free_sync(self.0) };
    }
}

/// Median time of `reps` runs of `enqueue` on `stream`, seconds (CUDA events around each run).
fn time_runs(
    gpu: &Gpu,
    stream: &Arc<cudarc::driver::CudaStream>,
    reps: usize,
    mut enqueue: impl FnMut() -> Result<(), CudaError>,
) -> Result<f64, CudaError> {
    let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let (t0, t1) = (
        gpu.ctx.new_event(flags).map_err(drv("creating an event"))?,
        gpu.ctx.new_event(flags).map_err(drv("creating an event"))?,
    );
    enqueue()?; // warm-up: module load, first touch
    let mut secs = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        t0.record(stream).map_err(drv("recording an event"))?;
        enqueue()?;
        t1.record(stream).map_err(drv("recording an event"))?;
        secs.push(f64::from(t0.elapsed_ms(&t1).map_err(drv("timing"))?) / 1e3);
    }
    secs.sort_by(f64::total_cmp);
    Ok(secs[secs.len() / 2])
}

/// The device's read bandwidth over `bytes` (several times L2), GB/s, median of `reps`: the
/// better of `read_sum` (4 blocks an SM, one load in flight a thread per loop turn; the
/// reference of sessions 1–22) and `read_sum8` (8 blocks an SM, unrolled by 8). Also prints (not
/// returned) the decode attention's cache walk over both cache layouts (`read_rows`).
pub fn read_bandwidth(gpu: &Gpu, bytes: usize, reps: usize) -> Result<f64, CudaError> {
    gpu.ctx
        .bind_to_thread()
        .map_err(drv("binding the context"))?;
    let n4 = (bytes / 16).max(1) as u64;
    let buf = DevBuf::new(16 * n4 as usize)?;
    // SAFETY: `buf` holds 16 · n4 bytes.
    unsafe { cu::memset_d8_sync(buf.0, 0, 16 * n4 as usize) }.map_err(drv("clearing"))?;
    let sms = gpu.info.sm_count.max(1) as u32;
    let out = DevBuf::new(4 * 8 * sms as usize)?;
    let stream = crate::device::new_stream(&gpu.ctx).map_err(drv("creating a stream"))?;
    let mut best = 0.0f64;
    for (name, blocks) in [("read_sum", 4 * sms), ("read_sum8", 8 * sms)] {
        let f = gpu.func(name)?.clone();
        let s = time_runs(gpu, &stream, reps, || {
            let mut b = stream.launch_builder(&f);
            b.arg(&buf.0).arg(&n4).arg(&out.0);
            let cfg = LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: arguments in the kernel's order and types; buffers live (out holds one
            // float per block).
            unsafe { b.launch(cfg) }
                .map(|_| ())
                .map_err(drv("launching read_sum"))
        })?;
        let gbps = 16.0 * n4 as f64 / s / 1e9;
        eprintln!("read bandwidth: {name} {gbps:.0} GB/s");
        best = best.max(gbps);
    }
    // The decode attention's cache walk (`read_rows`): one block an SM as `attn_split_gqa` runs
    // (and four, for more bytes in flight), over the cache's [position][2 KV heads][row] layout
    // with f16 rows (512 bytes) and f32 rows (1 KiB), and over a head-major layout (each block
    // one contiguous stretch).
    let f = gpu.func("read_rows")?.clone();
    for (what, piece, heads, per_sm) in [
        ("[pos][2 heads][512 B] (f16 cache)", 512usize, 2i32, 1u32),
        ("[pos][2 heads][1 KiB] (f32 cache)", 1024, 2, 1),
        ("[head][pos][512 B] (head-major)", 512, 1, 1),
        ("[pos][2 heads][512 B] (f16 cache)", 512, 2, 4),
        ("[head][pos][512 B] (head-major)", 512, 1, 4),
    ] {
        let piece16 = (piece / 16) as i32;
        let rows = 16 * n4 / (piece as u64 * heads as u64);
        let grid = per_sm * sms - (per_sm * sms) % heads as u32;
        let s = time_runs(gpu, &stream, reps, || {
            let mut b = stream.launch_builder(&f);
            b.arg(&buf.0)
                .arg(&rows)
                .arg(&piece16)
                .arg(&heads)
                .arg(&out.0);
            let cfg = LaunchConfig {
                grid_dim: (grid, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: arguments in the kernel's order and types; the rows fit `buf` (rows ·
            // heads · piece ≤ its bytes) and `out` holds one float per block.
            unsafe { b.launch(cfg) }
                .map(|_| ())
                .map_err(drv("launching read_rows"))
        })?;
        let gbps = (rows * heads as u64 * piece as u64) as f64 / s / 1e9;
        eprintln!("read bandwidth: cache walk {what}, {grid} blocks: {gbps:.0} GB/s");
    }
    // Diagnostic lines only: a failure here (a new split kernel's first run) does not end the bench.
    if let Err(e) = attention_walk(gpu, &stream, reps) {
        eprintln!("decode attention alone: {e}");
    }
    Ok(best)
}

/// The f16 decode attention's split kernels alone at position 32,767 of the full-size layout's
/// shape (16 query heads over 2 KV heads of 256, the model's one-wave grid of 2 × (SMs / 2)
/// blocks), each launch on the next of four caches (256 MiB of K/V, five times L2), back to back
/// without a graph or neighbours: µs a launch and GB/s of K/V (printed). Tells the kernel's own
/// stream from what its neighbours in a decode step do to it (session 26: 4xp 32.5 µs, 2.07 TB/s,
/// as in a step; the cache walk without the arithmetic at one block an SM 2.13 TB/s).
fn attention_walk(
    gpu: &Gpu,
    stream: &Arc<cudarc::driver::CudaStream>,
    reps: usize,
) -> Result<(), CudaError> {
    const CACHES: usize = 4;
    let (heads, nkv, hd, ctx) = (16usize, 2usize, 256usize, 32_768usize);
    let kv_bytes = ctx * nkv * hd * 2;
    let sms = gpu.info.sm_count;
    let caches: Vec<(DevBuf, DevBuf)> = (0..CACHES)
        .map(|_| Ok((DevBuf::new(kv_bytes)?, DevBuf::new(kv_bytes)?)))
        .collect::<Result<_, CudaError>>()?;
    for (k, v) in &caches {
        // SAFETY: each buffer holds kv_bytes; f16 zeros (every score 0: the same work).
        unsafe { cu::memset_d8_sync(k.0, 0, kv_bytes) }.map_err(drv("clearing"))?;
        unsafe { cu::memset_d8_sync(v.0, 0, kv_bytes) }.map_err(drv("clearing"))?;
    }
    let q = DevBuf::new(4 * heads * hd)?;
    // SAFETY: q holds heads · hd floats (zeros).
    unsafe { cu::memset_d8_sync(q.0, 0, 4 * heads * hd) }.map_err(drv("clearing"))?;
    // Chunks: one wave of at most 4 blocks an SM over the KV heads (`attn_one_wave_splits`).
    let max_splits = (4 * sms).div_ceil(nkv);
    let part = DevBuf::new(4 * heads * max_splits * (hd + 2))?;
    let pos = DevBuf::new(4)?;
    let last = (ctx - 1) as i32;
    // SAFETY: pos holds one i32.
    unsafe { cu::memcpy_htod_sync(pos.0, std::slice::from_ref(&last)) }.map_err(drv("pos"))?;
    let (hi, nkvi, hdi, mc) = (heads as i32, nkv as i32, hd as i32, 64i32);
    let scale = 1.0f32 / (hd as f32).sqrt();
    for name in [
        "attn_split_gqa4x_h",
        "attn_split_gqa4xp_h",
        "attn_split_gqa8x_h",
        "attn_split_gqa8xh3_h",
        "attn_split_mma_h",
    ] {
        let f = gpu.func(name)?.clone();
        // As the model launches it: `8xh3` with half the heads a block, and chunks for one
        // wave of the blocks an SM holds.
        let (gx, threads, splits) = crate::ops::attn_split_wave(&f, name, heads, nkv, sms)?;
        let splits = splits.min(max_splits);
        let mut i = 0usize;
        let s = time_runs(gpu, stream, reps.max(CACHES), || {
            for _ in 0..CACHES {
                let (k, v) = &caches[i % CACHES];
                i += 1;
                let mut b = stream.launch_builder(&f);
                b.arg(&q.0).arg(&k.0).arg(&v.0).arg(&part.0).arg(&pos.0);
                b.arg(&hi).arg(&nkvi).arg(&hdi).arg(&scale).arg(&mc);
                let cfg = LaunchConfig {
                    grid_dim: (gx, splits as u32, 1),
                    block_dim: (threads, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: arguments in the kernel's order and types; the caches hold ctx
                // positions, part heads · splits chunks, pos the last position.
                unsafe { b.launch(cfg) }
                    .map(|_| ())
                    .map_err(drv("launching the split kernel"))?;
            }
            Ok(())
        })? / CACHES as f64;
        let gbps = 2.0 * kv_bytes as f64 / s / 1e9;
        eprintln!(
            "decode attention alone: {name} at {ctx} positions, {} blocks: {:.1} µs, {gbps:.0} GB/s",
            gx as usize * splits,
            s * 1e6
        );
    }
    Ok(())
}

/// `matvec_norm3_<type>` (no norm) on `o.tokens` activation rows, cycling through matrices that
/// span `o.working_set` bytes.
pub fn bench_matvec(gpu: &Gpu, o: KernelBenchOptions) -> Result<KernelBenchResult, CudaError> {
    if o.tokens == 0 || o.tokens > 65_535 || o.rows == 0 || o.cols == 0 {
        return Err(CudaError::Invalid(format!(
            "bench shape {}x{} with {} tokens",
            o.rows, o.cols, o.tokens
        )));
    }
    if 4 * o.cols > 48 * 1024 {
        return Err(CudaError::Invalid(format!(
            "{} columns: the fused matvec stages at most 12288",
            o.cols
        )));
    }
    gpu.ctx
        .bind_to_thread()
        .map_err(drv("binding the context"))?;
    let bytes = row_bytes(o.ty, o.cols)? * o.rows;
    let matrices = o.working_set.div_ceil(bytes).max(1);
    let mut rng = Rng::new(0x6265_6e63_686b);
    let w = random_weights(&mut rng, o.ty, o.rows, o.cols);
    let weights = DevBuf::new(matrices * bytes)?;
    for m in 0..matrices {
        // SAFETY: matrix m's range lies inside `weights`.
        unsafe { cu::memcpy_htod_sync(weights.0 + (m * bytes) as u64, &w) }
            .map_err(drv("uploading weights"))?;
    }
    let x = rng.normals(o.tokens * o.cols, 1.0);
    let (xd, yd) = (
        DevBuf::new(4 * x.len())?,
        DevBuf::new(4 * o.tokens * o.rows)?,
    );
    // SAFETY: `xd` holds x.
    unsafe { cu::memcpy_htod_sync(xd.0, &x) }.map_err(drv("uploading x"))?;
    let acts = if o.tokens == 1 { o.acts } else { Acts::F32 };
    if acts == Acts::Q8 && Acts::for_decode(o.ty, o.cols) != Acts::Q8 {
        return Err(CudaError::Invalid(format!(
            "q8 activations: Q4_K or Q6_K with a multiple of 256 columns, not {} x {}",
            o.ty.name(),
            o.cols
        )));
    }
    let kernel = match acts {
        Acts::F32 => format!("matvec_norm3_{}", type_suffix(o.ty)),
        Acts::Q8 => format!("matvec_q8x_{}", type_suffix(o.ty)),
    };
    let f = gpu.func(&kernel)?.clone();
    let split = MvfSplit {
        parts: mvf_parts(o.ty, o.cols, o.split.map_or(4, |s| s.0)),
        rows: o.split.map_or_else(
            || match acts {
                Acts::F32 => mvf_rows_from_env(false),
                Acts::Q8 => q8_rows_from_env(),
            },
            |s| match acts {
                Acts::F32 => s.1.clamp(1, MVF_MAX_ROWS),
                Acts::Q8 => s.1.clamp(1, 16),
            },
        ),
    };
    let (parts, rpb) = (split.parts, split.rows_per_block() as usize);
    let stream = crate::device::new_stream(&gpu.ctx).map_err(drv("creating a stream"))?;
    // The q8 row of x (no norm weights: x itself), written once as decode's `rms_norm_q8` does.
    let (xq, invs) = (DevBuf::new(q8_row_bytes(o.cols))?, DevBuf::new(4)?);
    let (eps, cols, pi, rows) = (1e-6f32, o.cols as i32, split.arg(), o.rows as i32);
    if acts == Acts::Q8 {
        let norm = gpu.func("rms_norm_q8")?.clone();
        let args = [
            A::P(xd.0),
            A::P(0),
            A::F(eps),
            A::I(cols),
            A::P(xq.0),
            A::P(invs.0),
        ];
        // SAFETY: rms_norm_q8(x, nw, eps, cols, xq, invs) with live buffers of those sizes.
        unsafe { launch_ex(&stream, &norm, ((1, 1, 1), MVF_THREADS, 0), &args, false) }
            .map_err(drv("launching rms_norm_q8"))?;
    }
    let grid = (o.rows.div_ceil(rpb) as u32, o.tokens as u32, 1);
    let shared = match acts {
        Acts::F32 => 4 * o.cols as u32,
        Acts::Q8 => 0,
    };
    let s = time_runs(gpu, &stream, o.reps, || {
        for m in 0..matrices {
            let mut args = match acts {
                // matvec_norm3_<type>(x, nw, eps, cols, split, w0, y0, rows0, w1, ...)
                Acts::F32 => vec![A::P(xd.0), A::P(0), A::F(eps), A::I(cols), A::I(pi)],
                // matvec_q8x_<type>(xq, invs, cols, split, w0, y0, rows0, w1, ...)
                Acts::Q8 => vec![A::P(xq.0), A::P(0), A::I(cols), A::I(pi)],
            };
            let wm = weights.0 + (m * bytes) as u64;
            args.extend([A::P(wm), A::P(yd.0), A::I(rows)]);
            args.extend([A::P(0), A::P(0), A::I(0), A::P(0), A::P(0), A::I(0)]);
            // SAFETY: the arguments of the kernel, in order and of its types; the buffers are
            // sized above and live.
            unsafe { launch_ex(&stream, &f, (grid, MVF_THREADS, shared), &args, o.pdl) }
                .map_err(drv("launching the product"))?;
        }
        Ok(())
    })?;
    let call_s = s / matrices as f64;
    Ok(KernelBenchResult {
        ty: o.ty,
        rows: o.rows,
        cols: o.cols,
        tokens: o.tokens,
        parts,
        warp_rows: split.rows,
        kernel,
        matrices,
        call_s,
        gbps: bytes as f64 / call_s / 1e9,
        tflops: 2.0 * (o.rows * o.cols * o.tokens) as f64 / call_s / 1e12,
    })
}
