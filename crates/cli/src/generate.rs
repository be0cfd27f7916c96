//! `redlite generate`: stream a continuation of a prompt and report prompt and decode speed.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use redlite_engine::default_model::resolve_model;
use redlite_engine::sampler::{Sampler, SamplerConfig};
use redlite_engine::speculative::{generate_speculative, SpecMode};
use redlite_engine::{generate, load_model_with_cache, with_model, BackendChoice, GenerateOptions};
use redlite_gguf::GgufFile;
use redlite_tokenizer::chat_template::{ChatTemplate, RenderOptions};
use redlite_tokenizer::stream::StreamDecoder;
use redlite_tokenizer::tokenizer::Tokenizer;

#[derive(clap::Args)]
pub struct Args {
    /// Model file (GGUF); default: the shipped demo model (models/redlite-demo.gguf) or $REDLITE_MODEL.
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// Prompt text.
    #[arg(short = 'p', long = "prompt", conflicts_with_all = ["file", "ids"])]
    pub prompt: Option<String>,
    /// Read the prompt from a file.
    #[arg(short = 'f', long = "file", conflicts_with = "ids")]
    pub file: Option<PathBuf>,
    /// Prompt as token ids, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub ids: Option<Vec<u32>>,
    /// Wrap the prompt as a user message with the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// System message for --chat.
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// Tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
    pub n: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long = "temp", default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// Random seed (sampling is reproducible for a given seed).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print the generated ids as a JSON array at the end.
    #[arg(long)]
    pub print_ids: bool,
    /// Compute backend: cpu (fast, quantized kernels), oracle (f32 reference) or cuda (the
    /// device-resident GPU model; needs the `cuda` feature and a GPU).
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// CPU threads (0: one per physical core).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    #[command(flatten)]
    pub cache: crate::cache_args::CacheArgs,
    #[command(flatten)]
    pub kv: crate::kv_args::KvArgs,
    /// Speculative decoding: off, lookup (prompt n-gram lookup), mtp (the model's MTP head), or
    /// both (lookup when it matches, MTP otherwise). The output is the same as without.
    #[arg(long, default_value = "off")]
    pub spec: String,
    #[command(flatten)]
    pub spec_args: crate::spec_args::SpecArgs,
}

pub fn run(args: Args) -> Result<()> {
    check_sampling(&args)?;
    // `cuda` is the device-resident GPU model (crate::cuda_cmd), not a host-side backend.
    let choice = match crate::cuda_cmd::or_cpu(&args.backend) {
        "cuda" => None,
        name => Some(BackendChoice::parse(name)?),
    };
    let model_path = resolve_model(args.model.as_deref()).map_err(anyhow::Error::msg)?;
    let file = Arc::new(GgufFile::open(&model_path).context("opening the model file")?);
    let tokenizer = Tokenizer::from_gguf(&file).context("building the tokenizer")?;
    let model = match choice {
        Some(choice) => {
            let mut model = load_model_with_cache(
                file.clone(),
                choice,
                args.threads,
                args.cache.config(&file, args.kv.cpu())?,
            )
            .with_context(|| format!("loading {}", model_path.display()))?;
            args.kv.apply(&mut model)?;
            Some(model)
        }
        None => {
            args.kv.require_cuda()?;
            None
        }
    };

    let prompt_ids = match (&args.prompt, &args.file, &args.ids) {
        (_, _, Some(ids)) => ids.clone(),
        (Some(_), _, _) | (_, Some(_), _) => {
            let text = match (&args.prompt, &args.file) {
                (Some(p), _) => p.clone(),
                (_, Some(f)) => std::fs::read_to_string(f)
                    .with_context(|| format!("reading {}", f.display()))?,
                _ => unreachable!(),
            };
            let text = if args.chat {
                let template =
                    ChatTemplate::from_gguf(&file).context("reading the chat template")?;
                let mut messages = Vec::new();
                if let Some(s) = &args.system {
                    messages.push(serde_json::json!({"role": "system", "content": s}));
                }
                messages.push(serde_json::json!({"role": "user", "content": text}));
                let opts = RenderOptions {
                    add_generation_prompt: true,
                    ..Default::default()
                };
                template.render(&serde_json::Value::Array(messages), &opts)?
            } else {
                text
            };
            tokenizer.encode(&text, true)?
        }
        _ => bail!("give a prompt with -p TEXT, -f FILE or --ids 1,2,3"),
    };
    if prompt_ids.is_empty() {
        bail!("the prompt is empty");
    }
    let max_tokens = fit_context(&file, prompt_ids.len(), args.n)?;

    let mut sampler = Sampler::new(SamplerConfig {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repeat_penalty: args.repeat_penalty,
        presence_penalty: args.presence_penalty,
        frequency_penalty: args.frequency_penalty,
        seed: args.seed,
        ..Default::default()
    });
    let stop_ids = if args.ignore_eos {
        Vec::new()
    } else {
        tokenizer.stop_token_ids().to_vec()
    };
    let opts = GenerateOptions {
        max_tokens,
        stop_ids,
    };

    let spec = args.spec_args.config(SpecMode::parse(&args.spec)?);

    let mut stream = StreamDecoder::new();
    let stdout = std::io::stdout();
    let mut err: Option<std::io::Error> = None;
    let mut emit = |id| {
        let text = stream.push(&tokenizer, id);
        let mut out = stdout.lock();
        if let Err(e) = out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
            err = Some(e);
            return false;
        }
        true
    };
    let (ids, stats, spec_stats) = match &model {
        None if spec.mode != SpecMode::Off => {
            let (ids, stats, s) = crate::cuda_cmd::generate_speculative(
                file.clone(),
                &prompt_ids,
                &mut sampler,
                &opts,
                &spec,
                args.kv.gpu(&args.cache),
                &mut emit,
            )?;
            (ids, stats, Some(s))
        }
        None => {
            let (ids, stats) = crate::cuda_cmd::generate(
                file.clone(),
                &prompt_ids,
                &mut sampler,
                &opts,
                args.kv.gpu(&args.cache),
                &mut emit,
            )?;
            (ids, stats, None)
        }
        Some(model) => with_model!(model, m => {
            if spec.mode == SpecMode::Off {
                generate(m, &mut m.new_state(), &prompt_ids, &mut sampler, &opts, &mut emit)
                    .map(|(ids, stats)| (ids, stats, None))
            } else {
                generate_speculative(m, &mut m.new_state(), &prompt_ids, &mut sampler, &opts, &spec, &mut emit)
                    .map(|(ids, stats, s)| (ids, stats, Some(s)))
            }
        })?,
    };
    if let Some(e) = err {
        return Err(e).context("writing to stdout");
    }
    let tail = stream.finish();
    print!("{tail}");
    println!();
    if args.print_ids {
        println!("{}", serde_json::to_string(&ids)?);
    }
    eprintln!(
        "prompt: {} tokens, {:.1} tok/s | decode: {} tokens, {:.1} tok/s",
        stats.prompt_tokens,
        stats.prompt_tok_per_s(),
        stats.generated_tokens,
        stats.decode_tok_per_s()
    );
    if let Some(s) = spec_stats {
        eprintln!("{}", s.summary());
    }
    Ok(())
}

/// The sampling options a run can use: finite, with the probabilities in [0, 1] and a positive
/// repeat penalty (the server checks its request fields the same way).
fn check_sampling(args: &Args) -> Result<()> {
    let finite = [
        ("--temp", args.temperature),
        ("--top-p", args.top_p),
        ("--min-p", args.min_p),
        ("--repeat-penalty", args.repeat_penalty),
        ("--presence-penalty", args.presence_penalty),
        ("--frequency-penalty", args.frequency_penalty),
    ];
    if let Some((name, v)) = finite.iter().find(|(_, v)| !v.is_finite()) {
        bail!("{name} must be a finite number, got {v}");
    }
    if args.temperature < 0.0 {
        bail!(
            "--temp must be >= 0 (0 is greedy), got {}",
            args.temperature
        );
    }
    for (name, v) in [("--top-p", args.top_p), ("--min-p", args.min_p)] {
        if !(0.0..=1.0).contains(&v) {
            bail!("{name} must be between 0 and 1, got {v}");
        }
    }
    if args.repeat_penalty <= 0.0 {
        bail!(
            "--repeat-penalty must be greater than 0 (1 is off), got {}",
            args.repeat_penalty
        );
    }
    Ok(())
}

/// The tokens to generate: `n`, or fewer where the prompt and `n` would pass the model's trained
/// context length (a warning says so); an error when the prompt alone fills it.
fn fit_context(file: &GgufFile, prompt: usize, n: usize) -> Result<usize> {
    let ctx = redlite_model::Config::from_gguf(file)
        .context("reading the model configuration")?
        .context_length;
    if prompt >= ctx {
        bail!("the prompt of {prompt} tokens fills the model's context of {ctx} tokens");
    }
    if n > ctx - prompt {
        eprintln!(
            "warning: -n {n} with a {prompt}-token prompt passes the model's context of {ctx} \
             tokens; generating at most {} tokens",
            ctx - prompt
        );
        return Ok(ctx - prompt);
    }
    Ok(n)
}
