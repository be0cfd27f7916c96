//! ggml quantization block formats: the type table and scalar reference dequantizers.

pub mod types;

pub use types::{GgmlType, TypeTraits, TYPE_TRAITS};
