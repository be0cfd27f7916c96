//! `redlite parity`: run prompts through redlite and compare the logits with a reference —
//! llama.cpp run live through its Python binding (`scripts/llamacpp_logits.py`), or the stored
//! reference logits of `../shared/reference` (`--reference exact` or `--reference llamacpp`, no
//! Python needed). Reports mean/max KL, top-1 agreement, the largest logit difference and the
//! first step where the greedy continuations part.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use redlite_engine::parity::{
    compare_row, first_divergence, rows_from_le_bytes, run_prompt, ParityStats, PromptRun,
};
use redlite_engine::{load_model_from, with_model, BackendChoice};
use redlite_gguf::GgufFile;
use redlite_model::Mode;
use redlite_tokenizer::tokenizer::Tokenizer;
use serde_json::{json, Value};

#[derive(clap::Args)]
pub struct Args {
    /// Model file (GGUF).
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// What to compare with: `live` runs llama.cpp now (llama-cpp-python); `exact` / `llamacpp`
    /// use the stored reference logits of this model file under --fixtures.
    #[arg(long, default_value = "live", value_parser = ["live", "exact", "llamacpp"])]
    pub reference: String,
    /// Prompts for `live`: a prompts.json (`{"NAME": {"text": …, "ids": […]}}`) or a folder
    /// holding one, or a folder of `*.txt` files (one prompt each). Default: the fixtures' prompts.
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// The reference fixtures folder.
    #[arg(long, default_value = "../shared/reference")]
    pub fixtures: PathBuf,
    /// Which stored model's references to use (`F16`, `Q4_K_M`, …). Default: matched by file name.
    #[arg(long)]
    pub model_key: Option<String>,
    /// Greedy tokens to compare after each prompt (0: none).
    #[arg(short = 'n', long, default_value_t = 64)]
    pub greedy: usize,
    /// How redlite runs the prompt: one `prefill` pass or one token per `step`.
    #[arg(long, default_value = "prefill", value_parser = ["prefill", "step"])]
    pub mode: String,
    /// Compute backend: oracle (f32 reference) or cpu.
    #[arg(long, default_value = "oracle")]
    pub backend: String,
    /// CPU threads (0: one per core), for redlite's cpu backend and for llama.cpp.
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    /// Python interpreter for `live`.
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// The llama.cpp helper script (default: scripts/llamacpp_logits.py of this repository).
    #[arg(long)]
    pub script: Option<PathBuf>,
    /// Use llama.cpp logits already written by the helper script into this folder (its
    /// result.json) instead of running it.
    #[arg(long)]
    pub llamacpp_dir: Option<PathBuf>,
    /// Fail (exit status 1) when the mean KL over all rows exceeds this.
    #[arg(long)]
    pub max_kl_mean: Option<f64>,
    /// Fail when a greedy continuation diverges at a step whose top-2 logit gap (redlite's) is at
    /// least this (a smaller gap is a tie within rounding).
    #[arg(long)]
    pub fail_on_greedy_gap: Option<f32>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// One prompt with the reference's rows.
struct RefPrompt {
    name: String,
    ids: Vec<u32>,
    /// Prompt positions the reference rows belong to (row i: prediction after ids[..=positions[i]]).
    positions: Vec<usize>,
    rows: Vec<Vec<f32>>,
    greedy: Option<Vec<u32>>,
    /// The reference's tokenization of the prompt text, where it gave one.
    tokenized: Option<Vec<u32>>,
}

pub fn run(args: Args) -> Result<()> {
    let choice = BackendChoice::parse(&args.backend)?;
    let file = Arc::new(GgufFile::open(&args.model).context("opening the model file")?);
    let tokenizer = Tokenizer::from_gguf(&file).context("building the tokenizer")?;
    let model = load_model_from(file.clone(), choice, args.threads)
        .with_context(|| format!("loading {}", args.model.display()))?;
    let vocab = with_model!(&model, m => m.config.vocab);
    let mode = if args.mode == "step" {
        Mode::Step
    } else {
        Mode::Prefill
    };

    let (label, prompts) = match args.reference.as_str() {
        "live" => (
            "llama.cpp (live)".to_string(),
            live_reference(&args, &tokenizer, vocab)?,
        ),
        kind => (
            format!("stored {kind}"),
            stored_reference(&args, kind, vocab)?,
        ),
    };
    if prompts.is_empty() {
        bail!("no prompts to compare");
    }

    let mut total = ParityStats::default();
    let mut reports = Vec::new();
    let mut failures = Vec::new();
    let mut lines = Vec::new();
    for p in &prompts {
        let n_greedy = if p.greedy.is_some() { args.greedy } else { 0 };
        let run: PromptRun = with_model!(&model, m => run_prompt(m, &p.ids, mode, n_greedy))
            .with_context(|| format!("running prompt {}", p.name))?;
        let mut stats = ParityStats::default();
        let mut worst_row = None;
        for (i, (&pos, reference)) in p.positions.iter().zip(&p.rows).enumerate() {
            let ours = run.logits.get(pos).ok_or_else(|| {
                anyhow!(
                    "prompt {}: stored position {pos} is past the prompt ({} tokens)",
                    p.name,
                    p.ids.len()
                )
            })?;
            let cmp =
                compare_row(i, reference, ours).with_context(|| format!("prompt {}", p.name))?;
            if worst_row.is_none_or(|(_, kl)| cmp.kl > kl) {
                worst_row = Some((pos, cmp.kl));
            }
            stats.push(&cmp);
        }
        total.merge(&stats);

        let greedy = p.greedy.as_ref().map(|reference| {
            let n = args.greedy.min(reference.len());
            let div = first_divergence(&run.greedy[..n.min(run.greedy.len())], &reference[..n]);
            let gap = div.and_then(|d| run.greedy_gaps.get(d).copied());
            (n, div, gap, reference)
        });
        let greedy_text = match greedy {
            None => "greedy: -".to_string(),
            Some((n, None, _, _)) => format!("greedy: identical ({n} tokens)"),
            Some((_, Some(d), gap, reference)) => {
                let ours = run.greedy.get(d).map_or("-".into(), |t| t.to_string());
                let theirs = reference.get(d).map_or("-".into(), |t| t.to_string());
                let gap = gap.unwrap_or(f32::NAN);
                if args.fail_on_greedy_gap.is_some_and(|g| gap >= g) {
                    failures.push(format!(
                        "{}: greedy diverges at step {d} with top-2 gap {gap:.3e}",
                        p.name
                    ));
                }
                format!("greedy: diverges at step {d} (redlite {ours}, reference {theirs}; redlite top-2 gap {gap:.3e})")
            }
        };
        let tokenize_note = match &p.tokenized {
            Some(t) if *t != p.ids => " [reference tokenizes the text differently]",
            _ => "",
        };
        lines.push(format!(
            "{:<6} rows {:>4}  KL mean {:.3e} max {:.3e}  top-1 {:>6.2}%  max|Δ| {:.3e}  {}{}",
            p.name,
            stats.rows,
            stats.kl_mean(),
            stats.kl_max,
            100.0 * stats.top1_rate(),
            stats.max_abs,
            greedy_text,
            tokenize_note
        ));
        reports.push(json!({
            "prompt": p.name,
            "rows": stats.rows,
            "kl_mean": stats.kl_mean(),
            "kl_max": stats.kl_max,
            "kl_reverse_mean": stats.kl_reverse_mean(),
            "kl_reverse_max": stats.kl_reverse_max,
            "top1_agree": stats.top1_rate(),
            "max_abs_diff": stats.max_abs,
            "max_rel_diff": stats.max_rel,
            "worst_kl_position": worst_row.map(|(pos, _)| pos),
            "greedy_compared": greedy.map(|g| g.0),
            "greedy_first_divergence": greedy.and_then(|g| g.1),
            "greedy_divergence_top2_gap": greedy.and_then(|g| g.2),
            "redlite_greedy": run.greedy,
            "reference_tokenization_equal": p.tokenized.as_ref().map(|t| *t == p.ids),
        }));
    }
    if let Some(limit) = args.max_kl_mean {
        if total.kl_mean() > limit {
            failures.push(format!(
                "mean KL {:.3e} exceeds --max-kl-mean {limit:.3e}",
                total.kl_mean()
            ));
        }
    }

    if args.json {
        let out = json!({
            "model": args.model.display().to_string(),
            "backend": args.backend,
            "mode": args.mode,
            "reference": args.reference,
            "kl_direction": "KL(reference || redlite), nats per row; kl_reverse: KL(redlite || reference)",
            "rows": total.rows,
            "kl_mean": total.kl_mean(),
            "kl_max": total.kl_max,
            "kl_reverse_mean": total.kl_reverse_mean(),
            "kl_reverse_max": total.kl_reverse_max,
            "top1_agree": total.top1_rate(),
            "max_abs_diff": total.max_abs,
            "max_rel_diff": total.max_rel,
            "prompts": reports,
            "failures": failures,
        });
        println!("{out}");
    } else {
        println!(
            "parity: {} ({} backend, {}) vs {label}; KL(reference ‖ redlite) per row, nats",
            args.model.display(),
            args.backend,
            args.mode
        );
        for l in &lines {
            println!("{l}");
        }
        println!(
            "all    rows {:>4}  KL mean {:.3e} max {:.3e}  top-1 {:>6.2}%  max|Δ| {:.3e}  (KL(redlite ‖ reference) mean {:.3e})",
            total.rows,
            total.kl_mean(),
            total.kl_max,
            100.0 * total.top1_rate(),
            total.max_abs,
            total.kl_reverse_mean()
        );
        for f in &failures {
            println!("FAIL: {f}");
        }
    }
    if !failures.is_empty() {
        bail!("parity check failed ({} problem(s))", failures.len());
    }
    Ok(())
}

fn read_json(path: &Path) -> Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

fn ids_of(v: &Value, what: &str) -> Result<Vec<u32>> {
    v.as_array()
        .ok_or_else(|| anyhow!("{what}: expected an array of token ids"))?
        .iter()
        .map(|x| {
            x.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| anyhow!("{what}: {x} is not a token id"))
        })
        .collect()
}

/// Reads `count × width` little-endian f32 rows.
fn read_rows(path: &Path, width: usize, count: usize) -> Result<Vec<Vec<f32>>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let rows = rows_from_le_bytes(&bytes, width).ok_or_else(|| {
        anyhow!(
            "{}: {} bytes is not a whole number of {width}-float rows",
            path.display(),
            bytes.len()
        )
    })?;
    if rows.len() != count {
        bail!("{}: {} rows, expected {count}", path.display(), rows.len());
    }
    Ok(rows)
}

/// The stored references (`exact` or `llamacpp`) of this model file.
fn stored_reference(args: &Args, kind: &str, vocab: usize) -> Result<Vec<RefPrompt>> {
    let logits_dir = args.fixtures.join("logits");
    let index = read_json(&logits_dir.join("index.json"))?;
    let entries = index["entries"]
        .as_array()
        .ok_or_else(|| anyhow!("logits/index.json has no entries array"))?;
    let file_name = args
        .model
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let path_key = format!("{kind}_path");
    let greedy_key = format!("greedy_{kind}");
    let mut out = Vec::new();
    let mut matched_model = false;
    for e in entries {
        let matches = match &args.model_key {
            Some(k) => e["model"].as_str() == Some(k.as_str()),
            None => e["model_file"]
                .as_str()
                .and_then(|f| Path::new(f).file_name())
                .is_some_and(|n| n.to_string_lossy() == file_name),
        };
        if !matches {
            continue;
        }
        matched_model = true;
        let Some(rel) = e[&path_key].as_str() else {
            continue;
        };
        let name = e["prompt"].as_str().unwrap_or("?").to_string();
        let ids = ids_of(&e["token_ids"], &format!("{name} token_ids"))?;
        let positions: Vec<usize> = ids_of(&e["positions"], &format!("{name} positions"))?
            .into_iter()
            .map(|p| p as usize)
            .collect();
        let width = e["vocab"].as_u64().map_or(vocab, |v| v as usize);
        if width != vocab {
            bail!("{name}: stored logits have {width} columns, the model's vocabulary is {vocab}");
        }
        let rows = read_rows(&logits_dir.join(rel), width, positions.len())?;
        let greedy = match &e[&greedy_key] {
            Value::Null => None,
            g => Some(ids_of(g, &format!("{name} {greedy_key}"))?),
        };
        out.push(RefPrompt {
            name,
            ids,
            positions,
            rows,
            greedy,
            tokenized: None,
        });
    }
    if !matched_model {
        bail!(
            "no stored references for {file_name} in {}; pass --model-key (F16, Q8_0, …)",
            logits_dir.join("index.json").display()
        );
    }
    if out.is_empty() {
        bail!("the fixtures store no {kind} logits for {file_name}");
    }
    Ok(out)
}

/// A prompt to send to llama.cpp: its name, token ids and (where known) text.
type PromptInput = (String, Vec<u32>, Option<String>);

/// Prompts to send to llama.cpp.
fn load_prompts(args: &Args, tokenizer: &Tokenizer) -> Result<Vec<PromptInput>> {
    let path = args
        .prompts
        .clone()
        .unwrap_or_else(|| args.fixtures.join("logits").join("prompts.json"));
    let encode = |text: &str| -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        if tokenizer.add_bos_token() {
            ids.extend(tokenizer.bos_token_id());
        }
        ids.extend(tokenizer.encode(text, true)?);
        Ok(ids)
    };
    let json_file = if path.is_dir() {
        let p = path.join("prompts.json");
        p.is_file().then_some(p)
    } else {
        Some(path.clone())
    };
    let mut out = Vec::new();
    if let Some(json_path) = json_file {
        let v = read_json(&json_path)?;
        let obj = v
            .as_object()
            .ok_or_else(|| anyhow!("{}: expected an object of prompts", json_path.display()))?;
        for (name, p) in obj {
            let text = p["text"].as_str().map(str::to_string);
            let ids = match (&p["ids"], &text) {
                (Value::Array(_), _) => ids_of(&p["ids"], &format!("prompt {name} ids"))?,
                (_, Some(t)) => encode(t)?,
                _ => bail!("prompt {name} has neither ids nor text"),
            };
            out.push((name.clone(), ids, text));
        }
    } else {
        let mut files: Vec<PathBuf> = std::fs::read_dir(&path)
            .with_context(|| format!("listing {}", path.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "txt"))
            .collect();
        files.sort();
        for f in files {
            let text =
                std::fs::read_to_string(&f).with_context(|| format!("reading {}", f.display()))?;
            let name = f
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            out.push((name, encode(&text)?, Some(text)));
        }
    }
    out.retain(|(_, ids, _)| !ids.is_empty());
    Ok(out)
}

/// Where the helper script is: --script, else `scripts/` of the current folder, of the folder
/// two levels above the executable (target/<profile>/redlite), or of this source tree.
fn find_script(args: &Args) -> Result<PathBuf> {
    if let Some(s) = &args.script {
        return Ok(s.clone());
    }
    let rel = Path::new("scripts").join("llamacpp_logits.py");
    let mut candidates = vec![rel.clone()];
    if let Ok(exe) = std::env::current_exe() {
        if let Some(root) = exe.parent().and_then(Path::parent).and_then(Path::parent) {
            candidates.push(root.join(&rel));
        }
    }
    candidates.push(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(&rel),
    );
    candidates
        .into_iter()
        .find(|c| c.is_file())
        .ok_or_else(|| anyhow!("cannot find scripts/llamacpp_logits.py; pass --script"))
}

/// Runs llama.cpp on the prompts (or reads a folder it already wrote) and returns its logits.
fn live_reference(args: &Args, tokenizer: &Tokenizer, vocab: usize) -> Result<Vec<RefPrompt>> {
    let prompts = load_prompts(args, tokenizer)?;
    let (dir, cleanup) = match &args.llamacpp_dir {
        Some(d) => (d.clone(), false),
        None => {
            let dir = std::env::temp_dir().join(format!("redlite-parity-{}", std::process::id()));
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let request = json!({
                "prompts": prompts.iter().map(|(name, ids, text)| json!({"name": name, "ids": ids, "text": text})).collect::<Vec<_>>(),
                "greedy": args.greedy,
            });
            let req_path = dir.join("request.json");
            std::fs::write(&req_path, request.to_string())
                .with_context(|| format!("writing {}", req_path.display()))?;
            let script = find_script(args)?;
            let threads = if args.threads == 0 {
                std::thread::available_parallelism().map_or(1, |n| n.get())
            } else {
                args.threads
            };
            let status = Command::new(&args.python)
                .arg(&script)
                .arg("--model")
                .arg(&args.model)
                .arg("--request")
                .arg(&req_path)
                .arg("--out")
                .arg(&dir)
                .arg("--threads")
                .arg(threads.to_string())
                .status()
                .with_context(|| format!("running {} {}", args.python, script.display()))?;
            if !status.success() {
                let _ = std::fs::remove_dir_all(&dir);
                bail!(
                    "{} exited with {status} (is llama-cpp-python installed? `pip install llama-cpp-python`)",
                    script.display()
                );
            }
            (dir, true)
        }
    };
    let result = (|| -> Result<Vec<RefPrompt>> {
        let res = read_json(&dir.join("result.json"))?;
        let n_vocab = res["n_vocab"].as_u64().unwrap_or(0) as usize;
        if n_vocab != vocab {
            bail!("llama.cpp reports a vocabulary of {n_vocab}, redlite {vocab}");
        }
        let by_name: Vec<&Value> = res["prompts"]
            .as_array()
            .map(|a| a.iter().collect())
            .unwrap_or_default();
        let mut out = Vec::new();
        for (name, ids, _) in &prompts {
            let Some(entry) = by_name
                .iter()
                .find(|e| e["name"].as_str() == Some(name.as_str()))
            else {
                bail!("llama.cpp output has no prompt {name}");
            };
            let logits = entry["logits"]
                .as_str()
                .ok_or_else(|| anyhow!("prompt {name}: no logits file"))?;
            let rows = read_rows(&dir.join(logits), vocab, ids.len())?;
            let greedy = ids_of(&entry["greedy"], &format!("{name} greedy"))?;
            let tokenized = match &entry["tokenized"] {
                Value::Null => None,
                t => Some(ids_of(t, &format!("{name} tokenized"))?),
            };
            out.push(RefPrompt {
                name: name.clone(),
                ids: ids.clone(),
                positions: (0..ids.len()).collect(),
                rows,
                greedy: (!greedy.is_empty()).then_some(greedy),
                tokenized,
            });
        }
        Ok(out)
    })();
    if cleanup {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result
}
