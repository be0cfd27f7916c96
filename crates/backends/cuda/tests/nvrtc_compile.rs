//! Every kernel source compiles with NVRTC for `sm_90a` (the H200), on a machine without a GPU:
//! only libnvrtc is needed (`pip install "nvidia-cuda-nvrtc>=13,<14"`, then put its
//! `nvidia/cu13/lib` on `LD_LIBRARY_PATH`). Skipped, saying so, when libnvrtc is absent.
#![cfg(feature = "cuda")]

use redlite_cuda::kernels::{family_source, kernel_names, module_source, SOURCES};
use redlite_cuda::nvrtc;

const ARCH: &str = "sm_90a";

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn every_kernel_source_compiles_for_sm_90a() {
    if !nvrtc::available() {
        eprintln!(
            "SKIPPED: libnvrtc not found; install it with `pip install \"nvidia-cuda-nvrtc>=13,<14\"` \
             and add its nvidia/cu13/lib folder to LD_LIBRARY_PATH"
        );
        return;
    }
    let (major, minor) = nvrtc::version().expect("nvrtc version");
    eprintln!("NVRTC {major}.{minor}");

    // Each family on its own (with the files it builds on), so a failure names the file.
    for (file, _) in SOURCES {
        let src = family_source(file).expect("family");
        match nvrtc::compile_cubin(&src, ARCH) {
            Ok((cubin, log)) => {
                assert!(!cubin.is_empty(), "{file}: empty cubin");
                assert!(
                    !log.contains("warning"),
                    "{file}: NVRTC warnings for {ARCH}:\n{log}"
                );
            }
            Err(e) => panic!("{file}: {e}"),
        }
    }

    // The whole module, as the backend loads it: every entry point must be in the cubin.
    let (cubin, _) = nvrtc::compile_cubin(&module_source(), ARCH).expect("module compiles");
    for name in kernel_names() {
        assert!(
            contains(&cubin, name.as_bytes()),
            "kernel {name} missing from the {ARCH} cubin"
        );
    }
}

/// For reading the machine code here (no GPU needed): writes a kernel family's `sm_90a` cubin
/// (`REDLITE_CUBIN_FAMILY`, default `matvec.cu`),
/// with `REDLITE_CUDA_DEFINES`-style `NAME=VALUE` settings from `REDLITE_CUBIN_DEFINES`
/// (space-separated) prepended, to `REDLITE_CUBIN_OUT`; then
/// `nvdisasm -c -fun <kernel> FILE` (pip `nvidia-cuda-nvdisasm`) shows the SASS.
#[test]
#[ignore]
fn write_matvec_cubin() {
    let Ok(out) = std::env::var("REDLITE_CUBIN_OUT") else {
        eprintln!("SKIPPED: set REDLITE_CUBIN_OUT");
        return;
    };
    let defines: String = std::env::var("REDLITE_CUBIN_DEFINES")
        .unwrap_or_default()
        .split_whitespace()
        .map(|d| format!("#define {}\n", d.replacen('=', " ", 1)))
        .collect();
    let family = std::env::var("REDLITE_CUBIN_FAMILY").unwrap_or_else(|_| "matvec.cu".into());
    let src = defines + &family_source(&family).expect("family");
    let (cubin, _) = nvrtc::compile_cubin(&src, ARCH).expect("compiles");
    std::fs::write(&out, cubin).expect("writing the cubin");
}

/// Fills the kernel-module cache here, for a GPU machine to read instead of compiling (NVRTC
/// takes minutes there a configuration): the whole module, with `REDLITE_CUDA_DEFINES` as the
/// engine would read it, compiled through `nvrtc::compile_cached` into `REDLITE_CUDA_CACHE`. The
/// key holds NVRTC's major and minor version, so the GPU machine's NVRTC must be the same 13.x.
#[test]
#[ignore]
fn warm_module_cache() {
    if std::env::var_os("REDLITE_CUDA_CACHE").is_none() {
        eprintln!("SKIPPED: set REDLITE_CUDA_CACHE");
        return;
    }
    let compiled = nvrtc::compile_cached(&module_source(), ARCH).expect("compiles");
    eprintln!(
        "{} ({} bytes, {})",
        compiled
            .cache_path
            .as_ref()
            .map_or("no cache path".into(), |p| p.display().to_string()),
        compiled.cubin.len(),
        if compiled.cached {
            "was cached"
        } else {
            "compiled"
        }
    );
}
