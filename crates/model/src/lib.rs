//! The Qwen3-Next model: configuration from GGUF metadata, weights, per-sequence state, and the
//! plain f32 **oracle** forward pass that every faster kernel is checked against.

// The oracle is written as index loops that mirror the formulas; iterator chains would hide them.
#![allow(clippy::needless_range_loop)]

pub mod backend;
pub mod config;
pub mod delta_rule;
pub mod kv_type;
pub mod layout;
pub mod ops;
pub mod qwen3next;
pub mod sizing;
pub mod state;
pub mod weights;

pub use backend::{Backend, LinearData, LinearSource, Oracle};
pub use config::{Config, LayerKind};
pub use kv_type::KvType;
pub use qwen3next::{Mode, Model};
pub use state::{KvCache, KvRows, MtpState, SequenceState, Snapshot, StepTrace};

/// Errors from loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] redlite_gguf::GgufError),
    #[error("unsupported architecture '{0}' (redlite runs qwen3next)")]
    UnsupportedArchitecture(String),
    #[error("inconsistent model configuration: {0}")]
    BadConfig(String),
    #[error("missing tensor {0}")]
    MissingTensor(String),
    #[error("tensor {tensor} has shape {found:?}, expected {expected:?}")]
    BadShape {
        tensor: String,
        expected: Vec<u64>,
        found: Vec<u64>,
    },
    #[error("tensor {tensor}: {message}")]
    Tensor { tensor: String, message: String },
    #[error("token id {id} is outside the vocabulary (size {vocab})")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("sequence state: {0}")]
    State(String),
    #[error("this model file has no MTP block")]
    NoMtp,
    #[error("backend: {0}")]
    Backend(String),
}
