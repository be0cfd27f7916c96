//! Host-side wrappers of every kernel: upload the inputs, launch, download the outputs.
//!
//! Part 1 keeps activations on the host between kernels (simple and checkable); each wrapper is
//! one or two launches. Outputs are poisoned (all bits set: NaN for f32, -1 for i32) before the
//! launch, so an element a kernel fails to write shows up in every comparison.
//!
//! One file a kernel family, as `kernels/*.cu`: [`matvec`], [`gemm`], [`moe`], [`norm`],
//! [`deltanet`], [`attention`], [`sampling`]; here the buffers, the launch macro and the q8 row
//! every family shares.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};
use redlite_gguf::GgmlType;
use redlite_model::KvType;

use crate::kernels::type_suffix;
use crate::model::{MvfSplit, HEAD_XR_ROWS, MVF_MAX_ROWS, MVF_MAX_TILE, RES_XR_ROWS, XR_TOKENS};
use crate::{CudaError, Gpu};

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

mod attention;
mod deltanet;
mod gemm;
mod matvec;
mod moe;
mod norm;
mod sampling;

pub use attention::*;
pub use deltanet::*;
pub use gemm::*;
pub use matvec::*;
pub use moe::*;
pub use norm::*;
pub use sampling::*;

/// Warps (output rows) per block of the matvec-style kernels.
pub const MATVEC_WARPS: u32 = 4;
/// Warps from the variable `name` when it holds one of `allowed`, else `default`.
fn warps_from_env(name: &str, allowed: &[u32], default: u32) -> u32 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse::<u32>().ok())
        .filter(|w| allowed.contains(w))
        .unwrap_or(default)
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

fn check_rows(len: usize, n: usize, what: &str) -> Result<usize, CudaError> {
    if n == 0 || !len.is_multiple_of(n) {
        return Err(CudaError::Invalid(format!(
            "{what}: {len} values are not rows of {n}"
        )));
    }
    Ok(len / n)
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
