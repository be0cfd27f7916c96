//! Fixture parity on the GPU: the logits of the reference models through the device-resident
//! [`CudaModel`] against the stored exact (float64) logits, with the f32 oracle on the CPU
//! alongside. `prefill` runs each prompt in one forward call (the multi-token kernels: chunk-free
//! conv, the delta rule over all tokens in one launch, causal attention over the prompt);
//! `step` runs the first prompt through [`CudaModel::decode`], token by token (the decode step,
//! captured as a CUDA graph and replayed), reading each step's logits back.
//!
//! Layout of the fixture folder (a copy of the needed part of `shared/reference`):
//! `logits/index.json`, `logits/<MODEL>__<P>__exact.bin`, `models/tiny-<MODEL>.gguf`. Entries
//! whose model or exact file is absent are skipped.
//!
//! Per file: mean over the stored rows of all prompts of KL(exact ‖ cuda) (nats), against the
//! acceptance bound max(1e-5, 2 × llama.cpp's mean KL from the index); and the argmax equal to the
//! oracle's on every row where the oracle's top-2 margin exceeds 0.05.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use redlite_model::{KvType, Mode, Model};
use serde_json::Value;

use crate::{CudaError, CudaModel, CudaModelOptions, Gpu, GpuSampling};

/// Rows where the oracle's top-2 logit margin is above this must have the same argmax.
pub const ARGMAX_MARGIN: f32 = 0.05;

/// One model file's result.
#[derive(Debug, Clone)]
pub struct ParityRow {
    pub model: String,
    pub mode: &'static str,
    pub rows: usize,
    pub kl_cuda: f64,
    /// KL(exact ‖ oracle), when the oracle ran.
    pub kl_oracle: Option<f64>,
    pub kl_llamacpp: f64,
    pub bound: f64,
    /// Rows with a margin above [`ARGMAX_MARGIN`] and how many of them disagree.
    pub argmax_checked: usize,
    pub argmax_mismatch: usize,
    /// max |cuda − oracle| over the stored logits.
    pub max_abs_vs_oracle: Option<f64>,
    pub seconds: f64,
    pub pass: bool,
    /// Kernel launches of one decode step (step mode: the captured graph's size).
    pub launches_per_step: Option<u64>,
}

struct Prompt {
    ids: Vec<u32>,
    positions: Vec<usize>,
    exact: PathBuf,
    kl_llamacpp: f64,
}

fn io(context: String) -> impl FnOnce(std::io::Error) -> CudaError {
    move |source| CudaError::Io { context, source }
}

fn bad(msg: impl Into<String>) -> CudaError {
    CudaError::Invalid(msg.into())
}

/// `log_softmax` in f64.
fn log_softmax(x: &[f32]) -> Vec<f64> {
    let m = x
        .iter()
        .fold(f64::NEG_INFINITY, |a, &b| a.max(f64::from(b)));
    let lse = m + x
        .iter()
        .map(|&v| (f64::from(v) - m).exp())
        .sum::<f64>()
        .ln();
    x.iter().map(|&v| f64::from(v) - lse).collect()
}

/// KL(p ‖ q) of two logit rows, nats.
pub fn kl(p_logits: &[f32], q_logits: &[f32]) -> f64 {
    let (lp, lq) = (log_softmax(p_logits), log_softmax(q_logits));
    lp.iter().zip(&lq).map(|(a, b)| a.exp() * (a - b)).sum()
}

fn top2(x: &[f32]) -> (usize, f32) {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    let second = x
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != best)
        .fold(f32::NEG_INFINITY, |a, (_, &v)| a.max(v));
    (best, x[best] - second)
}

fn read_f32(path: &Path) -> Result<Vec<f32>, CudaError> {
    let bytes = std::fs::read(path).map_err(io(format!("reading {}", path.display())))?;
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// The models with stored exact logits and a model file in `dir`, with their prompts.
fn fixtures(dir: &Path) -> Result<Vec<(String, PathBuf, Vec<Prompt>)>, CudaError> {
    let index_path = dir.join("logits/index.json");
    let text = std::fs::read_to_string(&index_path)
        .map_err(io(format!("reading {}", index_path.display())))?;
    let index: Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("{}: {e}", index_path.display())))?;
    let entries = index["entries"]
        .as_array()
        .ok_or_else(|| bad("index.json: no entries"))?;
    let mut out: Vec<(String, PathBuf, Vec<Prompt>)> = Vec::new();
    for e in entries {
        let (Some(model), Some(file), Some(exact)) = (
            e["model"].as_str(),
            e["model_file"].as_str(),
            e["exact_path"].as_str(),
        ) else {
            continue;
        };
        let model_path = dir.join(file);
        let exact_path = dir.join("logits").join(exact);
        if !model_path.exists() || !exact_path.exists() {
            continue;
        }
        let nums = |v: &Value| -> Vec<u64> {
            v.as_array()
                .map(|a| a.iter().filter_map(Value::as_u64).collect())
                .unwrap_or_default()
        };
        let prompt = Prompt {
            ids: nums(&e["token_ids"])
                .into_iter()
                .map(|v| v as u32)
                .collect(),
            positions: nums(&e["positions"])
                .into_iter()
                .map(|v| v as usize)
                .collect(),
            exact: exact_path,
            kl_llamacpp: e["stats"]["kl_mean"].as_f64().unwrap_or(0.0),
        };
        match out.iter_mut().find(|(m, _, _)| m == model) {
            Some((_, _, ps)) => ps.push(prompt),
            None => out.push((model.to_string(), model_path, vec![prompt])),
        }
    }
    Ok(out)
}

fn at_positions(all: Vec<Vec<f32>>, p: &Prompt) -> Result<Vec<Vec<f32>>, CudaError> {
    p.positions
        .iter()
        .map(|&i| {
            all.get(i)
                .cloned()
                .ok_or_else(|| bad(format!("position {i} beyond {} tokens", all.len())))
        })
        .collect()
}

/// Logits at the stored positions of one prompt, on the CPU oracle.
fn run_prompt<B: redlite_model::Backend>(
    model: &Model<B>,
    p: &Prompt,
    mode: Mode,
) -> Result<Vec<Vec<f32>>, CudaError> {
    let mut state = model.new_state();
    let mut all = Vec::with_capacity(p.ids.len());
    let err = |e: redlite_model::ModelError| bad(format!("forward: {e}"));
    match mode {
        Mode::Prefill => {
            all = model
                .forward(&mut state, &p.ids, Mode::Prefill)
                .map_err(err)?
        }
        Mode::Step => {
            for &id in &p.ids {
                all.extend(model.forward(&mut state, &[id], Mode::Step).map_err(err)?);
            }
        }
    }
    at_positions(all, p)
}

/// Logits at the stored positions of one prompt, on the GPU.
fn run_prompt_gpu(
    model: &mut CudaModel,
    p: &Prompt,
    mode: Mode,
) -> Result<Vec<Vec<f32>>, CudaError> {
    model.reset()?;
    let all = match mode {
        Mode::Prefill => model.forward_logits(&p.ids)?,
        Mode::Step => {
            let mut all = Vec::with_capacity(p.ids.len());
            for &id in &p.ids {
                model.decode(id, &GpuSampling::greedy(), 0.0)?;
                all.push(model.last_logits()?);
            }
            all
        }
    };
    at_positions(all, p)
}

/// Run every fixture model in `dir` (prefill; `step` also runs each model's first prompt token by
/// token). `oracle`: also run the CPU oracle for the argmax check and its own KL. The GPU models
/// keep their KV caches in `kv` (f32 or f16; the oracle stays f32), under the same bound.
pub fn run(
    gpu: Arc<Gpu>,
    dir: &Path,
    oracle: bool,
    step: bool,
    kv: KvType,
) -> Result<Vec<ParityRow>, CudaError> {
    let mut rows = Vec::new();
    for (name, path, prompts) in fixtures(dir)? {
        let opts = CudaModelOptions {
            kv_type: kv,
            ..CudaModelOptions::default()
        };
        let mut cuda = CudaModel::load(gpu.clone(), &path, opts)
            .map_err(|e| bad(format!("loading {} on the GPU: {e}", path.display())))?;
        let cpu = if oracle {
            Some(Model::load(&path).map_err(|e| bad(format!("loading {}: {e}", path.display())))?)
        } else {
            None
        };
        let modes: &[(Mode, &'static str)] = if step {
            &[(Mode::Prefill, "prefill"), (Mode::Step, "step")]
        } else {
            &[(Mode::Prefill, "prefill")]
        };
        for &(mode, mode_name) in modes {
            let t0 = Instant::now();
            let prompts_here: Vec<&Prompt> = if mode == Mode::Step {
                prompts.iter().take(1).collect()
            } else {
                prompts.iter().collect()
            };
            let (mut n, mut kl_c, mut kl_o, mut kl_l) = (0usize, 0.0f64, 0.0f64, 0.0f64);
            let (mut checked, mut mismatch, mut max_abs) = (0usize, 0usize, 0.0f64);
            for p in prompts_here {
                let exact = read_f32(&p.exact)?;
                let vocab = exact.len() / p.positions.len().max(1);
                let got = run_prompt_gpu(&mut cuda, p, mode)?;
                let ora = match &cpu {
                    Some(m) => Some(run_prompt(m, p, mode)?),
                    None => None,
                };
                for (r, row) in got.iter().enumerate() {
                    let ex = &exact[r * vocab..(r + 1) * vocab];
                    if row.len() != vocab {
                        return Err(bad(format!(
                            "{name}: {} logits per row, exact has {vocab}",
                            row.len()
                        )));
                    }
                    kl_c += kl(ex, row);
                    if let Some(o) = &ora {
                        let orow = &o[r];
                        kl_o += kl(ex, orow);
                        let (ob, margin) = top2(orow);
                        if margin > ARGMAX_MARGIN {
                            checked += 1;
                            if top2(row).0 != ob {
                                mismatch += 1;
                            }
                        }
                        for (a, b) in row.iter().zip(orow) {
                            max_abs = max_abs.max(f64::from((a - b).abs()));
                        }
                    }
                }
                n += got.len();
                kl_l += p.kl_llamacpp * got.len() as f64;
            }
            let n_f = n.max(1) as f64;
            let kl_llamacpp = kl_l / n_f;
            let bound = f64::max(1e-5, 2.0 * kl_llamacpp);
            let kl_cuda = kl_c / n_f;
            rows.push(ParityRow {
                model: name.clone(),
                mode: mode_name,
                rows: n,
                kl_cuda,
                kl_oracle: cpu.as_ref().map(|_| kl_o / n_f),
                kl_llamacpp,
                bound,
                argmax_checked: checked,
                argmax_mismatch: mismatch,
                max_abs_vs_oracle: cpu.as_ref().map(|_| max_abs),
                seconds: t0.elapsed().as_secs_f64(),
                pass: kl_cuda.is_finite() && kl_cuda <= bound && mismatch == 0,
                launches_per_step: if mode == Mode::Step {
                    cuda.launches_per_step()
                } else {
                    None
                },
            });
        }
    }
    Ok(rows)
}
