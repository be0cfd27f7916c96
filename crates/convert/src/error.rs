//! Errors of the converter.

use std::path::PathBuf;

/// Everything that can go wrong while converting a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}: invalid safetensors file: {message}")]
    Safetensors { path: PathBuf, message: String },
    #[error("config.json: {0}")]
    Config(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("tensor '{name}': {message}")]
    Tensor { name: String, message: String },
    #[error("checkpoint has no tensor '{0}'")]
    MissingTensor(String),
    #[error("unused checkpoint tensors (not part of a Qwen3-Next model): {0}")]
    UnusedTensors(String),
    #[error("writing the GGUF file: {0}")]
    Gguf(redlite_gguf::GgufError),
}

impl ConvertError {
    pub(crate) fn tensor(name: &str, message: impl Into<String>) -> ConvertError {
        ConvertError::Tensor {
            name: name.to_string(),
            message: message.into(),
        }
    }
}

pub type Result<T, E = ConvertError> = std::result::Result<T, E>;

// By hand, not `#[from]`: the message above already includes the GGUF error's text, and as a
// `source` it would be printed twice in a context chain.
impl From<redlite_gguf::GgufError> for ConvertError {
    fn from(e: redlite_gguf::GgufError) -> Self {
        ConvertError::Gguf(e)
    }
}
