//! Writes the small seed corpus of the GGUF parser fuzz target (`fuzz/seeds/`).
//!
//! `cargo run -p redlite-gguf --example make_fuzz_seeds -- <reference dir> <out dir>`
//!
//! Seeds: a slim copy of `broken/valid_base.gguf` (all its metadata except the big tokenizer
//! arrays, and its three tensors), a file with every metadata value type and nested arrays, an
//! empty v2 file, alignment variants, and a few one-defect variants of the slim file.

use std::path::PathBuf;

use redlite_gguf::{GgmlType, GgufFile, GgufWriter, MetaArray, MetaValue};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, reference, out] = args.as_slice() else {
        return Err("usage: make_fuzz_seeds <reference dir> <out dir>".into());
    };
    let out = PathBuf::from(out);
    std::fs::create_dir_all(&out)?;
    let write = |name: &str, bytes: &[u8]| std::fs::write(out.join(name), bytes);

    // Slim valid_base: drop the vocabulary arrays, keep everything else.
    let base = GgufFile::open(PathBuf::from(reference).join("broken/valid_base.gguf"))?;
    let mut w = GgufWriter::new();
    for (k, v) in base.metadata() {
        let v = match (k.as_str(), v) {
            (
                "tokenizer.ggml.tokens" | "tokenizer.ggml.merges",
                MetaValue::Array(MetaArray::String(s)),
            ) => MetaValue::Array(MetaArray::String(s.iter().take(8).cloned().collect())),
            ("tokenizer.ggml.token_type", MetaValue::Array(MetaArray::I32(t))) => {
                MetaValue::Array(MetaArray::I32(t.iter().take(8).copied().collect()))
            }
            _ => v.clone(),
        };
        w.add_kv(k.clone(), v)?;
    }
    for t in base.tensors() {
        w.add_tensor(t.name.clone(), &t.dims, t.ty, base.tensor_data(t))?;
    }
    let slim = w.to_bytes()?;
    write("valid_base_slim.gguf", &slim)?;

    // One-defect variants of the slim file.
    let patched = |at: usize, b: &[u8]| {
        let mut v = slim.clone();
        v[at..at + b.len()].copy_from_slice(b);
        v
    };
    write("slim_bad_magic.gguf", &patched(0, b"GGUX"))?;
    write("slim_version_1.gguf", &patched(4, &1u32.to_le_bytes()))?;
    write(
        "slim_kv_count_huge.gguf",
        &patched(16, &(1u64 << 60).to_le_bytes()),
    )?;
    write("slim_truncated.gguf", &slim[..slim.len() - 100])?;

    // Every value type, nested arrays, several tensor types.
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "fuzz".into())?;
    let values: Vec<(&str, MetaValue)> = vec![
        ("u8", MetaValue::U8(1)),
        ("i8", MetaValue::I8(-1)),
        ("u16", MetaValue::U16(2)),
        ("i16", MetaValue::I16(-2)),
        ("u32", MetaValue::U32(3)),
        ("i32", MetaValue::I32(-3)),
        ("f32", MetaValue::F32(0.5)),
        ("bool", MetaValue::Bool(true)),
        ("str", "s".into()),
        ("u64", MetaValue::U64(4)),
        ("i64", MetaValue::I64(-4)),
        ("f64", MetaValue::F64(0.25)),
        ("a_str", vec!["a".to_string(), "bc".to_string()].into()),
        ("a_bool", vec![true, false].into()),
        ("a_f32", vec![1.0f32].into()),
        (
            "nested",
            MetaValue::Array(MetaArray::Array(vec![
                MetaArray::U16(vec![1, 2]),
                MetaArray::Array(vec![MetaArray::I8(vec![-1])]),
            ])),
        ),
    ];
    for (k, v) in values {
        w.add_kv(k, v)?;
    }
    w.add_tensor("f32", &[2, 2], GgmlType::F32, vec![0u8; 16])?;
    w.add_tensor("f16", &[3], GgmlType::F16, vec![0u8; 6])?;
    w.add_tensor("q8", &[32], GgmlType::Q8_0, vec![0u8; 34])?;
    w.add_tensor("q4k", &[256], GgmlType::Q4K, vec![0u8; 144])?;
    w.add_tensor("empty", &[0, 4], GgmlType::F32, Vec::new())?;
    write("all_types.gguf", &w.to_bytes()?)?;
    w.set_alignment(1)?;
    write("all_types_align1.gguf", &w.to_bytes()?)?;
    w.set_alignment(64)?;
    w.set_version(2)?;
    write("all_types_v2_align64.gguf", &w.to_bytes()?)?;

    // Minimal files.
    write("empty_v3.gguf", &GgufWriter::new().to_bytes()?)?;
    let mut w = GgufWriter::new();
    w.set_version(2)?;
    w.add_kv("k", MetaValue::U8(0))?;
    write("one_kv_v2.gguf", &w.to_bytes()?)?;
    Ok(())
}
