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
