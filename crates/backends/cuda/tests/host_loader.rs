//! The CUDA model's loading path without a GPU: every fixture loads through the model crate's
//! loader into [`HostLoader`], each layer's experts are found as one span of the file at a fixed
//! stride (so they go up in one copy and a kernel finds expert e at `base + e·stride`), and
//! opening the model on a machine without a GPU fails with an error instead of a panic.
#![cfg(feature = "cuda")]

use std::path::PathBuf;
use std::sync::Arc;

use redlite_cuda::host::{HostLinear, HostLoader};
use redlite_cuda::model::expert_span;
use redlite_cuda::{CudaError, Gpu};
use redlite_gguf::GgufFile;
use redlite_model::weights::Weights;
use redlite_model::Config;

fn models() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../../shared/reference/models"
    ))
}

#[test]
fn fixture_experts_are_regular_spans() {
    for name in [
        "tiny-Q4_K_M",
        "tiny-IQ2_XXS",
        "tiny-CF2",
        "tiny-LEGACY_CF2",
        "tiny-F16",
    ] {
        let path = models().join(format!("{name}.gguf"));
        let file = Arc::new(GgufFile::open(&path).expect("fixture opens"));
        let cfg = Config::from_gguf(&file).expect("config");
        let w = Weights::load(&file, &cfg, &HostLoader).expect("weights load");
        for (i, layer) in w.layers.iter().enumerate() {
            let e = &layer.moe.experts;
            let picks: [Vec<&HostLinear>; 3] = [
                e.iter().map(|x| &x.gate).collect(),
                e.iter().map(|x| &x.up).collect(),
                e.iter().map(|x| &x.down).collect(),
            ];
            for ws in &picks {
                let len = ws[0].bytes().len();
                let (_, range, stride) = expert_span(ws, len).unwrap_or_else(|| {
                    panic!("{name} layer {i}: {} not a regular span", ws[0].name)
                });
                assert!(stride >= len);
                assert_eq!(
                    range.len(),
                    (ws.len() - 1) * stride + len,
                    "{name} layer {i}"
                );
                for (k, x) in ws.iter().enumerate() {
                    let at = range.start + k * stride;
                    assert_eq!(
                        &file.bytes()[at..at + len],
                        x.bytes(),
                        "{name} layer {i} expert {k}"
                    );
                }
            }
        }
    }
}

#[test]
fn no_gpu_is_an_error_not_a_panic() {
    match Gpu::new(0) {
        Ok(gpu) => eprintln!("a GPU is present: {}", gpu.info),
        Err(e) => assert!(
            matches!(
                e,
                CudaError::NoDriver | CudaError::NoNvrtc | CudaError::NoDevice(_)
            ),
            "unexpected error without a GPU: {e}"
        ),
    }
}
