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

/// A tensor queued for writing; its data is borrowed or owned, or produced while writing.
struct PendingTensor<'a> {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    data: TensorBytes<'a>,
}

/// Where a queued tensor's bytes come from.
enum TensorBytes<'a> {
    /// Held (borrowed or owned) by the writer.
    Held(Cow<'a, [u8]>),
    /// Produced at write time by the callback of [`GgufWriter::write_streaming_to`]; the size
    /// in bytes is known from the dims and type.
    Deferred(u64),
}

impl TensorBytes<'_> {
    fn len(&self) -> u64 {
        match self {
            TensorBytes::Held(d) => d.len() as u64,
            TensorBytes::Deferred(n) => *n,
        }
    }
}

/// A tensor whose bytes the caller of [`GgufWriter::write_streaming_to`] writes.
#[derive(Debug, Clone, Copy)]
pub struct DeferredTensor<'w> {
    /// Position among all the writer's tensors (held ones included).
    pub index: usize,
    pub name: &'w str,
    /// ne0 first.
    pub dims: &'w [u64],
    pub ty: GgmlType,
    /// Exactly this many bytes must be written.
    pub n_bytes: u64,
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
        self.push_tensor(name, dims, ty, TensorBytes::Held(data))
    }

    /// Queues a tensor whose bytes are not held by the writer but produced while the file is
    /// written, by the callback of [`GgufWriter::write_streaming_to`]: a file of any size can
    /// then be written with little memory. `dims` are ne0 first.
    pub fn add_tensor_deferred(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ty: GgmlType,
    ) -> Result<()> {
        let name = name.into();
        let (_, n_bytes) = tensor_size(dims, ty).map_err(|k| GgufError::field(k, &name))?;
        self.push_tensor(name, dims, ty, TensorBytes::Deferred(n_bytes))
    }

    fn push_tensor(
        &mut self,
        name: String,
        dims: &[u64],
        ty: GgmlType,
        data: TensorBytes<'a>,
    ) -> Result<()> {
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

    /// Number of tensors queued so far.
    pub fn tensor_count(&self) -> usize {
        self.tensors.len()
    }

    /// Total bytes of tensor data (without alignment padding).
    pub fn tensor_data_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.data.len()).sum()
    }

    /// Writes the file to `w`; returns the number of bytes written. Fails when a tensor was
    /// added with [`GgufWriter::add_tensor_deferred`] (use [`GgufWriter::write_streaming_to`]).
    pub fn write_to<W: Write>(&self, w: W) -> Result<u64> {
        self.write_streaming_to(w, |t, _| {
            Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "tensor '{}' has deferred data: write it with write_streaming_to",
                    t.name
                ),
            ))
        })
    }

    /// Writes the file to `w`, calling `fill` for each tensor added with
    /// [`GgufWriter::add_tensor_deferred`], in file order, with the tensor's description and the
    /// output. `fill` must write exactly `n_bytes` bytes (padding is the writer's job); more or
    /// fewer is an error. Returns the number of bytes written.
    pub fn write_streaming_to<W, F>(&self, w: W, mut fill: F) -> Result<u64>
    where
        W: Write,
        F: FnMut(DeferredTensor<'_>, &mut dyn Write) -> std::io::Result<()>,
    {
        let mut out = Counting { inner: w, n: 0 };
        self.write_all(&mut out, &mut fill)?;
        out.flush()?;
        Ok(out.n)
    }

    /// [`GgufWriter::write_streaming_to`] into `path` (created or truncated), buffered and
    /// synced to disk at the end.
    pub fn write_streaming_to_path<F>(&self, path: impl AsRef<Path>, fill: F) -> Result<u64>
    where
        F: FnMut(DeferredTensor<'_>, &mut dyn Write) -> std::io::Result<()>,
    {
        let path = path.as_ref();
        let run = || -> Result<u64> {
            let f = std::fs::File::create(path)?;
            let mut bw = std::io::BufWriter::with_capacity(1 << 20, f);
            let n = self.write_streaming_to(&mut bw, fill)?;
            bw.into_inner()
                .map_err(|e| GgufError::from(e.into_error()))?
                .sync_all()?;
            Ok(n)
        };
        run().map_err(|e| e.with_path(path))
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

    fn write_all<W: Write>(
        &self,
        out: &mut Counting<W>,
        fill: &mut dyn FnMut(DeferredTensor<'_>, &mut dyn Write) -> std::io::Result<()>,
    ) -> Result<()> {
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
                .and_then(|o| align_up(o.checked_add(t.data.len())?, self.alignment))
                .ok_or_else(overflow)?;
        }

        if !self.tensors.is_empty() {
            out.pad_to(self.alignment)?;
            for (index, t) in self.tensors.iter().enumerate() {
                match &t.data {
                    TensorBytes::Held(d) => out.write_all(d)?,
                    TensorBytes::Deferred(n_bytes) => {
                        let desc = DeferredTensor {
                            index,
                            name: &t.name,
                            dims: &t.dims,
                            ty: t.ty,
                            n_bytes: *n_bytes,
                        };
                        let mut sink = Limited {
                            inner: &mut *out,
                            left: *n_bytes,
                        };
                        fill(desc, &mut sink).map_err(|e| GgufError::field(e.into(), &t.name))?;
                        if sink.left != 0 {
                            return Err(GgufError::field(
                                GgufErrorKind::TensorDataSizeMismatch {
                                    dims: t.dims.clone(),
                                    ty: t.ty,
                                    expected: *n_bytes,
                                    actual: *n_bytes - sink.left,
                                },
                                &t.name,
                            ));
                        }
                    }
                }
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

/// The output handed to a deferred tensor's callback: accepts at most `left` more bytes.
struct Limited<'o, W> {
    inner: &'o mut Counting<W>,
    left: u64,
}

impl<W: Write> Write for Limited<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if buf.len() as u64 > self.left {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "tensor data overflows its size: {} more bytes offered, {} left",
                    buf.len(),
                    self.left
                ),
            ));
        }
        self.inner.write_all(buf)?;
        self.left -= buf.len() as u64;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
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

#[cfg(test)]
mod tests {
    use super::*;

    fn held_and_deferred() -> (GgufWriter<'static>, GgufWriter<'static>, Vec<Vec<u8>>) {
        let datas: Vec<Vec<u8>> = vec![(0..40u8).collect(), (0..144u8).collect(), vec![7; 12]];
        let specs: [(&str, Vec<u64>, GgmlType); 3] = [
            ("a", vec![10], GgmlType::F32),
            ("b", vec![256], GgmlType::Q4K),
            ("c", vec![3, 2], GgmlType::F16),
        ];
        let mut held = GgufWriter::new();
        let mut deferred = GgufWriter::new();
        for w in [&mut held, &mut deferred] {
            w.add_kv("general.architecture", MetaValue::String("x".into()))
                .unwrap();
        }
        for ((name, dims, ty), d) in specs.iter().zip(&datas) {
            held.add_tensor(*name, dims, *ty, d.clone()).unwrap();
            deferred.add_tensor_deferred(*name, dims, *ty).unwrap();
        }
        (held, deferred, datas)
    }

    #[test]
    fn deferred_tensors_write_the_same_bytes() {
        let (held, deferred, datas) = held_and_deferred();
        assert_eq!(deferred.tensor_count(), 3);
        assert_eq!(deferred.tensor_data_bytes(), 40 + 144 + 12);
        let expected = held.to_bytes().unwrap();
        let mut got = Vec::new();
        let mut seen = Vec::new();
        let n = deferred
            .write_streaming_to(&mut got, |t, out| {
                seen.push(t.name.to_string());
                // Write in two pieces to exercise the limit bookkeeping.
                let d = &datas[t.index];
                out.write_all(&d[..d.len() / 2])?;
                out.write_all(&d[d.len() / 2..])
            })
            .unwrap();
        assert_eq!(n as usize, got.len());
        assert_eq!(got, expected);
        assert_eq!(seen, ["a", "b", "c"]);
        let f = GgufFile::from_bytes(got).unwrap();
        assert_eq!(f.tensor_bytes("b").unwrap(), &datas[1][..]);
    }

    #[test]
    fn deferred_size_mismatch_and_plain_write_fail() {
        let (_, deferred, datas) = held_and_deferred();
        assert!(deferred.to_bytes().is_err());
        let short =
            deferred.write_streaming_to(Vec::new(), |t, out| out.write_all(&datas[t.index][1..]));
        assert!(matches!(
            short.unwrap_err().kind(),
            GgufErrorKind::TensorDataSizeMismatch { .. }
        ));
        let long = deferred.write_streaming_to(Vec::new(), |t, out| {
            out.write_all(&datas[t.index])?;
            out.write_all(&[0])
        });
        assert!(long.is_err());
    }
}
