//! The device: context, stream, the loaded kernel module and its functions.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, DriverError};
use cudarc::nvrtc::Ptx;

use crate::{kernels, nvrtc, CudaError};

/// What was found and how the kernels were obtained.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    /// Streaming multiprocessors.
    pub sm_count: usize,
    /// The SM clock's peak rate (kHz; `clock64` cycles to time).
    pub clock_khz: usize,
    /// The NVRTC target, e.g. `sm_90a`.
    pub arch: String,
    pub total_mem: usize,
    pub nvrtc_version: (i32, i32),
    /// Whether the cubin came from the disk cache.
    pub cubin_cached: bool,
    pub cubin_bytes: usize,
    /// Start-up time spent compiling (or reading the cache) and loading the module.
    pub compile_ms: f64,
    pub load_ms: f64,
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GPU {}: {} (sm_{}{}, {:.1} GiB), kernels for {} via NVRTC {}.{} ({} KiB cubin, {}, {:.0} ms; load {:.0} ms)",
            self.ordinal,
            self.name,
            self.compute_capability.0,
            self.compute_capability.1,
            self.total_mem as f64 / (1u64 << 30) as f64,
            self.arch,
            self.nvrtc_version.0,
            self.nvrtc_version.1,
            self.cubin_bytes / 1024,
            if self.cubin_cached { "cached" } else { "compiled" },
            self.compile_ms,
            self.load_ms,
        )
    }
}

/// The NVRTC architecture for a compute capability: the `a` variant (all of the chip's own
/// instructions) from Hopper on, plain `sm_XY` before.
pub fn arch_for(major: i32, minor: i32) -> String {
    if major >= 9 {
        format!("sm_{major}{minor}a")
    } else {
        format!("sm_{major}{minor}")
    }
}

/// Whether libcuda (the driver) can be loaded. Checked before any driver call: cudarc's dynamic
/// loading panics when the library is missing.
pub fn driver_available() -> bool {
    // SAFETY: only tries to dlopen the candidate library names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether a GPU can be used at all (driver, NVRTC, at least one device), without compiling or
/// loading anything: lets a command say why not and run on the CPU instead.
pub fn probe() -> Result<(), CudaError> {
    if !driver_available() {
        return Err(CudaError::NoDriver);
    }
    if !nvrtc::available() {
        return Err(CudaError::NoNvrtc);
    }
    match CudaContext::device_count() {
        Ok(n) if n > 0 => Ok(()),
        Ok(_) => Err(CudaError::NoDevice("the driver sees no CUDA device".into())),
        Err(e) => Err(CudaError::NoDevice(format!("cuDeviceGetCount: {e}"))),
    }
}

/// Held while a stream captures a graph and while a stream is created: cudarc synchronises the
/// whole context when it creates a context's first stream, which the driver refuses
/// (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`) while another thread's stream is capturing, as two
/// models loaded at once in one process (the GPU tests' threads) did.
static CAPTURE: Mutex<()> = Mutex::new(());

/// The capture lock (a poisoned lock still serialises: the guarded data is `()`).
pub(crate) fn capture_lock() -> MutexGuard<'static, ()> {
    CAPTURE.lock().unwrap_or_else(|e| e.into_inner())
}

/// A new non-blocking stream of `ctx`, never while another thread captures a graph.
pub(crate) fn new_stream(ctx: &Arc<CudaContext>) -> Result<Arc<CudaStream>, DriverError> {
    let _guard = capture_lock();
    ctx.new_stream()
}

/// One GPU with the kernel module loaded.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    module: Arc<CudaModule>,
    funcs: HashMap<String, CudaFunction>,
    pub info: DeviceInfo,
}

impl Gpu {
    /// Open GPU `ordinal`, compile (or read from the cache) and load the kernels, fill the tables.
    pub fn new(ordinal: usize) -> Result<Gpu, CudaError> {
        if !driver_available() {
            return Err(CudaError::NoDriver);
        }
        if !nvrtc::available() {
            return Err(CudaError::NoNvrtc);
        }
        let count = CudaContext::device_count()
            .map_err(|e| CudaError::NoDevice(format!("cuDeviceGetCount: {e}")))?;
        if count <= 0 {
            return Err(CudaError::NoDevice("the driver sees no CUDA device".into()));
        }
        if ordinal >= count as usize {
            return Err(CudaError::NoDevice(format!(
                "device {ordinal} asked for, {count} present"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| {
            CudaError::NoDevice(format!("creating a context on device {ordinal}: {e}"))
        })?;
        let name = ctx
            .name()
            .map_err(|e| CudaError::driver("cuDeviceGetName", e))?;
        let cc = ctx
            .compute_capability()
            .map_err(|e| CudaError::driver("compute capability", e))?;
        let sm_count = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(|e| CudaError::driver("multiprocessor count", e))?
            .max(1) as usize;
        let clock_khz = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)
            .map_err(|e| CudaError::driver("clock rate", e))?
            .max(1) as usize;
        let total_mem = ctx
            .total_mem()
            .map_err(|e| CudaError::driver("cuDeviceTotalMem", e))?;
        let arch = arch_for(cc.0, cc.1);
        let nvrtc_version = nvrtc::version()?;

        let t0 = Instant::now();
        let compiled = nvrtc::compile_cached(&kernels::module_source(), &arch)?;
        let compile_ms = t0.elapsed().as_secs_f64() * 1e3;
        let t1 = Instant::now();
        let cubin_bytes = compiled.cubin.len();
        let module = ctx
            .load_module(Ptx::from_binary(compiled.cubin))
            .map_err(|e| CudaError::driver(format!("loading the {arch} kernel module"), e))?;
        let stream = ctx.default_stream();
        let mut funcs = HashMap::new();
        for name in kernels::kernel_names() {
            let f = module
                .load_function(&name)
                .map_err(|e| CudaError::driver(format!("kernel {name}"), e))?;
            funcs.insert(name, f);
        }
        for (symbol, bytes) in kernels::grid_tables().into_iter().chain(kernels::knobs()) {
            let mut dst = module
                .get_global(symbol, &stream)
                .map_err(|e| CudaError::driver(format!("table {symbol}"), e))?;
            if dst.len() != bytes.len() {
                return Err(CudaError::Invalid(format!(
                    "table {symbol}: device holds {} bytes, host has {}",
                    dst.len(),
                    bytes.len()
                )));
            }
            stream
                .memcpy_htod(&bytes, &mut dst)
                .map_err(|e| CudaError::driver(format!("uploading {symbol}"), e))?;
        }
        stream
            .synchronize()
            .map_err(|e| CudaError::driver("synchronize after load", e))?;
        let load_ms = t1.elapsed().as_secs_f64() * 1e3;
        Ok(Gpu {
            ctx,
            stream,
            module,
            funcs,
            info: DeviceInfo {
                ordinal,
                name,
                compute_capability: cc,
                sm_count,
                clock_khz,
                arch,
                total_mem,
                nvrtc_version,
                cubin_cached: compiled.cached,
                cubin_bytes,
                compile_ms,
                load_ms,
            },
        })
    }

    /// The slots of a `REDLITE_TRACE` kernel build (`g_trace`, laid out in common.cu: each traced
    /// kernel's calls and its phases' clock cycles summed over them), after a synchronize; `reset`
    /// zeroes them afterwards.
    pub fn trace(&self, reset: bool) -> Result<Vec<u64>, CudaError> {
        let drv = |what: &'static str| move |e| CudaError::driver(what, e);
        let mut slot = self
            .module
            .get_global("g_trace", &self.stream)
            .map_err(drv("g_trace"))?;
        let mut bytes = vec![0u8; slot.len()];
        self.stream
            .memcpy_dtoh(&slot, &mut bytes)
            .map_err(drv("reading g_trace"))?;
        if reset {
            let zeros = vec![0u8; slot.len()];
            self.stream
                .memcpy_htod(&zeros, &mut slot)
                .map_err(drv("zeroing g_trace"))?;
        }
        self.stream
            .synchronize()
            .map_err(drv("synchronize after g_trace"))?;
        Ok(bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect())
    }

    /// A kernel by name.
    pub fn func(&self, name: &str) -> Result<&CudaFunction, CudaError> {
        self.funcs
            .get(name)
            .ok_or_else(|| CudaError::Invalid(format!("no kernel named {name}")))
    }
}
