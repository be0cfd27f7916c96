//! Many independent matrix-vector products in one parallel region.
//!
//! A decode step of an MoE layer is a handful of small products (10 experts × gate, up, down);
//! running each through [`super::driver::matvec`] pays the thread hand-off per product. Here the
//! rows of all products are cut into tasks of similar weight bytes and run in one rayon region.
//! Activations shared by several products (gate and up of every expert read the same `x`) are
//! quantized once. Each output row is computed by the same row kernel on the same quantized
//! activations as `matvec`, so results are bit-identical to it.

use rayon::prelude::*;
use redlite_gguf::GgmlType;

use super::driver;
use super::q8::{quantize_row_q8_0, quantize_row_q8_k, BlockQ8K, BlockQ8_0, QK8_0, QK_K};
use super::{KernelError, RowDot};

/// One product `y = W · x`: `w` is `rows` rows of `cols` values of type `ty` (raw GGUF bytes).
#[derive(Clone, Copy)]
pub struct Product<'a> {
    pub ty: GgmlType,
    pub w: &'a [u8],
    pub rows: usize,
    pub cols: usize,
    /// Index into the `inputs` slice given to [`matvec_batch`].
    pub input: usize,
}

/// Weight bytes per task: large enough to amortise the hand-off, small enough to balance.
const TASK_BYTES: usize = 64 * 1024;

/// The kernel to run for `kernel` (the dispatch table's entry for `ty`) on activations that
/// [`quantize_row_q8_k`] made here: where the entry is the AVX-512 IQ2_XXS kernel, its twin that
/// skips the check for −128 (which that quantizer never writes). Same results either way.
fn trusted_twin(ty: GgmlType, kernel: RowDot) -> RowDot {
    #[cfg(target_arch = "x86_64")]
    if matches!(kernel, RowDot::Q8K(_)) && super::Isa::active() == super::Isa::Avx512 {
        if let Some(f) = super::iquants_avx512::kernel_without_minus_128(ty) {
            return RowDot::Q8K(f);
        }
    }
    let _ = ty;
    kernel
}

/// `outputs[i] = W_i · inputs[products[i].input]` for every product, in one parallel region.
pub fn matvec_batch(
    products: &[Product],
    inputs: &[&[f32]],
    outputs: &mut [Vec<f32>],
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
        kernels.push((trusted_twin(p.ty, kernel), shape.row_bytes));
    }
    if outputs.len() != products.len() {
        return Err(KernelError::BadLength {
            what: "outputs",
            expected: products.len(),
            got: outputs.len(),
        });
    }

    // Quantize each input once per activation format it is read in.
    let mut q8k: Vec<Option<Vec<BlockQ8K>>> = vec![None; inputs.len()];
    let mut q80: Vec<Option<Vec<BlockQ8_0>>> = vec![None; inputs.len()];
    for (p, (kernel, _)) in products.iter().zip(&kernels) {
        let x = inputs[p.input];
        match kernel {
            RowDot::Q8K(_) if q8k[p.input].is_none() => {
                let mut q = vec![BlockQ8K::ZERO; x.len() / QK_K];
                quantize_row_q8_k(x, &mut q);
                q8k[p.input] = Some(q);
            }
            RowDot::Q8_0(_) if q80[p.input].is_none() => {
                let mut q = vec![BlockQ8_0::ZERO; x.len() / QK8_0];
                quantize_row_q8_0(x, &mut q);
                q80[p.input] = Some(q);
            }
            _ => {}
        }
    }
    // Tasks: (product, first row, row count).
    let mut tasks = Vec::new();
    for (i, (p, (_, row_bytes))) in products.iter().zip(&kernels).enumerate() {
        let per = (TASK_BYTES / (*row_bytes).max(1)).clamp(1, p.rows.max(1));
        let mut r = 0;
        while r < p.rows {
            let n = per.min(p.rows - r);
            tasks.push((i, r, n));
            r += n;
        }
    }
    let task = |&(i, r0, n): &(usize, usize, usize)| -> Vec<f32> {
        let p = &products[i];
        let (kernel, row_bytes) = kernels[i];
        let x = inputs[p.input];
        (r0..r0 + n)
            .map(|r| {
                let w = &p.w[r * row_bytes..(r + 1) * row_bytes];
                // Every input a kernel reads was quantized to its format above.
                match kernel {
                    RowDot::Q8K(f) => f(w, q8k[p.input].as_deref().unwrap_or(&[])),
                    RowDot::Q8_0(f) => f(w, q80[p.input].as_deref().unwrap_or(&[])),
                    RowDot::F32(f) => f(w, x),
                }
            })
            .collect()
    };
    // Small products (a tiny model's whole MoE) run on the calling thread: handing them to the
    // pool costs more than the work. Each task computes the same values either way.
    let weight_bytes: usize = products.iter().map(|p| p.w.len()).sum();
    let results: Vec<Vec<f32>> = if weight_bytes < driver::PARALLEL_MIN_BYTES {
        tasks.iter().map(task).collect()
    } else {
        tasks.par_iter().map(task).collect()
    };
    for (o, p) in outputs.iter_mut().zip(products) {
        o.clear();
        o.resize(p.rows, 0.0);
    }
    for (&(i, r0, n), vals) in tasks.iter().zip(results) {
        outputs[i][r0..r0 + n].copy_from_slice(&vals);
    }
    Ok(())
}
