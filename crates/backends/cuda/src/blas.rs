//! cuBLAS for the long prompts' dense products: `Y = X · Wᵀ` with f16 inputs and f32
//! accumulation and output (cublasGemmEx). The library is opened at run time like the driver;
//! when it is not there (or `REDLITE_CUDA_CUBLAS=0`) the prompts keep the own `gemm_<type>`
//! kernels, so nothing depends on it.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::{result, sys, CudaBlas};
use cudarc::driver::CudaStream;

use crate::CudaError;

/// Whether libcublas can be opened. Checked before any cuBLAS call: cudarc's dynamic loading
/// panics when the library is missing.
pub fn available() -> bool {
    // SAFETY: only tries to dlopen the candidate library names.
    unsafe { sys::is_culib_present() }
}

/// One cuBLAS handle bound to one stream (a handle's workspace must not be shared by streams
/// that run at the same time, so each stream that issues GEMMs gets its own).
pub struct Blas {
    blas: CudaBlas,
}

impl Blas {
    /// A handle whose work is ordered on `stream`.
    pub fn new(stream: Arc<CudaStream>) -> Result<Blas, CudaError> {
        if !available() {
            return Err(CudaError::Invalid("libcublas could not be loaded".into()));
        }
        let blas =
            CudaBlas::new(stream).map_err(|e| CudaError::driver("creating a cuBLAS handle", e))?;
        Ok(Blas { blas })
    }

    /// `y[t][r] = Σ_k w[r][k] · x[t][k]` (+ the previous `y[t][r]` when `accumulate`) for
    /// `t < n`, `r < rows`, `k < cols`: `w` f16 `[rows][cols]`, `x` f16 `[n][cols]`, `y` f32
    /// `[n][rows]`, all row-major device buffers.
    pub fn gemm_f16(
        &self,
        wxy: (u64, u64, u64),
        shape: (usize, usize, usize),
        accumulate: bool,
    ) -> Result<(), CudaError> {
        self.gemm(wxy, shape, accumulate, sys::cudaDataType_t::CUDA_R_16F)
    }

    /// [`Self::gemm_f16`] with f32 `w` and `x` (full f32 products: the default math mode
    /// uses no TF32).
    pub fn gemm_f32(
        &self,
        wxy: (u64, u64, u64),
        shape: (usize, usize, usize),
        accumulate: bool,
    ) -> Result<(), CudaError> {
        self.gemm(wxy, shape, accumulate, sys::cudaDataType_t::CUDA_R_32F)
    }

    /// In cuBLAS's column-major terms `w` is a `cols × rows` matrix and `x` a `cols × n` one, so
    /// `y` (`rows × n`, leading dimension `rows`) is `wᵀ · x`.
    fn gemm(
        &self,
        (w, x, y): (u64, u64, u64),
        (rows, cols, n): (usize, usize, usize),
        accumulate: bool,
        input: sys::cudaDataType_t,
    ) -> Result<(), CudaError> {
        let int = |v: usize, what: &str| {
            i32::try_from(v)
                .map_err(|_| CudaError::Invalid(format!("cuBLAS GEMM: {what} {v} too large")))
        };
        let (m, nn, k) = (int(rows, "rows")?, int(n, "tokens")?, int(cols, "columns")?);
        let alpha = 1.0f32;
        let beta = if accumulate { 1.0f32 } else { 0.0 };
        // SAFETY: `w`, `x` and `y` are live device buffers of at least rows·cols and n·cols
        // elements of `input` and n·rows floats (the caller's contract), ordered on the handle's
        // stream; alpha and beta are host scalars (the handle's default pointer mode) that
        // outlive the call, which only enqueues the work.
        unsafe {
            result::gemm_ex(
                *self.blas.handle(),
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                m,
                nn,
                k,
                (&alpha as *const f32).cast::<c_void>(),
                w as *const c_void,
                input,
                k,
                x as *const c_void,
                input,
                k,
                (&beta as *const f32).cast::<c_void>(),
                y as *mut c_void,
                sys::cudaDataType_t::CUDA_R_32F,
                m,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| CudaError::driver("cublasGemmEx", e))
    }
}
