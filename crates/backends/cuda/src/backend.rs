//! [`CudaBackend`]: the model's [`Backend`] on one GPU.

use std::sync::Arc;

use cudarc::driver::CudaSlice;
use redlite_gguf::GgmlType;
use redlite_model::backend::swiglu;
use redlite_model::weights::FfnWeights;
use redlite_model::{Backend, LinearSource, ModelError};

use crate::ops::{self, ExpertSet};
use crate::{CudaError, DeviceInfo, Gpu};

/// A linear layer's weight, on the device in the file's quantized layout.
pub struct CudaLinear {
    name: String,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    w: CudaSlice<u8>,
}

impl CudaLinear {
    pub fn ty(&self) -> GgmlType {
        self.ty
    }
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The device buffer (for the kernel tests).
    pub fn device_bytes(&self) -> &CudaSlice<u8> {
        &self.w
    }
}

/// The CUDA backend: weights uploaded once, every linear layer and the routed experts on the GPU.
///
/// Device failures after start-up (out of memory, a kernel fault) have no error channel in the
/// [`Backend`] trait's compute methods, so they panic with the failing call named.
#[derive(Clone)]
pub struct CudaBackend {
    gpu: Arc<Gpu>,
}

impl CudaBackend {
    /// Open GPU 0 and load the kernels. Fails cleanly (no panic) without a driver, NVRTC or device.
    pub fn new() -> Result<CudaBackend, CudaError> {
        Ok(CudaBackend {
            gpu: Arc::new(Gpu::new(0)?),
        })
    }

    /// A backend on an already opened GPU.
    pub fn with_gpu(gpu: Arc<Gpu>) -> CudaBackend {
        CudaBackend { gpu }
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.gpu.info
    }

    /// Upload one weight (checked against its declared shape).
    pub fn upload_linear(
        &self,
        name: &str,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        bytes: &[u8],
    ) -> Result<CudaLinear, CudaError> {
        let rb = ops::row_bytes(ty, cols)?;
        if bytes.len() != rows * rb {
            return Err(CudaError::Invalid(format!(
                "{name}: {} bytes for {rows} rows of {cols} {} values ({} expected)",
                bytes.len(),
                ty.name(),
                rows * rb
            )));
        }
        let w = ops::upload(&self.gpu, bytes)?;
        Ok(CudaLinear {
            name: name.to_string(),
            ty,
            rows,
            cols,
            w,
        })
    }
}

impl Backend for CudaBackend {
    type Linear = CudaLinear;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn load_linear(&self, src: LinearSource) -> Result<CudaLinear, ModelError> {
        self.upload_linear(&src.name, src.ty, src.rows, src.cols, src.bytes())
            .map_err(|e| ModelError::Tensor {
                tensor: src.name.clone(),
                message: e.to_string(),
            })
    }

    fn linear(&self, w: &CudaLinear, xs: &[f32], n: usize, ys: &mut [f32]) {
        if n == 0 {
            return;
        }
        let out = ops::matvec(&self.gpu, w.ty, &w.w, w.rows, w.cols, xs, n)
            .unwrap_or_else(|e| panic!("CUDA linear {}: {e}", w.name));
        ys[..n * w.rows].copy_from_slice(&out);
    }

    fn linear_shape(&self, w: &CudaLinear) -> (usize, usize) {
        (w.rows, w.cols)
    }

    fn routed_experts(
        &self,
        experts: &[FfnWeights<Self>],
        chosen: &[(usize, f32)],
        x: &[f32],
    ) -> Vec<f32> {
        let Some(&(first, _)) = chosen.first() else {
            return vec![0.0; x.len()];
        };
        let e0 = &experts[first];
        let (ff, hidden) = (e0.gate.rows, e0.gate.cols);
        // The fused kernels need one type for gate and up and one for down across the chosen
        // experts (always so for the slabs of one 3-D tensor); otherwise take the generic path.
        let uniform = chosen.iter().all(|&(e, _)| {
            let w = &experts[e];
            w.gate.ty == e0.gate.ty
                && w.up.ty == e0.gate.ty
                && w.down.ty == e0.down.ty
                && (w.gate.rows, w.gate.cols, w.up.rows, w.up.cols) == (ff, hidden, ff, hidden)
                && (w.down.rows, w.down.cols) == (hidden, ff)
        });
        if !uniform || x.len() != hidden {
            let mut out = vec![0.0f32; x.len()];
            for &(e, weight) in chosen {
                let y = swiglu(self, &experts[e], x);
                for (o, v) in out.iter_mut().zip(&y) {
                    *o += weight * v;
                }
            }
            return out;
        }
        let set = ExpertSet {
            gate_up_ty: e0.gate.ty,
            down_ty: e0.down.ty,
            gate: chosen.iter().map(|&(e, _)| &experts[e].gate.w).collect(),
            up: chosen.iter().map(|&(e, _)| &experts[e].up.w).collect(),
            down: chosen.iter().map(|&(e, _)| &experts[e].down.w).collect(),
        };
        let weights: Vec<f32> = chosen.iter().map(|&(_, w)| w).collect();
        ops::moe_experts(&self.gpu, &set, &weights, x, ff)
            .unwrap_or_else(|e| panic!("CUDA routed experts ({}): {e}", e0.gate.name))
    }
}
