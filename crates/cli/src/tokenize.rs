//! `redlite tokenize` and `redlite detokenize`.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use redlite_gguf::GgufFile;
use redlite_tokenizer::tokenizer::Tokenizer;

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["text", "stdin"])))]
pub struct TokenizeArgs {
    /// Model file (GGUF) whose tokenizer to use.
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// Text to tokenize.
    #[arg(long)]
    pub text: Option<String>,
    /// Read the text from standard input (all of it, byte for byte: a trailing newline is
    /// tokenized too).
    #[arg(long)]
    pub stdin: bool,
    /// Treat special tokens written in the text (`<|im_start|>`, …) as plain text.
    #[arg(long)]
    pub no_special: bool,
}

#[derive(clap::Args)]
pub struct DetokenizeArgs {
    /// Model file (GGUF) whose tokenizer to use.
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// Token ids, separated by commas or spaces (`1,2,3`), or a JSON array. Without it, the
    /// ids are read from standard input in the same forms.
    #[arg(long)]
    pub ids: Option<String>,
    /// Leave special (control) tokens such as `<|im_end|>` out of the text.
    #[arg(long)]
    pub skip_special: bool,
}

/// Opens `path` and builds its tokenizer.
fn load_tokenizer(path: &Path) -> anyhow::Result<Tokenizer> {
    let file = GgufFile::open(path).context("opening the model file")?;
    Tokenizer::from_gguf(&file)
        .with_context(|| format!("building the tokenizer of {}", path.display()))
}

/// Reads all of standard input as UTF-8.
fn read_stdin() -> anyhow::Result<String> {
    let mut bytes = Vec::new();
    std::io::stdin()
        .read_to_end(&mut bytes)
        .context("reading standard input")?;
    String::from_utf8(bytes).context("standard input is not valid UTF-8")
}

pub fn run_tokenize(args: TokenizeArgs) -> anyhow::Result<()> {
    let text = match args.text {
        Some(text) => text,
        None => read_stdin()?,
    };
    let tokenizer = load_tokenizer(&args.model)?;
    let ids = tokenizer
        .encode(&text, !args.no_special)
        .context("tokenizing the text")?;
    let json = serde_json::to_string(&ids).context("formatting the ids")?;
    println!("{json}");
    Ok(())
}

pub fn run_detokenize(args: DetokenizeArgs) -> anyhow::Result<()> {
    let (source, list) = match args.ids {
        Some(list) => ("--ids", list),
        None => ("standard input", read_stdin()?),
    };
    let ids = parse_ids(&list).with_context(|| format!("reading token ids from {source}"))?;
    let tokenizer = load_tokenizer(&args.model)?;
    let text = tokenizer
        .decode(&ids, args.skip_special)
        .context("decoding the ids")?;
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .context("writing the text")?;
    Ok(())
}

/// Parses `[1, 2, 3]` (JSON) or `1,2,3` / `1 2 3` (commas and/or whitespace).
fn parse_ids(input: &str) -> anyhow::Result<Vec<u32>> {
    let input = input.trim();
    if input.starts_with('[') {
        return serde_json::from_str(input).context("expected a JSON array of token ids");
    }
    input
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .enumerate()
        .map(|(i, s)| match s.parse::<u32>() {
            Ok(id) => Ok(id),
            Err(_) => bail!("item {} `{s}` is not a token id", i + 1),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::parse_ids;

    #[test]
    fn id_lists() {
        assert_eq!(parse_ids("1,2,3").unwrap(), [1, 2, 3]);
        assert_eq!(parse_ids(" 1, 2\n3 ").unwrap(), [1, 2, 3]);
        assert_eq!(parse_ids("[1, 2, 3]\n").unwrap(), [1, 2, 3]);
        assert_eq!(parse_ids("").unwrap(), Vec::<u32>::new());
        assert!(parse_ids("1,x").unwrap_err().to_string().contains("`x`"));
        assert!(parse_ids("1,-2").is_err());
        assert!(parse_ids("[1, -2]").is_err());
    }
}
