//! Text in and out of token ids: the gpt2 byte-level BPE tokenizer built from `tokenizer.ggml.*`
//! GGUF metadata, a streaming detokenizer, and the chat template rendered with minijinja.

pub mod chat_template;
pub mod stream;
pub mod tokenizer;
