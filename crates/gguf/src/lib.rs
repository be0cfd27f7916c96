//! redlite's file-format crate: the GGUF container (reader over mmap, validation, writer) and the
//! ggml quant block formats (type table, scalar reference dequantizers, IQ grids).

pub mod quant;

pub use quant::{GgmlType, TypeTraits, TYPE_TRAITS};
