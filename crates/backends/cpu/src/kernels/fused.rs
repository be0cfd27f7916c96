//! Many independent matrix-vector products in one parallel region.
//!
//! A decode step of an MoE layer is a handful of small products (10 experts × gate, up, down);
//! running each through [`super::driver::matvec`] pays the thread hand-off per product. Here the
//! rows of all products are cut into tasks of similar weight bytes and run in one rayon region.
//! Activations shared by several products (gate and up of every expert read the same `x`) are
//! quantized once. Each output row is computed by the same row kernel on the same quantized
//! activations as `matvec`, so results are bit-identical to it.

use redlite_gguf::GgmlType;

use super::driver;
use super::q8::{quantize_row_q8_0, quantize_row_q8_k, BlockQ8K, BlockQ8_0, QK8_0, QK_K};
use super::tiles_x86::{pair_sums, DecodeTiles, TILE_ROWS};
#[cfg(target_arch = "x86_64")]
use super::tiles_x86::{Q80Act, Q80Tiles};
use super::{KernelError, RowDot, RowsDot};

/// One product `y = W · x`: `w` is `rows` rows of `cols` values of type `ty` (raw GGUF bytes).
#[derive(Clone, Copy)]
pub struct Product<'a> {
    pub ty: GgmlType,
    pub w: &'a [u8],
    pub rows: usize,
    pub cols: usize,
    /// Index into the `inputs` slice given to [`matvec_batch`].
    pub input: usize,
    /// The same matrix repacked as tiles (small models), computed through those instead.
    pub tiles: Option<&'a DecodeTiles>,
}

/// Weight bytes per task for a batch of `total` weight bytes: about 4 tasks per thread (as
/// [`driver`]'s one-product split), at least 64 KiB; `REDLITE_FUSED_TASK_KB` fixes it instead.
/// Large batches gain from long tasks: the full-size layout's decode (MoE batches of 3–7 MB,
/// projections of up to 15 MB) ran 11.9 tok/s at a fixed 64 KiB, 13.2–13.3 at 256 KiB–1 MiB
/// (2 threads, 4 alternating rounds): each task restarts the hardware prefetcher's streams and
/// pays the hand-off.
fn task_bytes(total: usize) -> usize {
    static KB: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let fixed = KB.get_or_init(|| {
        std::env::var("REDLITE_FUSED_TASK_KB")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .filter(|&kb: &usize| kb > 0)
    });
    match fixed {
        Some(kb) => kb * 1024,
        None => total
            .div_ceil(4 * driver::num_threads().max(1))
            .max(MIN_TASK_BYTES),
    }
}

/// The smallest task of [`task_bytes`].
const MIN_TASK_BYTES: usize = 64 * 1024;

/// A product's row kernel and the activations it reads.
#[derive(Clone, Copy)]
enum Kernel {
    /// A row kernel of the dispatch table, on the input quantized to its format.
    Row(RowDot),
    /// The rows kernel of the dispatch table's Q8_K row kernel ([`super::lookup_rows`]): a
    /// task's rows in one call, on the input quantized to Q8_K.
    Rows(RowsDot),
    /// The product's [`DecodeTiles`] on the input quantized to Q8_K (and its sub-block sums).
    Tiles,
    /// The product's Q8_0 [`DecodeTiles`] on the input quantized to Q8_0.
    Q8_0Tiles,
    /// An IQ2_XXS kernel on Q8_K activations reordered by `reorder` (the element-major or the
    /// interleaved order of `iquants_avx512`).
    Iq2Reordered {
        f: fn(w: &[u8], x: &[BlockQ8K]) -> f32,
        /// The same kernel over a task's rows in one call, where there is one.
        rows: Option<RowsDot>,
        reorder: fn(&[BlockQ8K]) -> Vec<BlockQ8K>,
    },
}

/// The kernel to run for `kernel` (the dispatch table's entry for `ty`) on activations that
/// [`quantize_row_q8_k`] made here: where the entry is the AVX-512 IQ2_XXS kernel, a variant on
/// reordered activations that skips the check for −128 (that quantizer never writes it): the
/// element-major kernel where the CPU has GFNI (6.8–7.1 ns per block on 2048-column rows), else
/// the interleaved one (9.6; the dispatch entry: 10.6). Same results bit for bit.
fn decode_kernel(ty: GgmlType, kernel: RowDot, cols: usize) -> Kernel {
    #[cfg(target_arch = "x86_64")]
    if matches!(kernel, RowDot::Q8K(_))
        && ty == GgmlType::IQ2XXS
        && super::Isa::active() == super::Isa::Avx512
    {
        use super::iquants_avx512 as k;
        if let Some(f) = k::iq2_xxs_element_major_kernel() {
            let rows = k::iq2_xxs_element_major_rows_kernel();
            let reorder = k::element_major_q8k;
            return Kernel::Iq2Reordered { f, rows, reorder };
        }
        if let Some(f) = k::iq2_xxs_interleaved_kernel() {
            let reorder = k::interleave_q8k_for_iq2_xxs;
            return Kernel::Iq2Reordered {
                f,
                rows: None,
                reorder,
            };
        }
    }
    if let (RowDot::Q8K(_), Some(f)) = (
        kernel,
        super::lookup_rows_for(ty, super::Isa::active(), cols),
    ) {
        return Kernel::Rows(f);
    }
    Kernel::Row(kernel)
}

/// `outputs[i] = W_i · inputs[products[i].input]` for every product, in one parallel region.
pub fn matvec_batch(
    products: &[Product],
    inputs: &[&[f32]],
    outputs: &mut [Vec<f32>],
) -> Result<(), KernelError> {
    for (o, p) in outputs.iter_mut().zip(products) {
        o.clear();
        o.resize(p.rows, 0.0);
    }
    let mut outs: Vec<&mut [f32]> = outputs.iter_mut().map(|o| o.as_mut_slice()).collect();
    batch_into(products, inputs, &mut outs)
}

/// `y = W · x` for one product, into `y` (`rows` values): [`matvec_batch`] of one product
/// without an output vector of its own.
pub fn matvec_into(product: &Product, x: &[f32], y: &mut [f32]) -> Result<(), KernelError> {
    batch_into(std::slice::from_ref(product), &[x], &mut [y])
}

/// [`matvec_batch`] into slices of exactly each product's rows.
fn batch_into(
    products: &[Product],
    inputs: &[&[f32]],
    outputs: &mut [&mut [f32]],
) -> Result<(), KernelError> {
    // Kernel and row size per product, with exactly `matvec`'s checks.
    let mut kernels = Vec::with_capacity(products.len());
    for p in products {
        let x = inputs.get(p.input).ok_or(KernelError::BadLength {
            what: "input index",
            expected: inputs.len(),
            got: p.input,
        })?;
        let (kernel, shape) = driver::check(p.ty, p.w, p.rows, p.cols, x.len(), p.rows, 1)?;
        let kernel = match p.tiles {
            Some(t) if t.q8_0().is_some() => Kernel::Q8_0Tiles,
            Some(_) => Kernel::Tiles,
            None => decode_kernel(p.ty, kernel, p.cols),
        };
        kernels.push((kernel, shape.row_bytes));
    }
    if outputs.len() != products.len() {
        return Err(KernelError::BadLength {
            what: "outputs",
            expected: products.len(),
            got: outputs.len(),
        });
    }
    for (o, p) in outputs.iter().zip(products) {
        if o.len() != p.rows {
            return Err(KernelError::BadLength {
                what: "output rows",
                expected: p.rows,
                got: o.len(),
            });
        }
    }

    // Quantize each input once per activation format it is read in.
    let mut q8k: Vec<Option<Vec<BlockQ8K>>> = vec![None; inputs.len()];
    let mut q80: Vec<Option<Vec<BlockQ8_0>>> = vec![None; inputs.len()];
    let mut q8k_reordered: Vec<Option<Vec<BlockQ8K>>> = vec![None; inputs.len()];
    let mut pairs: Vec<Option<Vec<[i32; 4]>>> = vec![None; inputs.len()];
    for (p, (kernel, _)) in products.iter().zip(&kernels) {
        let x = inputs[p.input];
        let needs_q8k = matches!(
            kernel,
            Kernel::Row(RowDot::Q8K(_))
                | Kernel::Rows(_)
                | Kernel::Tiles
                | Kernel::Iq2Reordered { .. }
        );
        if needs_q8k && q8k[p.input].is_none() {
            let mut q = vec![BlockQ8K::ZERO; x.len() / QK_K];
            quantize_row_q8_k(x, &mut q);
            q8k[p.input] = Some(q);
        }
        match kernel {
            Kernel::Row(RowDot::Q8_0(_)) | Kernel::Q8_0Tiles if q80[p.input].is_none() => {
                let mut q = vec![BlockQ8_0::ZERO; x.len() / QK8_0];
                quantize_row_q8_0(x, &mut q);
                q80[p.input] = Some(q);
            }
            Kernel::Tiles
                if pairs[p.input].is_none() && p.tiles.is_some_and(|t| t.needs_pairs()) =>
            {
                pairs[p.input] = Some(pair_sums(q8k[p.input].as_deref().unwrap_or(&[])));
            }
            Kernel::Iq2Reordered { reorder, .. } if q8k_reordered[p.input].is_none() => {
                let q = q8k[p.input].as_deref().unwrap_or(&[]);
                q8k_reordered[p.input] = Some(reorder(q));
            }
            _ => {}
        }
    }
    // The Q8_0 tiles' view of each Q8_0 input (block sums and scales), once per input.
    #[cfg(target_arch = "x86_64")]
    let q80_acts: Vec<Option<Q80Act>> = q80.iter().map(|q| q.as_deref().map(Q80Act::new)).collect();
    // Tasks: (product, first row, its slice of the product's output), ≈ `task_bytes` of weights
    // each; every task writes its own rows in place.
    let weight_bytes: usize = products.iter().map(|p| p.w.len()).sum();
    let task_bytes = task_bytes(weight_bytes);
    let mut tasks: Vec<(usize, usize, &mut [f32])> = Vec::new();
    for (i, (o, (kernel, row_bytes))) in outputs.iter_mut().zip(&kernels).enumerate() {
        let mut per = (task_bytes / (*row_bytes).max(1)).max(1);
        if let Kernel::Tiles | Kernel::Q8_0Tiles = kernel {
            // Whole tile groups.
            per = per.next_multiple_of(TILE_ROWS);
        }
        for (c, rows) in o.chunks_mut(per).enumerate() {
            tasks.push((i, c * per, rows));
        }
    }
    let task = |(i, r0, ys): &mut (usize, usize, &mut [f32])| {
        let p = &products[*i];
        let (kernel, row_bytes) = kernels[*i];
        let x = inputs[p.input];
        if let Kernel::Iq2Reordered { rows: Some(f), .. } = kernel {
            // The task's rows in one call (2-block expert rows: 8.1 → 6.5 ns per block).
            let w = &p.w[*r0 * row_bytes..(*r0 + ys.len()) * row_bytes];
            f(
                w,
                row_bytes,
                q8k_reordered[p.input].as_deref().unwrap_or(&[]),
                ys,
            );
            return;
        }
        if let (Kernel::Tiles, Some(tiles)) = (kernel, p.tiles) {
            let q = q8k[p.input].as_deref().unwrap_or(&[]);
            let s = pairs[p.input].as_deref().unwrap_or(&[]);
            tiles.matvec_groups(*r0 / TILE_ROWS, q, s, ys);
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if let (Kernel::Q8_0Tiles, Some(tiles)) = (kernel, p.tiles.and_then(|t| t.q8_0())) {
            // Quantized above for every Q8_0-tile product's input.
            if let Some(act) = &q80_acts[p.input] {
                tiles.matmul_groups(*r0 / TILE_ROWS, &[act], &mut [&mut **ys]);
                return;
            }
        }
        if let Kernel::Rows(f) = kernel {
            let w = &p.w[*r0 * row_bytes..(*r0 + ys.len()) * row_bytes];
            f(w, row_bytes, q8k[p.input].as_deref().unwrap_or(&[]), ys);
            return;
        }
        for (r, y) in (*r0..).zip(ys.iter_mut()) {
            let w = &p.w[r * row_bytes..(r + 1) * row_bytes];
            // Every input a kernel reads was quantized to its format above.
            *y = match kernel {
                Kernel::Row(RowDot::Q8K(f)) => f(w, q8k[p.input].as_deref().unwrap_or(&[])),
                Kernel::Row(RowDot::Q8_0(f)) => f(w, q80[p.input].as_deref().unwrap_or(&[])),
                Kernel::Row(RowDot::F32(f)) => f(w, x),
                Kernel::Iq2Reordered { f, .. } => {
                    f(w, q8k_reordered[p.input].as_deref().unwrap_or(&[]))
                }
                Kernel::Rows(_) | Kernel::Tiles | Kernel::Q8_0Tiles => {
                    unreachable!("run above")
                }
            };
        }
    };
    // Small products (a tiny model's whole MoE) run on the calling thread: handing them to the
    // pool costs more than the work. Each task computes the same values either way.
    if weight_bytes < driver::matvec_parallel_min_bytes() {
        tasks.iter_mut().for_each(task);
    } else {
        crate::team::for_each_mut(&mut tasks, task);
    }
    Ok(())
}

/// `ys[i] = W_i · xs` for Q8_0 weights held as tiles, `n` activation rows (`xs`: `[n, cols]`,
/// `ys[i]`: `[n, rows_i]`, row-major), each weight's `cols` equal: the rows quantized to Q8_0
/// once, then tasks of whole tile groups, each over every row (each output bit-identical to
/// `matvec`'s, see [`Q80Tiles`]). `Ok(false)` (nothing done) unless every weight has Q8_0 tiles.
pub fn q8_0_tiles_matmul(
    ws: &[&DecodeTiles],
    xs: &[f32],
    n: usize,
    ys: &mut [&mut [f32]],
) -> Result<bool, KernelError> {
    #[cfg(target_arch = "x86_64")]
    {
        let tiles: Option<Vec<&Q80Tiles>> = ws.iter().map(|t| t.q8_0()).collect();
        let Some(tiles) = tiles else {
            return Ok(false);
        };
        q8_0_tiles_run(&tiles, xs, n, ys)?;
        Ok(true)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ws, xs, n, ys);
        Ok(false)
    }
}

/// One task of a multi-row tiled product ([`tile_tasks`]): job `job`'s weight rows from tile group
/// `g0`, against its token rows `tokens`, written into `outs` (one slice per token: that token's
/// outputs for the task's weight rows).
#[cfg(target_arch = "x86_64")]
struct TileTask<'o> {
    job: usize,
    g0: usize,
    tokens: std::ops::Range<usize>,
    outs: Vec<&'o mut [f32]>,
    work: usize,
}

/// Tasks for tiled products of several tokens: job `j` is a weight of `shapes[j] = (rows, blocks,
/// tokens)` whose output for token `t` is `outs[j][t]` (`rows` values). A task's work is its
/// weight bytes times its token quads (the kernel reads each weight block once for up to 4
/// tokens); tasks aim at about 4 a thread, at least [`MIN_TASK_BYTES`]. A job is cut into weight-row slices first (its
/// weights still read once), then into token slices of whole quads when its rows run out, so a
/// verify's small matrices over many tokens still spread over the threads; the tasks come
/// largest first, so the last ones to start are the shortest. Which task computes an output
/// never changes it.
#[cfg(target_arch = "x86_64")]
fn tile_tasks<'o>(
    shapes: &[(usize, usize, usize)],
    outs: Vec<Vec<&'o mut [f32]>>,
) -> Vec<TileTask<'o>> {
    let cost = |rows: usize, nb: usize, toks: usize| rows * nb * 34 * toks.div_ceil(4);
    let total: usize = shapes.iter().map(|&(r, nb, t)| cost(r, nb, t)).sum();
    let target = total
        .div_ceil(4 * driver::num_threads().max(1))
        .max(MIN_TASK_BYTES);
    let mut tasks = Vec::new();
    for (j, (&(rows, nb, toks), out)) in shapes.iter().zip(outs).enumerate() {
        if toks == 0 || rows == 0 {
            continue;
        }
        let parts = cost(rows, nb, toks).div_ceil(target).max(1);
        let row_parts = parts.min(rows.div_ceil(2 * TILE_ROWS));
        let per = rows.div_ceil(row_parts).next_multiple_of(TILE_ROWS);
        let tok_parts = parts.div_ceil(row_parts).min(toks.div_ceil(4));
        let tper = toks.div_ceil(tok_parts).next_multiple_of(4);
        let first = tasks.len();
        for t0 in (0..toks).step_by(tper) {
            let t1 = (t0 + tper).min(toks);
            for r0 in (0..rows).step_by(per) {
                tasks.push(TileTask {
                    job: j,
                    g0: r0 / TILE_ROWS,
                    tokens: t0..t1,
                    outs: Vec::with_capacity(t1 - t0),
                    work: cost(per.min(rows - r0), nb, t1 - t0),
                });
            }
        }
        let row_chunks = rows.div_ceil(per);
        for (t, row) in out.into_iter().enumerate() {
            let base = first + (t / tper) * row_chunks;
            for (c, part) in row.chunks_mut(per).enumerate() {
                tasks[base + c].outs.push(part);
            }
        }
    }
    tasks.sort_by_key(|t| std::cmp::Reverse(t.work));
    tasks
}

/// The products of `tiles[j]` against the activation rows `acts(j)` into `outs[j][t]` (one
/// slice a row), as the tasks of [`tile_tasks`]: in one parallel region, or on this thread when
/// `serial` (too little work to hand over).
#[cfg(target_arch = "x86_64")]
fn run_tile_products<'a>(
    tiles: &[&Q80Tiles],
    acts: impl Fn(usize) -> &'a [&'a Q80Act<'a>] + Sync + Send,
    outs: Vec<Vec<&mut [f32]>>,
    serial: bool,
) {
    let shapes: Vec<(usize, usize, usize)> = tiles
        .iter()
        .enumerate()
        .map(|(j, t)| (t.rows(), t.blocks(), acts(j).len()))
        .collect();
    let mut tasks = tile_tasks(&shapes, outs);
    let run = |task: &mut TileTask| {
        let a = &acts(task.job)[task.tokens.clone()];
        tiles[task.job].matmul_groups(task.g0, a, &mut task.outs);
    };
    if serial {
        tasks.iter_mut().for_each(run);
    } else {
        crate::team::for_each_mut(&mut tasks, run);
    }
}

/// Each row `x(i)` (`n` rows of `nb` blocks) quantized to Q8_0 (`team::map_rows`: in parallel for
/// long runs; each row as alone).
#[cfg(target_arch = "x86_64")]
pub(crate) fn quantize_rows_q8_0<'x>(
    n: usize,
    nb: usize,
    x: impl Fn(usize) -> &'x [f32] + Sync + Send,
) -> Vec<Vec<BlockQ8_0>> {
    let quantize = |i: usize| {
        let mut q = vec![BlockQ8_0::ZERO; nb];
        quantize_row_q8_0(x(i), &mut q);
        q
    };
    crate::team::map_rows(n, quantize)
}

/// Products of Q8_0 tiles, each over its own activation rows, in one parallel region (a short
/// run's feed-forwards, [`crate::CpuBackend`]'s `moe_rows`): job `j` is `jobs[j].0` against the
/// rows `jobs[j].1` (indices into `acts`), into `outs[j]` (`[those rows][weight rows]`). A task
/// is whole tile groups of one weight over all its rows, so each weight block is read once for
/// every ≤ 4 rows; each output is `matvec`'s bit for bit ([`Q80Tiles`]).
#[cfg(target_arch = "x86_64")]
pub fn q8_0_tiles_jobs(acts: &[Q80Act], jobs: &[(&Q80Tiles, &[usize])], outs: &mut [Vec<f32>]) {
    assert_eq!(jobs.len(), outs.len(), "one output per job");
    for (o, (t, rows)) in outs.iter_mut().zip(jobs) {
        o.clear();
        o.resize(rows.len() * t.rows(), 0.0);
    }
    let job_acts: Vec<Vec<&Q80Act>> = jobs
        .iter()
        .map(|(_, rows)| rows.iter().map(|&i| &acts[i]).collect())
        .collect();
    let weight_bytes: usize = jobs.iter().map(|(t, _)| t.rows() * t.blocks() * 34).sum();
    let tiles: Vec<&Q80Tiles> = jobs.iter().map(|(t, _)| *t).collect();
    let per_token = outs
        .iter_mut()
        .zip(&tiles)
        .map(|(o, t)| o.chunks_mut(t.rows().max(1)).collect())
        .collect();
    let serial = weight_bytes < driver::matvec_parallel_min_bytes();
    run_tile_products(&tiles, |j| &job_acts[j], per_token, serial);
}

/// `W_i · x` for every row of `xs` through the Q8_0 tiles of several weights of the same width
/// (a run's projections, or the lm_head alone): the rows quantized once, every product in one
/// parallel region, each row's output its own vector written in place (no gathered input or
/// output buffer: a verify pass's lm_head writes 64 rows of the vocabulary's logits);
/// `out[i][t]` = `ts[i] · xs[t]`, as [`q8_0_tiles_matmul`] computes it.
#[cfg(target_arch = "x86_64")]
pub fn q8_0_tiles_rows_many(
    ts: &[&Q80Tiles],
    xs: &[Vec<f32>],
) -> Result<Vec<Vec<Vec<f32>>>, KernelError> {
    let Some(nb) = ts.first().map(|t| t.blocks()) else {
        return Ok(Vec::new());
    };
    let n = xs.len();
    let cols = nb * QK8_0;
    if let Some(t) = ts.iter().find(|t| t.blocks() != nb) {
        return Err(KernelError::BadLength {
            what: "weight width",
            expected: cols,
            got: t.blocks() * QK8_0,
        });
    }
    if let Some(x) = xs.iter().find(|x| x.len() != cols) {
        return Err(KernelError::BadLength {
            what: "activation row",
            expected: cols,
            got: x.len(),
        });
    }
    let q = quantize_rows_q8_0(n, nb, |i| &xs[i]);
    let acts: Vec<Q80Act> = q.iter().map(|q| Q80Act::new(q)).collect();
    let acts: Vec<&Q80Act> = acts.iter().collect();
    // One zeroed allocation a row (`vec![row; n]` would clone a zeroed row n times: a copy).
    let mut ys: Vec<Vec<Vec<f32>>> = ts
        .iter()
        .map(|t| (0..n).map(|_| vec![0.0f32; t.rows()]).collect())
        .collect();
    let per_token = ys
        .iter_mut()
        .map(|y| y.iter_mut().map(|r| r.as_mut_slice()).collect())
        .collect();
    let bytes: usize = ts.iter().map(|t| t.rows() * nb * 34).sum();
    let serial = bytes * n.min(4) < driver::matvec_parallel_min_bytes();
    run_tile_products(ts, |_| &acts, per_token, serial);
    Ok(ys)
}

#[cfg(target_arch = "x86_64")]
fn q8_0_tiles_run(
    tiles: &[&Q80Tiles],
    xs: &[f32],
    n: usize,
    ys: &mut [&mut [f32]],
) -> Result<(), KernelError> {
    let Some(nb) = tiles.first().map(|t| t.blocks()) else {
        return Ok(());
    };
    let cols = nb * QK8_0;
    if tiles.iter().any(|t| t.blocks() != nb) || xs.len() != n * cols {
        return Err(KernelError::BadLength {
            what: "activations",
            expected: n * cols,
            got: xs.len(),
        });
    }
    if ys.len() != tiles.len() {
        return Err(KernelError::BadLength {
            what: "outputs",
            expected: tiles.len(),
            got: ys.len(),
        });
    }
    for (y, t) in ys.iter().zip(tiles) {
        if y.len() != n * t.rows() {
            return Err(KernelError::BadLength {
                what: "output rows",
                expected: n * t.rows(),
                got: y.len(),
            });
        }
    }
    if n == 0 {
        return Ok(());
    }
    let q = quantize_rows_q8_0(n, nb, |i| &xs[i * cols..(i + 1) * cols]);
    let acts: Vec<Q80Act> = q.iter().map(|q| Q80Act::new(q)).collect();
    let acts: Vec<&Q80Act> = acts.iter().collect();
    let weight_bytes: usize = tiles.iter().map(|t| t.rows() * nb * 34).sum();
    let per_token = ys
        .iter_mut()
        .zip(tiles)
        .map(|(y, t)| y.chunks_mut(t.rows().max(1)).collect())
        .collect();
    let serial = weight_bytes * n.min(4) < driver::matvec_parallel_min_bytes();
    run_tile_products(tiles, |_| &acts, per_token, serial);
    Ok(())
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::kernels::selftest::{random_activations, random_weights};
    use redlite_gguf::quant::GgmlType;

    /// Each weight's row outputs, written in place, are the one-row `matvec`'s bit for bit (two
    /// weights of different heights sharing the rows, partial tile groups, runs below and above
    /// the 4-row quads).
    #[test]
    fn tiles_rows_many_match_matvec_bit_for_bit() {
        if !Q80Tiles::supported() {
            return;
        }
        let cols = 384;
        let shapes = [(37, cols), (160, cols)];
        let ws: Vec<Vec<u8>> = shapes
            .iter()
            .map(|&(r, c)| random_weights(GgmlType::Q8_0, r, c, (r * 31 + c) as u64))
            .collect();
        let tiles: Vec<Q80Tiles> = ws
            .iter()
            .zip(&shapes)
            .map(|(w, &(r, c))| Q80Tiles::repack(w, r, c).unwrap())
            .collect();
        let ts: Vec<&Q80Tiles> = tiles.iter().collect();
        for n in [1, 2, 5, 9, 33] {
            let xs: Vec<Vec<f32>> = (0..n)
                .map(|j| random_activations(cols, (j * 7 + 3) as u64))
                .collect();
            let got = q8_0_tiles_rows_many(&ts, &xs).unwrap();
            assert_eq!(got.len(), ts.len());
            for ((w, &(rows, c)), g) in ws.iter().zip(&shapes).zip(&got) {
                assert_eq!(g.len(), n);
                for (x, row) in xs.iter().zip(g) {
                    let mut want = vec![0.0f32; rows];
                    crate::kernels::matvec(GgmlType::Q8_0, w, rows, c, x, &mut want).unwrap();
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(row), bits(&want), "{rows}x{c} n {n}");
                }
            }
        }
        // Weights of different widths are refused, not mixed.
        let narrow = random_weights(GgmlType::Q8_0, 16, 64, 5);
        let nt = Q80Tiles::repack(&narrow, 16, 64).unwrap();
        let xs = vec![random_activations(cols, 1); 2];
        assert!(q8_0_tiles_rows_many(&[ts[0], &nt], &xs).is_err());
    }
}
