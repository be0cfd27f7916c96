//! The engine: sampling, sessions and the generation loop over a model.

pub mod sampler;
