//! `redlite make-model`: write a Qwen3-Next GGUF file with the real layout (tensor names,
//! shapes, types, metadata, tokenizer) and random but valid weights, for benchmarks only: the
//! weights mean nothing, so a file made here is never a correctness oracle.
//!
//! The data is generated and written tensor by tensor in chunks, so memory stays small even for
//! the ≈ 21.5 GB full-size layout.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use redlite_gguf::quant::random::{fill_random_blocks, QuantRng};
use redlite_gguf::{GgmlType, GgufFile, GgufWriter};
use redlite_model::layout::{Layout, LayoutParams, LayoutTypes, TensorRole, LAYOUT_NAMES};

/// Where the Qwen3 vocabulary is looked for when `--vocab` is not given (the shared fixtures,
/// absolute on the dev machine, relative to the repository root in CI).
const DEFAULT_VOCABS: &[&str] = &[
    "/work/shared/reference/tokenizer/qwen3-vocab.gguf",
    "../shared/reference/tokenizer/qwen3-vocab.gguf",
];

/// Bytes generated per write (a multiple of the block size is taken).
const CHUNK_BYTES: usize = 4 << 20;

#[derive(clap::Args)]
pub struct Args {
    /// Output GGUF file.
    #[arg(value_name = "OUT")]
    pub out: PathBuf,
    /// Layout: qwen3next-80b-a3b (full size) or qwen3next-tiny (the fixtures' shape, for tests).
    #[arg(long, default_value = "qwen3next-80b-a3b")]
    pub layout: String,
    /// Type of every non-expert matrix (attention, DeltaNet, shared expert, token embedding).
    #[arg(long, default_value = "Q4_K")]
    pub dense: String,
    /// Type of the routed experts.
    #[arg(long, default_value = "IQ2_XXS")]
    pub experts: String,
    /// Type of the output head (`output.weight`).
    #[arg(long, default_value = "Q6_K")]
    pub head: String,
    /// Number of trunk layers (default: the layout's); layer i is attention iff (i+1) % 4 == 0.
    #[arg(long)]
    pub layers: Option<u64>,
    /// GGUF file whose tokenizer.* keys are copied (its vocabulary sets the embedding size).
    #[arg(long, value_name = "FILE")]
    pub vocab: Option<PathBuf>,
    /// Add the MTP block (`blk.N.nextn.*`, block_count N+1, nextn_predict_layers 1).
    #[arg(long)]
    pub mtp: bool,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,
    /// Overwrite OUT if it exists.
    #[arg(long)]
    pub force: bool,
    /// How skewed routing is: expert e of a layer (in a seeded random order) gets router rows
    /// scaled by (1 + rank)^-S, so high-ranked experts win the top-k more often. 0: near-uniform.
    #[arg(long, default_value_t = 0.0, value_name = "S")]
    pub routing_skew: f32,
    /// How token-independent routing is: each expert's router row gets a fixed random offset of
    /// L × its noise scale along the all-ones direction, which the hidden states' common mean
    /// turns into a per-expert bias. 0: routing depends on the token alone.
    #[arg(long, default_value_t = 0.0, value_name = "L")]
    pub routing_locality: f32,
}

/// The routing knobs of `make-model`.
#[derive(Debug, Clone, Copy)]
struct Routing {
    skew: f32,
    locality: f32,
}

fn parse_type(flag: &str, name: &str) -> Result<GgmlType> {
    GgmlType::from_name(name).with_context(|| {
        let names: Vec<&str> = redlite_gguf::TYPE_TRAITS.iter().map(|t| t.name).collect();
        format!(
            "--{flag} {name}: unknown type (known: {})",
            names.join(", ")
        )
    })
}

fn find_vocab(arg: Option<PathBuf>) -> Result<PathBuf> {
    if let Some(p) = arg {
        return Ok(p);
    }
    DEFAULT_VOCABS
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .with_context(|| {
            format!(
                "no vocabulary found at {}; pass --vocab FILE (any qwen3next GGUF, a vocab-only \
                 file is enough)",
                DEFAULT_VOCABS.join(" or ")
            )
        })
}

/// Free bytes on the filesystem holding `dir`, from `df` (None when it cannot be told).
fn free_bytes(dir: &Path) -> Option<u64> {
    let out = std::process::Command::new("df")
        .arg("-Pk")
        .arg(dir)
        .output()
        .ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    let line = text.lines().nth(1)?;
    let avail_kb: u64 = line.split_whitespace().nth(3)?.parse().ok()?;
    Some(avail_kb * 1024)
}

pub fn run(args: Args) -> Result<()> {
    let mut params = LayoutParams::by_name(&args.layout).with_context(|| {
        format!(
            "unknown layout '{}' (known: {})",
            args.layout,
            LAYOUT_NAMES.join(", ")
        )
    })?;
    let types = LayoutTypes {
        dense: parse_type("dense", &args.dense)?,
        experts: parse_type("experts", &args.experts)?,
        head: parse_type("head", &args.head)?,
    };
    if let Some(n) = args.layers {
        params.n_layers = n;
    }
    params.mtp = args.mtp;
    if args.out.exists() && !args.force {
        bail!(
            "{} exists; pass --force to overwrite it",
            args.out.display()
        );
    }

    let vocab_path = find_vocab(args.vocab)?;
    let vocab = GgufFile::open(&vocab_path).context("opening the vocabulary file")?;
    let tokens = vocab
        .get_str_array("tokenizer.ggml.tokens")
        .with_context(|| format!("{} has no tokenizer", vocab_path.display()))?;
    params.vocab = tokens.len() as u64;

    let layout = Layout::new(params, types).context("building the layout")?;
    let mut w = GgufWriter::new();
    for (k, v) in layout.metadata() {
        w.add_kv(k, v)?;
    }
    for (k, v) in vocab.metadata() {
        if k.starts_with("tokenizer.") {
            w.add_kv(k.clone(), v.clone())?;
        }
    }
    for t in &layout.tensors {
        w.add_tensor_deferred(t.name.clone(), &t.dims, t.ty)?;
    }

    let total = w.tensor_data_bytes();
    let dir = match args.out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if let Some(free) = free_bytes(&dir) {
        // An existing OUT being overwritten frees its space first.
        let reclaim = std::fs::metadata(&args.out).map(|m| m.len()).unwrap_or(0);
        if free + reclaim < total + (256 << 20) {
            bail!(
                "{} needs {:.2} GB but {} has {:.2} GB free",
                args.out.display(),
                total as f64 / 1e9,
                dir.display(),
                (free + reclaim) as f64 / 1e9
            );
        }
    }

    eprintln!(
        "writing {}: layout {}, {} layers{}, {} tensors, {:.2} GB of tensor data \
         (dense {}, experts {}, head {})",
        args.out.display(),
        args.layout,
        layout.params.n_layers,
        if layout.params.mtp { " + MTP" } else { "" },
        layout.tensors.len(),
        total as f64 / 1e9,
        types.dense,
        types.experts,
        types.head
    );
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta} {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let start = Instant::now();
    let seed = args.seed;
    let roles: Vec<TensorRole> = layout.tensors.iter().map(|t| t.role).collect();
    let hidden = layout.params.hidden;
    if !(args.routing_skew >= 0.0 && args.routing_locality >= 0.0) {
        bail!("--routing-skew and --routing-locality must be ≥ 0");
    }
    let routing = Routing {
        skew: args.routing_skew,
        locality: args.routing_locality,
    };
    let written = w
        .write_streaming_to_path(&args.out, |t, out| {
            bar.set_message(t.name.to_string());
            // One generator per tensor: the data does not depend on the chunking.
            let mut rng =
                QuantRng::new(seed ^ (t.index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            write_tensor(
                roles[t.index],
                t.ty,
                t.n_bytes,
                hidden,
                routing,
                &mut rng,
                out,
                &bar,
            )
        })
        .with_context(|| format!("writing {}", args.out.display()))?;
    bar.finish_and_clear();
    let secs = start.elapsed().as_secs_f64();
    println!(
        "wrote {}: {} tensors, {:.2} GB ({} bytes) in {:.1} s, {:.2} GB/s",
        args.out.display(),
        layout.tensors.len(),
        written as f64 / 1e9,
        written,
        secs,
        written as f64 / 1e9 / secs.max(1e-9)
    );
    Ok(())
}

/// Router rows `[n_experts][hidden]`: `σ · (s_e · n_ed + L · β_e)` with `n, β ~ N(0, 1)`,
/// `s_e = (1 + rank_e)^-skew` over a seeded random ranking of the experts, `σ = 0.1/√hidden`
/// (router logits of a normed input then have σ ≈ 0.1 at skew 0: near-uniform routing).
fn router_values(n_values: usize, hidden: usize, routing: Routing, rng: &mut QuantRng) -> Vec<f32> {
    let n_experts = n_values / hidden.max(1);
    let sigma = 0.1 / (hidden as f32).sqrt();
    // A seeded random ranking (Fisher–Yates), so hot experts differ between layers.
    let mut rank_of: Vec<usize> = (0..n_experts).collect();
    for i in (1..n_experts).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        rank_of.swap(i, j);
    }
    let mut v = Vec::with_capacity(n_values);
    for &rank in &rank_of {
        let scale = (1.0 + rank as f32).powf(-routing.skew);
        let offset = routing.locality * rng.normal(0.0, 1.0);
        for _ in 0..hidden {
            v.push(sigma * (scale * rng.normal(0.0, 1.0) + offset));
        }
    }
    v
}

/// Generates and writes one tensor's `n_bytes`.
#[allow(clippy::too_many_arguments)]
fn write_tensor(
    role: TensorRole,
    ty: GgmlType,
    n_bytes: u64,
    hidden: u64,
    routing: Routing,
    rng: &mut QuantRng,
    out: &mut dyn Write,
    bar: &ProgressBar,
) -> std::io::Result<()> {
    let plain_router = routing.skew == 0.0 && routing.locality == 0.0;
    if role == TensorRole::Router && ty == GgmlType::F32 && !plain_router {
        let values = router_values((n_bytes / 4) as usize, hidden as usize, routing, rng);
        let buf: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        out.write_all(&buf)?;
        bar.inc(n_bytes);
        return Ok(());
    }
    if role != TensorRole::Matrix && ty == GgmlType::F32 {
        let n = (n_bytes / 4) as usize;
        let inv_sqrt_h = 1.0 / (hidden as f32).sqrt();
        let mut buf = Vec::with_capacity(n_bytes as usize);
        for _ in 0..n {
            let v = match role {
                TensorRole::Norm | TensorRole::GatedNorm => rng.normal(1.0, 0.05),
                TensorRole::ConvTaps => rng.normal(0.0, 0.2),
                TensorRole::DtBias => rng.normal(0.0, 0.02),
                TensorRole::DecayA => -rng.uniform(1.0, 16.0),
                // Router logits of a normed input come out with σ ≈ 0.1: near-uniform routing.
                TensorRole::Router => rng.normal(0.0, 0.1 * inv_sqrt_h),
                TensorRole::SharedExpertGate => rng.normal(0.0, inv_sqrt_h),
                TensorRole::Matrix => rng.normal(0.0, 0.02),
            };
            buf.extend_from_slice(&v.to_le_bytes());
        }
        out.write_all(&buf)?;
        bar.inc(n_bytes);
        return Ok(());
    }
    let bb = ty.block_bytes();
    let chunk = (CHUNK_BYTES / bb).max(1) * bb;
    let mut buf = vec![0u8; chunk.min(n_bytes as usize)];
    let mut left = n_bytes as usize;
    while left > 0 {
        let k = left.min(chunk);
        let piece = &mut buf[..k];
        fill_random_blocks(ty, piece, rng)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        out.write_all(piece)?;
        bar.inc(k as u64);
        left -= k;
    }
    Ok(())
}
