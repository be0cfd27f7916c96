//! Quantizing a Qwen3-Next GGUF file: choose each tensor's type by a recipe (as llama-quantize's
//! rules do), then stream the file tensor by tensor, quantizing rows in parallel.
//!
//! Which tensors are quantized at all (llama-quantize's rule): 2-D and 3-D weights whose name ends
//! in `weight`, except norms (`*_norm.weight`), the MoE routers (`ffn_gate_inp*`) and the DeltaNet
//! convolution (`ssm_conv1d`); `ssm_a`, `ssm_dt.bias` and every 1-D tensor are copied as they are.
//!
//! Recipes:
//! * `cf2`: the routed experts (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`) IQ2_XXS, the
//!   output head Q6_K, every other weight (attention, DeltaNet projections, shared experts,
//!   `nextn.eh_proj`, token embedding) Q4_K; `general.file_type` Q4_K_S, as llama-quantize writes it.
//! * `q4_k_m`: llama-quantize's Q4_K_M mix: Q4_K, with Q6_K on the output head, on `attn_v` /
//!   `attn_qkv` of the layers `use_more_bits` picks and on `ffn_down*` of those layers.
//! * a single type T (`--type`): every quantized weight T.
//!
//! Types that need an importance matrix (IQ2_XXS, IQ1_M): without an imatrix file that is an
//! error; a tensor the imatrix has no data for (the MTP block, which llama-imatrix never runs)
//! falls back to Q4_K, as the reference files were made. A row length that is not a whole number
//! of the type's blocks falls back like llama-quantize does (to the nearest type redlite can write).

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use redlite_gguf::quant::quantize::{quantize, QUANTIZE_TYPES};
use redlite_gguf::quant::{dequantize_to_vec, DequantError};
use redlite_gguf::{GgmlType, GgufError, GgufFile, GgufWriter, MetaValue, TensorInfo};

use crate::imatrix::Imatrix;

/// Errors from planning or writing a quantized file.
#[derive(Debug, thiserror::Error)]
pub enum QuantizeError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("unknown recipe '{0}' (recipes: {recipes})", recipes = Recipe::NAMES.join(", "))]
    UnknownRecipe(String),
    #[error("redlite cannot quantize to {0} (types: {types})", types = whole_type_names())]
    UnsupportedType(String),
    #[error("the input architecture is '{0}'; redlite quantizes only qwen3next files")]
    NotQwen3Next(String),
    #[error(
        "{recipe} puts {ty} on {tensor}, and {ty} needs an importance matrix: pass --imatrix FILE (make one with `redlite imatrix`)"
    )]
    NeedsImatrix {
        recipe: String,
        ty: GgmlType,
        tensor: String,
    },
    #[error(
        "imatrix entry for '{tensor}' has {got} values ({n_mat} slices of {n_per_row}); the tensor needs {want}"
    )]
    ImatrixShape {
        tensor: String,
        got: usize,
        n_mat: usize,
        n_per_row: usize,
        want: String,
    },
    #[error(
        "tensor '{tensor}' is already {ty}: requantizing loses quality twice (pass --allow-requantize to do it anyway)"
    )]
    Requantize { tensor: String, ty: GgmlType },
    #[error("tensor '{tensor}': {source}")]
    Dequantize {
        tensor: String,
        #[source]
        source: DequantError,
    },
    #[error("could not start {threads} threads: {message}")]
    Threads { threads: usize, message: String },
    #[error("renaming {from} to {to}: {source}")]
    Rename {
        from: PathBuf,
        to: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// How each tensor's type is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recipe {
    /// Q4_K dense, IQ2_XXS routed experts, Q6_K head.
    Cf2,
    /// llama-quantize's Q4_K_M mix.
    Q4KM,
    /// Every quantized weight one type.
    Whole(GgmlType),
}

/// The types `--type` accepts: what [`quantize`] can write.
pub fn whole_types() -> &'static [GgmlType] {
    QUANTIZE_TYPES
}

fn whole_type_names() -> String {
    whole_types()
        .iter()
        .map(|t| t.name())
        .collect::<Vec<_>>()
        .join(", ")
}

impl Recipe {
    pub const NAMES: &'static [&'static str] = &["cf2", "q4_k_m"];

    /// A named recipe (case-insensitive).
    pub fn named(name: &str) -> Result<Recipe, QuantizeError> {
        match name.to_ascii_lowercase().as_str() {
            "cf2" => Ok(Recipe::Cf2),
            "q4_k_m" => Ok(Recipe::Q4KM),
            _ => Err(QuantizeError::UnknownRecipe(name.into())),
        }
    }

    /// One type for the whole file (ggml spelling, case-insensitive).
    pub fn whole(name: &str) -> Result<Recipe, QuantizeError> {
        GgmlType::from_name(name)
            .filter(|t| whole_types().contains(t))
            .map(Recipe::Whole)
            .ok_or_else(|| QuantizeError::UnsupportedType(name.into()))
    }

    /// llama.cpp's `general.file_type` (`llama_ftype`) for the result.
    pub fn file_type(self) -> u32 {
        match self {
            Recipe::Cf2 => 14, // MOSTLY_Q4_K_S: llama-quantize's base type for the mix
            Recipe::Q4KM => 15,
            Recipe::Whole(t) => match t {
                GgmlType::F32 => 0,
                GgmlType::F16 => 1,
                GgmlType::Q8_0 => 7,
                GgmlType::Q4K => 14,
                GgmlType::Q5K => 16,
                GgmlType::Q6K => 18,
                GgmlType::IQ2XXS => 19,
                GgmlType::IQ4XS => 30,
                GgmlType::IQ1M => 31,
                GgmlType::BF16 => 32,
                _ => 1024, // LLAMA_FTYPE_GUESSED
            },
        }
    }

    pub fn label(self) -> String {
        match self {
            Recipe::Cf2 => "cf2".into(),
            Recipe::Q4KM => "q4_k_m".into(),
            Recipe::Whole(t) => t.name().into(),
        }
    }
}

/// Whether llama-quantize quantizes this tensor at all.
pub fn is_quantizable(name: &str, dims: &[u64]) -> bool {
    name.ends_with("weight")
        && dims.len() >= 2
        && !name.contains("_norm.weight")
        && !name.contains("ffn_gate_inp")
        && !name.contains("ssm_conv1d")
}

/// Whether llama-quantize insists on importance data for `ty` (IQ1_M spares the embedding and
/// the head).
fn needs_imatrix(ty: GgmlType, name: &str) -> bool {
    match ty {
        GgmlType::IQ2XXS | GgmlType::IQ2XS | GgmlType::IQ1S => true,
        GgmlType::IQ1M => name != "token_embd.weight" && name != "output.weight",
        _ => false,
    }
}

/// llama.cpp's `use_more_bits`: the first and last eighth of the layers, and every third between.
fn use_more_bits(i: usize, n: usize) -> bool {
    // `i - n / 8` cannot underflow: the first test failed.
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// The block number of `blk.N.*`.
fn block_index(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// The decision for one tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorChoice {
    pub name: String,
    pub dims: Vec<u64>,
    /// The input type.
    pub from: GgmlType,
    /// The output type (`from` when copied).
    pub to: GgmlType,
    /// Quantized with importance data.
    pub with_imatrix: bool,
    /// Why the type differs from what the recipe asked for, if it does.
    pub note: Option<String>,
}

impl TensorChoice {
    /// Copied byte for byte.
    pub fn is_copy(&self) -> bool {
        self.to == self.from
    }
}

/// Choose every tensor's type.
pub fn plan(
    file: &GgufFile,
    recipe: Recipe,
    imatrix: Option<&Imatrix>,
    allow_requantize: bool,
) -> Result<Vec<TensorChoice>, QuantizeError> {
    let arch = file
        .get_opt_str("general.architecture")?
        .unwrap_or("(none)");
    if arch != "qwen3next" {
        return Err(QuantizeError::NotQwen3Next(arch.into()));
    }
    let n_layer = file.get_usize("qwen3next.block_count")?;
    let is_wv = |n: &str| n.contains("attn_v.weight") || n.contains("attn_qkv.weight");
    let n_wv = file.tensors().iter().filter(|t| is_wv(&t.name)).count();
    let mut i_wv = 0;
    let mut out = Vec::with_capacity(file.tensors().len());
    for t in file.tensors() {
        let mut c = TensorChoice {
            name: t.name.clone(),
            dims: t.dims.clone(),
            from: t.ty,
            to: t.ty,
            with_imatrix: false,
            note: None,
        };
        if !is_quantizable(&t.name, &t.dims) {
            out.push(c);
            continue;
        }
        let wanted = match recipe {
            Recipe::Cf2 if t.name.contains("_exps.weight") => GgmlType::IQ2XXS,
            Recipe::Cf2 | Recipe::Q4KM if t.name == "output.weight" => GgmlType::Q6K,
            Recipe::Cf2 => GgmlType::Q4K,
            Recipe::Q4KM => {
                let more = if is_wv(&t.name) {
                    i_wv += 1;
                    use_more_bits(i_wv - 1, n_wv)
                } else if t.name.contains("ffn_down") {
                    block_index(&t.name).is_some_and(|i| use_more_bits(i, n_layer))
                } else {
                    false
                };
                if more {
                    GgmlType::Q6K
                } else {
                    GgmlType::Q4K
                }
            }
            Recipe::Whole(ty) => ty,
        };
        c.to = wanted;
        let entry = imatrix.and_then(|m| m.entries.get(&t.name));
        if let Some(e) = entry {
            check_imatrix_shape(t, e.n_per_row, e.n_mat(), e.in_sum2.len())?;
        }
        if needs_imatrix(wanted, &t.name) && entry.is_none() {
            if imatrix.is_none() {
                return Err(QuantizeError::NeedsImatrix {
                    recipe: match recipe {
                        Recipe::Whole(_) => "--type".into(),
                        r => format!("recipe {}", r.label()),
                    },
                    ty: wanted,
                    tensor: t.name.clone(),
                });
            }
            c.to = GgmlType::Q4K;
            c.note = Some(format!(
                "{wanted} needs importance data and the imatrix has none for this tensor: Q4_K"
            ));
        }
        if let Some((ty, why)) = block_fallback(c.to, t.ne0()) {
            c.to = ty;
            c.note = Some(why);
        }
        c.with_imatrix = entry.is_some() && c.to != c.from;
        let float_input = matches!(t.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
        if !float_input && c.to != c.from && !allow_requantize {
            return Err(QuantizeError::Requantize {
                tensor: t.name.clone(),
                ty: t.ty,
            });
        }
        out.push(c);
    }
    Ok(out)
}

/// The imatrix entry must have one slice of `ne0` values per expert (or one for a 2-D weight).
fn check_imatrix_shape(
    t: &TensorInfo,
    n_per_row: usize,
    n_mat: usize,
    got: usize,
) -> Result<(), QuantizeError> {
    let slices: u64 = t.dims.iter().skip(2).product();
    if n_per_row as u64 != t.ne0() || n_mat as u64 != slices {
        return Err(QuantizeError::ImatrixShape {
            tensor: t.name.clone(),
            got,
            n_mat,
            n_per_row,
            want: format!("{slices} slice(s) of {}", t.ne0()),
        });
    }
    Ok(())
}

/// When rows of `ne0` are not whole blocks of `ty`: llama-quantize's replacement (IQ/Q2_K/Q3_K
/// types → IQ4_NL, Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0, and F16 when even 32 does not divide),
/// or Q8_0 where redlite cannot write llama's choice.
fn block_fallback(ty: GgmlType, ne0: u64) -> Option<(GgmlType, String)> {
    if ne0.is_multiple_of(ty.block_elems() as u64) {
        return None;
    }
    let llama = match ty {
        GgmlType::Q4K => "Q5_0",
        GgmlType::Q5K => "Q5_1",
        GgmlType::Q6K => "Q8_0",
        _ => "IQ4_NL",
    };
    let (to, how) = if !ne0.is_multiple_of(32) {
        (GgmlType::F16, "F16 (not even a multiple of 32)".to_string())
    } else if llama == "Q8_0" {
        (GgmlType::Q8_0, "Q8_0, as llama-quantize does".to_string())
    } else {
        (
            GgmlType::Q8_0,
            format!("Q8_0 (llama-quantize would use {llama}, which redlite cannot write)"),
        )
    };
    Some((
        to,
        format!(
            "rows of {ne0} are not a multiple of {ty}'s block of {}: {how}",
            ty.block_elems()
        ),
    ))
}

/// How to run [`quantize_file`].
#[derive(Debug, Clone)]
pub struct QuantizeOptions<'a> {
    pub recipe: Recipe,
    pub imatrix: Option<&'a Imatrix>,
    /// The imatrix file's name, recorded in `quantize.imatrix.file`.
    pub imatrix_path: Option<String>,
    /// Worker threads (0: one per core).
    pub threads: usize,
    pub allow_requantize: bool,
}

/// What [`quantize_file`] did.
#[derive(Debug, Clone)]
pub struct QuantizeReport {
    pub tensors: Vec<TensorChoice>,
    pub bytes_in: u64,
    pub bytes_out: u64,
}

/// Values per unit of parallel work (rows are grouped up to this many values).
const WORK_VALUES: usize = 1 << 16;
/// Values dequantized at a time from one tensor (bounds memory for huge tensors).
const BATCH_VALUES: usize = 1 << 24;

/// Quantize `input` to `output`. `progress(tensor, values)` is called as values are done.
pub fn quantize_file(
    input: &Path,
    output: &Path,
    opts: &QuantizeOptions,
    mut progress: impl FnMut(&str, u64),
) -> Result<QuantizeReport, QuantizeError> {
    let file = GgufFile::open(input)?;
    let choices = plan(&file, opts.recipe, opts.imatrix, opts.allow_requantize)?;
    let writer = output_writer(&file, &choices, opts)?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(opts.threads)
        .build()
        .map_err(|e| QuantizeError::Threads {
            threads: opts.threads,
            message: e.to_string(),
        })?;
    let by_name: HashMap<&str, &TensorChoice> =
        choices.iter().map(|c| (c.name.as_str(), c)).collect();
    let tmp = temp_path(output);
    let bytes_out = writer.write_streaming_to_path(&tmp, |t, out| {
        let info = file.tensor(t.name).ok_or_else(|| {
            std::io::Error::other(format!("tensor '{}' vanished from the input", t.name))
        })?;
        let choice = by_name[t.name];
        let imp = match (choice.with_imatrix, opts.imatrix) {
            (true, Some(m)) => m.importance(t.name),
            _ => None,
        };
        write_tensor(
            &pool,
            &file,
            info,
            choice,
            imp.as_deref(),
            out,
            &mut progress,
        )
        .map_err(|e| std::io::Error::other(e.to_string()))
    });
    let bytes_out = match bytes_out {
        Ok(n) => n,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e.into());
        }
    };
    std::fs::rename(&tmp, output).map_err(|source| QuantizeError::Rename {
        from: tmp.clone(),
        to: output.to_path_buf(),
        source,
    })?;
    Ok(QuantizeReport {
        tensors: choices,
        bytes_in: file.file_size(),
        bytes_out,
    })
}

fn temp_path(output: &Path) -> PathBuf {
    let mut name = output.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    output.with_file_name(name)
}

/// The output's metadata (the input's, with `general.file_type`, `general.quantization_version`
/// and the `quantize.imatrix.*` keys at the end, as llama-quantize writes them) and tensor table.
fn output_writer<'f>(
    file: &'f GgufFile,
    choices: &[TensorChoice],
    opts: &QuantizeOptions,
) -> Result<GgufWriter<'f>, QuantizeError> {
    let mut w = GgufWriter::new();
    w.set_version(file.version())?;
    for (k, v) in file.metadata() {
        let replaced = k == "general.file_type"
            || k == "general.quantization_version"
            || k.starts_with("quantize.");
        if !replaced {
            w.add_kv(k.clone(), v.clone())?;
        }
    }
    w.add_kv("general.quantization_version", MetaValue::U32(2))?;
    w.add_kv("general.file_type", MetaValue::U32(opts.recipe.file_type()))?;
    if let Some(m) = opts
        .imatrix
        .filter(|_| choices.iter().any(|c| c.with_imatrix))
    {
        if let Some(p) = &opts.imatrix_path {
            w.add_kv("quantize.imatrix.file", MetaValue::String(p.clone()))?;
        }
        if let Some(d) = m.datasets.first() {
            w.add_kv("quantize.imatrix.dataset", MetaValue::String(d.clone()))?;
        }
        w.add_kv(
            "quantize.imatrix.entries_count",
            MetaValue::U32(m.entries.len() as u32),
        )?;
        w.add_kv(
            "quantize.imatrix.chunks_count",
            MetaValue::U32(m.chunk_count),
        )?;
    }
    for c in choices {
        w.add_tensor_deferred(c.name.clone(), &c.dims, c.to)?;
    }
    Ok(w)
}

/// Write one tensor: its bytes as they are, or dequantized and quantized again slice by slice
/// (an expert slice uses its own importance vector), rows in parallel.
fn write_tensor(
    pool: &rayon::ThreadPool,
    file: &GgufFile,
    info: &TensorInfo,
    choice: &TensorChoice,
    importance: Option<&[f32]>,
    out: &mut dyn Write,
    progress: &mut dyn FnMut(&str, u64),
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let src = file.tensor_data(info);
    if choice.is_copy() {
        out.write_all(src)?;
        progress(&info.name, info.n_elements);
        return Ok(());
    }
    let ne0 = info.ne0() as usize;
    let n_slices = info.dims.iter().skip(2).product::<u64>().max(1) as usize;
    let rows_per_slice = info.n_rows() as usize / n_slices;
    let src_row_bytes = info.row_bytes() as usize;
    let batch_rows = (BATCH_VALUES / ne0).clamp(1, rows_per_slice.max(1));
    let work_rows = (WORK_VALUES / ne0).max(1);
    for s in 0..n_slices {
        let imp = importance.map(|v| {
            if v.len() == ne0 {
                v
            } else {
                &v[s * ne0..(s + 1) * ne0]
            }
        });
        let mut row = 0;
        while row < rows_per_slice {
            let n = batch_rows.min(rows_per_slice - row);
            let first = s * rows_per_slice + row;
            let bytes = &src[first * src_row_bytes..(first + n) * src_row_bytes];
            let values =
                dequantize_to_vec(info.ty, bytes).map_err(|source| QuantizeError::Dequantize {
                    tensor: info.name.clone(),
                    source,
                })?;
            let pieces: Vec<Result<Vec<u8>, _>> = pool.install(|| {
                values
                    .par_chunks(work_rows * ne0)
                    .map(|rows| quantize(choice.to, rows, ne0, imp))
                    .collect()
            });
            for p in pieces {
                out.write_all(&p.map_err(|e| format!("tensor '{}': {e}", info.name))?)?;
            }
            progress(&info.name, (n * ne0) as u64);
            row += n;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn use_more_bits_matches_llama_for_five_layers() {
        let picked: Vec<usize> = (0..5).filter(|&i| use_more_bits(i, 5)).collect();
        assert_eq!(picked, vec![2, 4]);
    }

    #[test]
    fn quantizable_follows_llama_quantize() {
        assert!(is_quantizable("blk.0.attn_qkv.weight", &[256, 1024]));
        assert!(is_quantizable("blk.0.ffn_up_exps.weight", &[256, 256, 4]));
        assert!(!is_quantizable("blk.0.attn_norm.weight", &[256]));
        assert!(!is_quantizable("blk.0.ffn_gate_inp.weight", &[256, 4]));
        assert!(!is_quantizable("blk.0.ssm_conv1d.weight", &[4, 768]));
        assert!(!is_quantizable("blk.0.ssm_a", &[4]));
        assert!(!is_quantizable("blk.0.ssm_dt.bias", &[4]));
    }

    #[test]
    fn block_fallbacks() {
        assert_eq!(block_fallback(GgmlType::Q4K, 512), None);
        assert_eq!(block_fallback(GgmlType::Q6K, 96).unwrap().0, GgmlType::Q8_0);
        assert_eq!(
            block_fallback(GgmlType::IQ2XXS, 96).unwrap().0,
            GgmlType::Q8_0
        );
        assert_eq!(block_fallback(GgmlType::Q4K, 100).unwrap().0, GgmlType::F16);
    }

    #[test]
    fn recipe_names() {
        assert_eq!(Recipe::named("CF2").unwrap(), Recipe::Cf2);
        assert!(matches!(
            Recipe::named("q3"),
            Err(QuantizeError::UnknownRecipe(_))
        ));
        assert_eq!(
            Recipe::whole("q8_0").unwrap(),
            Recipe::Whole(GgmlType::Q8_0)
        );
        assert!(matches!(
            Recipe::whole("Q4_0"),
            Err(QuantizeError::UnsupportedType(_))
        ));
    }
}
