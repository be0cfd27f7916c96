//! Importance matrices in llama.cpp's GGUF format (`llama-imatrix`), read for quantization and
//! computed with our own forward pass.
//!
//! The file has no architecture key: `general.type = "imatrix"`, `imatrix.datasets` (strings),
//! `imatrix.chunk_count` and `imatrix.chunk_size` (u32), and for every weight `W` that was seen
//! in a matrix multiplication two F32 tensors:
//! * `W.in_sum2` `[n_per_row, n_mat]`: Σ x_j² over every activation row x that entered `W`
//!   (`n_mat` = 1 for a 2-D weight, the number of experts for a stacked `*_exps` weight, whose
//!   slice e only sums the tokens routed to expert e);
//! * `W.counts` `[1, n_mat]`: how many activation rows went into each slice.
//!
//! The importance of column j of slice e is `in_sum2[e][j] / counts[e]` (the mean squared input),
//! which llama-quantize hands to the quantizer of each expert slice.
//!
//! Collection follows llama-imatrix: the text is cut into chunks of `ctx` tokens, each run from
//! an empty state; only weights of the repeated blocks (`blk.*`) are recorded (not `output`,
//! which llama-imatrix skips unless `--process-output`), and the MTP block never runs.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use redlite_gguf::{GgmlType, GgufError, GgufFile, GgufWriter, MetaArray, MetaValue};
use redlite_model::delta_rule::{DeltaRule, HeadInputs};
use redlite_model::state::KvCache;
use redlite_model::{Backend, LinearSource, Mode, Model, ModelError};

const SUM2_SUFFIX: &str = ".in_sum2";
const COUNTS_SUFFIX: &str = ".counts";
const KEY_DATASETS: &str = "imatrix.datasets";
const KEY_CHUNK_COUNT: &str = "imatrix.chunk_count";
const KEY_CHUNK_SIZE: &str = "imatrix.chunk_size";

/// Errors reading, writing or computing an importance matrix.
#[derive(Debug, thiserror::Error)]
pub enum ImatrixError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("imatrix tensor '{0}' has no matching '{1}' tensor")]
    Unpaired(String, String),
    #[error("imatrix tensor '{name}' is {ty}; only F32 is valid")]
    NotF32 { name: String, ty: GgmlType },
    #[error("imatrix tensor '{name}' has dims {dims:?}; expected {expected}")]
    BadShape {
        name: String,
        dims: Vec<u64>,
        expected: String,
    },
    #[error("the file has no imatrix entries (no '*.in_sum2' tensors)")]
    Empty,
    #[error("the text gives only {tokens} tokens: one chunk needs {ctx}")]
    TooFewTokens { tokens: usize, ctx: usize },
}

/// One weight's statistics: `n_mat` slices of `n_per_row` squared-input sums, and a count each.
#[derive(Debug, Clone, PartialEq)]
pub struct ImatrixEntry {
    pub n_per_row: usize,
    /// `[n_mat][n_per_row]`, flattened.
    pub in_sum2: Vec<f32>,
    /// `[n_mat]`: activation rows summed into each slice.
    pub counts: Vec<f32>,
}

impl ImatrixEntry {
    /// Number of slices (experts; 1 for a 2-D weight).
    pub fn n_mat(&self) -> usize {
        self.counts.len()
    }

    /// The importance of every column, slice after slice: `in_sum2 / count`. A slice that saw no
    /// activation (an expert never routed to) gets uniform importance 1 instead of 0/0.
    pub fn importance(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.in_sum2.len());
        for (sums, &count) in self.in_sum2.chunks_exact(self.n_per_row).zip(&self.counts) {
            if count > 0.0 {
                out.extend(sums.iter().map(|s| s / count));
            } else {
                out.extend(std::iter::repeat_n(1.0, sums.len()));
            }
        }
        out
    }
}

/// A whole importance matrix: entries by weight name (`blk.0.attn_qkv.weight`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Imatrix {
    pub entries: BTreeMap<String, ImatrixEntry>,
    pub datasets: Vec<String>,
    pub chunk_count: u32,
    pub chunk_size: u32,
}

impl Imatrix {
    /// Read an imatrix GGUF file.
    pub fn load(path: impl AsRef<Path>) -> Result<Imatrix, ImatrixError> {
        Imatrix::from_gguf(&GgufFile::open(path.as_ref())?)
    }

    /// Parse the entries of an opened imatrix file (`*.in_sum` tensors, written by newer
    /// llama-imatrix versions, are ignored: quantization only uses the squares).
    pub fn from_gguf(file: &GgufFile) -> Result<Imatrix, ImatrixError> {
        let mut m = Imatrix {
            datasets: file
                .get_str_array(KEY_DATASETS)
                .map(|d| d.to_vec())
                .unwrap_or_default(),
            chunk_count: file.get_opt_u32(KEY_CHUNK_COUNT)?.unwrap_or(0),
            chunk_size: file.get_opt_u32(KEY_CHUNK_SIZE)?.unwrap_or(0),
            ..Default::default()
        };
        for t in file.tensors() {
            let Some(weight) = t.name.strip_suffix(SUM2_SUFFIX) else {
                continue;
            };
            let counts_name = format!("{weight}{COUNTS_SUFFIX}");
            let c = file
                .tensor(&counts_name)
                .ok_or_else(|| ImatrixError::Unpaired(t.name.clone(), counts_name.clone()))?;
            let n_per_row = t.ne0() as usize;
            let n_mat = t.n_rows() as usize;
            if t.dims.len() > 2 || n_per_row == 0 {
                return Err(ImatrixError::BadShape {
                    name: t.name.clone(),
                    dims: t.dims.clone(),
                    expected: "[n_per_row] or [n_per_row, n_mat]".into(),
                });
            }
            if c.ne0() != 1 || c.n_rows() as usize != n_mat || c.dims.len() > 2 {
                return Err(ImatrixError::BadShape {
                    name: c.name.clone(),
                    dims: c.dims.clone(),
                    expected: format!("[1, {n_mat}] (one count per slice of {})", t.name),
                });
            }
            m.entries.insert(
                weight.to_string(),
                ImatrixEntry {
                    n_per_row,
                    in_sum2: f32_tensor(file, &t.name)?,
                    counts: f32_tensor(file, &counts_name)?,
                },
            );
        }
        if m.entries.is_empty() {
            return Err(ImatrixError::Empty);
        }
        Ok(m)
    }

    /// Per-column importance of `weight` (all slices, flattened), if it has an entry.
    pub fn importance(&self, weight: &str) -> Option<Vec<f32>> {
        self.entries.get(weight).map(ImatrixEntry::importance)
    }

    /// The file llama-imatrix writes: entries in name order, `in_sum2` then `counts`.
    pub fn to_writer(&self) -> Result<GgufWriter<'static>, ImatrixError> {
        let mut w = GgufWriter::new();
        w.add_kv("general.type", MetaValue::String("imatrix".into()))?;
        w.add_kv(
            KEY_DATASETS,
            MetaValue::Array(MetaArray::String(self.datasets.clone())),
        )?;
        w.add_kv(KEY_CHUNK_COUNT, MetaValue::U32(self.chunk_count))?;
        w.add_kv(KEY_CHUNK_SIZE, MetaValue::U32(self.chunk_size))?;
        for (name, e) in &self.entries {
            // ggml drops trailing dimensions of 1 when writing.
            let dims = |ne0: usize| {
                if e.n_mat() == 1 {
                    vec![ne0 as u64]
                } else {
                    vec![ne0 as u64, e.n_mat() as u64]
                }
            };
            w.add_tensor(
                format!("{name}{SUM2_SUFFIX}"),
                &dims(e.n_per_row),
                GgmlType::F32,
                f32_bytes(&e.in_sum2),
            )?;
            w.add_tensor(
                format!("{name}{COUNTS_SUFFIX}"),
                &dims(1),
                GgmlType::F32,
                f32_bytes(&e.counts),
            )?;
        }
        Ok(w)
    }

    /// Write the file to `path`.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), ImatrixError> {
        self.to_writer()?.write_to_path(path)?;
        Ok(())
    }
}

fn f32_tensor(file: &GgufFile, name: &str) -> Result<Vec<f32>, ImatrixError> {
    let t = file
        .tensor(name)
        .ok_or_else(|| ImatrixError::Unpaired(name.into(), name.into()))?;
    if t.ty != GgmlType::F32 {
        return Err(ImatrixError::NotF32 {
            name: name.into(),
            ty: t.ty,
        });
    }
    Ok(file
        .tensor_data(t)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

// ---------------------------------------------------------------------------------------------
// Collection

/// Where one prepared linear layer's inputs are summed.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SliceId {
    /// The GGUF weight (`blk.0.ffn_up_exps.weight`).
    weight: String,
    /// The expert slice (0 for a 2-D weight).
    mat: usize,
    /// False for a layer whose input another layer of the same weight already records (the
    /// `up` half of a fused gate/up expert, the `z` half of a legacy `ssm_in`).
    record: bool,
}

/// Maps the name the model loader gives a linear layer to its GGUF weight and slice:
/// `W[3]` (expert 3), `W[3].gate` / `W[3].up` (fused gate+up experts), `W[qkv]` / `W[z]` (the
/// legacy `ssm_in` split in two), or plain `W`.
fn slice_id(name: &str) -> SliceId {
    let Some(open) = name.find('[') else {
        return SliceId {
            weight: name.into(),
            mat: 0,
            record: true,
        };
    };
    let weight = name[..open].to_string();
    let rest = &name[open + 1..];
    let (inside, after) = rest.split_once(']').unwrap_or((rest, ""));
    match inside.parse::<usize>() {
        Ok(mat) => SliceId {
            weight,
            mat,
            record: after != ".up",
        },
        Err(_) => SliceId {
            weight,
            mat: 0,
            record: inside != "z",
        },
    }
}

/// Running sums of one slice.
#[derive(Debug, Clone, Default)]
struct SliceSums {
    sum2: Vec<f64>,
    count: u64,
}

/// A backend wrapper that runs `B` and, on every matrix multiplication, adds the squares of the
/// input rows to that weight's slice (llama-imatrix's statistic).
pub struct Recorder<B: Backend> {
    inner: B,
    ids: Mutex<Vec<SliceId>>,
    sums: Mutex<Vec<SliceSums>>,
}

/// A linear layer of the wrapped backend, tagged with its slot in the recorder.
pub struct Recorded<L> {
    inner: L,
    slot: usize,
}

impl<B: Backend> Recorder<B> {
    pub fn new(inner: B) -> Recorder<B> {
        Recorder {
            inner,
            ids: Mutex::new(Vec::new()),
            sums: Mutex::new(Vec::new()),
        }
    }

    /// Add `n` input rows of width `cols` to `slot`.
    fn record(&self, slot: usize, xs: &[f32], n: usize, cols: usize) {
        let mut sums = self.sums.lock().unwrap_or_else(|p| p.into_inner());
        let s = &mut sums[slot];
        if s.sum2.is_empty() {
            s.sum2 = vec![0.0; cols];
        }
        for x in xs.chunks_exact(cols).take(n) {
            for (acc, &v) in s.sum2.iter_mut().zip(x) {
                *acc += f64::from(v) * f64::from(v);
            }
        }
        s.count += n as u64;
    }

    /// The statistics so far, one entry per recorded weight of the repeated blocks, plus the
    /// routers (see [`add_router_entries`]).
    pub fn entries(&self) -> BTreeMap<String, ImatrixEntry> {
        let ids = self.ids.lock().unwrap_or_else(|p| p.into_inner());
        let sums = self.sums.lock().unwrap_or_else(|p| p.into_inner());
        // Slices per weight: the highest expert index seen at load + 1.
        let mut n_mat: BTreeMap<&str, usize> = BTreeMap::new();
        for id in ids.iter().filter(|id| id.record) {
            let n = n_mat.entry(&id.weight).or_insert(0);
            *n = (*n).max(id.mat + 1);
        }
        let mut out = BTreeMap::new();
        for (id, s) in ids.iter().zip(sums.iter()) {
            if !id.record || s.count == 0 || !id.weight.starts_with("blk.") {
                continue;
            }
            let n = n_mat[id.weight.as_str()];
            let cols = s.sum2.len();
            let e = out
                .entry(id.weight.clone())
                .or_insert_with(|| ImatrixEntry {
                    n_per_row: cols,
                    in_sum2: vec![0.0; cols * n],
                    counts: vec![0.0; n],
                });
            for (dst, &v) in e.in_sum2[id.mat * cols..(id.mat + 1) * cols]
                .iter_mut()
                .zip(&s.sum2)
            {
                *dst += v as f32;
            }
            e.counts[id.mat] += s.count as f32;
        }
        add_router_entries(&mut out);
        out
    }
}

/// The MoE routers (`ffn_gate_inp`, and `ffn_gate_inp_shexp`, the shared expert's gate) read
/// exactly the input of the shared expert's up projection; our model applies them as plain f32
/// products outside the backend, so their entries are copies of `ffn_up_shexp`'s (llama-imatrix
/// records them too; quantization keeps these weights in F32 and never reads them).
fn add_router_entries(entries: &mut BTreeMap<String, ImatrixEntry>) {
    let copies: Vec<(String, ImatrixEntry)> = entries
        .iter()
        .filter_map(|(name, e)| {
            let prefix = name.strip_suffix("ffn_up_shexp.weight")?;
            Some([
                (format!("{prefix}ffn_gate_inp.weight"), e.clone()),
                (format!("{prefix}ffn_gate_inp_shexp.weight"), e.clone()),
            ])
        })
        .flatten()
        .collect();
    for (name, e) in copies {
        entries.entry(name).or_insert(e);
    }
}

impl<B: Backend> Backend for Recorder<B> {
    type Linear = Recorded<B::Linear>;

    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn load_linear(&self, src: LinearSource) -> Result<Self::Linear, ModelError> {
        let id = slice_id(&src.name);
        let inner = self.inner.load_linear(src)?;
        let mut ids = self.ids.lock().unwrap_or_else(|p| p.into_inner());
        let mut sums = self.sums.lock().unwrap_or_else(|p| p.into_inner());
        ids.push(id);
        sums.push(SliceSums::default());
        Ok(Recorded {
            inner,
            slot: ids.len() - 1,
        })
    }

    fn linear(&self, w: &Self::Linear, xs: &[f32], n: usize, ys: &mut [f32]) {
        let (_, cols) = self.inner.linear_shape(&w.inner);
        self.record(w.slot, xs, n, cols);
        self.inner.linear(&w.inner, xs, n, ys);
    }

    fn linear_shape(&self, w: &Self::Linear) -> (usize, usize) {
        self.inner.linear_shape(&w.inner)
    }

    fn delta_rule(
        &self,
        heads: &[HeadInputs],
        states: &mut [f32],
        rule: DeltaRule,
        traces: Option<&mut [Vec<f32>]>,
    ) -> Vec<Vec<f32>> {
        self.inner.delta_rule(heads, states, rule, traces)
    }

    fn attention(
        &self,
        q: &[f32],
        kv: &KvCache,
        n_heads: usize,
        head_dim: usize,
        scale: f32,
    ) -> Vec<f32> {
        self.inner.attention(q, kv, n_heads, head_dim, scale)
    }

    fn attention_rows(
        &self,
        q: &[Vec<f32>],
        kv: &KvCache,
        n_heads: usize,
        head_dim: usize,
        scale: f32,
    ) -> Vec<Vec<f32>> {
        self.inner.attention_rows(q, kv, n_heads, head_dim, scale)
    }
    // `routed_experts` keeps the default: one `linear` per chosen expert, so every expert slice
    // sees exactly the tokens routed to it.
}

/// How to collect an importance matrix.
#[derive(Debug, Clone)]
pub struct CollectOptions {
    /// Tokens per chunk (llama-imatrix's `-c`).
    pub ctx: usize,
    /// At most this many chunks (`--chunks`); `None`: every full chunk.
    pub max_chunks: Option<usize>,
    /// Replace each chunk's first token with this id (when the vocabulary adds a BOS).
    pub bos: Option<u32>,
    /// Name of the text, stored in `imatrix.datasets`.
    pub dataset: String,
}

/// Run `tokens` through `file`'s model on `backend` chunk by chunk, recording the squared inputs
/// of every matrix multiplication. `on_chunk(done, total)` is called after each chunk.
pub fn collect<B: Backend>(
    file: Arc<GgufFile>,
    backend: B,
    tokens: &[u32],
    opts: &CollectOptions,
    mut on_chunk: impl FnMut(usize, usize),
) -> Result<Imatrix, ImatrixError> {
    let ctx = opts.ctx.max(1);
    let full = tokens.len() / ctx;
    let total = opts.max_chunks.map_or(full, |m| m.min(full));
    if total == 0 {
        return Err(ImatrixError::TooFewTokens {
            tokens: tokens.len(),
            ctx,
        });
    }
    let model = Model::from_gguf(file, Recorder::new(backend))?;
    for (i, chunk) in tokens.chunks_exact(ctx).take(total).enumerate() {
        let mut input = chunk.to_vec();
        if let Some(b) = opts.bos {
            input[0] = b;
        }
        let mut state = model.new_state();
        // Only the trunk runs (no lm_head: `output` is not recorded; no MTP block).
        model.forward_hidden(&mut state, &input, Mode::Prefill)?;
        on_chunk(i + 1, total);
    }
    Ok(Imatrix {
        entries: model.backend.entries(),
        datasets: vec![opts.dataset.clone()],
        chunk_count: total as u32,
        chunk_size: ctx as u32,
    })
}

/// How far apart two importance matrices are, over the entries both have.
#[derive(Debug, Clone, Default)]
pub struct ImatrixDiff {
    /// Entries compared (present in both with the same shape).
    pub compared: usize,
    /// Entries of one that the other lacks or has with another shape.
    pub unmatched: Vec<String>,
    /// Worst relative difference of the counts over all slices.
    pub max_count_rel: f64,
    /// Mean over entries of `‖a − b‖ / ‖b‖` of the importance vectors.
    pub mean_rel_l2: f64,
    /// The worst entry by that measure, and its value.
    pub worst: Option<(String, f64)>,
}

/// Compare `ours` with `reference` (importance = in_sum2 / count).
pub fn compare(ours: &Imatrix, reference: &Imatrix) -> ImatrixDiff {
    let mut d = ImatrixDiff::default();
    let mut sum_rel = 0.0;
    for (name, r) in &reference.entries {
        let Some(o) = ours
            .entries
            .get(name)
            .filter(|o| o.n_per_row == r.n_per_row && o.n_mat() == r.n_mat())
        else {
            d.unmatched.push(name.clone());
            continue;
        };
        for (a, b) in o.counts.iter().zip(&r.counts) {
            let rel = f64::from((a - b).abs()) / f64::from(b.abs().max(1.0));
            d.max_count_rel = d.max_count_rel.max(rel);
        }
        let (a, b) = (o.importance(), r.importance());
        let num: f64 = a
            .iter()
            .zip(&b)
            .map(|(x, y)| f64::from(x - y).powi(2))
            .sum();
        let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
        let rel = (num / den.max(f64::MIN_POSITIVE)).sqrt();
        sum_rel += rel;
        d.compared += 1;
        if d.worst.as_ref().is_none_or(|(_, w)| rel > *w) {
            d.worst = Some((name.clone(), rel));
        }
    }
    d.unmatched.extend(
        ours.entries
            .keys()
            .filter(|k| !reference.entries.contains_key(*k))
            .cloned(),
    );
    d.mean_rel_l2 = if d.compared > 0 {
        sum_rel / d.compared as f64
    } else {
        0.0
    };
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slice_ids_follow_the_loader_names() {
        let id = slice_id("blk.0.ffn_up_exps.weight[3]");
        assert_eq!(
            (id.weight.as_str(), id.mat, id.record),
            ("blk.0.ffn_up_exps.weight", 3, true)
        );
        assert!(slice_id("blk.0.ffn_gate_up_exps.weight[1].gate").record);
        assert!(!slice_id("blk.0.ffn_gate_up_exps.weight[1].up").record);
        assert!(slice_id("blk.0.ssm_in.weight[qkv]").record);
        assert!(!slice_id("blk.0.ssm_in.weight[z]").record);
        let plain = slice_id("blk.0.ssm_out.weight");
        assert_eq!(
            (plain.weight.as_str(), plain.mat),
            ("blk.0.ssm_out.weight", 0)
        );
    }

    #[test]
    fn importance_divides_by_count_and_fills_unseen_slices() {
        let e = ImatrixEntry {
            n_per_row: 2,
            in_sum2: vec![4.0, 8.0, 0.0, 0.0],
            counts: vec![2.0, 0.0],
        };
        assert_eq!(e.importance(), vec![2.0, 4.0, 1.0, 1.0]);
    }

    #[test]
    fn write_then_read_round_trips() {
        let mut m = Imatrix {
            datasets: vec!["t.txt".into()],
            chunk_count: 3,
            chunk_size: 16,
            ..Default::default()
        };
        m.entries.insert(
            "blk.0.a.weight".into(),
            ImatrixEntry {
                n_per_row: 2,
                in_sum2: vec![1.0, 2.0],
                counts: vec![5.0],
            },
        );
        m.entries.insert(
            "blk.0.b_exps.weight".into(),
            ImatrixEntry {
                n_per_row: 2,
                in_sum2: vec![1.0, 2.0, 3.0, 4.0],
                counts: vec![5.0, 6.0],
            },
        );
        let bytes = m.to_writer().unwrap().to_bytes().unwrap();
        let back = Imatrix::from_gguf(&GgufFile::from_bytes(bytes).unwrap()).unwrap();
        assert_eq!(back, m);
    }
}
