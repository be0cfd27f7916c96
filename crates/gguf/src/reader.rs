//! The GGUF reader: parses and validates a whole file up front, then serves metadata and tensor
//! data without further checks.
//!
//! Layout (GGUF v2/v3, little-endian):
//! ```text
//! "GGUF" | version u32 | tensor_count u64 | kv_count u64
//! kv_count × (key: string, value_type u32, value)
//! tensor_count × (name: string, n_dims u32, dims u64 × n_dims (ne0 first), ggml_type u32, offset u64)
//! padding to `general.alignment` (default 32) — the data section starts here
//! tensor data, each tensor at data_start + offset (offset a multiple of the alignment)
//! ```
//! A string is a u64 byte length followed by UTF-8 bytes; an array is an item type u32, a u64
//! count and the items.
//!
//! Every count, length, offset and size read from the file is checked with overflow-safe
//! arithmetic against the file size before anything is allocated, so no input can make the parser
//! panic, loop for long or allocate more than a small multiple of the file size.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

use crate::error::{ggml_name_of_unsupported_id, GgufError, GgufErrorKind};
use crate::metadata::{MetaArray, MetaValue, MetaValueType};
use crate::GgmlType;

/// The four magic bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// The data section alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The metadata key that sets the alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// ggml's limit on tensor dimensions.
pub const MAX_DIMS: usize = 4;
/// How deeply arrays may nest (an array of arrays is depth 2). ggml rejects nested arrays
/// entirely; gguf-py allows them; this bound keeps the recursive parser's stack small.
pub const MAX_ARRAY_DEPTH: usize = 8;

/// Smallest encoded size of a KV pair: key length u64 + value type u32 + a one-byte value.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
/// Smallest encoded size of a tensor info: name length u64 + n_dims u32 + type u32 + offset u64.
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 4 + 8;

type Result<T, E = GgufError> = std::result::Result<T, E>;

/// One entry of the tensor table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions, ne0 (the contiguous row length) first.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset of the data relative to the start of the data section.
    pub offset: u64,
    /// Product of `dims` (1 for a zero-dimensional tensor).
    pub n_elements: u64,
    /// Size of the data in bytes.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Row length ne0 (1 for a zero-dimensional tensor).
    pub fn ne0(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Number of rows: the product of all dims but the first (0 when ne0 is 0).
    pub fn n_rows(&self) -> u64 {
        self.n_elements.checked_div(self.ne0()).unwrap_or(0)
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> u64 {
        // Validated at parse time: ne0 is a whole number of blocks and the total size fits u64.
        self.ty.row_bytes(self.ne0()).unwrap_or(0)
    }
}

/// Element count and byte size of a tensor with `dims` of type `ty`, with every check ggml makes:
/// at most four dims, the element count fits int64, ne0 is a whole number of blocks.
pub(crate) fn tensor_size(dims: &[u64], ty: GgmlType) -> Result<(u64, u64), GgufErrorKind> {
    if dims.len() > MAX_DIMS {
        return Err(GgufErrorKind::TooManyDims {
            n_dims: u32::try_from(dims.len()).unwrap_or(u32::MAX),
        });
    }
    let overflow = || GgufErrorKind::ElementCountOverflow {
        dims: dims.to_vec(),
    };
    let mut n_elements: u64 = 1;
    for &d in dims {
        n_elements = n_elements.checked_mul(d).ok_or_else(overflow)?;
    }
    if n_elements > i64::MAX as u64 || dims.iter().any(|&d| d > i64::MAX as u64) {
        return Err(overflow());
    }
    let ne0 = dims.first().copied().unwrap_or(1);
    let block_elems = ty.block_elems() as u64;
    if ne0 % block_elems != 0 {
        return Err(GgufErrorKind::RowNotBlockMultiple {
            ne0,
            ty,
            block_elems,
        });
    }
    // ne0 is a multiple of the block, so the element count is too.
    let n_bytes = (n_elements / block_elems)
        .checked_mul(ty.block_bytes() as u64)
        .ok_or(GgufErrorKind::TensorSizeOverflow)?;
    Ok((n_elements, n_bytes))
}

/// Checks an alignment value: nonzero, a power of two, at most u32::MAX.
pub(crate) fn check_alignment(value: &MetaValue) -> Result<u64, GgufErrorKind> {
    let bad = |detail: String| GgufErrorKind::InvalidAlignment { detail };
    let Some(v) = value.as_integer() else {
        return Err(bad(format!(
            "{ALIGNMENT_KEY} has type {}, expected an unsigned integer",
            value.type_name()
        )));
    };
    match u32::try_from(v) {
        Ok(a) if a.is_power_of_two() => Ok(a.into()),
        _ => Err(bad(format!(
            "{ALIGNMENT_KEY} = {v} is not a nonzero power of two fitting u32"
        ))),
    }
}

/// `x` rounded up to a multiple of `align` (a power of two), or `None` on overflow.
pub(crate) fn align_up(x: u64, align: u64) -> Option<u64> {
    debug_assert!(align.is_power_of_two());
    Some(x.checked_add(align - 1)? & !(align - 1))
}

/// A bounds-checked little-endian reader over the file bytes. Every method takes the name of the
/// field it reads (as a closure, only called on error) so errors say what and where.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

type FieldName<'f> = &'f dyn Fn() -> String;

impl<'a> Cursor<'a> {
    fn file_size(&self) -> u64 {
        self.buf.len() as u64
    }

    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn pos(&self) -> u64 {
        self.pos as u64
    }

    fn take(&mut self, n: u64, field: FieldName) -> Result<&'a [u8]> {
        let available = self.remaining();
        if n > available {
            return Err(GgufError::at(
                GgufErrorKind::UnexpectedEof {
                    needed: n,
                    available,
                },
                field(),
                self.pos(),
            ));
        }
        // n <= remaining <= usize::MAX, so the cast and the slice are in range.
        let n = n as usize;
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, field: FieldName) -> Result<[u8; N]> {
        let bytes = self.take(N as u64, field)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn u32(&mut self, field: FieldName) -> Result<u32> {
        self.array(field).map(u32::from_le_bytes)
    }

    fn u64(&mut self, field: FieldName) -> Result<u64> {
        self.array(field).map(u64::from_le_bytes)
    }

    /// Reads a u64 count of items that each take at least `min_item_bytes`. A count that cannot
    /// fit in the whole file is [`GgufErrorKind::CountTooLarge`]; one that fits in the file but
    /// not in what is left is [`GgufErrorKind::UnexpectedEof`] (a truncated file).
    fn count(&mut self, min_item_bytes: u64, field: FieldName) -> Result<usize> {
        let at = self.pos();
        let count = self.u64(field)?;
        let needed = count.checked_mul(min_item_bytes);
        match needed {
            Some(n) if n <= self.remaining() => Ok(count as usize),
            Some(n) if n <= self.file_size() => Err(GgufError::at(
                GgufErrorKind::UnexpectedEof {
                    needed: n,
                    available: self.remaining(),
                },
                field(),
                at,
            )),
            _ => Err(GgufError::at(
                GgufErrorKind::CountTooLarge {
                    count,
                    min_item_bytes,
                    file_size: self.file_size(),
                },
                field(),
                at,
            )),
        }
    }

    /// Reads a length-prefixed UTF-8 string.
    fn string(&mut self, field: FieldName) -> Result<String> {
        let at = self.pos();
        let len = self.u64(field)?;
        if len > self.file_size() {
            return Err(GgufError::at(
                GgufErrorKind::StringTooLong {
                    len,
                    file_size: self.file_size(),
                },
                field(),
                at,
            ));
        }
        let start = self.pos();
        let bytes = self.take(len, field)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(GgufError::at(
                GgufErrorKind::InvalidUtf8(e),
                field(),
                start + e.valid_up_to() as u64,
            )),
        }
    }

    fn value_type(&mut self, field: FieldName) -> Result<MetaValueType> {
        let at = self.pos();
        let id = self.u32(field)?;
        MetaValueType::from_id(id)
            .ok_or_else(|| GgufError::at(GgufErrorKind::InvalidValueType { id }, field(), at))
    }

    fn bool(&mut self, field: FieldName) -> Result<bool> {
        let at = self.pos();
        let [b] = self.array::<1>(field)?;
        decode_bool(b).map_err(|k| GgufError::at(k, field(), at))
    }

    /// Reads one metadata value of type `ty`. `depth` counts enclosing arrays.
    fn value(&mut self, ty: MetaValueType, depth: usize, field: FieldName) -> Result<MetaValue> {
        use MetaValueType as T;
        Ok(match ty {
            T::U8 => MetaValue::U8(u8::from_le_bytes(self.array(field)?)),
            T::I8 => MetaValue::I8(i8::from_le_bytes(self.array(field)?)),
            T::U16 => MetaValue::U16(u16::from_le_bytes(self.array(field)?)),
            T::I16 => MetaValue::I16(i16::from_le_bytes(self.array(field)?)),
            T::U32 => MetaValue::U32(u32::from_le_bytes(self.array(field)?)),
            T::I32 => MetaValue::I32(i32::from_le_bytes(self.array(field)?)),
            T::F32 => MetaValue::F32(f32::from_le_bytes(self.array(field)?)),
            T::U64 => MetaValue::U64(u64::from_le_bytes(self.array(field)?)),
            T::I64 => MetaValue::I64(i64::from_le_bytes(self.array(field)?)),
            T::F64 => MetaValue::F64(f64::from_le_bytes(self.array(field)?)),
            T::Bool => MetaValue::Bool(self.bool(field)?),
            T::String => MetaValue::String(self.string(field)?),
            T::Array => MetaValue::Array(self.meta_array(depth + 1, field)?),
        })
    }

    /// Reads an array (item type, count, items) nested `depth` levels deep (1 = top level).
    fn meta_array(&mut self, depth: usize, field: FieldName) -> Result<MetaArray> {
        if depth > MAX_ARRAY_DEPTH {
            return Err(GgufError::at(
                GgufErrorKind::ArrayNestingTooDeep {
                    max: MAX_ARRAY_DEPTH,
                },
                field(),
                self.pos(),
            ));
        }
        let item_field = || format!("{}.item_type", field());
        let item_ty = self.value_type(&item_field)?;
        let count_field = || format!("{}.count", field());
        let n = self.count(item_ty.min_encoded_size(), &count_field)?;

        /// Decodes `n` fixed-size little-endian items in one bounds-checked read.
        macro_rules! fixed {
            ($t:ty, $variant:ident) => {{
                const SIZE: usize = std::mem::size_of::<$t>();
                // n × SIZE <= remaining was checked by `count`.
                let bytes = self.take((n * SIZE) as u64, field)?;
                MetaArray::$variant(
                    bytes
                        .chunks_exact(SIZE)
                        .map(|c| {
                            let mut a = [0u8; SIZE];
                            a.copy_from_slice(c);
                            <$t>::from_le_bytes(a)
                        })
                        .collect(),
                )
            }};
        }

        use MetaValueType as T;
        Ok(match item_ty {
            T::U8 => fixed!(u8, U8),
            T::I8 => fixed!(i8, I8),
            T::U16 => fixed!(u16, U16),
            T::I16 => fixed!(i16, I16),
            T::U32 => fixed!(u32, U32),
            T::I32 => fixed!(i32, I32),
            T::F32 => fixed!(f32, F32),
            T::U64 => fixed!(u64, U64),
            T::I64 => fixed!(i64, I64),
            T::F64 => fixed!(f64, F64),
            T::Bool => {
                let start = self.pos();
                let bytes = self.take(n as u64, field)?;
                let mut out = Vec::with_capacity(n);
                for (j, &b) in bytes.iter().enumerate() {
                    out.push(decode_bool(b).map_err(|k| {
                        GgufError::at(k, format!("{}[{j}]", field()), start + j as u64)
                    })?);
                }
                MetaArray::Bool(out)
            }
            T::String => {
                let mut out = Vec::with_capacity(n);
                for j in 0..n {
                    out.push(self.string(&|| format!("{}[{j}]", field()))?);
                }
                MetaArray::String(out)
            }
            T::Array => {
                let mut out = Vec::with_capacity(n);
                for j in 0..n {
                    out.push(self.meta_array(depth + 1, &|| format!("{}[{j}]", field()))?);
                }
                MetaArray::Array(out)
            }
        })
    }
}

fn decode_bool(b: u8) -> Result<bool, GgufErrorKind> {
    match b {
        0 => Ok(false),
        1 => Ok(true),
        value => Err(GgufErrorKind::InvalidBool { value }),
    }
}

/// Everything parsed from a file's header, metadata and tensor table.
struct Parsed {
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, MetaValue)>,
    kv_offsets: Vec<u64>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

/// Parses and validates `buf` as a whole GGUF file.
fn parse(buf: &[u8]) -> Result<Parsed> {
    let mut c = Cursor { buf, pos: 0 };

    let magic: [u8; 4] = c.array(&|| "header.magic".into())?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::at(
            GgufErrorKind::BadMagic { found: magic },
            "header.magic",
            0,
        ));
    }
    let version = c.u32(&|| "header.version".into())?;
    if !matches!(version, 2 | 3) {
        return Err(GgufError::at(
            GgufErrorKind::UnsupportedVersion { version },
            "header.version",
            4,
        ));
    }
    let tensor_count = c.count(MIN_TENSOR_INFO_BYTES, &|| "header.tensor_count".into())?;
    let kv_count = c.count(MIN_KV_BYTES, &|| "header.kv_count".into())?;

    // Metadata.
    let mut metadata = Vec::with_capacity(kv_count);
    let mut kv_offsets = Vec::with_capacity(kv_count);
    let mut key_index = HashMap::with_capacity(kv_count);
    for i in 0..kv_count {
        let at = c.pos();
        let key = c.string(&|| format!("kv[{i}].key"))?;
        let field = || format!("kv[{i}] {key:?}");
        let ty = c.value_type(&|| format!("{}.value_type", field()))?;
        let value = c.value(ty, 0, &|| format!("{}.value", field()))?;
        if let Some(&first) = key_index.get(&key) {
            let first_offset: u64 = kv_offsets[first];
            return Err(GgufError::at(
                GgufErrorKind::DuplicateKey {
                    key: key.clone(),
                    first_offset,
                },
                format!("kv[{i}].key"),
                at,
            ));
        }
        key_index.insert(key.clone(), metadata.len());
        metadata.push((key, value));
        kv_offsets.push(at);
    }

    let alignment = match key_index.get(ALIGNMENT_KEY) {
        Some(&i) => check_alignment(&metadata[i].1)
            .map_err(|k| GgufError::at(k, ALIGNMENT_KEY, kv_offsets[i]))?,
        None => DEFAULT_ALIGNMENT,
    };

    // Tensor table. Offsets are checked after it, once the data section start is known.
    let mut tensors = Vec::with_capacity(tensor_count);
    let mut offset_positions = Vec::with_capacity(tensor_count);
    let mut tensor_index = HashMap::with_capacity(tensor_count);
    for i in 0..tensor_count {
        let name_at = c.pos();
        let name = c.string(&|| format!("tensor[{i}].name"))?;
        let field = |what: &str| format!("tensor[{i}] {name:?}.{what}");

        let n_dims_at = c.pos();
        let n_dims = c.u32(&|| field("n_dims"))?;
        if n_dims as usize > MAX_DIMS {
            return Err(GgufError::at(
                GgufErrorKind::TooManyDims { n_dims },
                field("n_dims"),
                n_dims_at,
            ));
        }
        let dims_at = c.pos();
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64(&|| field("dims"))?);
        }

        let type_at = c.pos();
        let type_id = c.u32(&|| field("ggml_type"))?;
        let ty = GgmlType::from_id(type_id).ok_or_else(|| {
            GgufError::at(
                GgufErrorKind::UnknownGgmlType {
                    id: type_id,
                    name: ggml_name_of_unsupported_id(type_id),
                },
                field("ggml_type"),
                type_at,
            )
        })?;

        let offset_at = c.pos();
        let offset = c.u64(&|| field("offset"))?;

        let (n_elements, n_bytes) =
            tensor_size(&dims, ty).map_err(|k| GgufError::at(k, field("dims"), dims_at))?;

        if tensor_index.contains_key(&name) {
            return Err(GgufError::at(
                GgufErrorKind::DuplicateTensorName { name: name.clone() },
                format!("tensor[{i}].name"),
                name_at,
            ));
        }
        tensor_index.insert(name.clone(), tensors.len());
        tensors.push(TensorInfo {
            name,
            dims,
            ty,
            offset,
            n_elements,
            n_bytes,
        });
        offset_positions.push(offset_at);
    }

    // Data section.
    let file_size = c.file_size();
    let data_offset = align_up(c.pos(), alignment).ok_or_else(|| {
        GgufError::at(
            GgufErrorKind::TensorSizeOverflow,
            "data section start",
            c.pos(),
        )
    })?;
    let data_len = file_size.saturating_sub(data_offset);
    for (t, &at) in tensors.iter().zip(&offset_positions) {
        let field = || format!("tensor {:?}.offset", t.name);
        if t.offset % alignment != 0 {
            return Err(GgufError::at(
                GgufErrorKind::MisalignedTensorOffset {
                    offset: t.offset,
                    alignment,
                },
                field(),
                at,
            ));
        }
        let starts_outside = t.offset > data_len || (t.offset == data_len && t.n_bytes > 0);
        if starts_outside {
            return Err(GgufError::at(
                GgufErrorKind::TensorOffsetOutOfBounds {
                    offset: t.offset,
                    absolute: data_offset.saturating_add(t.offset),
                    file_size,
                },
                field(),
                at,
            ));
        }
        // offset <= data_len, so data_offset + offset <= file_size cannot overflow.
        let start = data_offset + t.offset;
        if t.n_bytes > data_len - t.offset {
            return Err(GgufError::at(
                GgufErrorKind::TensorDataTruncated {
                    start,
                    end: start.saturating_add(t.n_bytes),
                    file_size,
                },
                field(),
                at,
            ));
        }
    }

    // No two tensors may share bytes: sorted by offset, each non-empty tensor must end at or
    // before the next one starts (a retyped or moved tensor would otherwise read its
    // neighbour's data as its own).
    let mut by_offset: Vec<usize> = (0..tensors.len())
        .filter(|&i| tensors[i].n_bytes > 0)
        .collect();
    by_offset.sort_by_key(|&i| tensors[i].offset);
    for pair in by_offset.windows(2) {
        let (a, b) = (&tensors[pair[0]], &tensors[pair[1]]);
        // Both lie inside the data section (checked above), so the sum cannot overflow.
        let end = a.offset + a.n_bytes;
        if end > b.offset {
            return Err(GgufError::at(
                GgufErrorKind::TensorsOverlap {
                    end,
                    other: b.name.clone(),
                },
                format!("tensor {:?}.offset", a.name),
                offset_positions[pair[0]],
            ));
        }
    }

    Ok(Parsed {
        version,
        alignment,
        data_offset,
        metadata,
        kv_offsets,
        key_index,
        tensors,
        tensor_index,
    })
}

/// The bytes behind a [`GgufFile`].
enum Backing {
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// A parsed and fully validated GGUF file (v2 or v3), memory-mapped or in memory.
///
/// All validation happens in [`GgufFile::open`] / [`GgufFile::from_bytes`]; afterwards every tensor's
/// data is known to lie inside the file, so [`GgufFile::tensor_data`] cannot fail.
pub struct GgufFile {
    backing: Backing,
    /// The path it was opened from (`None` for in-memory files).
    path: Option<std::path::PathBuf>,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, MetaValue)>,
    kv_offsets: Vec<u64>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("file_size", &self.file_size())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .field("n_kv", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and validates the file at `path`.
    ///
    /// The map is read-only; as with any mmap, truncating the file while it is open is undefined
    /// (the OS may deliver SIGBUS), so do not modify model files while they are loaded.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let ctx = |e: GgufError| e.with_path(path);
        let file = std::fs::File::open(path).map_err(|e| ctx(e.into()))?;
        let meta = file.metadata().map_err(|e| ctx(e.into()))?;
        if meta.is_dir() {
            return Err(ctx(GgufError::new(GgufErrorKind::NotAFile)));
        }
        let len = meta.len();
        let backing = if len == 0 {
            Backing::Owned(Vec::new())
        } else {
            // SAFETY: the map is only read. Soundness relies on the file not being modified while
            // mapped, the usual contract for memory-mapped model files (documented above).
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ctx(e.into()))?;
            Backing::Mmap(map)
        };
        let mut f = Self::from_backing(backing).map_err(ctx)?;
        f.path = Some(path.to_path_buf());
        Ok(f)
    }

    /// Validates an in-memory file (accepts `Vec<u8>` or `&[u8]`).
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Result<GgufFile> {
        Self::from_backing(Backing::Owned(bytes.into()))
    }

    fn from_backing(backing: Backing) -> Result<GgufFile> {
        let p = parse(backing.bytes())?;
        Ok(GgufFile {
            backing,
            path: None,
            version: p.version,
            alignment: p.alignment,
            data_offset: p.data_offset,
            metadata: p.metadata,
            kv_offsets: p.kv_offsets,
            key_index: p.key_index,
            tensors: p.tensors,
            tensor_index: p.tensor_index,
        })
    }

    /// The path the file was opened from (`None` for [`GgufFile::from_bytes`]), for readers that
    /// bypass the map (the expert cache reads experts with `pread`/`O_DIRECT`).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Header version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Data alignment (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute offset of the data section (may equal or exceed the file size when there are no tensors).
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// File size in bytes.
    pub fn file_size(&self) -> u64 {
        self.bytes().len() as u64
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.backing.bytes()
    }

    /// All metadata in file order.
    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.metadata
    }

    /// The value of metadata `key`.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// Byte offset in the file of the KV pair `key`.
    pub fn kv_offset(&self, key: &str) -> Option<u64> {
        self.key_index.get(key).map(|&i| self.kv_offsets[i])
    }

    /// All tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The `n_bytes` bytes of tensor `t`. Bounds were validated at open; for a `TensorInfo` that
    /// does not belong to this file and does not fit in it, the result is empty (never a panic).
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let range = || {
            let start = usize::try_from(self.data_offset.checked_add(t.offset)?).ok()?;
            let end = start.checked_add(usize::try_from(t.n_bytes).ok()?)?;
            self.bytes().get(start..end)
        };
        range().unwrap_or(&[])
    }

    /// Data of the tensor named `name`.
    pub fn tensor_bytes(&self, name: &str) -> Option<&[u8]> {
        self.tensor(name).map(|t| self.tensor_data(t))
    }

    // ---- typed metadata accessors ----

    /// The value of `key`, or a [`GgufErrorKind::MissingKey`] error naming it.
    pub fn value(&self, key: &str) -> Result<&MetaValue> {
        self.get(key)
            .ok_or_else(|| GgufError::field(GgufErrorKind::MissingKey, key))
    }

    fn located(&self, key: &str, e: GgufError) -> GgufError {
        e.with_offset(self.kv_offset(key))
    }

    /// An integer of any width converted to `T`, erroring when it is not an integer or out of range.
    fn integer<T: TryFrom<i128>>(&self, key: &str, expected: &'static str) -> Result<T> {
        let v = self.value(key)?;
        let i = v.as_integer().ok_or_else(|| {
            self.located(
                key,
                GgufError::field(
                    GgufErrorKind::TypeMismatch {
                        expected,
                        found: v.type_name(),
                    },
                    key,
                ),
            )
        })?;
        T::try_from(i).map_err(|_| {
            self.located(
                key,
                GgufError::field(
                    GgufErrorKind::ValueOutOfRange {
                        expected,
                        value: i.to_string(),
                    },
                    key,
                ),
            )
        })
    }

    fn mismatch(&self, key: &str, expected: &'static str, v: &MetaValue) -> GgufError {
        self.located(
            key,
            GgufError::field(
                GgufErrorKind::TypeMismatch {
                    expected,
                    found: v.type_name(),
                },
                key,
            ),
        )
    }

    /// Any integer value that fits u32.
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        self.integer(key, "uint32")
    }

    /// Any integer value that fits i32.
    pub fn get_i32(&self, key: &str) -> Result<i32> {
        self.integer(key, "int32")
    }

    /// Any integer value that fits u64.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.integer(key, "uint64")
    }

    /// Any integer value that fits i64.
    pub fn get_i64(&self, key: &str) -> Result<i64> {
        self.integer(key, "int64")
    }

    /// Any integer value that fits usize.
    pub fn get_usize(&self, key: &str) -> Result<usize> {
        self.integer(key, "usize")
    }

    /// A float32 value, or a float64 one rounded to f32.
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        let v = self.value(key)?;
        match *v {
            MetaValue::F32(x) => Ok(x),
            MetaValue::F64(x) => Ok(x as f32),
            _ => Err(self.mismatch(key, "float32", v)),
        }
    }

    /// A float64 or float32 value.
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        let v = self.value(key)?;
        v.as_float().ok_or_else(|| self.mismatch(key, "float64", v))
    }

    pub fn get_bool(&self, key: &str) -> Result<bool> {
        let v = self.value(key)?;
        v.as_bool().ok_or_else(|| self.mismatch(key, "bool", v))
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self.value(key)?;
        v.as_str().ok_or_else(|| self.mismatch(key, "string", v))
    }

    /// An array value of any item type.
    pub fn get_array(&self, key: &str) -> Result<&MetaArray> {
        let v = self.value(key)?;
        v.as_array().ok_or_else(|| self.mismatch(key, "array", v))
    }

    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<&[String]> {
        let v = self.value(key)?;
        match v {
            MetaValue::Array(MetaArray::String(s)) => Ok(s),
            _ => Err(self.mismatch(key, "array[string]", v)),
        }
    }

    /// An array of bools.
    pub fn get_bool_array(&self, key: &str) -> Result<&[bool]> {
        let v = self.value(key)?;
        match v {
            MetaValue::Array(MetaArray::Bool(b)) => Ok(b),
            _ => Err(self.mismatch(key, "array[bool]", v)),
        }
    }

    /// An array of integers of any width, each converted to `T`.
    fn integer_array<T: TryFrom<i128>>(&self, key: &str, expected: &'static str) -> Result<Vec<T>> {
        let v = self.value(key)?;
        let ints = v
            .as_array()
            .and_then(MetaArray::integers)
            .ok_or_else(|| self.mismatch(key, expected, v))?;
        ints.into_iter()
            .enumerate()
            .map(|(j, i)| {
                T::try_from(i).map_err(|_| {
                    self.located(
                        key,
                        GgufError::field(
                            GgufErrorKind::ValueOutOfRange {
                                expected,
                                value: format!("{i} (item {j})"),
                            },
                            key,
                        ),
                    )
                })
            })
            .collect()
    }

    /// An array of integers of any width whose items all fit i32.
    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>> {
        self.integer_array(key, "array[int32]")
    }

    /// An array of integers of any width whose items all fit u32.
    pub fn get_u32_array(&self, key: &str) -> Result<Vec<u32>> {
        self.integer_array(key, "array[uint32]")
    }

    /// An array of integers of any width whose items all fit u64.
    pub fn get_u64_array(&self, key: &str) -> Result<Vec<u64>> {
        self.integer_array(key, "array[uint64]")
    }

    /// An array of float32 (or float64, rounded to f32).
    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>> {
        let v = self.value(key)?;
        match v {
            MetaValue::Array(MetaArray::F32(x)) => Ok(x.clone()),
            MetaValue::Array(MetaArray::F64(x)) => Ok(x.iter().map(|&f| f as f32).collect()),
            _ => Err(self.mismatch(key, "array[float32]", v)),
        }
    }

    fn opt<T>(&self, key: &str, f: impl FnOnce(&str) -> Result<T>) -> Result<Option<T>> {
        if self.key_index.contains_key(key) {
            f(key).map(Some)
        } else {
            Ok(None)
        }
    }

    /// `None` when absent; an error when present with the wrong type or out of range.
    pub fn get_opt_u32(&self, key: &str) -> Result<Option<u32>> {
        self.opt(key, |k| self.get_u32(k))
    }

    pub fn get_opt_u64(&self, key: &str) -> Result<Option<u64>> {
        self.opt(key, |k| self.get_u64(k))
    }

    pub fn get_opt_i64(&self, key: &str) -> Result<Option<i64>> {
        self.opt(key, |k| self.get_i64(k))
    }

    pub fn get_opt_f32(&self, key: &str) -> Result<Option<f32>> {
        self.opt(key, |k| self.get_f32(k))
    }

    pub fn get_opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.opt(key, |k| self.get_bool(k))
    }

    pub fn get_opt_str(&self, key: &str) -> Result<Option<&str>> {
        self.opt(key, |k| self.get_str(k))
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gguf_file_is_send_and_sync() {
        fn assert<T: Send + Sync>() {}
        assert::<GgufFile>();
        assert::<GgufError>();
    }

    #[test]
    fn align_up_rounds_and_detects_overflow() {
        assert_eq!(align_up(0, 32), Some(0));
        assert_eq!(align_up(1, 32), Some(32));
        assert_eq!(align_up(64, 32), Some(64));
        assert_eq!(align_up(5, 1), Some(5));
        assert_eq!(align_up(u64::MAX, 2), None);
    }

    #[test]
    fn tensor_size_checks() {
        assert_eq!(tensor_size(&[], GgmlType::F32).unwrap(), (1, 4));
        assert_eq!(tensor_size(&[0, 7], GgmlType::Q4K).unwrap(), (0, 0));
        assert_eq!(
            tensor_size(&[256, 3], GgmlType::Q4K).unwrap(),
            (768, 3 * 144)
        );
        assert!(matches!(
            tensor_size(&[1 << 63], GgmlType::F32),
            Err(GgufErrorKind::ElementCountOverflow { .. })
        ));
        assert!(matches!(
            tensor_size(&[1 << 62, 2], GgmlType::F32),
            Err(GgufErrorKind::ElementCountOverflow { .. })
        ));
        assert!(matches!(
            tensor_size(&[1 << 62], GgmlType::F32),
            Err(GgufErrorKind::TensorSizeOverflow)
        ));
        assert!(matches!(
            tensor_size(&[1; 5], GgmlType::F32),
            Err(GgufErrorKind::TooManyDims { n_dims: 5 })
        ));
    }

    #[test]
    fn alignment_values() {
        assert_eq!(check_alignment(&MetaValue::U32(32)).unwrap(), 32);
        assert_eq!(check_alignment(&MetaValue::U64(1)).unwrap(), 1);
        for bad in [
            MetaValue::U32(0),
            MetaValue::U32(48),
            MetaValue::I32(-32),
            MetaValue::U64(1 << 32),
            MetaValue::String("32".into()),
        ] {
            assert!(check_alignment(&bad).is_err(), "{bad:?}");
        }
    }
}
