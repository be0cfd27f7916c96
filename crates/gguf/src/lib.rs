//! redlite's file-format crate: the GGUF container (reader over mmap, validation, writer) and the
//! ggml quant block formats (type table, scalar reference dequantizers, IQ grids).
//!
//! ```no_run
//! use redlite_gguf::GgufFile;
//! let f = GgufFile::open("model.gguf")?;
//! let arch = f.architecture()?;
//! let n_layer = f.get_u32(&format!("{arch}.block_count"))?;
//! for t in f.tensors() {
//!     let bytes: &[u8] = f.tensor_data(t);
//!     println!("{} {:?} {} {} bytes", t.name, t.dims, t.ty, bytes.len());
//! }
//! # let _ = n_layer;
//! # Ok::<(), redlite_gguf::GgufError>(())
//! ```

pub mod checksum;
pub mod error;
pub mod metadata;
pub mod quant;
pub mod reader;
pub mod writer;

pub use checksum::{fnv1a, FNV_OFFSET};
pub use error::{GgufError, GgufErrorKind};
pub use metadata::{MetaArray, MetaValue, MetaValueType};
pub use quant::{GgmlType, TypeTraits, TYPE_TRAITS};
pub use reader::{GgufFile, TensorInfo, DEFAULT_ALIGNMENT, MAX_ARRAY_DEPTH, MAX_DIMS};
pub use writer::GgufWriter;
