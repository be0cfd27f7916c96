//! The GGUF writer: metadata in insertion order, tensor infos, and the data section with each
//! tensor aligned and padded, laid out exactly as llama.cpp / gguf-py write files.

use std::borrow::Cow;
use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use crate::error::{GgufError, GgufErrorKind};
use crate::metadata::{MetaArray, MetaValue};
use crate::reader::{
    align_up, check_alignment, tensor_size, GgufFile, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC,
    MAX_ARRAY_DEPTH,
};
use crate::GgmlType;

type Result<T, E = GgufError> = std::result::Result<T, E>;

/// A tensor queued for writing; its data is borrowed or owned.
struct PendingTensor<'a> {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    data: Cow<'a, [u8]>,
}

/// Builds a GGUF file. Defaults: version 3, alignment 32.
///
/// Tensors are written in the order added, each at the next multiple of the alignment, with zero
/// padding after the tensor infos (when there are tensors) and after every tensor.
pub struct GgufWriter<'a> {
    version: u32,
    alignment: u64,
    kvs: Vec<(String, MetaValue)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<PendingTensor<'a>>,
    tensor_names: HashMap<String, usize>,
}

impl Default for GgufWriter<'_> {
    fn default() -> Self {
        Self::new()
    }
}

impl<'a> GgufWriter<'a> {
    /// An empty version-3 file with alignment 32.
    pub fn new() -> Self {
        GgufWriter {
            version: 3,
            alignment: DEFAULT_ALIGNMENT,
            kvs: Vec::new(),
            key_index: HashMap::new(),
            tensors: Vec::new(),
            tensor_names: HashMap::new(),
        }
    }

    /// A writer holding all of `file`'s metadata (in order, `general.alignment` included), its
    /// version and its tensors (data borrowed from `file`), ready to write an equivalent file.
    pub fn from_file(file: &'a GgufFile) -> Result<Self> {
        let mut w = GgufWriter::new();
        w.set_version(file.version())?;
        for (k, v) in file.metadata() {
            w.add_kv(k.clone(), v.clone())?;
        }
        for t in file.tensors() {
            w.add_tensor(t.name.clone(), &t.dims, t.ty, file.tensor_data(t))?;
        }
        Ok(w)
    }

    /// GGUF version to write: 2 or 3 (identical layouts for little-endian files).
    pub fn set_version(&mut self, version: u32) -> Result<()> {
        if !matches!(version, 2 | 3) {
            return Err(GgufError::new(GgufErrorKind::UnsupportedWriteVersion {
                version,
            }));
        }
        self.version = version;
        Ok(())
    }

    /// Sets the data alignment (a nonzero power of two fitting u32). Updates an existing
    /// `general.alignment` entry in place, or appends one when the alignment is not the default.
    pub fn set_alignment(&mut self, alignment: u64) -> Result<()> {
        let value = match u32::try_from(alignment) {
            Ok(a) => MetaValue::U32(a),
            Err(_) => MetaValue::U64(alignment),
        };
        let a =
            check_alignment(&value).map_err(|k| GgufError::field(k, ALIGNMENT_KEY.to_string()))?;
        match self.key_index.get(ALIGNMENT_KEY) {
            Some(&i) => self.kvs[i].1 = value,
            None if a != DEFAULT_ALIGNMENT => self.push_kv(ALIGNMENT_KEY.to_string(), value),
            None => {}
        }
        self.alignment = a;
        Ok(())
    }

    /// The alignment that will be used.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    fn push_kv(&mut self, key: String, value: MetaValue) {
        self.key_index.insert(key.clone(), self.kvs.len());
        self.kvs.push((key, value));
    }

    /// Appends a metadata entry. Errors on a duplicate key, on arrays nested deeper than the
    /// reader accepts, and on an invalid `general.alignment` (which also sets the alignment).
    pub fn add_kv(&mut self, key: impl Into<String>, value: MetaValue) -> Result<()> {
        let key = key.into();
        if self.key_index.contains_key(&key) {
            return Err(GgufError::field(
                GgufErrorKind::DuplicateKey {
                    key: key.clone(),
                    first_offset: 0,
                },
                key,
            ));
        }
        if let MetaValue::Array(a) = &value {
            if array_depth(a) > MAX_ARRAY_DEPTH {
                return Err(GgufError::field(
                    GgufErrorKind::ArrayNestingTooDeep {
                        max: MAX_ARRAY_DEPTH,
                    },
                    key,
                ));
            }
        }
        if key == ALIGNMENT_KEY {
            self.alignment = check_alignment(&value).map_err(|k| GgufError::field(k, &key))?;
        }
        self.push_kv(key, value);
        Ok(())
    }

    /// Metadata added so far, in order.
    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.kvs
    }

    /// Queues a tensor. `dims` are ne0 first; `data` must be exactly the size `dims` and `ty` imply.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ty: GgmlType,
        data: impl Into<Cow<'a, [u8]>>,
    ) -> Result<()> {
        let name = name.into();
        let data = data.into();
        let (_, n_bytes) = tensor_size(dims, ty).map_err(|k| GgufError::field(k, &name))?;
        if n_bytes != data.len() as u64 {
            return Err(GgufError::field(
                GgufErrorKind::TensorDataSizeMismatch {
                    dims: dims.to_vec(),
                    ty,
                    expected: n_bytes,
                    actual: data.len() as u64,
                },
                name,
            ));
        }
        if self.tensor_names.contains_key(&name) {
            return Err(GgufError::field(
                GgufErrorKind::DuplicateTensorName { name: name.clone() },
                name,
            ));
        }
        self.tensor_names.insert(name.clone(), self.tensors.len());
        self.tensors.push(PendingTensor {
            name,
            dims: dims.to_vec(),
            ty,
            data,
        });
        Ok(())
    }

    /// Writes the file to `w`; returns the number of bytes written.
    pub fn write_to<W: Write>(&self, w: W) -> Result<u64> {
        let mut out = Counting { inner: w, n: 0 };
        self.write_all(&mut out)?;
        out.flush()?;
        Ok(out.n)
    }

    /// Writes the file to `path` (created or truncated).
    pub fn write_to_path(&self, path: impl AsRef<Path>) -> Result<u64> {
        let path = path.as_ref();
        let run = || -> Result<u64> {
            let f = std::fs::File::create(path)?;
            let mut bw = std::io::BufWriter::new(f);
            let n = self.write_to(&mut bw)?;
            bw.into_inner()
                .map_err(|e| GgufError::from(e.into_error()))?
                .sync_all()?;
            Ok(n)
        };
        run().map_err(|e| e.with_path(path))
    }

    /// The file as bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut v = Vec::new();
        self.write_to(&mut v)?;
        Ok(v)
    }

    fn write_all<W: Write>(&self, out: &mut Counting<W>) -> Result<()> {
        out.write_all(&GGUF_MAGIC)?;
        out.write_all(&self.version.to_le_bytes())?;
        out.write_all(&(self.tensors.len() as u64).to_le_bytes())?;
        out.write_all(&(self.kvs.len() as u64).to_le_bytes())?;
        for (k, v) in &self.kvs {
            write_string(out, k)?;
            out.write_all(&v.value_type().id().to_le_bytes())?;
            write_value(out, v)?;
        }

        let overflow = || GgufError::new(GgufErrorKind::TensorSizeOverflow);
        let mut offset = 0u64;
        for t in &self.tensors {
            write_string(out, &t.name)?;
            out.write_all(&(t.dims.len() as u32).to_le_bytes())?;
            for d in &t.dims {
                out.write_all(&d.to_le_bytes())?;
            }
            out.write_all(&t.ty.id().to_le_bytes())?;
            out.write_all(&offset.to_le_bytes())?;
            offset = align_up(offset, self.alignment)
                .and_then(|o| align_up(o.checked_add(t.data.len() as u64)?, self.alignment))
                .ok_or_else(overflow)?;
        }

        if !self.tensors.is_empty() {
            out.pad_to(self.alignment)?;
            for t in &self.tensors {
                out.write_all(&t.data)?;
                out.pad_to(self.alignment)?;
            }
        }
        Ok(())
    }
}

/// Nesting depth of an array (1 for an array of scalars).
fn array_depth(a: &MetaArray) -> usize {
    match a {
        MetaArray::Array(items) => 1 + items.iter().map(array_depth).max().unwrap_or(0),
        _ => 1,
    }
}

/// A writer that counts bytes, for padding and the returned size.
struct Counting<W> {
    inner: W,
    n: u64,
}

impl<W: Write> Counting<W> {
    fn write_all(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.inner.write_all(b)?;
        self.n += b.len() as u64;
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }

    /// Writes zeros up to the next multiple of `align`.
    fn pad_to(&mut self, align: u64) -> std::io::Result<()> {
        const ZEROS: [u8; 4096] = [0; 4096];
        let mut pad = self.n.next_multiple_of(align) - self.n;
        while pad > 0 {
            let k = pad.min(ZEROS.len() as u64) as usize;
            self.write_all(&ZEROS[..k])?;
            pad -= k as u64;
        }
        Ok(())
    }
}

fn write_string<W: Write>(out: &mut Counting<W>, s: &str) -> std::io::Result<()> {
    out.write_all(&(s.len() as u64).to_le_bytes())?;
    out.write_all(s.as_bytes())
}

fn write_value<W: Write>(out: &mut Counting<W>, v: &MetaValue) -> std::io::Result<()> {
    match v {
        MetaValue::U8(x) => out.write_all(&x.to_le_bytes()),
        MetaValue::I8(x) => out.write_all(&x.to_le_bytes()),
        MetaValue::U16(x) => out.write_all(&x.to_le_bytes()),
        MetaValue::I16(x) => out.write_all(&x.to_le_bytes()),
        MetaValue::U32(x) => out.write_all(&x.to_le_bytes()),
        MetaValue::I32(x) => out.write_all(&x.to_le_bytes()),
        MetaValue::F32(x) => out.write_all(&x.to_le_bytes()),
        MetaValue::Bool(x) => out.write_all(&[u8::from(*x)]),
        MetaValue::String(s) => write_string(out, s),
        MetaValue::Array(a) => write_array(out, a),
        MetaValue::U64(x) => out.write_all(&x.to_le_bytes()),
        MetaValue::I64(x) => out.write_all(&x.to_le_bytes()),
        MetaValue::F64(x) => out.write_all(&x.to_le_bytes()),
    }
}

fn write_array<W: Write>(out: &mut Counting<W>, a: &MetaArray) -> std::io::Result<()> {
    out.write_all(&a.item_type().id().to_le_bytes())?;
    out.write_all(&(a.len() as u64).to_le_bytes())?;
    macro_rules! each {
        ($v:expr) => {{
            for x in $v {
                out.write_all(&x.to_le_bytes())?;
            }
            Ok(())
        }};
    }
    match a {
        MetaArray::U8(v) => out.write_all(v),
        MetaArray::I8(v) => each!(v),
        MetaArray::U16(v) => each!(v),
        MetaArray::I16(v) => each!(v),
        MetaArray::U32(v) => each!(v),
        MetaArray::I32(v) => each!(v),
        MetaArray::F32(v) => each!(v),
        MetaArray::U64(v) => each!(v),
        MetaArray::I64(v) => each!(v),
        MetaArray::F64(v) => each!(v),
        MetaArray::Bool(v) => {
            for &b in v {
                out.write_all(&[u8::from(b)])?;
            }
            Ok(())
        }
        MetaArray::String(v) => {
            for s in v {
                write_string(out, s)?;
            }
            Ok(())
        }
        MetaArray::Array(v) => {
            for inner in v {
                write_array(out, inner)?;
            }
            Ok(())
        }
    }
}
