//! Streaming detokenizer: never emits half a UTF-8 character.
