//! The errors of the CUDA backend. Defined with or without the `cuda` feature, so callers can
//! report "no CUDA here" the same way in every build.

/// Why the CUDA backend cannot run, or what failed while it ran.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("this redlite was built without the `cuda` feature (rebuild with `--features cuda`)")]
    NotBuilt,
    #[error(
        "no CUDA driver on this machine: libcuda could not be loaded (no NVIDIA GPU or driver)"
    )]
    NoDriver,
    #[error(
        "NVRTC not found: libnvrtc could not be loaded (install the CUDA toolkit or `pip install \
         nvidia-cuda-nvrtc` and put its nvidia/cu13/lib on LD_LIBRARY_PATH)"
    )]
    NoNvrtc,
    #[error("no usable CUDA device: {0}")]
    NoDevice(String),
    #[error("CUDA {context}: {message}")]
    Driver {
        context: String,
        message: String,
        /// The driver's `CUresult` when the failure came from a driver call (cudarc's
        /// `DriverError`), so callers can tell failures apart without reading the message.
        code: Option<u32>,
    },
    #[error("NVRTC could not compile the kernels for {arch}:\n{log}")]
    Compile { arch: String, log: String },
    #[error("{0}")]
    Invalid(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl CudaError {
    /// A driver failure with what was being done (and, for a cudarc `DriverError`, its code).
    pub fn driver<E: std::fmt::Display + 'static>(context: impl Into<String>, err: E) -> CudaError {
        CudaError::Driver {
            context: context.into(),
            message: err.to_string(),
            code: driver_code(&err),
        }
    }

    /// The driver's `CUresult` of a [`CudaError::Driver`] that came from a driver call.
    pub fn driver_code(&self) -> Option<u32> {
        match self {
            CudaError::Driver { code, .. } => *code,
            _ => None,
        }
    }
}

/// The `CUresult` of `err` when it is cudarc's `DriverError`.
#[cfg(feature = "cuda")]
fn driver_code(err: &dyn std::any::Any) -> Option<u32> {
    err.downcast_ref::<cudarc::driver::DriverError>()
        .map(|e| e.0 as u32)
}

#[cfg(not(feature = "cuda"))]
fn driver_code(_: &dyn std::any::Any) -> Option<u32> {
    None
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::CudaError;
    use cudarc::driver::{sys::CUresult, DriverError};

    #[test]
    fn driver_errors_keep_their_code() {
        // (A DriverError's message needs libcuda, absent on CI machines: its code alone here.)
        let invalidated = CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
        assert_eq!(
            super::driver_code(&DriverError(invalidated)),
            Some(invalidated as u32)
        );
        let e = CudaError::Driver {
            context: "launching a kernel".into(),
            message: "capture invalidated".into(),
            code: Some(invalidated as u32),
        };
        assert_eq!(e.driver_code(), Some(invalidated as u32));
        // Other errors reported the same way carry no code.
        let e = CudaError::driver("reading back", "short read".to_string());
        assert_eq!(e.driver_code(), None);
        assert_eq!(e.to_string(), "CUDA reading back: short read");
        assert_eq!(CudaError::Invalid("x".into()).driver_code(), None);
    }
}
