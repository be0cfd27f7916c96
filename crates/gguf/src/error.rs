//! Errors of the GGUF reader, writer and metadata accessors.
//!
//! A [`GgufError`] is a [`GgufErrorKind`] (what went wrong, matchable) plus where: the file field it
//! concerns (`"header.kv_count"`, `"tensor[2] 'blk.0.ssm_a'.dims[1]"`, a metadata key, ...) and, for
//! errors found while parsing, the byte offset of that field in the file.

use std::fmt;
use std::path::{Path, PathBuf};

/// What went wrong. Every variant is specific enough to tell corrupt files apart.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufErrorKind {
    /// Opening, mapping or writing a file failed.
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),

    /// The first four bytes are not `GGUF`.
    #[error("bad magic \"{}\" (expected \"GGUF\")", found.escape_ascii())]
    BadMagic { found: [u8; 4] },

    /// A header version other than 2 or 3.
    #[error("{}", version_message(*.version))]
    UnsupportedVersion { version: u32 },

    /// The file ends inside a field: `needed` bytes were required, `available` remained.
    #[error("unexpected end of file: need {needed} bytes, {available} left")]
    UnexpectedEof { needed: u64, available: u64 },

    /// A count (of KV pairs, tensors or array items) that cannot fit in the whole file even at
    /// the smallest possible item size: a corrupt count, rejected before anything is allocated.
    #[error("count {count} is absurd: {count} items of at least {min_item_bytes} bytes cannot fit in a {file_size}-byte file")]
    CountTooLarge {
        count: u64,
        min_item_bytes: u64,
        file_size: u64,
    },

    /// A string length larger than the whole file.
    #[error("string length {len} exceeds the file size {file_size}")]
    StringTooLong { len: u64, file_size: u64 },

    /// A string that is not UTF-8.
    #[error("string is not valid UTF-8: {0}")]
    InvalidUtf8(std::str::Utf8Error),

    /// A metadata value type id outside 0..=12.
    #[error("invalid metadata value type id {id} (valid: 0..=12)")]
    InvalidValueType { id: u32 },

    /// A bool byte other than 0 or 1.
    #[error("invalid bool value {value} (must be 0 or 1)")]
    InvalidBool { value: u8 },

    /// Arrays nested deeper than [`crate::reader::MAX_ARRAY_DEPTH`].
    #[error("arrays nested deeper than {max} levels")]
    ArrayNestingTooDeep { max: usize },

    /// The same metadata key twice.
    #[error("duplicate metadata key {key:?} (first at byte {first_offset})")]
    DuplicateKey { key: String, first_offset: u64 },

    /// `general.alignment` with the wrong type, zero, or not a power of two.
    #[error("invalid alignment: {detail}")]
    InvalidAlignment { detail: String },

    /// A tensor with more than four dimensions.
    #[error("tensor has {n_dims} dimensions (at most 4)")]
    TooManyDims { n_dims: u32 },

    /// A dimension, or the product of the dimensions, does not fit ggml's int64 element count.
    #[error("element count overflows: dims {dims:?}")]
    ElementCountOverflow { dims: Vec<u64> },

    /// A ggml type id that redlite does not know (`name` is ggml's name when ggml defines it).
    #[error("{}", match name {
        Some(n) => format!("ggml type id {id} ({n}) is not supported"),
        None => format!("unknown ggml type id {id}"),
    })]
    UnknownGgmlType { id: u32, name: Option<&'static str> },

    /// The first dimension of a quantized tensor is not a whole number of blocks.
    #[error("row length {ne0} is not a multiple of the {ty} block size {block_elems}")]
    RowNotBlockMultiple {
        ne0: u64,
        ty: crate::GgmlType,
        block_elems: u64,
    },

    /// A tensor's byte size overflows u64.
    #[error("tensor byte size overflows")]
    TensorSizeOverflow,

    /// Two tensor infos with the same name.
    #[error("duplicate tensor name {name:?}")]
    DuplicateTensorName { name: String },

    /// A tensor data offset that is not a multiple of the file's alignment.
    #[error("tensor data offset {offset} is not a multiple of the alignment {alignment}")]
    MisalignedTensorOffset { offset: u64, alignment: u64 },

    /// A tensor whose data starts at or beyond the end of the file.
    #[error("tensor data offset {offset} (absolute {absolute}) lies past the end of the file ({file_size} bytes)")]
    TensorOffsetOutOfBounds {
        offset: u64,
        absolute: u64,
        file_size: u64,
    },

    /// A tensor whose data starts inside the file but runs past its end (a truncated file).
    #[error("tensor data [{start}, {end}) runs past the end of the file ({file_size} bytes): file truncated")]
    TensorDataTruncated {
        start: u64,
        end: u64,
        file_size: u64,
    },

    /// Two tensors whose data ranges overlap (a tensor would read another's bytes).
    #[error("tensor data runs to data offset {end}, into the data of tensor {other:?}")]
    TensorsOverlap { end: u64, other: String },

    /// The path names a directory.
    #[error("is a directory, not a GGUF file")]
    NotAFile,

    /// A metadata key asked for by an accessor is absent.
    #[error("metadata key is missing")]
    MissingKey,

    /// A metadata value has another type than the accessor wants.
    #[error("expected {expected}, found {found}")]
    TypeMismatch {
        expected: &'static str,
        found: String,
    },

    /// A metadata value has the right kind of type but does not fit the accessor's type.
    #[error("value {value} does not fit {expected}")]
    ValueOutOfRange {
        expected: &'static str,
        value: String,
    },

    /// Writer: tensor bytes do not match the size implied by dims and type.
    #[error("tensor data is {actual} bytes, dims {dims:?} of type {ty} need {expected}")]
    TensorDataSizeMismatch {
        dims: Vec<u64>,
        ty: crate::GgmlType,
        expected: u64,
        actual: u64,
    },

    /// Writer: a version other than 2 or 3 was requested.
    #[error("cannot write GGUF version {version} (only 2 and 3)")]
    UnsupportedWriteVersion { version: u32 },

    /// Writer: a metadata value that cannot be written (an array whose items disagree with its type).
    #[error("invalid metadata value: {detail}")]
    InvalidValue { detail: String },
}

fn version_message(version: u32) -> String {
    match version {
        1 => "GGUF version 1 is not supported (obsolete format with 32-bit counts; re-convert the model)"
            .to_string(),
        v if matches!(v.swap_bytes(), 1..=3) => format!(
            "GGUF version field reads {v}: this looks like a big-endian file (version {}), which is not supported",
            v.swap_bytes()
        ),
        v => format!("unsupported GGUF version {v} (supported: 2, 3)"),
    }
}

/// An error with context: its kind, the field it concerns and that field's byte offset.
#[derive(Debug)]
pub struct GgufError {
    kind: GgufErrorKind,
    field: Option<String>,
    offset: Option<u64>,
    path: Option<PathBuf>,
}

impl GgufError {
    /// An error of `kind` with no location.
    pub fn new(kind: GgufErrorKind) -> GgufError {
        GgufError {
            kind,
            field: None,
            offset: None,
            path: None,
        }
    }

    /// An error of `kind` about `field` at byte `offset` of the file.
    pub fn at(kind: GgufErrorKind, field: impl Into<String>, offset: u64) -> GgufError {
        GgufError {
            kind,
            field: Some(field.into()),
            offset: Some(offset),
            path: None,
        }
    }

    /// An error of `kind` about `field` (a metadata key, a tensor name) without a file offset.
    pub fn field(kind: GgufErrorKind, field: impl Into<String>) -> GgufError {
        GgufError {
            kind,
            field: Some(field.into()),
            offset: None,
            path: None,
        }
    }

    pub(crate) fn with_offset(mut self, offset: Option<u64>) -> GgufError {
        if self.offset.is_none() {
            self.offset = offset;
        }
        self
    }

    pub(crate) fn with_path(mut self, path: &Path) -> GgufError {
        self.path = Some(path.to_path_buf());
        self
    }

    /// What went wrong.
    pub fn kind(&self) -> &GgufErrorKind {
        &self.kind
    }

    /// The field (file structure path, metadata key or tensor name) the error concerns.
    pub fn field_name(&self) -> Option<&str> {
        self.field.as_deref()
    }

    /// Byte offset in the file of the offending field, when known.
    pub fn offset(&self) -> Option<u64> {
        self.offset
    }

    /// The file, for errors from [`crate::GgufFile::open`] and writer path methods.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }
}

impl fmt::Display for GgufError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(p) = &self.path {
            write!(f, "{}: ", p.display())?;
        }
        match (&self.field, self.offset) {
            (Some(field), Some(off)) => write!(f, "{field} (byte {off}): ")?,
            (Some(field), None) => write!(f, "{field}: ")?,
            (None, Some(off)) => write!(f, "byte {off}: ")?,
            (None, None) => {}
        }
        write!(f, "{}", self.kind)
    }
}

// No `source()`: the message already ends with the inner I/O or UTF-8 error's text
// (`GgufErrorKind`'s Display), and a source would print it twice in a context chain
// ("…: No such device (os error 19): No such device (os error 19)"). The inner error stays
// reachable through `GgufError::kind`.
impl std::error::Error for GgufError {}

impl From<std::io::Error> for GgufError {
    fn from(e: std::io::Error) -> Self {
        GgufError::new(GgufErrorKind::Io(e))
    }
}

/// ggml's name for a type id that ggml defines but redlite does not support, for error messages.
pub(crate) fn ggml_name_of_unsupported_id(id: u32) -> Option<&'static str> {
    Some(match id {
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        9 => "Q8_1",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => return None,
    })
}
