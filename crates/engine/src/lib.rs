//! The engine: sampling, sessions and the generation loop over a model.

pub mod backends;
pub mod bench;
pub mod default_model;
pub mod generate;
pub mod imatrix;
pub mod parity;
pub mod perplexity;
pub mod planner;
pub mod quantize;
pub mod sampler;
pub mod spec_bench;
pub mod speculative;

pub use backends::{
    load_model, load_model_from, load_model_with_cache, AnyModel, BackendChoice, CacheConfig,
    CachePolicy, CacheSize, CacheStats,
};
pub use generate::{generate, GenerateOptions, GenerationStats};
