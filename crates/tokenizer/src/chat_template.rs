//! Chat template rendering (`tokenizer.chat_template`) with minijinja.
