//! Matrix-vector and matrix-matrix products over quantized weight matrices, on the rayon pool.
//!
//! A weight matrix is `rows` rows of `cols` elements in GGUF layout (row `r` is the bytes
//! `r·row_bytes .. (r+1)·row_bytes`). The activation row is quantized once per call to the
//! kernel's activation format ([`RowDot`]); rows are then split into chunks across the global
//! rayon pool (persistent threads, no per-call thread creation).
//!
//! **Determinism:** output element `(j, r)` of [`matmul`] is computed by the same kernel call as
//! [`matvec`] of activation row `j` (the same quantized activations, the same weight bytes, the
//! same summation order), so the two are bit-identical, whatever the thread count.

use super::q8::{quantize_row_q8_0, quantize_row_q8_k, BlockQ8K, BlockQ8_0, QK8_0, QK_K};
use super::{lookup, Isa, RowDot, RowsDot};
use rayon::prelude::*;
use redlite_gguf::quant::GgmlType;
use std::sync::OnceLock;

/// Why a product could not be computed. Every check happens before any output is written.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum KernelError {
    #[error("no CPU kernel for weight type {0:?}")]
    Unsupported(GgmlType),
    #[error("{ty:?}: {cols} columns is not a multiple of the block size {block}")]
    BadCols {
        ty: GgmlType,
        cols: usize,
        block: usize,
    },
    #[error("{what}: expected {expected} elements/bytes, got {got}")]
    BadLength {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("matrix size overflows usize ({rows} x {cols})")]
    Overflow { rows: usize, cols: usize },
    #[error("thread pool: {0}")]
    ThreadPool(String),
}

/// Number of physical cores (distinct `core_cpus`/`thread_siblings` sets in Linux sysfs), or the
/// logical CPU count where that is not available.
pub fn physical_cores() -> usize {
    let logical = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let mut sets = std::collections::BTreeSet::new();
    for cpu in 0..logical.max(1) * 4 {
        let base = format!("/sys/devices/system/cpu/cpu{cpu}/topology/");
        let read = |f: &str| std::fs::read_to_string(format!("{base}{f}")).ok();
        let package = read("physical_package_id").unwrap_or_default();
        match read("core_cpus_list").or_else(|| read("thread_siblings_list")) {
            Some(s) => {
                sets.insert((package.trim().to_string(), s.trim().to_string()));
            }
            None if cpu >= logical => break,
            None => {}
        }
    }
    if sets.is_empty() {
        logical
    } else {
        sets.len().min(logical).max(1)
    }
}

/// The default thread count: `REDLITE_THREADS`, else `RAYON_NUM_THREADS`, else
/// [`physical_cores`].
pub fn default_threads() -> usize {
    ["REDLITE_THREADS", "RAYON_NUM_THREADS"]
        .iter()
        .filter_map(|k| std::env::var(k).ok()?.trim().parse::<usize>().ok())
        .find(|&n| n > 0)
        .unwrap_or_else(physical_cores)
}

/// The most threads [`init_threads`] starts: far past any CPU's hardware threads, and low enough
/// that a mistyped count fails at once instead of spending minutes starting threads.
pub const MAX_THREADS: usize = 1024;

/// Builds the global rayon pool with `n` threads (`0` = [`default_threads`]). A pool that already
/// exists (it is created on first use with the default size) is kept, and that is not an error;
/// a count above [`MAX_THREADS`] or threads the system cannot start are.
pub fn init_threads(n: usize) -> Result<(), KernelError> {
    let n = if n == 0 { default_threads() } else { n };
    if n > MAX_THREADS {
        let cpus = std::thread::available_parallelism().map_or(1, |c| c.get());
        return Err(KernelError::ThreadPool(format!(
            "{n} threads requested; at most {MAX_THREADS} (this machine has {cpus} CPUs)"
        )));
    }
    match rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(|i| format!("redlite-cpu-{i}"))
        .build_global()
    {
        Ok(()) => Ok(()),
        // Only a failure to start the threads carries an I/O error as its source; the others
        // say that the pool exists already.
        Err(e) if std::error::Error::source(&e).is_none() => Ok(()),
        Err(e) => Err(KernelError::ThreadPool(format!(
            "cannot start {n} threads: {e}"
        ))),
    }
}

/// Makes sure the global pool exists, sized by [`default_threads`] unless [`init_threads`] (or
/// another rayon user) created it first.
fn ensure_pool() {
    static INIT: OnceLock<()> = OnceLock::new();
    INIT.get_or_init(|| {
        // On failure rayon builds its own default pool on first use.
        let _ = init_threads(0);
    });
}

/// The number of threads products are split over.
pub fn num_threads() -> usize {
    ensure_pool();
    rayon::current_num_threads()
}

/// Whether a kernel exists for weight type `ty`.
pub fn supported(ty: GgmlType) -> bool {
    super::supported(ty)
}

/// Activations quantized for one kernel: `n` rows, each `per_row` blocks (or f32 values).
enum Acts {
    Q8K(Vec<BlockQ8K>, usize),
    Q8_0(Vec<BlockQ8_0>, usize),
    F32(Vec<f32>, usize),
}

/// `n` activation rows of `cols` values quantized to `per` blocks each by `row` (prefill-sized
/// batches spread the rows over the pool; each row's blocks are the same either way).
fn quantize_rows<B: Copy + Send + Sync>(
    xs: &[f32],
    cols: usize,
    n: usize,
    per: usize,
    zero: B,
    row: fn(&[f32], &mut [B]),
) -> Vec<B> {
    let mut q = vec![zero; per * n];
    let xs = &xs[..cols * n];
    if n > 1 && cols * n >= PARALLEL_QUANTIZE_MIN {
        // Prefill-sized (so cols > 0): the rows across the pool.
        xs.par_chunks_exact(cols)
            .zip(q.par_chunks_exact_mut(per.max(1)))
            .for_each(|(x, out)| row(x, out));
    } else {
        for (x, out) in xs
            .chunks_exact(cols.max(1))
            .zip(q.chunks_exact_mut(per.max(1)))
        {
            row(x, out);
        }
    }
    q
}

impl Acts {
    /// Quantizes `n` activation rows of `cols` values for `kernel`.
    fn quantize(kernel: RowDot, xs: &[f32], cols: usize, n: usize) -> Acts {
        match kernel {
            RowDot::Q8K(_) => {
                let per = cols / QK_K;
                let q = quantize_rows(xs, cols, n, per, BlockQ8K::ZERO, quantize_row_q8_k);
                Acts::Q8K(q, per)
            }
            RowDot::Q8_0(_) => {
                let per = cols / QK8_0;
                let q = quantize_rows(xs, cols, n, per, BlockQ8_0::ZERO, quantize_row_q8_0);
                Acts::Q8_0(q, per)
            }
            RowDot::F32(_) => Acts::F32(xs[..cols * n].to_vec(), cols),
        }
    }

    /// Dot of weight row `w` with activation row `j`.
    #[inline(always)]
    fn dot(&self, kernel: RowDot, w: &[u8], j: usize) -> f32 {
        match (kernel, self) {
            (RowDot::Q8K(f), Acts::Q8K(q, per)) => f(w, &q[j * per..(j + 1) * per]),
            (RowDot::Q8_0(f), Acts::Q8_0(q, per)) => f(w, &q[j * per..(j + 1) * per]),
            (RowDot::F32(f), Acts::F32(x, per)) => f(w, &x[j * per..(j + 1) * per]),
            // `quantize` builds the variant matching the kernel.
            _ => unreachable!("activation format matches the kernel"),
        }
    }
}

/// Activation values from which [`Acts::quantize`] spreads the rows of a batch over the pool.
const PARALLEL_QUANTIZE_MIN: usize = 64 * 1024;

/// Checked shape facts of a product.
pub(crate) struct Shape {
    ty: GgmlType,
    pub(crate) row_bytes: usize,
}

pub(crate) fn check(
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x_len: usize,
    y_len: usize,
    n: usize,
) -> Result<(RowDot, Shape), KernelError> {
    let kernel = lookup(ty, Isa::active()).ok_or(KernelError::Unsupported(ty))?;
    check_with(kernel, ty, w, rows, cols, x_len, y_len, n)
}

#[allow(clippy::too_many_arguments)]
fn check_with(
    kernel: RowDot,
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x_len: usize,
    y_len: usize,
    n: usize,
) -> Result<(RowDot, Shape), KernelError> {
    let block = ty.block_elems();
    if !cols.is_multiple_of(block) {
        return Err(KernelError::BadCols { ty, cols, block });
    }
    // Activation formats need whole activation blocks too.
    let act_block = match kernel {
        RowDot::Q8K(_) => QK_K,
        RowDot::Q8_0(_) => QK8_0,
        RowDot::F32(_) => 1,
    };
    if !cols.is_multiple_of(act_block) {
        return Err(KernelError::BadCols {
            ty,
            cols,
            block: act_block,
        });
    }
    let overflow = KernelError::Overflow { rows, cols };
    let row_bytes = (cols / block)
        .checked_mul(ty.block_bytes())
        .ok_or(overflow.clone())?;
    let w_bytes = row_bytes.checked_mul(rows).ok_or(overflow.clone())?;
    let x_want = cols.checked_mul(n).ok_or(overflow.clone())?;
    let y_want = rows.checked_mul(n).ok_or(overflow)?;
    let len = |what, expected, got| {
        if expected == got {
            Ok(())
        } else {
            Err(KernelError::BadLength {
                what,
                expected,
                got,
            })
        }
    };
    len("weight bytes", w_bytes, w.len())?;
    len("activations", x_want, x_len)?;
    len("outputs", y_want, y_len)?;
    Ok((kernel, Shape { ty, row_bytes }))
}

/// Below this many weight bytes a product runs on the calling thread (splitting costs more).
pub(crate) const PARALLEL_MIN_BYTES: usize = 256 * 1024;

/// Below this many weight bytes a one-row product (`matvec`, a fused decode batch) runs on the
/// calling thread: `REDLITE_PARALLEL_MIN_KB` KiB, default 64. Lower than [`PARALLEL_MIN_BYTES`]:
/// the pool is kept warm during a pass, so a hand-off costs less than the ≈ 5 µs a 64 KiB
/// product takes from cache (tiny Q4_K_M fixture decode, 2 threads: 2709 → 3281 tok/s at 64
/// KiB, median of 5; 32 KiB no better).
pub(crate) fn matvec_parallel_min_bytes() -> usize {
    static KB: OnceLock<usize> = OnceLock::new();
    1024 * *KB.get_or_init(|| {
        std::env::var("REDLITE_PARALLEL_MIN_KB")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(64)
    })
}

/// Smallest parallel task, in weight bytes (`REDLITE_TASK_KB` KiB, default 16).
fn min_task_bytes() -> usize {
    static KB: OnceLock<usize> = OnceLock::new();
    1024 * *KB.get_or_init(|| {
        std::env::var("REDLITE_TASK_KB")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .filter(|&kb: &usize| kb > 0)
            .unwrap_or(16)
    })
}

/// Rows per parallel task for a matrix of `rows` rows of `row_bytes` bytes: about 4 tasks per
/// thread for load balance, at least [`min_task_bytes`] of weights per task.
fn rows_per_task(rows: usize, row_bytes: usize) -> usize {
    rows_per_task_min(rows, row_bytes, min_task_bytes())
}

/// [`rows_per_task`] with at least `min_bytes` of weights per task.
fn rows_per_task_min(rows: usize, row_bytes: usize, min_bytes: usize) -> usize {
    let threads = num_threads().max(1);
    let by_balance = rows.div_ceil(threads * 4);
    let by_size = min_bytes.div_ceil(row_bytes.max(1));
    by_balance.max(by_size).clamp(1, rows.max(1))
}

/// Smallest task of a one-row product ([`run_matvec`]), unless `REDLITE_TASK_KB` asks for more:
/// one pass over the weights per task, so each task restarts the hardware prefetcher's streams.
/// `bench kernel --type IQ2_XXS --shape 512x2048 -t 2` (270 KB matrices): 16 KiB tasks
/// 13.2–14.4 GB/s, 128 KiB 15.8–16.3 GB/s.
const MATVEC_MIN_TASK_BYTES: usize = 128 * 1024;

/// `y = W · x`: `W` is `rows × cols` of type `ty` (raw GGUF bytes), `x` has `cols` values, `y`
/// gets `rows`. Uses the kernel level of [`Isa::active`].
pub fn matvec(
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    y: &mut [f32],
) -> Result<(), KernelError> {
    let (kernel, shape) = check(ty, w, rows, cols, x.len(), y.len(), 1)?;
    run_matvec(Isa::active(), kernel, shape, w, cols, x, y);
    Ok(())
}

/// [`matvec`] with the kernel of level `isa` (or the best lower one): for tests and benchmarks.
pub fn matvec_isa(
    isa: Isa,
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    y: &mut [f32],
) -> Result<(), KernelError> {
    let kernel = lookup(ty, isa).ok_or(KernelError::Unsupported(ty))?;
    let (kernel, shape) = check_with(kernel, ty, w, rows, cols, x.len(), y.len(), 1)?;
    run_matvec(isa, kernel, shape, w, cols, x, y);
    Ok(())
}

/// The activations of a one-row product at level `isa` and the kernel that reads them: the
/// dispatch kernel on [`Acts::quantize`]'s, except for IQ2_XXS at the AVX-512 level with GFNI,
/// whose element-major kernel reads the Q8_K blocks reordered once here
/// (`iquants_avx512::element_major_q8k`; same results bit for bit, ~30 % fewer ns per block), and
/// Q4_K at the AVX-512 level with VNNI, whose kernel reads them in the paired order
/// (`kquants_x86::q4k_paired_q8k`: one 64-byte load per product; same results bit for bit).
///
/// Also the kernel's rows form where it is to be used instead: for the element-major kernel its
/// rows kernel (tables loaded once per task, rows prefetched ahead; same values).
fn matvec_acts(
    isa: Isa,
    kernel: RowDot,
    ty: GgmlType,
    x: &[f32],
    cols: usize,
) -> (RowDot, Acts, Option<RowsDot>) {
    let acts = Acts::quantize(kernel, x, cols, 1);
    #[cfg(target_arch = "x86_64")]
    if ty == GgmlType::IQ2XXS && isa.min(Isa::best()) == Isa::Avx512 {
        if let (Some(f), Acts::Q8K(q, _)) =
            (super::iquants_avx512::iq2_xxs_element_major_kernel(), &acts)
        {
            let q = super::iquants_avx512::element_major_q8k(q);
            let per = q.len();
            let rows = super::iquants_avx512::iq2_xxs_element_major_rows_kernel();
            return (RowDot::Q8K(f), Acts::Q8K(q, per), rows);
        }
    }
    #[cfg(target_arch = "x86_64")]
    if ty == GgmlType::Q4K && isa.min(Isa::best()) == Isa::Avx512 {
        if let (Some(f), Acts::Q8K(q, per)) = (super::kquants_x86::q4k_paired_kernel(), &acts) {
            let q = super::kquants_x86::q4k_paired_q8k(q);
            // The rows kernel where `lookup_rows_for` would give one, in its paired form.
            let rows = super::lookup_rows_for(ty, isa, cols)
                .and(super::kquants_x86::q4k_paired_rows_kernel());
            return (RowDot::Q8K(f), Acts::Q8K(q, *per), rows);
        }
    }
    let rows = match kernel {
        RowDot::Q8K(_) => super::lookup_rows_for(ty, isa, cols),
        _ => None,
    };
    (kernel, acts, rows)
}

fn run_matvec(
    isa: Isa,
    kernel: RowDot,
    shape: Shape,
    w: &[u8],
    cols: usize,
    x: &[f32],
    y: &mut [f32],
) {
    if y.is_empty() {
        return;
    }
    let rb = shape.row_bytes;
    if rb == 0 {
        y.fill(0.0);
        return;
    }
    let (kernel, acts, rows_kernel) = matvec_acts(isa, kernel, shape.ty, x, cols);
    // Several rows per kernel call where the type has a rows kernel (same values).
    let rows = match (rows_kernel, &acts) {
        (Some(f), Acts::Q8K(q, _)) => Some((f, q)),
        _ => None,
    };
    let run = |ys: &mut [f32], ws: &[u8]| match rows {
        Some((f, q)) => f(ws, rb, q, ys),
        None => {
            for (out, wr) in ys.iter_mut().zip(ws.chunks_exact(rb)) {
                *out = acts.dot(kernel, wr, 0);
            }
        }
    };
    if w.len() < matvec_parallel_min_bytes() {
        return run(y, w);
    }
    let per = rows_per_task_min(y.len(), rb, min_task_bytes().max(MATVEC_MIN_TASK_BYTES));
    let mut chunks: Vec<(&mut [f32], &[u8])> = y.chunks_mut(per).zip(w.chunks(per * rb)).collect();
    crate::team::for_each_mut(&mut chunks, |(ys, ws)| run(ys, ws));
}

/// `Y = X · Wᵀ`: `xs` holds `n` activation rows of `cols` values, `ys` gets `n` rows of `rows`
/// values (`ys[j·rows + r] = W_r · x_j`). Every weight row is read once for all `n` activation
/// rows. Row `j` of the result is bit-identical to `matvec` of `x_j`.
pub fn matmul(
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    xs: &[f32],
    n: usize,
    ys: &mut [f32],
) -> Result<(), KernelError> {
    let (kernel, shape) = check(ty, w, rows, cols, xs.len(), ys.len(), n)?;
    run_matmul_at(Isa::active(), kernel, shape, w, rows, cols, xs, n, ys);
    Ok(())
}

/// [`matmul`] with the kernel of level `isa` (or the best lower one): for tests and benchmarks.
#[allow(clippy::too_many_arguments)]
pub fn matmul_isa(
    isa: Isa,
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    xs: &[f32],
    n: usize,
    ys: &mut [f32],
) -> Result<(), KernelError> {
    let kernel = lookup(ty, isa).ok_or(KernelError::Unsupported(ty))?;
    let (kernel, shape) = check_with(kernel, ty, w, rows, cols, xs.len(), ys.len(), n)?;
    run_matmul_at(isa, kernel, shape, w, rows, cols, xs, n, ys);
    Ok(())
}

/// A kernel that takes one weight row and up to `MULTI_ROWS` Q8_K activation rows at once (the
/// weight blocks are decoded once for all of them); each result is bit-identical to the
/// single-row kernel that [`lookup`] returns for the same type and level.
#[cfg(target_arch = "x86_64")]
type MultiRowDot = super::iquants_avx512::MultiRowDot;
#[cfg(target_arch = "x86_64")]
const MULTI_ROWS: usize = super::iquants_avx512::MULTI_ROWS_WIDE;
#[cfg(not(target_arch = "x86_64"))]
type MultiRowDot = fn(w: &[u8], xs: &[&[BlockQ8K]], out: &mut [f32]);
#[cfg(not(target_arch = "x86_64"))]
const MULTI_ROWS: usize = 1;

/// The Q8_0 weight kernel taking up to `Q8_0_MULTI_ROWS` Q8_0 activation rows at once.
#[cfg(target_arch = "x86_64")]
use super::simple_x86::{Q8_0MultiDot, Q8_0_MULTI_ROWS};
#[cfg(not(target_arch = "x86_64"))]
type Q8_0MultiDot = fn(w: &[u8], xs: &[&[BlockQ8_0]], out: &mut [f32]);
#[cfg(not(target_arch = "x86_64"))]
const Q8_0_MULTI_ROWS: usize = 1;

/// The Q8_0 kernel taking 16 activation rows per pass in i32 lanes.
#[cfg(target_arch = "x86_64")]
use super::q8_0_lanes_x86::{LanesDot, LANES};
#[cfg(not(target_arch = "x86_64"))]
type LanesDot = fn(w: &[u8], row_bytes: usize, ys: &[()], narrow: bool, out: &mut [[f32; 16]]);

/// Activation rows from which Q8_0 products take the lane kernel, and the fewest rows a
/// partial lane group must have (`REDLITE_Q8_0_LANES_MIN`, default 3; 0 turns it off).
#[cfg(target_arch = "x86_64")]
fn q8_0_lanes_min_rows() -> usize {
    static MIN: OnceLock<usize> = OnceLock::new();
    *MIN.get_or_init(|| rows_threshold("REDLITE_Q8_0_LANES_MIN", 3))
}

/// The float-weight kernel taking up to `FLOAT_MULTI_ROWS` f32 activation rows at once.
#[cfg(target_arch = "x86_64")]
use super::simple_x86::{FloatMultiDot, FLOAT_MULTI_ROWS};
#[cfg(not(target_arch = "x86_64"))]
type FloatMultiDot = fn(w: &[u8], xs: &[&[f32]], out: &mut [f32]);
#[cfg(not(target_arch = "x86_64"))]
const FLOAT_MULTI_ROWS: usize = 1;

/// The form a multi-row kernel takes its Q8_K activation rows in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ActForm {
    /// As quantized.
    Plain,
    /// `q8 ^ 0x80` (`iquants_avx512::offset_activations`).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Offset,
    /// Sub-block-aligned lanes (`kquants_multi_x86::grouped_activations`, no offset).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Grouped,
    /// Grouped and in offset form (`grouped_activations(_, true)`).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    GroupedOffset,
}

/// A multi-row kernel: the function, the form of its activations and the most rows per call.
#[derive(Clone, Copy)]
struct Multi {
    f: MultiRowDot,
    form: ActForm,
    rows: usize,
}

/// The multi-row kernel matching `lookup(ty, isa)`, if there is one. At the AVX-512 level the
/// i-quant types with a multi-row kernel are served by `iquants_avx512` alone (no module before
/// it in the dispatch table claims them), and Q4_K and Q6_K by `kquants_x86`'s VNNI kernels when
/// the CPU has VNNI (the only case `kquants_multi_x86` answers), so each multi-row kernel is the same
/// arithmetic as the single-row one.
fn multi_lookup(ty: GgmlType, isa: Isa) -> Option<Multi> {
    #[cfg(target_arch = "x86_64")]
    if isa.min(Isa::best()) == Isa::Avx512 {
        use super::kquants_multi_x86 as k;
        if grouped_enabled() {
            if let Some(f) = k::grouped_kernel(ty) {
                let (form, rows) = (ActForm::Grouped, k::GROUPED_ROWS);
                return Some(Multi { f, form, rows });
            }
            if let Some((f, rows)) = super::iquants_avx512::multi_kernel_grouped(ty) {
                let form = ActForm::GroupedOffset;
                return Some(Multi { f, form, rows });
            }
        }
        // (Both take up to MULTI_ROWS rows; the 4-row `iquants_avx512::multi_kernel` is
        // superseded by the offset one.)
        let rows = MULTI_ROWS;
        if let Some(f) = super::iquants_avx512::multi_kernel_offset(ty) {
            let form = ActForm::Offset;
            return Some(Multi { f, form, rows });
        }
        let form = ActForm::Plain;
        return k::multi_kernel(ty).map(|f| Multi { f, form, rows });
    }
    let _ = (ty, isa);
    None
}

/// Whether the grouped-activation kernels are used (`REDLITE_GROUPED=0` turns them off, for A/B
/// measurements).
#[cfg(target_arch = "x86_64")]
fn grouped_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("REDLITE_GROUPED").map_or(true, |v| v.trim() != "0"))
}

/// Weight bytes per row tile of [`matmul`]: a tile stays in L2 while it meets every activation.
const TILE_BYTES: usize = 128 * 1024;

/// [`run_matmul`], with the multi-row kernel of level `isa` where the type has one.
#[allow(clippy::too_many_arguments)]
fn run_matmul_at(
    isa: Isa,
    kernel: RowDot,
    shape: Shape,
    w: &[u8],
    rows: usize,
    cols: usize,
    xs: &[f32],
    n: usize,
    ys: &mut [f32],
) {
    let multis = multis_at(isa, kernel, shape.ty, n);
    #[cfg(target_arch = "x86_64")]
    if rows > 0 && shape.row_bytes > 0 && isa.min(Isa::best()) == Isa::Avx512 {
        // The tile GEMMs (Q4_K, IQ2_XXS) from their row thresholds on.
        type TileGemm = fn(&[BlockQ8K], usize, usize, &[u8], usize, usize, &mut [f32]);
        let tile: Option<TileGemm> = match shape.ty {
            GgmlType::Q4K
                if n >= tile_min_rows() && super::kquants_multi_x86::tile_gemm_supported() =>
            {
                Some(run_tile_gemm_q4k)
            }
            GgmlType::IQ2XXS if n >= tile_min_rows_iq2() && super::iquants_avx512::supported() => {
                Some(run_tile_gemm_iq2_xxs)
            }
            _ => None,
        };
        if let Some(gemm) = tile {
            if let Acts::Q8K(q, per) = Acts::quantize(kernel, xs, cols, n) {
                return gemm(&q, per, n, w, rows, shape.row_bytes, ys);
            }
        }
    }
    run_matmul(isa, kernel, multis, shape, w, rows, cols, xs, n, ys)
}

/// The multi-row kernels of level `isa` for an `n`-row product of `ty` weights by `kernel`.
fn multis_at(isa: Isa, kernel: RowDot, ty: GgmlType, n: usize) -> Multis {
    let multi = if n > 1 && matches!(kernel, RowDot::Q8K(_)) {
        multi_lookup(ty, isa)
    } else {
        None
    };
    #[cfg(target_arch = "x86_64")]
    let multi_q8_0 = if n > 1 && ty == GgmlType::Q8_0 && matches!(kernel, RowDot::Q8_0(_)) {
        super::simple_x86::q8_0_multi_kernel(isa)
    } else {
        None
    };
    #[cfg(not(target_arch = "x86_64"))]
    let multi_q8_0: Option<Q8_0MultiDot> = None;
    #[cfg(target_arch = "x86_64")]
    let lanes_q8_0 = if n >= q8_0_lanes_min_rows() && multi_q8_0.is_some() {
        super::q8_0_lanes_x86::kernel(isa)
    } else {
        None
    };
    #[cfg(not(target_arch = "x86_64"))]
    let lanes_q8_0: Option<LanesDot> = None;
    #[cfg(target_arch = "x86_64")]
    let multi_f32 = if n > 1 && matches!(kernel, RowDot::F32(_)) {
        super::simple_x86::float_multi_kernel(ty, isa)
    } else {
        None
    };
    #[cfg(not(target_arch = "x86_64"))]
    let multi_f32: Option<FloatMultiDot> = None;
    (multi, multi_q8_0, multi_f32, lanes_q8_0)
}

/// Several products of one weight type over the same `n` activation rows (`xs`, `cols` values
/// each): `ys[i] = xs · W_iᵀ` for `ws[i] = (bytes, rows)`. The activations are quantized (and
/// repacked for the multi-row kernel) once for all of them; each product then runs as
/// [`matmul`] would, so every output is bit-identical to [`matmul`]'s (and each row to
/// [`matvec`]'s). Types whose large batches take a tile GEMM (Q4_K, IQ2_XXS) and single rows
/// run product by product.
pub fn matmul_many(
    ty: GgmlType,
    ws: &[(&[u8], usize)],
    cols: usize,
    xs: &[f32],
    n: usize,
    ys: &mut [&mut [f32]],
) -> Result<(), KernelError> {
    if ws.len() != ys.len() {
        return Err(KernelError::BadLength {
            what: "outputs",
            expected: ws.len(),
            got: ys.len(),
        });
    }
    if n <= 1 || ws.len() <= 1 || matches!(ty, GgmlType::Q4K | GgmlType::IQ2XXS) {
        for (&(w, rows), y) in ws.iter().zip(ys.iter_mut()) {
            matmul(ty, w, rows, cols, xs, n, y)?;
        }
        return Ok(());
    }
    let mut checked = Vec::with_capacity(ws.len());
    for (&(w, rows), y) in ws.iter().zip(ys.iter()) {
        checked.push(check(ty, w, rows, cols, xs.len(), y.len(), n)?);
    }
    let isa = Isa::active();
    let kernel = checked[0].0;
    let multis = multis_at(isa, kernel, ty, n);
    let prep = Prepared::new(isa, kernel, multis, xs, cols, n);
    for (((_, shape), &(w, rows)), y) in checked.into_iter().zip(ws).zip(ys.iter_mut()) {
        if rows == 0 {
            continue;
        }
        if shape.row_bytes == 0 {
            y.fill(0.0);
            continue;
        }
        run_prepared(kernel, multis, &prep, shape, w, rows, n, y);
    }
    Ok(())
}

/// The multi-row kernels [`run_matmul`] may use: Q8_K-activation, Q8_0 (≤ 4 rows), float, and
/// Q8_0 lane groups (16 rows per pass).
type Multis = (
    Option<Multi>,
    Option<Q8_0MultiDot>,
    Option<FloatMultiDot>,
    Option<LanesDot>,
);

#[allow(clippy::too_many_arguments)]
fn run_matmul(
    isa: Isa,
    kernel: RowDot,
    multis: Multis,
    shape: Shape,
    w: &[u8],
    rows: usize,
    cols: usize,
    xs: &[f32],
    n: usize,
    ys: &mut [f32],
) {
    if rows == 0 || n == 0 {
        return;
    }
    if n == 1 {
        return run_matvec(isa, kernel, shape, w, cols, xs, ys);
    }
    let rb = shape.row_bytes;
    if rb == 0 {
        ys.fill(0.0);
        return;
    }
    let prep = Prepared::new(isa, kernel, multis, xs, cols, n);
    run_prepared(kernel, multis, &prep, shape, w, rows, n, ys);
}

/// Q8_0 rows for the lane kernel: the kernels, the repacked groups, the groups, and the rows
/// they cover.
#[cfg(target_arch = "x86_64")]
type LaneRows = (
    (LanesDot, Option<super::q8_0_lanes_x86::LanesPairDot>),
    Vec<super::q8_0_lanes_x86::LaneBlock>,
    Vec<super::q8_0_lanes_x86::LaneGroup>,
    usize,
);
#[cfg(not(target_arch = "x86_64"))]
type LaneRows = ();

/// The activation rows of a multi-row product, quantized and put in the multi-row kernel's
/// form once (for one weight or several of the same type).
struct Prepared {
    acts: Acts,
    reformed: Option<Vec<BlockQ8K>>,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    lanes: Option<LaneRows>,
}

impl Prepared {
    fn new(
        isa: Isa,
        kernel: RowDot,
        multis: Multis,
        xs: &[f32],
        cols: usize,
        n: usize,
    ) -> Prepared {
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
        let (multi, _, _, lanes_q8_0) = multis;
        #[cfg(not(target_arch = "x86_64"))]
        let _ = isa;
        let acts = Acts::quantize(kernel, xs, cols, n);
        // The multi-row kernel's activation rows, in the form it takes them.
        #[cfg(target_arch = "x86_64")]
        let reformed = match (multi, &acts) {
            (Some(m), Acts::Q8K(q, _)) => match m.form {
                ActForm::Plain => None,
                ActForm::Offset => Some(super::iquants_avx512::offset_activations(q)),
                ActForm::Grouped => Some(super::kquants_multi_x86::grouped_activations(q, false)),
                ActForm::GroupedOffset => {
                    Some(super::kquants_multi_x86::grouped_activations(q, true))
                }
            },
            _ => None,
        };
        #[cfg(not(target_arch = "x86_64"))]
        let reformed: Option<Vec<BlockQ8K>> = None;
        // Q8_0 rows for the lane kernel: groups of 16, and a last group of 9-15 rows, or of 3-8
        // rows in 256-bit vectors (1-2 rows left over take the 4-row kernel).
        #[cfg(target_arch = "x86_64")]
        let lanes = match (lanes_q8_0, &acts) {
            (Some(f), Acts::Q8_0(q, per)) => {
                use super::q8_0_lanes_x86 as l;
                let groups = l::plan(n, q8_0_lanes_min_rows());
                let m = groups.last().map_or(0, |g| g.first + g.rows);
                let f = (f, l::pair_kernel(isa));
                Some((f, l::lane_blocks(q, *per, &groups), groups, m))
            }
            _ => None,
        };
        #[cfg(not(target_arch = "x86_64"))]
        let lanes: Option<LaneRows> = None;
        Prepared {
            acts,
            reformed,
            lanes,
        }
    }
}

/// [`run_matmul`] with its activations already prepared.
#[allow(clippy::too_many_arguments)]
fn run_prepared(
    kernel: RowDot,
    (multi, multi_q8_0, multi_f32, _): Multis,
    prep: &Prepared,
    shape: Shape,
    w: &[u8],
    rows: usize,
    n: usize,
    ys: &mut [f32],
) {
    let rb = shape.row_bytes;
    let Prepared {
        acts,
        reformed,
        lanes,
    } = prep;
    #[cfg(not(target_arch = "x86_64"))]
    let _ = lanes;
    let tile = (TILE_BYTES / rb).clamp(1, rows);
    // Each task owns whole weight rows, i.e. the columns `r` of `ys` it writes.
    let out = SharedOut::new(ys, rows);
    let work = |(task, ws): (usize, &[u8]), per: usize| {
        let r_task = task * per;
        for (t, wtile) in ws.chunks(tile * rb).enumerate() {
            let r_tile = r_task + t * tile;
            if let (Some(f), Acts::F32(x, per)) = (multi_f32, &acts) {
                let g = FLOAT_MULTI_ROWS;
                multi_row_tile::<_, MAX_GROUP>(f, x, *per, n, g, wtile, rb, r_tile, out);
                continue;
            }
            match (multi, multi_q8_0, &acts) {
                (Some(m), _, Acts::Q8K(q, per)) => {
                    let q = reformed.as_deref().unwrap_or(q);
                    let g = m.rows;
                    multi_row_tile::<_, MAX_GROUP>(m.f, q, *per, n, g, wtile, rb, r_tile, out);
                    continue;
                }
                (_, Some(f), Acts::Q8_0(q, per)) => {
                    #[cfg(target_arch = "x86_64")]
                    let j0 = match &lanes {
                        Some((lf, lq, groups, m)) => {
                            lanes_tile(*lf, lq, groups, *per, wtile, rb, r_tile, out);
                            *m
                        }
                        None => 0,
                    };
                    #[cfg(not(target_arch = "x86_64"))]
                    let j0 = 0;
                    let g = Q8_0_MULTI_ROWS;
                    let q = &q[j0 * per..];
                    let out = out.offset_rows(j0);
                    multi_row_tile::<_, MAX_GROUP>(f, q, *per, n - j0, g, wtile, rb, r_tile, out);
                    continue;
                }
                _ => {}
            }
            for j in 0..n {
                for (r, wr) in wtile.chunks_exact(rb).enumerate() {
                    // SAFETY: as above.
                    unsafe { out.set(j, r_tile + r, acts.dot(kernel, wr, j)) };
                }
            }
        }
    };
    if w.len().saturating_mul(n) < PARALLEL_MIN_BYTES {
        work((0, w), rows);
    } else {
        let per = rows_per_task(rows, rb);
        w.par_chunks(per * rb)
            .enumerate()
            .for_each(|task| work(task, per));
    }
}

/// A row threshold from the environment variable `var` (for A/B runs), else `default`; `0`
/// turns the path off.
#[cfg(target_arch = "x86_64")]
fn rows_threshold(var: &str, default: usize) -> usize {
    match std::env::var(var).map(|v| v.trim().parse::<usize>()) {
        Ok(Ok(0)) => usize::MAX,
        Ok(Ok(m)) => m,
        _ => default,
    }
}

/// Activation rows from which Q4_K products take the tile GEMM (`REDLITE_TILE_MIN`, default
/// 24; 0 turns it off).
#[cfg(target_arch = "x86_64")]
fn tile_min_rows() -> usize {
    static MIN: OnceLock<usize> = OnceLock::new();
    *MIN.get_or_init(|| rows_threshold("REDLITE_TILE_MIN", 24))
}

/// Activation rows from which IQ2_XXS products take the tile GEMM (`REDLITE_TILE_MIN_IQ2`,
/// default 56; 0 turns it off): its repack decodes the grid, so it needs more rows to pay.
#[cfg(target_arch = "x86_64")]
fn tile_min_rows_iq2() -> usize {
    static MIN: OnceLock<usize> = OnceLock::new();
    *MIN.get_or_init(|| rows_threshold("REDLITE_TILE_MIN_IQ2", 56))
}

/// Weight rows per tile of the tile GEMMs (one per i32 lane).
#[cfg(target_arch = "x86_64")]
const TILE_ROWS: usize = 16;
/// Activation rows per micro-kernel pass of the tile GEMMs.
#[cfg(target_arch = "x86_64")]
const TILE_ACT_ROWS: usize = 4;

/// `ys = X · Wᵀ` for Q4_K weights through the tile GEMM of `kquants_multi_x86` (see
/// [`run_tile_gemm`]). Bit-identical to `matvec` per row (see `q4k_tile_rows`).
#[cfg(target_arch = "x86_64")]
fn run_tile_gemm_q4k(
    q: &[BlockQ8K],
    per: usize,
    n: usize,
    w: &[u8],
    rows: usize,
    rb: usize,
    ys: &mut [f32],
) {
    use super::kquants_multi_x86 as k;
    let pairs: Vec<[i32; 4]> = q.iter().map(k::q8k_pair_sums).collect();
    let repack = |wt: &[u8], here: usize, tile: &mut Vec<k::Q4kTileBlock>| {
        k::q4k_tile_repack(wt, here, rb, per, tile)
    };
    let micro = |tile: &[k::Q4kTileBlock], j0: usize, out: &mut [[f32; TILE_ROWS]]| {
        let ys: [&[BlockQ8K]; TILE_ACT_ROWS] =
            core::array::from_fn(|j| q.get((j0 + j) * per..(j0 + j + 1) * per).unwrap_or(&[]));
        let ps: [&[[i32; 4]]; TILE_ACT_ROWS] =
            core::array::from_fn(|j| pairs.get((j0 + j) * per..(j0 + j + 1) * per).unwrap_or(&[]));
        let m = out.len();
        k::q4k_tile_rows(tile, &ys[..m], &ps[..m], out);
    };
    run_tile_gemm(n, w, rows, rb, ys, repack, micro);
}

/// `ys = X · Wᵀ` for IQ2_XXS weights through the tile GEMM of `iquants_avx512` (offset
/// activations). Bit-identical to `matvec` per row (see `iq2_xxs_tile_rows`).
#[cfg(target_arch = "x86_64")]
fn run_tile_gemm_iq2_xxs(
    q: &[BlockQ8K],
    per: usize,
    n: usize,
    w: &[u8],
    rows: usize,
    rb: usize,
    ys: &mut [f32],
) {
    use super::iquants_avx512 as k;
    let q = k::offset_activations(q);
    let repack = |wt: &[u8], here: usize, tile: &mut Vec<k::Iq2xxsTileBlock>| {
        k::iq2_xxs_tile_repack(wt, here, rb, per, tile)
    };
    let micro = |tile: &[k::Iq2xxsTileBlock], j0: usize, out: &mut [[f32; TILE_ROWS]]| {
        let ys: [&[BlockQ8K]; TILE_ACT_ROWS] =
            core::array::from_fn(|j| q.get((j0 + j) * per..(j0 + j + 1) * per).unwrap_or(&[]));
        let m = out.len();
        k::iq2_xxs_tile_rows(tile, &ys[..m], out);
    };
    run_tile_gemm(n, w, rows, rb, ys, repack, micro);
}

/// A tile GEMM: each task owns whole tiles of 16 weight rows, `repack`s a tile once (lane =
/// weight row) and runs `micro` over every activation row against it, four at a time
/// (`micro(tile, j0, out)`: rows `j0..j0 + out.len()`, `out[j][r]` = weight row `r`).
#[cfg(target_arch = "x86_64")]
fn run_tile_gemm<T: Send>(
    n: usize,
    w: &[u8],
    rows: usize,
    rb: usize,
    ys: &mut [f32],
    repack: impl Fn(&[u8], usize, &mut Vec<T>) + Sync,
    micro: impl Fn(&[T], usize, &mut [[f32; TILE_ROWS]]) + Sync,
) {
    let out = SharedOut::new(ys, rows);
    let per_task = rows_per_task(rows, rb).next_multiple_of(TILE_ROWS);
    let work = |(task, ws): (usize, &[u8])| {
        let mut tile = Vec::new();
        let mut res = [[0.0f32; TILE_ROWS]; TILE_ACT_ROWS];
        for (t, wt) in ws.chunks(TILE_ROWS * rb).enumerate() {
            let r0 = task * per_task + t * TILE_ROWS;
            let here = wt.len() / rb;
            repack(wt, here, &mut tile);
            let mut j0 = 0;
            while j0 < n {
                let m = TILE_ACT_ROWS.min(n - j0);
                micro(&tile, j0, &mut res[..m]);
                for (jj, row) in res[..m].iter().enumerate() {
                    // SAFETY: this task owns weight rows r0..r0 + here; j0 + jj < n.
                    unsafe { out.set_run(j0 + jj, r0, &row[..here]) };
                }
                j0 += m;
            }
        }
    };
    if w.len().saturating_mul(n) < PARALLEL_MIN_BYTES {
        work((0, w));
    } else {
        w.par_chunks(per_task * rb).enumerate().for_each(work);
    }
}

/// The largest activation-row group of any multi-row kernel.
const MAX_GROUP: usize = 16;

/// One tile of weight rows (first row `r_tile`) against all `n` activation rows through a
/// multi-row kernel: groups of up to `group` (≤ `G`) activation rows per weight-row pass.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn multi_row_tile<B, const G: usize>(
    multi: fn(&[u8], &[&[B]], &mut [f32]),
    q: &[B],
    per: usize,
    n: usize,
    group: usize,
    wtile: &[u8],
    rb: usize,
    r_tile: usize,
    out: SharedOut,
) {
    let mut j0 = 0;
    while j0 < n {
        let m = group.min(G).min(n - j0);
        let mut group: [&[B]; G] = [&[]; G];
        for (k, g) in group[..m].iter_mut().enumerate() {
            *g = &q[(j0 + k) * per..(j0 + k + 1) * per];
        }
        let mut buf = [0.0f32; G];
        for (r, wr) in wtile.chunks_exact(rb).enumerate() {
            multi(wr, &group[..m], &mut buf[..m]);
            for (k, &v) in buf[..m].iter().enumerate() {
                // SAFETY: the caller's task owns weight rows r_tile.. of this tile; j0 + k < n.
                unsafe { out.set(j0 + k, r_tile + r, v) };
            }
        }
        j0 += m;
    }
}

/// The rows of a Q8_0 product in the lane groups `groups` through the lane kernel `f` (`lq`: the
/// groups' repacked rows, `per` blocks each), for the weight rows of `wtile` (`r_tile..`).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn lanes_tile(
    (f, pair): (LanesDot, Option<super::q8_0_lanes_x86::LanesPairDot>),
    lq: &[super::q8_0_lanes_x86::LaneBlock],
    groups: &[super::q8_0_lanes_x86::LaneGroup],
    per: usize,
    wtile: &[u8],
    rb: usize,
    r_tile: usize,
    out: SharedOut,
) {
    let nw = wtile.len() / rb;
    let per = per.max(1);
    let mut buf = vec![[0.0f32; LANES]; nw];
    let mut buf2 = Vec::new();
    // Row by row of the output: runs of consecutive addresses (the output rows are often a
    // multiple of 4 KiB apart, so a lane-by-lane walk thrashes one L1 set).
    let store = |group: &super::q8_0_lanes_x86::LaneGroup, buf: &[[f32; LANES]]| {
        for k in 0..group.rows {
            // SAFETY: the caller's task owns weight rows r_tile..r_tile + nw of this tile; the
            // row < n.
            let dst = unsafe { out.run_ptr(group.first + k, r_tile, nw) };
            for (r, v) in buf.iter().enumerate() {
                // SAFETY: r < nw, within the run.
                unsafe { *dst.add(r) = v[k] };
            }
        }
    };
    let mut g = 0;
    while g < groups.len() {
        let ys = &lq[g * per..(g + 1) * per];
        match (pair, groups.get(g + 1)) {
            (Some(f2), Some(next)) if !groups[g].narrow && !next.narrow => {
                // Two wide groups against each weight row at once.
                buf2.resize(nw, [0.0f32; LANES]);
                let ys2 = &lq[(g + 1) * per..(g + 2) * per];
                f2(wtile, rb, ys, ys2, &mut buf, &mut buf2);
                store(&groups[g], &buf);
                store(next, &buf2);
                g += 2;
            }
            _ => {
                f(wtile, rb, ys, groups[g].narrow, &mut buf);
                store(&groups[g], &buf);
                g += 1;
            }
        }
    }
}

/// The output of [`run_matmul`], `n` rows of `rows` values, written by several tasks at once:
/// each task writes only the columns (weight rows) it owns, so no element has two writers.
#[derive(Clone, Copy)]
struct SharedOut {
    ptr: *mut f32,
    rows: usize,
    len: usize,
}

// SAFETY: the tasks write disjoint elements (see `set`), and the buffer outlives them (it is
// borrowed mutably for the whole product).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    fn new(ys: &mut [f32], rows: usize) -> SharedOut {
        SharedOut {
            ptr: ys.as_mut_ptr(),
            rows,
            len: ys.len(),
        }
    }

    /// `ys[j·rows + r] = v`.
    ///
    /// # Safety
    /// No other task may write element `(j, r)`, and the buffer must still be borrowed.
    #[inline(always)]
    unsafe fn set(&self, j: usize, r: usize, v: f32) {
        let at = j * self.rows + r;
        debug_assert!(r < self.rows && at < self.len);
        *self.ptr.add(at) = v;
    }

    /// `ys[j·rows + r0 + i] = vs[i]` for every `i` (one copy of consecutive elements).
    ///
    /// # Safety
    /// As [`SharedOut::set`], for each of the elements.
    #[inline(always)]
    unsafe fn set_run(&self, j: usize, r0: usize, vs: &[f32]) {
        let at = j * self.rows + r0;
        debug_assert!(r0 + vs.len() <= self.rows && at + vs.len() <= self.len);
        std::ptr::copy_nonoverlapping(vs.as_ptr(), self.ptr.add(at), vs.len());
    }

    /// Where `ys[j·rows + r0 ..][..len]` starts, for a loop that writes the run itself (a
    /// local pointer: no reload of `self` after each store, which may alias it).
    ///
    /// # Safety
    /// As [`SharedOut::set`], for each element of the run.
    #[inline(always)]
    unsafe fn run_ptr(&self, j: usize, r0: usize, len: usize) -> *mut f32 {
        let at = j * self.rows + r0;
        debug_assert!(r0 + len <= self.rows && at + len <= self.len);
        self.ptr.add(at)
    }

    /// The same output from row `j0` on (row `j` of the result is row `j0 + j` here).
    fn offset_rows(self, j0: usize) -> SharedOut {
        let at = (j0 * self.rows).min(self.len);
        SharedOut {
            // SAFETY: `at` is within the buffer (or one past its end).
            ptr: unsafe { self.ptr.add(at) },
            rows: self.rows,
            len: self.len - at,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_shapes_and_types() {
        let w = vec![0u8; 144 * 2];
        let x = vec![0.0f32; 256];
        let mut y = vec![0.0f32; 2];
        assert!(matvec(GgmlType::Q4K, &w, 2, 256, &x, &mut y).is_ok());
        assert_eq!(
            matvec(GgmlType::Q4K, &w, 2, 128, &x[..128], &mut y),
            Err(KernelError::BadCols {
                ty: GgmlType::Q4K,
                cols: 128,
                block: 256
            })
        );
        assert!(matches!(
            matvec(GgmlType::Q4K, &w[..100], 2, 256, &x, &mut y),
            Err(KernelError::BadLength { .. })
        ));
        assert!(matches!(
            matvec(GgmlType::Q4K, &w, 2, 256, &x, &mut y[..1]),
            Err(KernelError::BadLength { .. })
        ));
        assert_eq!(
            matvec(GgmlType::Q8K, &w, 1, 256, &x, &mut y[..1]),
            Err(KernelError::Unsupported(GgmlType::Q8K))
        );
        assert!(matches!(
            matvec(GgmlType::Q4K, &w, usize::MAX, 256, &x, &mut y),
            Err(KernelError::Overflow { .. })
        ));
        let mut ys = vec![0.0f32; 4];
        assert!(matches!(
            matmul(GgmlType::Q4K, &w, 2, 256, &x, 2, &mut ys),
            Err(KernelError::BadLength { .. })
        ));
    }

    #[test]
    fn empty_products() {
        let mut y: Vec<f32> = vec![];
        assert!(matvec(GgmlType::F32, &[], 0, 8, &[0.0; 8], &mut y).is_ok());
        assert!(matmul(GgmlType::F32, &[], 0, 8, &[0.0; 16], 2, &mut y).is_ok());
    }

    #[test]
    fn physical_cores_is_sane() {
        let p = physical_cores();
        assert!(p >= 1);
        assert!(
            p <= std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        );
    }
}
