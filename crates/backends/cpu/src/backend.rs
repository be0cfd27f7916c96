//! [`CpuBackend`]: the model's [`Backend`] on the fast CPU kernels. Weights stay in their quantized
//! GGUF form, read in place from the memory map (the routed experts of a 20 GB file are never
//! copied); activations are quantized to 8 bits per product where the weight type calls for it.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::Arc;

use rayon::prelude::*;
use redlite_gguf::{GgmlType, GgufFile};
use redlite_model::backend::{Backend, LinearData, LinearSource};
use redlite_model::delta_rule::{DeltaRule, HeadInputs};
use redlite_model::ops::silu;
use redlite_model::state::KvCache;
use redlite_model::weights::FfnWeights;
use redlite_model::ModelError;

use crate::kernels::driver;
use crate::kernels::fused::{self, Product};

/// Where a weight's bytes live.
enum Bytes {
    /// In place in the memory-mapped file.
    Mapped(Arc<GgufFile>, Range<usize>),
    /// Rearranged at load (the legacy DeltaNet layout).
    Owned(Vec<u8>),
}

/// One linear layer, quantized.
pub struct CpuLinear {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    bytes: Bytes,
}

impl CpuLinear {
    pub fn bytes(&self) -> &[u8] {
        match &self.bytes {
            Bytes::Mapped(file, range) => &file.bytes()[range.clone()],
            Bytes::Owned(v) => v,
        }
    }
}

/// The fast CPU backend. Threads come from one persistent pool (rayon's global pool, sized by
/// [`CpuBackend::with_threads`] or to the physical cores).
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend;

impl CpuBackend {
    /// A backend whose pool has `threads` threads (0: one per physical core). The pool is process-wide
    /// and can be sized once; later calls keep the first size.
    pub fn with_threads(threads: usize) -> CpuBackend {
        let n = if threads == 0 {
            driver::physical_cores()
        } else {
            threads
        };
        // An already-built pool is not an error for us: it is the one persistent pool.
        let _ = driver::init_threads(n);
        CpuBackend
    }
}

impl Backend for CpuBackend {
    type Linear = CpuLinear;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn load_linear(&self, src: LinearSource) -> Result<CpuLinear, ModelError> {
        let unsupported = |message: String| ModelError::Tensor {
            tensor: src.name.clone(),
            message,
        };
        if !driver::supported(src.ty) {
            return Err(unsupported(format!(
                "the CPU backend has no kernel for {}",
                src.ty
            )));
        }
        let expected = src
            .ty
            .row_bytes(src.cols as u64)
            .and_then(|rb| rb.checked_mul(src.rows as u64))
            .ok_or_else(|| {
                unsupported(format!(
                    "{} columns is not a whole number of {} blocks",
                    src.cols, src.ty
                ))
            })?;
        if src.bytes().len() as u64 != expected {
            return Err(unsupported(format!(
                "{} bytes, expected {expected}",
                src.bytes().len()
            )));
        }
        let bytes = match src.data {
            LinearData::Mapped { file, range } => Bytes::Mapped(file.clone(), range),
            LinearData::Owned(v) => Bytes::Owned(v),
        };
        Ok(CpuLinear {
            ty: src.ty,
            rows: src.rows,
            cols: src.cols,
            bytes,
        })
    }

    fn linear(&self, w: &CpuLinear, xs: &[f32], n: usize, ys: &mut [f32]) {
        // Shapes were checked at load; the model passes matching activation lengths.
        let result = if n == 1 {
            driver::matvec(w.ty, w.bytes(), w.rows, w.cols, xs, ys)
        } else {
            driver::matmul(w.ty, w.bytes(), w.rows, w.cols, xs, n, ys)
        };
        if let Err(e) = result {
            panic!("CPU linear {}×{} {}: {e}", w.rows, w.cols, w.ty);
        }
    }

    fn linear_shape(&self, w: &CpuLinear) -> (usize, usize) {
        (w.rows, w.cols)
    }

    fn attention(
        &self,
        q: &[f32],
        kv: &KvCache,
        n_heads: usize,
        head_dim: usize,
        scale: f32,
    ) -> Vec<f32> {
        crate::attention::attention_online(q, kv, n_heads, head_dim, scale)
    }

    fn delta_rule(
        &self,
        heads: &[HeadInputs],
        states: &mut [f32],
        rule: DeltaRule,
        traces: Option<&mut [Vec<f32>]>,
    ) -> Vec<Vec<f32>> {
        crate::delta_rule::delta_rule_parallel(heads, states, rule, traces)
    }

    fn routed_experts_rows(
        &self,
        experts: &[FfnWeights<Self>],
        chosen: &[Vec<(usize, f32)>],
        xs: &[Vec<f32>],
    ) -> Vec<Vec<f32>> {
        // Tokens per expert, so each expert's weights are read once for all its tokens.
        let mut tokens_of: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for (t, c) in chosen.iter().enumerate() {
            for &(e, _) in c {
                tokens_of.entry(e).or_default().push(t);
            }
        }
        let groups: Vec<(usize, Vec<usize>)> = tokens_of.into_iter().collect();
        // down(silu(gate·x) ⊙ up·x) for every (expert, token) pair; matmul rows are bit-identical
        // to matvec, so each token gets exactly what `routed_experts` computes for it alone.
        let outputs: Vec<Vec<Vec<f32>>> = groups
            .par_iter()
            .map(|(e, toks)| {
                let ffn = &experts[*e];
                let n = toks.len();
                let x: Vec<f32> = toks.iter().flat_map(|&t| xs[t].iter().copied()).collect();
                let mut gate = vec![0.0f32; n * ffn.gate.rows];
                let mut up = vec![0.0f32; n * ffn.up.rows];
                self.linear(&ffn.gate, &x, n, &mut gate);
                self.linear(&ffn.up, &x, n, &mut up);
                let act: Vec<f32> = gate.iter().zip(&up).map(|(&g, &u)| silu(g) * u).collect();
                let mut down = vec![0.0f32; n * ffn.down.rows];
                self.linear(&ffn.down, &act, n, &mut down);
                down.chunks_exact(ffn.down.rows)
                    .map(|r| r.to_vec())
                    .collect()
            })
            .collect();
        let mut per_pair: HashMap<(usize, usize), &[f32]> = HashMap::new();
        for ((e, toks), outs) in groups.iter().zip(&outputs) {
            for (&t, y) in toks.iter().zip(outs) {
                per_pair.insert((*e, t), y);
            }
        }
        // Weighted sum per token, in its chosen order.
        chosen
            .iter()
            .enumerate()
            .map(|(t, c)| {
                let mut out = vec![0.0f32; xs[t].len()];
                for &(e, weight) in c {
                    for (o, v) in out.iter_mut().zip(per_pair[&(e, t)]) {
                        *o += weight * v;
                    }
                }
                out
            })
            .collect()
    }

    fn routed_experts(
        &self,
        experts: &[FfnWeights<Self>],
        chosen: &[(usize, f32)],
        x: &[f32],
    ) -> Vec<f32> {
        // Gate and up of every chosen expert in one parallel pass over the same quantized x…
        let mut products = Vec::with_capacity(2 * chosen.len());
        for &(e, _) in chosen {
            for w in [&experts[e].gate, &experts[e].up] {
                products.push(Product {
                    ty: w.ty,
                    w: w.bytes(),
                    rows: w.rows,
                    cols: w.cols,
                    input: 0,
                });
            }
        }
        let mut gate_up = vec![Vec::new(); products.len()];
        fused::matvec_batch(&products, &[x], &mut gate_up)
            .unwrap_or_else(|e| panic!("expert gate/up: {e}"));
        // …then SwiGLU per expert, and every down projection in a second pass.
        let acts: Vec<Vec<f32>> = gate_up
            .chunks_exact(2)
            .map(|gu| {
                gu[0]
                    .iter()
                    .zip(&gu[1])
                    .map(|(&g, &u)| silu(g) * u)
                    .collect()
            })
            .collect();
        let inputs: Vec<&[f32]> = acts.iter().map(|a| a.as_slice()).collect();
        let products: Vec<Product> = chosen
            .iter()
            .enumerate()
            .map(|(i, &(e, _))| {
                let w = &experts[e].down;
                Product {
                    ty: w.ty,
                    w: w.bytes(),
                    rows: w.rows,
                    cols: w.cols,
                    input: i,
                }
            })
            .collect();
        let mut downs = vec![Vec::new(); products.len()];
        fused::matvec_batch(&products, &inputs, &mut downs)
            .unwrap_or_else(|e| panic!("expert down: {e}"));
        // Weighted sum in the given order.
        let mut out = vec![0.0f32; x.len()];
        for (y, &(_, weight)) in downs.iter().zip(chosen) {
            for (o, v) in out.iter_mut().zip(y) {
                *o += weight * v;
            }
        }
        out
    }
}
