//! Choosing a compute backend at run time. Everything that runs a model is generic over
//! [`Backend`]; this is the one place that maps a `--backend` name to a concrete type.
//!
//! ```ignore
//! let model = load_model(&path, BackendChoice::parse("cpu")?, 0)?;
//! with_model!(&model, m => run_something(m))
//! ```

use std::path::Path;
use std::sync::Arc;

use redlite_cpu::CpuBackend;
use redlite_gguf::GgufFile;
use redlite_model::{Model, ModelError, Oracle};

pub use redlite_expert_cache::{CacheConfig, CacheSize, CacheStats, Policy as CachePolicy};
pub use redlite_model::Backend;

/// A backend by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    /// Plain f32, every weight dequantized: the reference.
    Oracle,
    /// SIMD quantized kernels, threads.
    Cpu,
}

impl BackendChoice {
    pub const NAMES: &'static [&'static str] = &["cpu", "oracle"];

    pub fn parse(name: &str) -> Result<BackendChoice, ModelError> {
        match name {
            "oracle" => Ok(BackendChoice::Oracle),
            "cpu" => Ok(BackendChoice::Cpu),
            other => Err(ModelError::BadConfig(format!(
                "unknown backend '{other}' (available: {})",
                BackendChoice::NAMES.join(", ")
            ))),
        }
    }
}

/// A model on whichever backend was chosen.
// One per process, never moved in a hot path: boxing the larger variant would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum AnyModel {
    Oracle(Model<Oracle>),
    Cpu(Model<CpuBackend>),
}

/// Run an expression with the model bound to `$m` whatever its backend type:
/// `with_model!(&any, m => m.forward(...))`.
#[macro_export]
macro_rules! with_model {
    ($any:expr, $m:ident => $body:expr) => {
        match $any {
            $crate::backends::AnyModel::Oracle($m) => $body,
            $crate::backends::AnyModel::Cpu($m) => $body,
        }
    };
}

/// Load a model from an open file on `choice`; `threads` sizes the CPU pool (0: physical cores).
/// Every expert resident.
pub fn load_model_from(
    file: Arc<GgufFile>,
    choice: BackendChoice,
    threads: usize,
) -> Result<AnyModel, ModelError> {
    load_model_with_cache(file, choice, threads, CacheConfig::default())
}

/// [`load_model_from`] with an expert cache (the oracle holds every weight as f32 and has none).
pub fn load_model_with_cache(
    file: Arc<GgufFile>,
    choice: BackendChoice,
    threads: usize,
    cache: CacheConfig,
) -> Result<AnyModel, ModelError> {
    Ok(match choice {
        BackendChoice::Oracle => AnyModel::Oracle(Model::from_gguf(file, Oracle)?),
        BackendChoice::Cpu => {
            let backend = CpuBackend::try_with_threads_and_cache(threads, cache)
                .map_err(|e| ModelError::Backend(e.to_string()))?;
            AnyModel::Cpu(Model::from_gguf(file, backend)?)
        }
    })
}

impl AnyModel {
    /// The expert cache's counters (`None` on a backend without one).
    pub fn expert_cache_stats(&self) -> Option<CacheStats> {
        match self {
            AnyModel::Oracle(_) => None,
            AnyModel::Cpu(m) => m.backend.expert_cache_stats(),
        }
    }
}

impl crate::bench::ExpertProbe for AnyModel {
    fn cache_stats(&self) -> Option<CacheStats> {
        self.expert_cache_stats()
    }

    fn set_trace(&self, on: bool) {
        if let AnyModel::Cpu(m) = self {
            m.backend.set_expert_trace(on);
        }
    }

    fn take_trace(&self) -> Vec<(usize, usize)> {
        match self {
            AnyModel::Oracle(_) => Vec::new(),
            AnyModel::Cpu(m) => m
                .backend
                .take_expert_trace()
                .into_iter()
                .map(|k| (k.layer as usize, k.expert as usize))
                .collect(),
        }
    }
}

/// Open `path` and load it on `choice`.
pub fn load_model(
    path: impl AsRef<Path>,
    choice: BackendChoice,
    threads: usize,
) -> Result<AnyModel, ModelError> {
    load_model_from(Arc::new(GgufFile::open(path.as_ref())?), choice, threads)
}
