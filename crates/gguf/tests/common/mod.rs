//! Helpers shared by the integration tests: the reference fixtures (`../shared/reference`
//! beside the repository root), little-endian file readers, and the block-by-block comparison
//! of quantizer output.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use redlite_gguf::quant::GgmlType;

/// Row length of every quantizer fixture.
pub const N_PER_ROW: usize = 512;

/// `shared/reference` (the fixtures of every test), or `rel` below it.
pub fn reference(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/reference")
        .join(rel)
}

/// `tests/data/<rel>` of this crate.
pub fn local_data(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(rel)
}

pub fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// A file of little-endian f32 values.
pub fn read_f32(path: &Path) -> Vec<f32> {
    read(path)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// `Err` naming the first differing block and byte (within the block), if any.
pub fn compare(ty: GgmlType, what: &str, got: &[u8], want: &[u8]) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} bytes, expected {}",
            got.len(),
            want.len()
        ));
    }
    let Some(at) = got.iter().zip(want).position(|(a, b)| a != b) else {
        return Ok(());
    };
    let bb = ty.block_bytes();
    let (block, byte) = (at / bb, at % bb);
    let n_diff = got
        .chunks_exact(bb)
        .zip(want.chunks_exact(bb))
        .filter(|(a, b)| a != b)
        .count();
    Err(format!(
        "{what}: {n_diff} of {} blocks differ; first: block {block} (row {}), byte {byte}: \
         got {:#04x}, expected {:#04x}\n  got    {:02x?}\n  expect {:02x?}",
        got.len() / bb,
        at / (N_PER_ROW / ty.block_elems() * bb),
        got[at],
        want[at],
        &got[block * bb..(block + 1) * bb],
        &want[block * bb..(block + 1) * bb],
    ))
}
