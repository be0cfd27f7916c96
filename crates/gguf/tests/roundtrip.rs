//! Writer round trip: every fixture file is read, written back with `GgufWriter`, and re-read.
//! Metadata and tensor bytes must be equal, and the written file must be byte-identical to the
//! original (all fixtures were written by gguf-py or ggml with the standard layout).

mod common;

use std::path::{Path, PathBuf};

use common::reference;
use redlite_gguf::{GgmlType, GgufErrorKind, GgufFile, GgufWriter, MetaArray, MetaValue};

fn fixture_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(reference("models"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .collect();
    files.sort();
    files.push(reference("tokenizer/qwen3-vocab.gguf"));
    files.push(reference("broken/valid_base.gguf"));
    files
}

fn round_trip(path: &Path) {
    let original = GgufFile::open(path).unwrap();
    let written = GgufWriter::from_file(&original)
        .unwrap()
        .to_bytes()
        .unwrap();
    let reread = GgufFile::from_bytes(written.as_slice()).unwrap();

    assert_eq!(reread.version(), original.version());
    assert_eq!(reread.alignment(), original.alignment());
    assert_eq!(reread.metadata(), original.metadata(), "{path:?}");
    assert_eq!(reread.tensors().len(), original.tensors().len());
    for (a, b) in original.tensors().iter().zip(reread.tensors()) {
        assert_eq!(
            (&a.name, &a.dims, a.ty, a.n_bytes),
            (&b.name, &b.dims, b.ty, b.n_bytes)
        );
        assert!(
            original.tensor_data(a) == reread.tensor_data(b),
            "{}",
            a.name
        );
    }
    assert!(
        written.as_slice() == original.bytes(),
        "{path:?}: written file differs from the original ({} vs {} bytes)",
        written.len(),
        original.file_size()
    );
}

#[test]
fn fixtures_round_trip_byte_identical() {
    let files = fixture_files();
    assert!(files.len() >= 13);
    for f in files {
        round_trip(&f);
    }
}

#[test]
fn write_to_path_then_open() {
    let dir = std::env::temp_dir().join(format!("redlite-gguf-rt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("small.gguf");
    let w = small_writer(3, 64);
    let n = w.write_to_path(&path).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.file_size(), n);
    check_small(&f, 3, 64);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A file with every metadata value type, nested arrays and a few tensors.
fn small_writer(version: u32, alignment: u64) -> GgufWriter<'static> {
    let mut w = GgufWriter::new();
    w.set_version(version).unwrap();
    w.add_kv("general.architecture", "test".into()).unwrap();
    w.set_alignment(alignment).unwrap();
    for (k, v) in all_values() {
        w.add_kv(k, v).unwrap();
    }
    w.add_tensor("a", &[4, 2], GgmlType::F32, vec![7u8; 32])
        .unwrap();
    w.add_tensor("b", &[256], GgmlType::Q4K, vec![1u8; 144])
        .unwrap();
    w.add_tensor("c", &[32, 3], GgmlType::Q8_0, vec![2u8; 3 * 34])
        .unwrap();
    w.add_tensor("scalar", &[], GgmlType::F16, vec![3u8; 2])
        .unwrap();
    w
}

fn all_values() -> Vec<(&'static str, MetaValue)> {
    vec![
        ("t.u8", MetaValue::U8(200)),
        ("t.i8", MetaValue::I8(-5)),
        ("t.u16", MetaValue::U16(60000)),
        ("t.i16", MetaValue::I16(-30000)),
        ("t.u32", MetaValue::U32(4_000_000_000)),
        ("t.i32", MetaValue::I32(-7)),
        ("t.f32", MetaValue::F32(1.5)),
        ("t.bool", MetaValue::Bool(true)),
        ("t.str", MetaValue::String("héllo ✓".into())),
        ("t.u64", MetaValue::U64(u64::MAX)),
        ("t.i64", MetaValue::I64(i64::MIN)),
        ("t.f64", MetaValue::F64(-2.25)),
        ("t.arr_i32", vec![1i32, -2, 3].into()),
        ("t.arr_str", vec!["x".to_string(), String::new()].into()),
        ("t.arr_bool", vec![true, false].into()),
        ("t.arr_f32", vec![0.5f32, 2.0].into()),
        ("t.arr_u8", vec![1u8, 2, 3].into()),
        ("t.arr_empty", MetaValue::Array(MetaArray::U64(vec![]))),
        (
            "t.nested",
            MetaValue::Array(MetaArray::Array(vec![
                MetaArray::I16(vec![1, 2]),
                MetaArray::String(vec!["s".into()]),
                MetaArray::Array(vec![MetaArray::F64(vec![1.0])]),
                MetaArray::Array(vec![]),
            ])),
        ),
    ]
}

fn check_small(f: &GgufFile, version: u32, alignment: u64) {
    assert_eq!(f.version(), version);
    assert_eq!(f.alignment(), alignment);
    assert_eq!(f.data_offset() % alignment, 0);
    for (k, v) in all_values() {
        assert_eq!(f.get(k), Some(&v), "{k}");
    }
    assert_eq!(f.get_u32("t.u8").unwrap(), 200);
    assert_eq!(f.get_i64("t.i8").unwrap(), -5);
    assert_eq!(f.get_u64("t.u64").unwrap(), u64::MAX);
    assert!(matches!(
        f.get_u32("t.u64").unwrap_err().kind(),
        GgufErrorKind::ValueOutOfRange { .. }
    ));
    assert!(matches!(
        f.get_u32("t.i8").unwrap_err().kind(),
        GgufErrorKind::ValueOutOfRange { .. }
    ));
    assert_eq!(f.get_f32("t.f64").unwrap(), -2.25);
    assert_eq!(f.get_str("t.str").unwrap(), "héllo ✓");
    assert_eq!(f.get_i32_array("t.arr_i32").unwrap(), [1, -2, 3]);
    assert!(f.get_u32_array("t.arr_i32").is_err());
    assert_eq!(f.get_u32_array("t.arr_u8").unwrap(), [1, 2, 3]);
    assert_eq!(f.get_f32_array("t.arr_f32").unwrap(), [0.5, 2.0]);
    assert_eq!(f.get_bool_array("t.arr_bool").unwrap(), [true, false]);
    assert_eq!(f.get_str_array("t.arr_str").unwrap(), ["x", ""]);
    assert_eq!(f.get_opt_bool("t.bool").unwrap(), Some(true));
    assert_eq!(f.get_opt_f32("t.f32").unwrap(), Some(1.5));
    assert_eq!(
        f.get("t.nested").unwrap().type_name(),
        "array[array[int16]]"
    );

    let names: Vec<_> = f.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["a", "b", "c", "scalar"]);
    let c = f.tensor("c").unwrap();
    assert_eq!(
        (c.n_elements, c.n_bytes, c.n_rows(), c.row_bytes()),
        (96, 102, 3, 34)
    );
    assert_eq!(f.tensor_data(c), vec![2u8; 102]);
    let s = f.tensor("scalar").unwrap();
    assert_eq!((s.n_elements, s.n_bytes), (1, 2));
    for t in f.tensors() {
        assert_eq!(t.offset % alignment, 0);
        assert_eq!(f.tensor_data(t).len() as u64, t.n_bytes);
    }
    assert_eq!(f.file_size() % alignment, 0);
}

#[test]
fn every_value_type_round_trips_v2_and_v3() {
    for version in [2, 3] {
        for alignment in [1, 32, 64, 4096] {
            let bytes = small_writer(version, alignment).to_bytes().unwrap();
            let f = GgufFile::from_bytes(bytes.as_slice()).unwrap();
            check_small(&f, version, alignment);
            // Reading back and writing again reproduces the bytes.
            let again = GgufWriter::from_file(&f).unwrap().to_bytes().unwrap();
            assert!(again == bytes);
            // general.alignment is only written when it is not the default.
            assert_eq!(f.get("general.alignment").is_some(), alignment != 32);
        }
    }
}

#[test]
fn writer_rejects_bad_input() {
    let mut w = GgufWriter::new();
    let e = w
        .add_tensor("t", &[256, 2], GgmlType::Q4K, vec![0u8; 100])
        .unwrap_err();
    assert!(matches!(
        e.kind(),
        GgufErrorKind::TensorDataSizeMismatch {
            expected: 288,
            actual: 100,
            ..
        }
    ));
    let e = w
        .add_tensor("t", &[100], GgmlType::Q8_0, vec![0u8; 100])
        .unwrap_err();
    assert!(matches!(
        e.kind(),
        GgufErrorKind::RowNotBlockMultiple { .. }
    ));
    let e = w
        .add_tensor("t", &[1, 1, 1, 1, 1], GgmlType::F32, vec![0u8; 4])
        .unwrap_err();
    assert!(matches!(e.kind(), GgufErrorKind::TooManyDims { n_dims: 5 }));
    w.add_tensor("t", &[1], GgmlType::F32, vec![0u8; 4])
        .unwrap();
    let e = w
        .add_tensor("t", &[1], GgmlType::F32, vec![0u8; 4])
        .unwrap_err();
    assert!(matches!(
        e.kind(),
        GgufErrorKind::DuplicateTensorName { .. }
    ));

    w.add_kv("k", MetaValue::U8(1)).unwrap();
    let e = w.add_kv("k", MetaValue::U8(2)).unwrap_err();
    assert!(matches!(e.kind(), GgufErrorKind::DuplicateKey { .. }));
    let e = w
        .add_kv("general.alignment", MetaValue::U32(48))
        .unwrap_err();
    assert!(matches!(e.kind(), GgufErrorKind::InvalidAlignment { .. }));
    assert!(w.set_alignment(0).is_err());
    assert!(w.set_alignment(1 << 40).is_err());
    assert!(w.set_version(1).is_err());

    let mut deep = MetaArray::U8(vec![]);
    for _ in 0..redlite_gguf::MAX_ARRAY_DEPTH {
        deep = MetaArray::Array(vec![deep]);
    }
    let e = w.add_kv("deep", MetaValue::Array(deep)).unwrap_err();
    assert!(matches!(
        e.kind(),
        GgufErrorKind::ArrayNestingTooDeep { .. }
    ));
}

#[test]
fn reader_rejects_what_writer_cannot_express() {
    // v1, a bool byte of 2, invalid UTF-8, duplicate keys, bad alignment: built by patching a
    // small valid file.
    let mut w = GgufWriter::new();
    w.add_kv("a", MetaValue::Bool(true)).unwrap();
    w.add_kv("b", "xy".into()).unwrap();
    w.add_kv("general.alignment", MetaValue::U32(32)).unwrap();
    let bytes = w.to_bytes().unwrap();
    assert!(GgufFile::from_bytes(bytes.as_slice()).is_ok());
    // Layout: 24 header | "a": 8+1 key, 4 type, 1 value (@37) | "b": 8+1 key (@46), 4 type, 8+2 (@59..61) | ...
    let patch = |at: usize, b: &[u8]| {
        let mut v = bytes.clone();
        v[at..at + b.len()].copy_from_slice(b);
        GgufFile::from_bytes(v).unwrap_err()
    };
    let e = patch(4, &1u32.to_le_bytes());
    assert!(matches!(
        e.kind(),
        GgufErrorKind::UnsupportedVersion { version: 1 }
    ));
    assert!(e.to_string().contains("version 1 is not supported"), "{e}");
    let e = patch(4, &3u32.to_be_bytes());
    assert!(e.to_string().contains("big-endian"), "{e}");
    let e = patch(37, &[2]);
    assert!(matches!(e.kind(), GgufErrorKind::InvalidBool { value: 2 }));
    assert_eq!(e.offset(), Some(37));
    let e = patch(59, &[0xff]);
    assert!(matches!(e.kind(), GgufErrorKind::InvalidUtf8(_)));
    assert_eq!(e.offset(), Some(59));
    let e = patch(46, b"a");
    assert!(
        matches!(e.kind(), GgufErrorKind::DuplicateKey { key, first_offset: 24 } if key == "a")
    );
    let at = bytes.len() - 4;
    let e = patch(at, &48u32.to_le_bytes());
    assert!(matches!(e.kind(), GgufErrorKind::InvalidAlignment { .. }));
    let e = patch(at, &0u32.to_le_bytes());
    assert!(matches!(e.kind(), GgufErrorKind::InvalidAlignment { .. }));

    // Too-deep nesting in a file.
    let mut v = Vec::new();
    v.extend_from_slice(b"GGUF");
    v.extend_from_slice(&3u32.to_le_bytes());
    v.extend_from_slice(&0u64.to_le_bytes());
    v.extend_from_slice(&1u64.to_le_bytes());
    v.extend_from_slice(&1u64.to_le_bytes());
    v.push(b'k');
    v.extend_from_slice(&9u32.to_le_bytes());
    for _ in 0..100 {
        v.extend_from_slice(&9u32.to_le_bytes());
        v.extend_from_slice(&1u64.to_le_bytes());
    }
    let e = GgufFile::from_bytes(v).unwrap_err();
    assert!(
        matches!(e.kind(), GgufErrorKind::ArrayNestingTooDeep { .. }),
        "{e}"
    );

    // Empty and tiny inputs.
    for n in 0..24 {
        assert!(GgufFile::from_bytes(&bytes[..n]).is_err());
    }
}

#[test]
fn open_reports_io_errors_and_handles_empty_files() {
    let missing = std::env::temp_dir().join("redlite-gguf-definitely-missing.gguf");
    let e = GgufFile::open(&missing).unwrap_err();
    assert!(matches!(e.kind(), GgufErrorKind::Io(_)));
    assert!(e.to_string().contains("definitely-missing"), "{e}");

    let dir = std::env::temp_dir().join(format!("redlite-gguf-empty-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let empty = dir.join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    let e = GgufFile::open(&empty).unwrap_err();
    assert!(matches!(
        e.kind(),
        GgufErrorKind::UnexpectedEof {
            needed: 4,
            available: 0
        }
    ));
    assert_eq!(e.field_name(), Some("header.magic"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn reader_rejects_overlapping_tensors_and_directories() {
    let mut w = GgufWriter::new();
    w.add_tensor("a", &[8], GgmlType::F32, vec![1u8; 32])
        .unwrap();
    w.add_tensor("b", &[8], GgmlType::F32, vec![2u8; 32])
        .unwrap();
    let bytes = w.to_bytes().unwrap();
    assert!(GgufFile::from_bytes(bytes.as_slice()).is_ok());
    // Tensor info of "b": name (u64 length 1, "b"), n_dims u32 = 1, dims u64, type u32, offset u64.
    let name = [1u8, 0, 0, 0, 0, 0, 0, 0, b'b'];
    let at = bytes
        .windows(name.len())
        .position(|s| s == name)
        .expect("tensor info of b")
        + name.len()
        + 4
        + 8
        + 4;
    assert_eq!(bytes[at..at + 8], 32u64.to_le_bytes());
    let mut v = bytes.clone();
    v[at..at + 8].copy_from_slice(&0u64.to_le_bytes());
    let e = GgufFile::from_bytes(v).unwrap_err();
    assert!(
        matches!(e.kind(), GgufErrorKind::TensorsOverlap { other, .. } if other == "b" || other == "a"),
        "{e}"
    );
    assert!(e.to_string().contains("into the data of tensor"), "{e}");

    let e = GgufFile::open(std::env::temp_dir()).unwrap_err();
    assert!(matches!(e.kind(), GgufErrorKind::NotAFile), "{e}");
    assert!(e.to_string().contains("is a directory"), "{e}");
}
