//! Helpers shared by the end-to-end tests of the `redlite` binary.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// `rel` below `shared/reference` (the fixtures, beside the repository root).
pub fn reference(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/reference")
        .join(rel)
}

/// Runs the `redlite` binary built for this test with `args`.
pub fn redlite(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_redlite"))
        .args(args)
        .output()
        .expect("run redlite")
}

/// A file of little-endian f32 values.
pub fn read_f32(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}
