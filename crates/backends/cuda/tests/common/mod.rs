//! Shared by the GPU tests: where the fixture models are, and bit-for-bit comparison.

use std::path::PathBuf;

/// The fixture models: `$REDLITE_TEST_MODELS` (on the GPU machine) or `shared/reference/models`.
pub fn models() -> PathBuf {
    std::env::var_os("REDLITE_TEST_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../../../shared/reference/models"
            ))
        })
}

/// Equal bit for bit (and of one length).
pub fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits())
}

/// The KV cache type the models are loaded with: `$REDLITE_KV_TYPE` (as the CLI's `--kv-type`
/// reads it), f32 when unset.
#[allow(dead_code)] // not every test binary loads a model
pub fn kv_type() -> redlite_model::KvType {
    std::env::var("REDLITE_KV_TYPE")
        .ok()
        .map(|s| s.parse().expect("REDLITE_KV_TYPE: f32 or f16"))
        .unwrap_or_default()
}
