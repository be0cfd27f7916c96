//! Every tensor of every reference model file dequantizes, matches gguf-py bit for bit, and is
//! finite. The expected values come from `tools/gen_dequant_checks.py` (gguf-py 0.19.0) and are
//! stored as SHA-256 digests of the little-endian f32 values in `tests/data/dequant_checks.json`:
//! one digest over all tensors of a file (in file order) and one per sampled tensor.

use std::collections::HashMap;
use std::path::Path;

use redlite_gguf::quant::dequantize_to_vec;
use redlite_gguf::GgufFile;

const REFERENCE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/reference");
const CHECKS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/data/dequant_checks.json"
);

#[test]
fn reference_models_dequantize_like_gguf_py() {
    let checks: serde_json::Value =
        serde_json::from_slice(&std::fs::read(CHECKS).expect("read dequant_checks.json"))
            .expect("dequant_checks.json parses");
    let files = checks["files"].as_array().expect("files array");
    assert!(
        files.len() >= 10,
        "expected every model file, got {}",
        files.len()
    );

    let mut failures = Vec::new();
    let mut sampled = 0;
    for entry in files {
        let rel = entry["file"].as_str().unwrap();
        let f = GgufFile::open(Path::new(REFERENCE).join(rel))
            .unwrap_or_else(|e| panic!("open {rel}: {e}"));
        assert_eq!(
            f.tensors().len() as u64,
            entry["n_tensors"].as_u64().unwrap(),
            "{rel}: tensor count"
        );
        let samples: HashMap<&str, &serde_json::Value> = entry["samples"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| (s["name"].as_str().unwrap(), s))
            .collect();
        let nonfinite_expected = entry["nonfinite"].as_object().unwrap();

        let mut whole = Sha256::new();
        let mut n_values = 0u64;
        for t in f.tensors() {
            let data = f.tensor_data(t);
            let values = match dequantize_to_vec(t.ty, data) {
                Ok(v) => v,
                Err(e) => {
                    failures.push(format!("{rel}: {}: {e}", t.name));
                    continue;
                }
            };
            if values.len() as u64 != t.n_elements {
                failures.push(format!(
                    "{rel}: {}: {} values for {} elements",
                    t.name,
                    values.len(),
                    t.n_elements
                ));
            }
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            whole.update(&bytes);
            n_values += values.len() as u64;

            let nonfinite = values.iter().filter(|v| !v.is_finite()).count() as u64;
            let expected_nonfinite = nonfinite_expected
                .get(&t.name)
                .and_then(|v| v.as_u64())
                .unwrap_or(0);
            if nonfinite != expected_nonfinite {
                failures.push(format!(
                    "{rel}: {}: {nonfinite} non-finite values, gguf-py has {expected_nonfinite}",
                    t.name
                ));
            }

            if let Some(s) = samples.get(t.name.as_str()) {
                sampled += 1;
                let dims: Vec<u64> = s["dims"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|d| d.as_u64().unwrap())
                    .collect();
                assert_eq!(t.dims, dims, "{rel}: {} dims", t.name);
                assert_eq!(
                    t.ty.name(),
                    s["type"].as_str().unwrap(),
                    "{rel}: {}",
                    t.name
                );
                assert_eq!(
                    Some(f.data_offset() + t.offset),
                    s["offset"].as_u64(),
                    "{rel}: {}",
                    t.name
                );
                assert_eq!(Some(t.n_bytes), s["n_bytes"].as_u64(), "{rel}: {}", t.name);
                let got = hex(&Sha256::digest(&bytes));
                if got != s["sha256"].as_str().unwrap() {
                    failures.push(format!(
                        "{rel}: {} ({}): f32 values differ from gguf-py",
                        t.name, t.ty
                    ));
                }
            }
        }
        assert_eq!(
            Some(n_values),
            entry["n_values"].as_u64(),
            "{rel}: value count"
        );
        if hex(&whole.finish()) != entry["all_sha256"].as_str().unwrap() {
            failures.push(format!(
                "{rel}: digest over all tensors differs from gguf-py"
            ));
        }
        let expected_samples = samples.len();
        assert!(expected_samples > 0, "{rel}: no samples");
    }
    assert!(
        sampled >= 50,
        "only {sampled} sampled tensors were found in the files"
    );
    assert!(failures.is_empty(), "{failures:#?}");
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A small streaming SHA-256 (FIPS 180-4), enough to compare digests without a dependency.
struct Sha256 {
    state: [u32; 8],
    block: [u8; 64],
    block_len: usize,
    total_len: u64,
}

const K: [u32; 64] = [
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
];

impl Sha256 {
    fn new() -> Self {
        Sha256 {
            state: [
                0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab,
                0x5be0cd19,
            ],
            block: [0; 64],
            block_len: 0,
            total_len: 0,
        }
    }

    fn digest(data: &[u8]) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(data);
        h.finish()
    }

    fn update(&mut self, mut data: &[u8]) {
        self.total_len += data.len() as u64;
        while !data.is_empty() {
            let take = (64 - self.block_len).min(data.len());
            self.block[self.block_len..self.block_len + take].copy_from_slice(&data[..take]);
            self.block_len += take;
            data = &data[take..];
            if self.block_len == 64 {
                let block = self.block;
                self.compress(&block);
                self.block_len = 0;
            }
        }
    }

    fn finish(mut self) -> [u8; 32] {
        let bit_len = self.total_len.wrapping_mul(8);
        self.update(&[0x80]);
        while self.block_len != 56 {
            self.update(&[0]);
        }
        self.update(&bit_len.to_be_bytes());
        let mut out = [0u8; 32];
        for (o, s) in out.chunks_exact_mut(4).zip(self.state) {
            o.copy_from_slice(&s.to_be_bytes());
        }
        out
    }

    fn compress(&mut self, block: &[u8; 64]) {
        let mut w = [0u32; 64];
        for (i, word) in block.chunks_exact(4).enumerate() {
            w[i] = u32::from_be_bytes([word[0], word[1], word[2], word[3]]);
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16]
                .wrapping_add(s0)
                .wrapping_add(w[i - 7])
                .wrapping_add(s1);
        }
        let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut h] = self.state;
        for i in 0..64 {
            let s1 = e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25);
            let ch = (e & f) ^ (!e & g);
            let t1 = h
                .wrapping_add(s1)
                .wrapping_add(ch)
                .wrapping_add(K[i])
                .wrapping_add(w[i]);
            let s0 = a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22);
            let maj = (a & b) ^ (a & c) ^ (b & c);
            let t2 = s0.wrapping_add(maj);
            h = g;
            g = f;
            f = e;
            e = d.wrapping_add(t1);
            d = c;
            c = b;
            b = a;
            a = t1.wrapping_add(t2);
        }
        for (s, v) in self.state.iter_mut().zip([a, b, c, d, e, f, g, h]) {
            *s = s.wrapping_add(v);
        }
    }
}

#[test]
fn sha256_known_answers() {
    assert_eq!(
        hex(&Sha256::digest(b"")),
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    );
    assert_eq!(
        hex(&Sha256::digest(b"abc")),
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
    // Two blocks, fed in uneven pieces.
    let msg = b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
    let mut h = Sha256::new();
    h.update(&msg[..10]);
    h.update(&msg[10..]);
    assert_eq!(
        hex(&h.finish()),
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"
    );
}
