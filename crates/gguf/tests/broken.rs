//! Every corrupt file in `reference/broken/` is rejected with its own specific error kind (never a
//! panic), and the control file `valid_base.gguf` parses.

use std::path::PathBuf;

use redlite_gguf::{GgmlType, GgufErrorKind, GgufFile};

fn broken_dir() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/reference/broken"
    ))
}

fn open_err(name: &str) -> redlite_gguf::GgufError {
    match GgufFile::open(broken_dir().join(name)) {
        Ok(f) => panic!("{name} was accepted: {f:?}"),
        Err(e) => {
            // The message names the field and a byte offset (except for pure I/O errors).
            let msg = e.to_string();
            assert!(e.field_name().is_some(), "{name}: no field in {msg}");
            assert!(e.offset().is_some(), "{name}: no offset in {msg}");
            assert!(msg.contains(name), "{name}: path missing from {msg}");
            eprintln!("{name}: {msg}");
            e
        }
    }
}

#[test]
fn valid_base_parses() {
    let f = GgufFile::open(broken_dir().join("valid_base.gguf")).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.metadata().len(), 44);
    assert_eq!(f.architecture().unwrap(), "qwen3next");
    let names: Vec<_> = f.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        ["output_norm.weight", "blk.0.ssm_a", "blk.0.ssm_ba.weight"]
    );
    let types: Vec<_> = f.tensors().iter().map(|t| t.ty).collect();
    assert_eq!(types, [GgmlType::F32, GgmlType::F32, GgmlType::Q4K]);
    for t in f.tensors() {
        assert_eq!(f.tensor_data(t).len() as u64, t.n_bytes);
        assert_eq!(f.data_offset() % 32, 0);
    }
}

#[test]
fn index_json_lists_exactly_the_files_tested_here() {
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(broken_dir().join("index.json")).unwrap()).unwrap();
    let mut listed: Vec<_> = index.as_object().unwrap().keys().cloned().collect();
    listed.sort();
    let mut tested: Vec<_> = CASES.iter().map(|(n, _)| n.to_string()).collect();
    tested.push("valid_base.gguf".into());
    tested.sort();
    assert_eq!(listed, tested);
}

type Check = fn(&GgufErrorKind) -> bool;

/// Each broken file and the error kind it must produce.
const CASES: &[(&str, Check)] = &[
    (
        "bad_magic.gguf",
        |k| matches!(k, GgufErrorKind::BadMagic { found } if found == b"GGUX"),
    ),
    ("version_99.gguf", |k| {
        matches!(k, GgufErrorKind::UnsupportedVersion { version: 99 })
    }),
    ("truncated_in_header.gguf", |k| {
        matches!(k, GgufErrorKind::UnexpectedEof { .. })
    }),
    ("truncated_in_tensor_data.gguf", |k| {
        matches!(k, GgufErrorKind::TensorDataTruncated { start, end, file_size }
            if end - file_size == 600 && start < file_size)
    }),
    (
        "tensor_offset_past_eof.gguf",
        |k| matches!(k, GgufErrorKind::TensorOffsetOutOfBounds { offset, .. } if *offset == 1 << 32),
    ),
    ("n_dims_9.gguf", |k| {
        matches!(k, GgufErrorKind::TooManyDims { n_dims: 9 })
    }),
    (
        "kv_count_2pow60.gguf",
        |k| matches!(k, GgufErrorKind::CountTooLarge { count, .. } if *count == 1 << 60),
    ),
    (
        "string_len_too_large.gguf",
        |k| matches!(k, GgufErrorKind::StringTooLong { len, .. } if *len == 1 << 40),
    ),
    ("unknown_ggml_type.gguf", |k| {
        matches!(
            k,
            GgufErrorKind::UnknownGgmlType {
                id: 1000,
                name: None
            }
        )
    }),
    ("misaligned_data_offset.gguf", |k| {
        matches!(
            k,
            GgufErrorKind::MisalignedTensorOffset {
                offset: 1041,
                alignment: 32
            }
        )
    }),
    (
        "duplicate_tensor_names.gguf",
        |k| matches!(k, GgufErrorKind::DuplicateTensorName { name } if name == "output_norm.weight"),
    ),
    (
        "dims_product_overflow.gguf",
        |k| matches!(k, GgufErrorKind::ElementCountOverflow { dims } if dims == &[1 << 32; 3]),
    ),
    ("row_not_multiple_of_block.gguf", |k| {
        matches!(
            k,
            GgufErrorKind::RowNotBlockMultiple {
                ne0: 255,
                ty: GgmlType::Q4K,
                block_elems: 256
            }
        )
    }),
    ("kv_bad_value_type.gguf", |k| {
        matches!(k, GgufErrorKind::InvalidValueType { id: 99 })
    }),
];

#[test]
fn every_broken_file_gives_its_specific_error() {
    let mut failures = Vec::new();
    for (name, check) in CASES {
        let e = open_err(name);
        if !check(e.kind()) {
            failures.push(format!("{name}: unexpected error {e} ({:?})", e.kind()));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn broken_files_fail_the_same_way_from_bytes() {
    for (name, check) in CASES {
        let bytes = std::fs::read(broken_dir().join(name)).unwrap();
        let e = GgufFile::from_bytes(bytes).unwrap_err();
        assert!(check(e.kind()), "{name}: {e}");
    }
}

#[test]
fn error_locations_point_at_the_defect() {
    // Header fields sit at fixed offsets.
    assert_eq!(open_err("bad_magic.gguf").offset(), Some(0));
    assert_eq!(open_err("version_99.gguf").offset(), Some(4));
    assert_eq!(open_err("kv_count_2pow60.gguf").offset(), Some(16));
    let e = open_err("kv_count_2pow60.gguf");
    assert_eq!(e.field_name(), Some("header.kv_count"));
    // The first KV key's length prefix follows the 24-byte header.
    let e = open_err("string_len_too_large.gguf");
    assert_eq!((e.field_name(), e.offset()), (Some("kv[0].key"), Some(24)));
    let e = open_err("n_dims_9.gguf");
    assert!(e.field_name().unwrap().ends_with(".n_dims"), "{e}");
    let e = open_err("unknown_ggml_type.gguf");
    assert!(e.field_name().unwrap().starts_with("tensor[1]"), "{e}");
    let e = open_err("kv_bad_value_type.gguf");
    assert!(e.field_name().unwrap().starts_with("kv[0]"), "{e}");
}
