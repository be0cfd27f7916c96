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
    Driver { context: String, message: String },
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
    /// A driver failure with what was being done.
    pub fn driver(context: impl Into<String>, err: impl std::fmt::Display) -> CudaError {
        CudaError::Driver {
            context: context.into(),
            message: err.to_string(),
        }
    }
}
