//! `bench expert`: one layer's expert kernels on N distinct experts copied from the file, K experts
//! per call, one token, no model loaded. With IQ2_XXS experts (the default, `ExpertActs::Auto`)
//! the kernels a decode step's experts take when its router is not fused into them (a verify row,
//! a call under a memory budget): `moe_gate_up_tab_q8q_iq2_xxs` on the token's q8 row (which
//! also quantises the activations) and `moe_down_combine_tab_q8_iq2_xxs` on those q8 rows; the
//! fused route kernel of a resident decode step runs the same rows' arithmetic
//! (`gate_up_q8q_rows`). `ExpertActs::F32` (other types always): the f32-activation kernels
//! (`moe_gate_up_tab_<type>` + `moe_down_combine_tab_<type>`), which every session up to 40
//! measured although decode had left them for the q8 ones. Consecutive calls take the next K
//! experts (cyclically), so with N·slot bytes well above the L2 cache every call reads its experts
//! from memory. The calls are captured once as a CUDA graph and replayed (no launch gaps). Run
//! twice: experts in device slots (memory bandwidth) and in mapped pinned host memory (the expert
//! cache's miss path, PCIe). Each run ends with a checksum of the output row, equal across builds
//! whose kernels give the same bits.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{result as cu, sys, LaunchConfig, PushKernelArg};
use redlite_gguf::{GgmlType, GgufFile};
use redlite_model::weights::Weights;
use redlite_model::Config;

use crate::expert_cache::{moe_warps, ExpertLayout};
use crate::host::{HostLinear, HostLoader};
use crate::kernels::type_suffix;
use crate::ops::row_bytes;
use crate::{CudaError, Gpu};

/// What to run.
#[derive(Debug, Clone, Copy)]
pub struct ExpertBenchOptions {
    /// The layer whose experts are copied.
    pub layer: usize,
    /// Distinct experts (N), at most the layer's.
    pub distinct: usize,
    /// Experts per call (K).
    pub per_call: usize,
    /// Calls per graph replay, and replays timed.
    pub calls: usize,
    pub replays: usize,
    /// Which kernels: the q8 ones where the types have them, or the f32-activation ones.
    pub acts: ExpertActs,
}

/// The activations of the benchmarked expert kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertActs {
    /// 8-bit (the decode path's) where the expert types have q8 kernels (IQ2_XXS), else f32.
    Auto,
    /// 8-bit; an error for types without q8 kernels.
    Q8,
    /// f32 (`moe_gate_up_tab_<type>`, `moe_down_combine_tab_<type>`).
    F32,
}

/// One measurement.
#[derive(Debug, Clone)]
pub struct ExpertBenchResult {
    /// "device" or "host (PCIe)".
    pub place: &'static str,
    /// Warps per block of both kernels.
    pub warps: u32,
    /// The two kernels, gate/up then down.
    pub kernels: String,
    pub types: String,
    pub expert_bytes: usize,
    pub per_call: usize,
    pub distinct: usize,
    /// Median time of one call (both kernels), seconds.
    pub call_s: f64,
    /// Expert bytes read per second.
    pub gbps: f64,
    /// FNV-1a of the output row after this place's calls (the same across builds whose kernels
    /// give the same bits).
    pub checksum: u64,
}

/// Run the bench on layer `o.layer` of `file`: device slots, then host-mapped experts.
pub fn bench_experts(
    gpu: &Arc<Gpu>,
    file: &Arc<GgufFile>,
    o: ExpertBenchOptions,
) -> Result<Vec<ExpertBenchResult>, CudaError> {
    let model = |e: redlite_model::ModelError| CudaError::Invalid(e.to_string());
    let c = Config::from_gguf(file).map_err(model)?;
    let w = Weights::load(file, &c, &HostLoader).map_err(model)?;
    let layer = w
        .layers
        .get(o.layer)
        .ok_or_else(|| CudaError::Invalid(format!("layer {} of {}", o.layer, w.layers.len())))?;
    let ex = &layer.moe.experts;
    let n = o.distinct.clamp(1, ex.len());
    let k = o.per_call.clamp(1, n);
    let len =
        |w: &HostLinear| -> Result<usize, CudaError> { Ok(row_bytes(w.ty, w.cols)? * w.rows) };
    let layout = ExpertLayout::new(len(&ex[0].gate)?, len(&ex[0].down)?);
    let sb = layout.slot_bytes;
    let mut packed = vec![0u8; n * sb];
    for (e, slot) in ex.iter().zip(packed.chunks_mut(sb)) {
        slot[..layout.gate_bytes].copy_from_slice(e.gate.bytes());
        slot[layout.up_off..layout.up_off + layout.gate_bytes].copy_from_slice(e.up.bytes());
        slot[layout.down_off..layout.down_off + layout.down_bytes].copy_from_slice(e.down.bytes());
    }
    gpu.ctx
        .bind_to_thread()
        .map_err(|e| CudaError::driver("binding the context", e))?;
    let drv = |what: &'static str| move |e: cudarc::driver::DriverError| CudaError::driver(what, e);
    let mut owned: Vec<u64> = Vec::new();
    let mut dalloc = |bytes: usize| -> Result<u64, CudaError> {
        // SAFETY: plain allocation, freed at the end of this function.
        let p = unsafe { cu::malloc_sync(bytes.max(16)) }.map_err(drv("allocating"))?;
        owned.push(p);
        Ok(p)
    };
    let slots = dalloc(n * sb)?;
    // SAFETY: `slots` holds n · sb bytes; synchronous copy.
    unsafe { cu::memcpy_htod_sync(slots, &packed) }.map_err(drv("uploading experts"))?;
    let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
    // SAFETY: pinned allocation, freed at the end of this function.
    let host =
        unsafe { cu::malloc_host(n * sb, flags) }.map_err(drv("pinning host memory"))? as *mut u8;
    // SAFETY: `host` holds n · sb bytes.
    unsafe { std::ptr::copy_nonoverlapping(packed.as_ptr(), host, n * sb) };
    let mut host_dev: sys::CUdeviceptr = 0;
    // SAFETY: `host` came from cuMemHostAlloc with DEVICEMAP.
    unsafe { sys::cuMemHostGetDevicePointer_v2(&mut host_dev, host as *mut _, 0) }
        .result()
        .map_err(drv("mapping host memory"))?;

    let (h, ff) = (c.hidden, c.expert_ff);
    let x: Vec<f32> = (0..h)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
        .collect();
    let calls = o.calls.max(1);
    let ids: Vec<i32> = (0..calls * k).map(|i| (i % n) as i32).collect();
    let wts = vec![1.0f32 / k as f32; k];
    let zeros = vec![0.0f32; h];
    let (xb, xo, act, shared, gl) = (
        dalloc(4 * h)?,
        dalloc(4 * h)?,
        dalloc(4 * k * ff)?,
        dalloc(4 * h)?,
        dalloc(4)?,
    );
    let (ids_d, wts_d, tab) = (dalloc(4 * ids.len())?, dalloc(4 * k)?, dalloc(8 * 3 * n)?);
    // x as the q8 row a producer writes (quants, an f32 scale per 32, an i32 sum per 16), and the
    // K choices' q8 activation rows the gate/up kernel writes for the down kernel.
    let (xq, actq) = (
        dalloc(crate::ops::q8_row_bytes(h))?,
        dalloc(k * crate::ops::q8_row_bytes(ff))?,
    );
    // SAFETY: each destination holds its source's bytes; synchronous copies.
    unsafe {
        cu::memcpy_htod_sync(xb, &x).map_err(drv("upload"))?;
        cu::memcpy_htod_sync(xq, &crate::ops::q8_row(&x)).map_err(drv("upload"))?;
        cu::memcpy_htod_sync(xo, &zeros).map_err(drv("upload"))?;
        cu::memcpy_htod_sync(shared, &zeros).map_err(drv("upload"))?;
        cu::memcpy_htod_sync(gl, &[0.0f32]).map_err(drv("upload"))?;
        cu::memcpy_htod_sync(ids_d, &ids).map_err(drv("upload"))?;
        cu::memcpy_htod_sync(wts_d, &wts).map_err(drv("upload"))?;
    }
    let q8_types = ex[0].gate.ty == GgmlType::IQ2XXS
        && ex[0].down.ty == GgmlType::IQ2XXS
        && h.is_multiple_of(256)
        && ff.is_multiple_of(256);
    let q8 = match o.acts {
        ExpertActs::Auto => q8_types,
        ExpertActs::F32 => false,
        ExpertActs::Q8 if q8_types => true,
        ExpertActs::Q8 => {
            return Err(CudaError::Invalid(format!(
                "no q8 expert kernels for {} / {} experts ({h} × {ff}): only IQ2_XXS with both sizes multiples of 256",
                ex[0].gate.ty.name(),
                ex[0].down.ty.name()
            )))
        }
    };
    let (gate_up_name, down_name) = if q8 {
        (
            "moe_gate_up_tab_q8q_iq2_xxs".to_string(),
            "moe_down_combine_tab_q8_iq2_xxs".to_string(),
        )
    } else {
        (
            format!("moe_gate_up_tab_{}", type_suffix(ex[0].gate.ty)),
            format!("moe_down_combine_tab_{}", type_suffix(ex[0].down.ty)),
        )
    };
    let gate_up = gpu.func(&gate_up_name)?.clone();
    let down = gpu.func(&down_name)?.clone();
    let stream = crate::device::new_stream(&gpu.ctx).map_err(drv("creating a stream"))?;
    let warps = moe_warps();
    // The q8 kernels' launch shapes as the model's (`enqueue_moe`): gate/up blocks of 32 rows of
    // one choice at `q8q_threads_for(1)`, down rows over the model's warps a row.
    let parts = crate::model::fit_down_parts(crate::model::moe_down_parts_from_env(), warps);
    let dstride: u64 = 0;
    let types = format!("{}/{}", ex[0].gate.ty.name(), ex[0].down.ty.name());
    let mut out = Vec::new();
    for (place, base) in [("device", slots), ("host (PCIe)", host_dev)] {
        let entries: Vec<u64> = (0..n)
            .flat_map(|e| {
                let b = base + (e * sb) as u64;
                [b, b + layout.up_off as u64, b + layout.down_off as u64]
            })
            .collect();
        // SAFETY: `tab` holds 3n u64.
        unsafe { cu::memcpy_htod_sync(tab, &entries) }.map_err(drv("upload"))?;
        let capturing = crate::device::capture_lock();
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(drv("beginning the capture"))?;
        let (hi, ffi, ki) = (h as i32, ff as i32, k as i32);
        // Launch shapes: the q8 gate/up takes blocks of 32 rows of one choice, its down `parts`
        // warps a row; the f32 pair `warps` rows a block and one warp a row.
        let (gate_up_grid, gate_up_threads, down_rows) = if q8 {
            ((ff / 32) as u32, crate::ops::q8q_threads_for(1), h * parts)
        } else {
            (ff.div_ceil(warps as usize) as u32, 32 * warps, h)
        };
        // The q8 kernels read x's q8 row and write / read the activations' q8 rows, and take the
        // expert table's stride (0: entries, not an affine table) last.
        let (x_in, down_in) = if q8 { (xq, actq) } else { (xb, act) };
        for call in 0..calls {
            let idp = ids_d + (4 * call * k) as u64;
            let mut b = stream.launch_builder(&gate_up);
            b.arg(&tab).arg(&idp).arg(&x_in).arg(&act);
            if q8 {
                b.arg(&actq);
            }
            b.arg(&ffi).arg(&hi).arg(&ki);
            if q8 {
                b.arg(&dstride);
            }
            let cfg = LaunchConfig {
                grid_dim: (gate_up_grid, k as u32, 1),
                block_dim: (gate_up_threads, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: arguments in the kernel's order and types, buffers sized above.
            unsafe { b.launch(cfg) }.map_err(drv("the gate/up kernel"))?;
            let mut b = stream.launch_builder(&down);
            b.arg(&tab).arg(&idp).arg(&wts_d).arg(&down_in);
            b.arg(&xo).arg(&shared).arg(&gl).arg(&hi).arg(&ffi).arg(&ki);
            if q8 {
                b.arg(&dstride);
            }
            let cfg = LaunchConfig {
                grid_dim: (down_rows.div_ceil(warps as usize) as u32, 1, 1),
                block_dim: (32 * warps, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: as above.
            unsafe { b.launch(cfg) }.map_err(drv("the down kernel"))?;
        }
        let graph = stream
            .end_capture(sys::CUgraphInstantiate_flags_enum(0))
            .map_err(drv("ending the capture"))?
            .ok_or_else(|| CudaError::Invalid("empty capture".into()))?;
        drop(capturing);
        graph.launch().map_err(drv("warm-up"))?;
        stream.synchronize().map_err(drv("sync"))?;
        let mut secs = Vec::new();
        for _ in 0..o.replays.max(1) {
            let t = Instant::now();
            graph.launch().map_err(drv("replay"))?;
            stream.synchronize().map_err(drv("sync"))?;
            secs.push(t.elapsed().as_secs_f64() / calls as f64);
        }
        secs.sort_by(f64::total_cmp);
        let call_s = secs[secs.len() / 2];
        // The residual the down kernel added into over every call so far: equal across builds
        // whose kernels give the same bits (the same calls in the same order).
        let mut sum_x = vec![0u8; 4 * h];
        // SAFETY: `xo` holds h f32; the stream is idle.
        unsafe { cu::memcpy_dtoh_sync(&mut sum_x, xo) }.map_err(drv("reading the output"))?;
        let checksum = redlite_gguf::fnv1a(&sum_x, redlite_gguf::FNV_OFFSET);
        out.push(ExpertBenchResult {
            place,
            warps,
            kernels: format!("{gate_up_name} + {down_name}"),
            types: types.clone(),
            expert_bytes: layout.expert_bytes(),
            per_call: k,
            distinct: n,
            call_s,
            gbps: (k * layout.expert_bytes()) as f64 / call_s / 1e9,
            checksum,
        });
    }
    stream.synchronize().map_err(drv("sync"))?;
    // SAFETY: nothing uses these any more (the stream is idle).
    unsafe {
        let _ = cu::free_host(host as *mut _);
        for p in owned {
            let _ = cu::free_sync(p);
        }
    }
    Ok(out)
}
