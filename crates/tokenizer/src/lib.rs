//! redlite-tokenizer
