//! Sizes derived from a model file: bytes per decode token (dense, routed experts, head), KV bytes per position, recurrent state bytes.
