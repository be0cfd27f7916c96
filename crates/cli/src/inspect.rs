//! `redlite inspect`: describe a GGUF file: container facts, hyperparameters, layer pattern,
//! tensor bytes by type, dense vs routed-expert bytes, bytes read per decode token, KV-cache and
//! recurrent-state sizes; optionally every tensor, JSON output, or one tensor dequantized to f32.
//!
//! Files that are not Qwen3-Next models (other architectures, vocab-only files) get the generic
//! parts and a note that the model configuration is unavailable; that is not an error.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use redlite_gguf::quant::dequantize;
use redlite_gguf::{GgufFile, MetaValue, TensorInfo};
use redlite_model::sizing::{FileSizes, LayerSizes, ModelSizes, OUTPUT, TOKEN_EMBD};
use redlite_model::{Config, KvType, LayerKind};
use serde_json::{json, Value};

#[derive(clap::Args)]
pub struct Args {
    /// Model file (GGUF).
    #[arg(value_name = "FILE", required_unless_present = "model")]
    pub file: Option<PathBuf>,
    /// Model file (GGUF), as an option (same as FILE).
    #[arg(short = 'm', long = "model", conflicts_with = "file")]
    pub model: Option<PathBuf>,
    /// List every tensor (name, type, dims, bytes, offset).
    #[arg(long)]
    pub tensors: bool,
    /// Show the per-layer byte breakdown (always part of --json).
    #[arg(long)]
    pub layers: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Select one tensor: print its entry (and write it with --dequant) instead of the report.
    #[arg(long, value_name = "NAME")]
    pub tensor: Option<String>,
    /// Write the --tensor dequantized to raw little-endian f32 at this path.
    #[arg(long, value_name = "OUT.f32", requires = "tensor")]
    pub dequant: Option<PathBuf>,
}

pub fn run(args: Args) -> Result<()> {
    match run_inner(args) {
        // `redlite inspect … | head` closes stdout early: not an error.
        Err(e) if is_broken_pipe(&e) => Ok(()),
        r => r,
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

fn run_inner(args: Args) -> Result<()> {
    let path = args
        .file
        .as_deref()
        .or(args.model.as_deref())
        .context("no model file given")?;
    let file = GgufFile::open(path).context("opening the model file")?;

    if let Some(name) = &args.tensor {
        return run_tensor(&file, path, name, args.dequant.as_deref(), args.json);
    }

    let report = Report::new(&file, path);
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if args.json {
        let mut v = report.to_json();
        if args.tensors {
            v["tensors"] = file.tensors().iter().map(tensor_json).collect();
        }
        let text = serde_json::to_string_pretty(&v).context("encoding JSON")?;
        writeln!(out, "{text}")?;
    } else {
        report.print(&mut out, args.layers)?;
        if args.tensors {
            print_tensors(&mut out, file.tensors())?;
        }
    }
    out.flush().context("writing to stdout")?;
    Ok(())
}

/// `--tensor NAME [--dequant OUT]`: describe one tensor and optionally write it as f32.
fn run_tensor(
    file: &GgufFile,
    path: &Path,
    name: &str,
    dequant: Option<&Path>,
    json: bool,
) -> Result<()> {
    let t = file.tensor(name).with_context(|| {
        format!(
            "{} has no tensor named {name:?} (`redlite inspect --tensors` lists them)",
            path.display()
        )
    })?;
    if let Some(out_path) = dequant {
        write_dequantized(file, t, out_path)?;
    }
    if json {
        let mut v = tensor_json(t);
        if let Some(p) = dequant {
            v["dequantized_to"] = json!(p.display().to_string());
            v["dequantized_bytes"] = json!(t.n_elements * 4);
        }
        let text = serde_json::to_string_pretty(&v)?;
        writeln!(std::io::stdout().lock(), "{text}")?;
    } else {
        let mut out = std::io::stdout().lock();
        print_tensors(&mut out, std::slice::from_ref(t))?;
        if let Some(p) = dequant {
            writeln!(
                out,
                "wrote {} f32 values ({}) to {}",
                group(t.n_elements),
                human_bytes(t.n_elements * 4),
                p.display()
            )?;
        }
    }
    Ok(())
}

/// Dequantizes tensor `t` to raw little-endian f32 at `out_path`, a bounded chunk of blocks at a
/// time (expert tensors of a full-size model are gigabytes of f32).
fn write_dequantized(file: &GgufFile, t: &TensorInfo, out_path: &Path) -> Result<()> {
    const BLOCKS_PER_CHUNK: usize = 1 << 14;
    let data = file.tensor_data(t);
    if data.len() as u64 != t.n_bytes {
        bail!("tensor {}: data lies outside the file", t.name);
    }
    let chunk_bytes = BLOCKS_PER_CHUNK * t.ty.block_bytes();
    let f = File::create(out_path).with_context(|| format!("creating {}", out_path.display()))?;
    let mut w = BufWriter::new(f);
    let mut values = Vec::new();
    let mut bytes = Vec::new();
    for chunk in data.chunks(chunk_bytes) {
        values.resize(
            chunk.len() / t.ty.block_bytes() * t.ty.block_elems(),
            0.0f32,
        );
        dequantize(t.ty, chunk, &mut values)
            .with_context(|| format!("dequantizing {} ({})", t.name, t.ty))?;
        bytes.clear();
        bytes.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        w.write_all(&bytes)
            .with_context(|| format!("writing {}", out_path.display()))?;
    }
    w.flush()
        .with_context(|| format!("writing {}", out_path.display()))?;
    Ok(())
}

/// Everything the report shows, gathered once.
struct Report<'a> {
    file: &'a GgufFile,
    path: &'a Path,
    architecture: Option<String>,
    name: Option<String>,
    sizes: FileSizes,
    /// The model config and sizes, or why they are unavailable.
    model: std::result::Result<(Config, ModelSizes), String>,
}

impl<'a> Report<'a> {
    fn new(file: &'a GgufFile, path: &'a Path) -> Report<'a> {
        let model = Config::from_gguf(file)
            .map_err(|e| e.to_string())
            .and_then(|cfg| {
                ModelSizes::new(file, &cfg)
                    .map(|s| (cfg, s))
                    .map_err(|e| e.to_string())
            });
        Report {
            file,
            path,
            architecture: meta_string(file, "general.architecture"),
            name: meta_string(file, "general.name"),
            sizes: FileSizes::of(file),
            model,
        }
    }

    fn print(&self, out: &mut impl Write, show_layers: bool) -> Result<()> {
        let f = self.file;
        writeln!(out, "file:           {}", self.path.display())?;
        writeln!(out, "file size:      {}", bytes_line(f.file_size()))?;
        writeln!(
            out,
            "GGUF:           version {}, alignment {}, {} metadata keys, data at byte {}",
            f.version(),
            f.alignment(),
            f.metadata().len(),
            group(f.data_offset())
        )?;
        writeln!(
            out,
            "architecture:   {}",
            self.architecture.as_deref().unwrap_or("(not set)")
        )?;
        writeln!(
            out,
            "name:           {}",
            self.name.as_deref().unwrap_or("(not set)")
        )?;

        let model = match &self.model {
            Ok((cfg, s)) => {
                print_config(out, cfg, s)?;
                Some(s)
            }
            Err(why) => {
                writeln!(out, "\nmodel config unavailable: {why}")?;
                None
            }
        };

        self.print_tensor_totals(out, model)?;

        if let Some(s) = model {
            print_decode(out, s, self.file)?;
            if show_layers {
                print_layers(out, s)?;
            }
        }
        Ok(())
    }

    fn print_tensor_totals(&self, out: &mut impl Write, model: Option<&ModelSizes>) -> Result<()> {
        let s = &self.sizes;
        writeln!(out, "\ntensors:        {}", s.n_tensors)?;
        if s.n_tensors == 0 {
            return Ok(());
        }
        writeln!(
            out,
            "  {:<8} {:>6} {:>14} {:>11} {:>7}",
            "type", "count", "bytes", "", "bpw"
        )?;
        for t in &s.by_type {
            writeln!(
                out,
                "  {:<8} {:>6} {:>14} {:>11} {:>7.4}",
                t.ty.name(),
                t.count,
                group(t.bytes),
                human_bytes(t.bytes),
                t.ty.bits_per_weight()
            )?;
        }
        writeln!(
            out,
            "  {:<8} {:>6} {:>14} {:>11}",
            "total",
            s.n_tensors,
            group(s.tensor_bytes),
            human_bytes(s.tensor_bytes)
        )?;
        writeln!(
            out,
            "dense weights:  {} (every tensor that is not a routed expert)",
            bytes_line(s.dense_bytes)
        )?;
        writeln!(
            out,
            "routed experts: {} (*_exps, all experts)",
            bytes_line(s.expert_bytes)
        )?;
        if let Some(m) = model {
            let embd = m.token_embd_bytes;
            let head = m.output_bytes.unwrap_or(0);
            let mut parts = format!(
                "  of the dense: token_embd {}, output {}",
                human_bytes(embd),
                human_bytes(head)
            );
            if !m.mtp.is_empty() {
                let mtp: u64 = m.mtp.iter().map(|b| b.dense_bytes).sum();
                parts.push_str(&format!(", MTP block {}", human_bytes(mtp)));
            }
            writeln!(out, "{parts}")?;
        }
        Ok(())
    }

    fn to_json(&self) -> Value {
        let f = self.file;
        let s = &self.sizes;
        let mut v = json!({
            "file": self.path.display().to_string(),
            "file_size": f.file_size(),
            "gguf_version": f.version(),
            "alignment": f.alignment(),
            "data_offset": f.data_offset(),
            "metadata_keys": f.metadata().len(),
            "architecture": self.architecture,
            "name": self.name,
            "tensor_count": s.n_tensors,
            "tensor_bytes": s.tensor_bytes,
            "by_type": s.by_type.iter().map(|t| json!({
                "type": t.ty.name(),
                "count": t.count,
                "bytes": t.bytes,
            })).collect::<Vec<_>>(),
            "dense_bytes": s.dense_bytes,
            "expert_bytes": s.expert_bytes,
        });
        match &self.model {
            Ok((cfg, m)) => {
                v["config"] = config_json(cfg);
                v["layer_pattern"] = json!(layer_pattern(&cfg.layer_kinds));
                v["sizes"] = sizes_json(m, f);
            }
            Err(why) => {
                v["config"] = Value::Null;
                v["config_unavailable"] = json!(why);
            }
        }
        v
    }
}

fn print_config(out: &mut impl Write, c: &Config, s: &ModelSizes) -> Result<()> {
    writeln!(out, "\nhyperparameters:")?;
    let rows: Vec<(&str, String)> = vec![
        ("hidden", c.hidden.to_string()),
        ("n_layers (trunk)", c.n_layers.to_string()),
        ("vocab", c.vocab.to_string()),
        ("context_length", c.context_length.to_string()),
        ("rms_eps", format!("{:e}", c.rms_eps)),
        ("n_heads", c.n_heads.to_string()),
        ("n_kv_heads", c.n_kv_heads.to_string()),
        ("head_dim", c.head_dim.to_string()),
        ("rope_dims", c.rope_dims.to_string()),
        ("rope_theta", format!("{}", c.rope_theta)),
        ("conv_kernel", c.conv_kernel.to_string()),
        ("dn_k_heads", c.dn_k_heads.to_string()),
        ("dn_v_heads", c.dn_v_heads.to_string()),
        ("dn_k_dim", c.dn_k_dim.to_string()),
        ("dn_v_dim", c.dn_v_dim.to_string()),
        ("n_experts", c.n_experts.to_string()),
        ("n_experts_used", c.n_experts_used.to_string()),
        ("expert_ff", c.expert_ff.to_string()),
        ("shared_ff", c.shared_ff.to_string()),
        ("nextn_layers (MTP)", c.nextn_layers.to_string()),
    ];
    for (k, v) in rows {
        writeln!(out, "  {k:<20} {v}")?;
    }
    let mut pattern = layer_pattern(&c.layer_kinds);
    if !s.mtp.is_empty() {
        pattern.push_str(&format!(" + {} MTP block(s)", s.mtp.len()));
    } else if c.nextn_layers > 0 {
        pattern.push_str(" (MTP declared, no MTP tensors stored)");
    }
    writeln!(
        out,
        "layer pattern:  {pattern}   (D = Gated DeltaNet, A = full attention; {} D + {} A)",
        c.count(LayerKind::DeltaNet),
        c.count(LayerKind::Attention)
    )?;
    Ok(())
}

fn print_decode(out: &mut impl Write, s: &ModelSizes, file: &GgufFile) -> Result<()> {
    let d = &s.decode;
    let k = s.layers.len();
    let (n_used, n_exp) = experts_used(file);
    let head_name = if s.head_is_tied() { TOKEN_EMBD } else { OUTPUT };
    let head_ty = file.tensor(head_name).map(|t| t.ty.name()).unwrap_or("?");
    writeln!(out, "\nbytes read per decode token (batch 1):")?;
    let rows = [
        ("dense (trunk without embedding/head)".to_string(), d.dense),
        (
            format!("routed experts (top-{n_used} of {n_exp}, {k} layers)"),
            d.experts,
        ),
        (format!("head ({head_name}, {head_ty})"), d.head),
        ("token embedding row".to_string(), d.embedding_row),
    ];
    for (label, b) in &rows {
        writeln!(out, "  {label:<42} {:>11} {:>16} B", mb(*b), group(*b))?;
    }
    writeln!(
        out,
        "  {:<42} {:>11} {:>16} B   (= {} + {} + {} + {})",
        "total",
        mb(d.total()),
        group(d.total()),
        mb(d.dense),
        mb(d.experts),
        mb(d.head),
        mb(d.embedding_row)
    )?;
    let non_expert = d.total() - d.experts;
    writeln!(
        out,
        "  {:<42} {:>11} {:>16} B",
        "  of which not experts (dense+head+row)",
        mb(non_expert),
        group(non_expert)
    )?;
    if let Some(mtp) = s.mtp_per_token_bytes() {
        let dense: u64 = s.mtp.iter().map(|b| b.dense_bytes).sum();
        let experts: u64 = s.mtp.iter().map(|b| b.top_k_expert_bytes).sum();
        writeln!(
            out,
            "MTP block:      {} stored; per draft token {} (dense {} + top-{n_used} experts {}), plus the head and an embedding row",
            human_bytes(s.mtp_total_bytes()),
            mb(mtp),
            mb(dense),
            mb(experts)
        )?;
    }
    writeln!(
        out,
        "KV per position: f32 {} ({}), f16 {} ({}), q8_0 {} ({}){}",
        bytes_line(s.kv_bytes_per_position_f32()),
        kib(s.kv_bytes_per_position_f32()),
        bytes_line(s.kv_bytes_per_position_f16()),
        kib(s.kv_bytes_per_position_f16()),
        bytes_line(s.kv_bytes_per_position(KvType::Q8_0)),
        kib(s.kv_bytes_per_position(KvType::Q8_0)),
        if s.mtp_kv_values_per_position > 0 {
            format!(
                "; MTP block adds f32 {} / f16 {}",
                group(s.mtp_kv_values_per_position * 4),
                group(s.mtp_kv_values_per_position * 2)
            )
        } else {
            String::new()
        }
    )?;
    writeln!(
        out,
        "recurrent state per sequence (f32): {} ({})",
        bytes_line(s.recurrent_state_bytes_f32()),
        mib(s.recurrent_state_bytes_f32())
    )?;
    Ok(())
}

fn print_layers(out: &mut impl Write, s: &ModelSizes) -> Result<()> {
    writeln!(out, "\nper layer:")?;
    writeln!(
        out,
        "  {:>5} {:<5} {:>7} {:>11} {:>11} {:>11} {:>11}",
        "blk", "kind", "tensors", "dense", "experts", "top-k", "per token"
    )?;
    for l in s.layers.iter().chain(&s.mtp) {
        writeln!(
            out,
            "  {:>5} {:<5} {:>7} {:>11} {:>11} {:>11} {:>11}",
            l.index,
            layer_label(l),
            l.n_tensors,
            human_bytes(l.dense_bytes),
            human_bytes(l.expert_bytes),
            human_bytes(l.top_k_expert_bytes),
            human_bytes(l.per_token_bytes())
        )?;
    }
    Ok(())
}

fn print_tensors(out: &mut impl Write, tensors: &[TensorInfo]) -> Result<()> {
    writeln!(
        out,
        "\n{:<40} {:<8} {:<24} {:>14} {:>16}",
        "tensor", "type", "dims", "bytes", "offset"
    )?;
    for t in tensors {
        writeln!(
            out,
            "{:<40} {:<8} {:<24} {:>14} {:>16}",
            t.name,
            t.ty.name(),
            format!("{:?}", t.dims),
            group(t.n_bytes),
            group(t.offset)
        )?;
    }
    Ok(())
}

fn layer_label(l: &LayerSizes) -> &'static str {
    match (l.is_mtp, l.kind) {
        (true, _) => "MTP",
        (false, LayerKind::DeltaNet) => "D",
        (false, LayerKind::Attention) => "A",
    }
}

fn config_json(c: &Config) -> Value {
    json!({
        "hidden": c.hidden,
        "n_layers": c.n_layers,
        "layer_kinds": c.layer_kinds.iter().map(|k| match k {
            LayerKind::DeltaNet => "deltanet",
            LayerKind::Attention => "attention",
        }).collect::<Vec<_>>(),
        "vocab": c.vocab,
        "context_length": c.context_length,
        "rms_eps": c.rms_eps,
        "n_heads": c.n_heads,
        "n_kv_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "rope_dims": c.rope_dims,
        "rope_theta": c.rope_theta,
        "conv_kernel": c.conv_kernel,
        "dn_k_heads": c.dn_k_heads,
        "dn_v_heads": c.dn_v_heads,
        "dn_k_dim": c.dn_k_dim,
        "dn_v_dim": c.dn_v_dim,
        "n_experts": c.n_experts,
        "n_experts_used": c.n_experts_used,
        "expert_ff": c.expert_ff,
        "shared_ff": c.shared_ff,
        "nextn_layers": c.nextn_layers,
    })
}

fn layer_json(l: &LayerSizes) -> Value {
    json!({
        "index": l.index,
        "kind": match l.kind {
            LayerKind::DeltaNet => "deltanet",
            LayerKind::Attention => "attention",
        },
        "mtp": l.is_mtp,
        "tensors": l.n_tensors,
        "dense_bytes": l.dense_bytes,
        "expert_bytes": l.expert_bytes,
        "expert_slab_bytes": l.expert_slab_bytes,
        "top_k_expert_bytes": l.top_k_expert_bytes,
        "per_token_bytes": l.per_token_bytes(),
    })
}

fn sizes_json(s: &ModelSizes, file: &GgufFile) -> Value {
    let d = &s.decode;
    let head_name = if s.head_is_tied() { TOKEN_EMBD } else { OUTPUT };
    let mut v = json!({
        "token_embd_bytes": s.token_embd_bytes,
        "output_bytes": s.output_bytes,
        "other_global_bytes": s.other_global_bytes,
        "decode_per_token": {
            "dense": d.dense,
            "experts": d.experts,
            "head": d.head,
            "head_tensor": head_name,
            "head_type": file.tensor(head_name).map(|t| t.ty.name()),
            "embedding_row": d.embedding_row,
            "total": d.total(),
        },
        "mtp": if s.mtp.is_empty() { Value::Null } else { json!({
            "total_bytes": s.mtp_total_bytes(),
            "dense": s.mtp.iter().map(|b| b.dense_bytes).sum::<u64>(),
            "experts_top_k": s.mtp.iter().map(|b| b.top_k_expert_bytes).sum::<u64>(),
            "per_token": s.mtp_per_token_bytes(),
            "kv_bytes_per_position_f32": s.mtp_kv_values_per_position * 4,
            "kv_bytes_per_position_f16": s.mtp_kv_values_per_position * 2,
        })},
        "kv_bytes_per_position": {
            "f32": s.kv_bytes_per_position_f32(),
            "f16": s.kv_bytes_per_position_f16(),
            "q8_0": s.kv_bytes_per_position(KvType::Q8_0),
        },
        "recurrent_state_bytes_f32": s.recurrent_state_bytes_f32(),
    });
    v["layers"] = s.layers.iter().chain(&s.mtp).map(layer_json).collect();
    v
}

fn tensor_json(t: &TensorInfo) -> Value {
    json!({
        "name": t.name,
        "type": t.ty.name(),
        "dims": t.dims,
        "n_elements": t.n_elements,
        "bytes": t.n_bytes,
        "offset": t.offset,
    })
}

/// `n_experts_used` and `n_experts` from the metadata (for labels only).
fn experts_used(file: &GgufFile) -> (String, String) {
    let get = |k: &str| {
        file.get(&format!("qwen3next.{k}"))
            .and_then(MetaValue::as_integer)
            .map(|v| v.to_string())
            .unwrap_or_else(|| "?".into())
    };
    (get("expert_used_count"), get("expert_count"))
}

fn meta_string(file: &GgufFile, key: &str) -> Option<String> {
    file.get(key)
        .and_then(MetaValue::as_str)
        .map(str::to_string)
}

/// The layer kinds as a string of D/A letters, shortened to its smallest repeating unit:
/// `"DDDA" ×12` for the 48-layer Qwen3-Next, the full string when it does not repeat.
pub fn layer_pattern(kinds: &[LayerKind]) -> String {
    let letters: String = kinds
        .iter()
        .map(|k| match k {
            LayerKind::DeltaNet => 'D',
            LayerKind::Attention => 'A',
        })
        .collect();
    let n = letters.len();
    for p in 1..n {
        if n.is_multiple_of(p)
            && letters
                .as_bytes()
                .chunks(p)
                .all(|c| c == &letters.as_bytes()[..p])
        {
            return format!("\"{}\" ×{}", &letters[..p], n / p);
        }
    }
    format!("\"{letters}\"")
}

/// Decimal human-readable size (1 kB = 1000 B), as the sizing tables use.
pub fn human_bytes(b: u64) -> String {
    let x = b as f64;
    if x >= 1e12 {
        format!("{:.2} TB", x / 1e12)
    } else if x >= 1e9 {
        format!("{:.2} GB", x / 1e9)
    } else if x >= 1e6 {
        format!("{:.1} MB", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1} kB", x / 1e3)
    } else {
        format!("{b} B")
    }
}

/// Always in MB (for the per-token table, whose parts are summed).
fn mb(b: u64) -> String {
    format!("{:.3} MB", b as f64 / 1e6)
}

fn kib(b: u64) -> String {
    format!("{:.1} KiB", b as f64 / 1024.0)
}

fn mib(b: u64) -> String {
    format!("{:.2} MiB", b as f64 / (1024.0 * 1024.0))
}

/// `human (exact B)`.
fn bytes_line(b: u64) -> String {
    if b < 1000 {
        format!("{b} B")
    } else {
        format!("{} ({} B)", human_bytes(b), group(b))
    }
}

/// An integer with thousands separators: 1,234,567.
pub fn group(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grouping_and_units() {
        assert_eq!(group(0), "0");
        assert_eq!(group(999), "999");
        assert_eq!(group(1000), "1,000");
        assert_eq!(group(79_036_416), "79,036,416");
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(49_152), "49.2 kB");
        assert_eq!(human_bytes(389_283_840), "389.3 MB");
        assert_eq!(human_bytes(1_330_000_000), "1.33 GB");
    }

    #[test]
    fn layer_patterns() {
        use LayerKind::{Attention as A, DeltaNet as D};
        let qwen: Vec<_> = (0..48).map(|i| if i % 4 == 3 { A } else { D }).collect();
        assert_eq!(layer_pattern(&qwen), "\"DDDA\" ×12");
        assert_eq!(layer_pattern(&[D, D, D, A]), "\"DDDA\"");
        assert_eq!(layer_pattern(&[D, A, A]), "\"DAA\"");
        assert_eq!(layer_pattern(&[A, A]), "\"A\" ×2");
        assert_eq!(layer_pattern(&[]), "\"\"");
    }
}
