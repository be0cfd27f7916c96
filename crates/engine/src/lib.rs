//! The engine: sampling, sessions and the generation loop over a model.

pub mod generate;
pub mod sampler;

pub use generate::{generate, GenerateOptions, GenerationStats};
