//! Property-style robustness tests: truncations and byte flips of valid files must give `Err` or
//! `Ok`, never a panic; any accepted file must be fully usable. Deterministic (fixed-seed PRNG)
//! and fast (a few thousand parses).

use std::path::PathBuf;

use redlite_gguf::{GgmlType, GgufFile, GgufWriter, MetaArray, MetaValue};

fn valid_base() -> Vec<u8> {
    let p = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/reference/broken/valid_base.gguf"
    ));
    std::fs::read(p).unwrap()
}

/// splitmix64: a tiny deterministic PRNG.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Exercises an accepted file: every tensor slice has its size, every value renders, and the
/// writer reproduces an equivalent file.
fn exercise(f: &GgufFile) {
    for t in f.tensors() {
        assert_eq!(f.tensor_data(t).len() as u64, t.n_bytes, "{}", t.name);
    }
    for (k, v) in f.metadata() {
        let _ = v.to_string();
        let _ = f.get_u32(k).map_err(|e| e.to_string());
        let _ = f.get_str_array(k).map_err(|e| e.to_string());
    }
    if f.alignment() <= 4096 {
        let bytes = GgufWriter::from_file(f).unwrap().to_bytes().unwrap();
        let g = GgufFile::from_bytes(bytes).unwrap();
        assert_eq!(g.tensors().len(), f.tensors().len());
        assert_eq!(g.metadata().len(), f.metadata().len());
    }
}

/// End of the last tensor's data: any shorter prefix must be rejected.
fn data_end(f: &GgufFile) -> u64 {
    f.tensors()
        .iter()
        .map(|t| f.data_offset() + t.offset + t.n_bytes)
        .max()
        .unwrap_or(0)
}

#[test]
fn every_truncation_of_valid_base_is_rejected() {
    let bytes = valid_base();
    let full = GgufFile::from_bytes(bytes.as_slice()).unwrap();
    let end = data_end(&full) as usize;
    let mut lengths: Vec<usize> = (0..bytes.len()).step_by(37).collect();
    // Every length around the header fields, the end of the tensor table and the end of the data.
    lengths.extend(0..64);
    let d = full.data_offset() as usize;
    lengths.extend(d.saturating_sub(200)..(d + 8).min(bytes.len()));
    lengths.extend(end.saturating_sub(8)..=end);
    let mut n_ok = 0;
    for len in lengths {
        match GgufFile::from_bytes(&bytes[..len]) {
            Ok(f) => {
                assert!(
                    len >= end,
                    "prefix of {len} bytes accepted (data ends at {end})"
                );
                exercise(&f);
                n_ok += 1;
            }
            Err(e) => {
                assert!(len < end, "prefix of {len} bytes rejected: {e}");
                assert!(e.offset().is_some(), "{e}");
            }
        }
    }
    assert!(n_ok >= 1);
}

/// Flips 1–4 bytes per case inside the header region (everything before the data section),
/// biased towards the structure-dense parts: the first KV pairs and the tensor table.
#[test]
fn random_header_byte_flips_never_panic() {
    let bytes = valid_base();
    let data_offset = GgufFile::from_bytes(bytes.as_slice())
        .unwrap()
        .data_offset() as usize;
    let mut rng = Rng(0x5EED_0000_6675_6666);
    let (mut ok, mut err) = (0, 0);
    for _ in 0..3000 {
        let mut v = bytes.clone();
        for _ in 0..1 + rng.below(4) {
            let pos = match rng.below(3) {
                0 => rng.below(data_offset),
                1 => rng.below(2048),
                _ => data_offset - 1 - rng.below(512),
            };
            v[pos] = match rng.below(4) {
                0 => rng.next() as u8,
                1 => v[pos] ^ (1 << rng.below(8)),
                2 => 0xFF,
                _ => 0,
            };
        }
        match GgufFile::from_bytes(v) {
            Ok(f) => {
                exercise(&f);
                ok += 1;
            }
            Err(e) => {
                let _ = e.to_string();
                err += 1;
            }
        }
    }
    assert_eq!(ok + err, 3000);
    assert!(err > 0 && ok > 0, "ok {ok}, err {err}");
}

/// A small file with every value type and nested arrays: every byte of it set to a few values.
#[test]
fn exhaustive_byte_edits_of_a_small_file() {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "x".into()).unwrap();
    w.add_kv("a", MetaValue::U16(7)).unwrap();
    w.add_kv("b", MetaValue::Bool(false)).unwrap();
    w.add_kv("c", vec!["p".to_string(), "q".to_string()].into())
        .unwrap();
    w.add_kv(
        "d",
        MetaValue::Array(MetaArray::Array(vec![MetaArray::F32(vec![1.0])])),
    )
    .unwrap();
    w.add_kv("e", MetaValue::F64(1.0)).unwrap();
    w.add_tensor("t", &[32, 2], GgmlType::Q8_0, vec![0u8; 68])
        .unwrap();
    w.add_tensor("u", &[2], GgmlType::F32, vec![0u8; 8])
        .unwrap();
    let bytes = w.to_bytes().unwrap();
    let mut cases = 0;
    for pos in 0..bytes.len() {
        for val in [0x00, 0x01, 0x09, 0x0C, 0x80, 0xFF] {
            let mut v = bytes.clone();
            v[pos] = val;
            if let Ok(f) = GgufFile::from_bytes(v) {
                exercise(&f);
            }
            cases += 1;
        }
    }
    assert!(cases > 1000);
}
