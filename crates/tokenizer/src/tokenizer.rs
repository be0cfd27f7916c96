//! The gpt2 byte-level BPE tokenizer (pre-tokenizer `qwen2`) built from GGUF metadata.
