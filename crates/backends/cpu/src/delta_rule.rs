//! The gated delta rule on the CPU: the oracle's own step and chunked kernels, compiled for the
//! widest vector unit present (they are `#[inline(always)]`, so the wrapper's target features
//! apply), with the V heads of a layer spread over the thread pool.
//!
//! The inner loops run across the value dimension (independent lanes, no reassociation), so the
//! vectorised code computes exactly what the oracle computes.

use rayon::prelude::*;
use redlite_model::delta_rule::{
    delta_rule_chunked, delta_rule_step_traced, DeltaRule, HeadInputs,
};

use crate::kernels::Isa;

/// One head, compiled for the running CPU.
fn one_head(
    inp: &HeadInputs,
    s: &mut [f32],
    rule: DeltaRule,
    trace: Option<&mut Vec<f32>>,
) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    {
        if Isa::active() >= Isa::Avx512 {
            // SAFETY: `Isa::active` only reports AVX-512 when the CPU supports it.
            return unsafe { one_head_avx512(inp, s, rule, trace) };
        }
        if Isa::active() >= Isa::Avx2 {
            // SAFETY: as above, for AVX2 + FMA.
            return unsafe { one_head_avx2(inp, s, rule, trace) };
        }
    }
    one_head_portable(inp, s, rule, trace)
}

#[inline(always)]
fn one_head_portable(
    inp: &HeadInputs,
    s: &mut [f32],
    rule: DeltaRule,
    trace: Option<&mut Vec<f32>>,
) -> Vec<f32> {
    match rule {
        DeltaRule::Step => delta_rule_step_traced(inp, s, trace),
        DeltaRule::Chunked { pos0 } => delta_rule_chunked(inp, pos0, s),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn one_head_avx512(
    inp: &HeadInputs,
    s: &mut [f32],
    rule: DeltaRule,
    trace: Option<&mut Vec<f32>>,
) -> Vec<f32> {
    one_head_portable(inp, s, rule, trace)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn one_head_avx2(
    inp: &HeadInputs,
    s: &mut [f32],
    rule: DeltaRule,
    trace: Option<&mut Vec<f32>>,
) -> Vec<f32> {
    one_head_portable(inp, s, rule, trace)
}

/// Every head of a layer, in parallel.
pub fn delta_rule_parallel(
    heads: &[HeadInputs],
    states: &mut [f32],
    rule: DeltaRule,
    traces: Option<&mut [Vec<f32>]>,
) -> Vec<Vec<f32>> {
    let per = heads.first().map_or(1, |h| (h.dk * h.dv).max(1));
    match traces {
        Some(traces) => heads
            .par_iter()
            .zip(states.par_chunks_mut(per))
            .zip(traces.par_iter_mut())
            .map(|((inp, s), t)| one_head(inp, s, rule, Some(t)))
            .collect(),
        None => heads
            .par_iter()
            .zip(states.par_chunks_mut(per))
            .map(|(inp, s)| one_head(inp, s, rule, None))
            .collect(),
    }
}
