//! `redlite`: the command-line entry point. Each subcommand lives in its own module with its
//! clap `Args` and a `run` function.

use clap::{Parser, Subcommand};

/// mimalloc for every Rust allocation: a forward pass allocates and frees its activation rows
/// (per layer, per row of a batch) on both pool threads, and glibc's arenas spent ≈ 20 % of a
/// demo verify pass in malloc/free/memset/memmove, much of it on the pass's serial path. With
/// mimalloc the demo's decode step is ≈ 20 % and a 128-row verify ≈ 15 % faster; the full-size
/// layout's decode is unchanged (docs/perf-ledger.md, 2026-12-05 session 39).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod bench;
mod cache_args;
mod convert;
mod cuda_cmd;
mod generate;
mod imatrix;
mod inspect;
mod kv_args;
mod logits;
mod make_model;
mod parity;
mod perplexity;
mod plan;
mod quantize;
mod selftest;
mod serve;
mod spec_args;
mod spec_bench;
mod tokenize;

#[derive(Parser)]
#[command(
    name = "redlite",
    version,
    about = "Qwen3-Next inference from GGUF files"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Describe a GGUF file: architecture, hyperparameters, tensor bytes, bytes per decode token.
    Inspect(inspect::Args),
    /// Convert a Hugging Face Qwen3-Next checkpoint folder to GGUF.
    Convert(convert::Args),
    /// Generate text from a prompt, streaming it as it decodes.
    Generate(generate::Args),
    /// Write the logits of every position of a token sequence as raw f32.
    Logits(logits::Args),
    /// Tokenize text with the model's tokenizer and print the ids as JSON.
    Tokenize(tokenize::TokenizeArgs),
    /// Turn token ids back into text.
    Detokenize(tokenize::DetokenizeArgs),
    /// Measure speed: kernel, decode or prefill, next to the memory bandwidth.
    Bench(bench::Args),
    /// Serve the model over HTTP (OpenAI-compatible API).
    Serve(serve::Args),
    /// Write a Qwen3-Next layout with random valid weights (for benchmarks only).
    MakeModel(make_model::Args),
    /// Speculative decoding benchmarks: verify cost per draft length, file-rewrite speed.
    SpecBench(spec_bench::Args),
    /// Check every fast kernel against the oracle on fresh random data.
    Selftest(selftest::Args),
    /// Importance matrix (llama-imatrix's GGUF format) of a text, for `quantize --imatrix`.
    Imatrix(imatrix::Args),
    /// Quantize a GGUF file by a recipe (cf2, q4_k_m) or to one type.
    Quantize(quantize::Args),
    /// Perplexity of a text by llama.cpp's method (chunks, second half of each scored).
    Perplexity(perplexity::Args),
    /// What is resident under a memory budget; the expert cache size.
    Plan(plan::Args),
    /// Compare redlite's logits with llama.cpp's or the stored references (KL, top-1, greedy).
    Parity(parity::Args),
}

fn main() {
    redlite_cpu::heap::keep_freed_memory();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Inspect(a) => inspect::run(a),
        Command::Convert(a) => convert::run(a),
        Command::Generate(a) => generate::run(a),
        Command::Logits(a) => logits::run(a),
        Command::Tokenize(a) => tokenize::run_tokenize(a),
        Command::Detokenize(a) => tokenize::run_detokenize(a),
        Command::Bench(a) => bench::run(a),
        Command::Serve(a) => serve::run(a),
        Command::MakeModel(a) => make_model::run(a),
        Command::Selftest(a) => selftest::run(a),
        Command::SpecBench(a) => spec_bench::run(a),
        Command::Perplexity(a) => perplexity::run(a),
        Command::Imatrix(a) => imatrix::run(a),
        Command::Quantize(a) => quantize::run(a),
        Command::Parity(a) => parity::run(a),
        Command::Plan(a) => plan::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
