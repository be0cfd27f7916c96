//! [`HostLoader`]: a [`Backend`] that only records where each linear layer's bytes are, so that
//! [`crate::CudaModel`] can load through the model crate's own loader (every shape check, the
//! legacy `ssm_in` un-grouping and the fused expert layouts) and then upload the bytes once.

use std::ops::Range;
use std::sync::Arc;

use redlite_gguf::{GgmlType, GgufFile};
use redlite_model::{Backend, LinearData, LinearSource, ModelError};

/// Where a weight's bytes are: in place in the mapped file, or rearranged by the loader.
pub enum HostBytes {
    Mapped {
        file: Arc<GgufFile>,
        range: Range<usize>,
    },
    Owned(Vec<u8>),
}

/// One linear layer's weight as the file holds it.
pub struct HostLinear {
    pub name: String,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: HostBytes,
}

impl HostLinear {
    pub fn bytes(&self) -> &[u8] {
        match &self.data {
            HostBytes::Mapped { file, range } => &file.bytes()[range.clone()],
            HostBytes::Owned(v) => v,
        }
    }

    /// The byte range in the mapped file, when the weight is there unchanged.
    pub fn file_range(&self) -> Option<(&Arc<GgufFile>, Range<usize>)> {
        match &self.data {
            HostBytes::Mapped { file, range } => Some((file, range.clone())),
            HostBytes::Owned(_) => None,
        }
    }
}

/// The recording "backend" (its `linear` dequantizes row by row: correct, slow, and unused by the
/// CUDA model, which never computes on the host).
#[derive(Debug, Clone, Copy, Default)]
pub struct HostLoader;

impl Backend for HostLoader {
    type Linear = HostLinear;

    fn name(&self) -> &'static str {
        "cuda-loader"
    }

    fn load_linear(&self, src: LinearSource) -> Result<HostLinear, ModelError> {
        let data = match src.data {
            LinearData::Mapped { file, range } => HostBytes::Mapped {
                file: file.clone(),
                range,
            },
            LinearData::Owned(v) => HostBytes::Owned(v),
        };
        Ok(HostLinear {
            name: src.name,
            ty: src.ty,
            rows: src.rows,
            cols: src.cols,
            data,
        })
    }

    fn linear(&self, w: &HostLinear, xs: &[f32], n: usize, ys: &mut [f32]) {
        let row_bytes = w.bytes().len() / w.rows.max(1);
        for r in 0..w.rows {
            let row = redlite_gguf::quant::dequantize_to_vec(
                w.ty,
                &w.bytes()[r * row_bytes..(r + 1) * row_bytes],
            )
            .unwrap_or_else(|_| vec![0.0; w.cols]);
            for t in 0..n {
                let x = &xs[t * w.cols..(t + 1) * w.cols];
                ys[t * w.rows + r] = row.iter().zip(x).map(|(a, b)| a * b).sum();
            }
        }
    }

    fn linear_shape(&self, w: &HostLinear) -> (usize, usize) {
        (w.rows, w.cols)
    }
}
