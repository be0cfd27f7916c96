//! NVRTC: compile the kernel sources to a cubin for one architecture, with an on-disk cache.
//!
//! The cache key is a 64-bit FNV-1a hash of the source, the architecture, the options and the
//! NVRTC version; entries live in `$REDLITE_CUDA_CACHE`, else `$XDG_CACHE_HOME/redlite/cuda`, else
//! `~/.cache/redlite/cuda`, as `<hash>-<arch>.cubin`. A cache that cannot be read or written is
//! skipped (the compile still happens), never an error.

use std::ffi::{c_char, CStr, CString};
use std::path::PathBuf;

use cudarc::nvrtc::{result, sys};

use crate::CudaError;

/// Options every compile uses (besides the architecture). No fast-math: the kernels keep IEEE
/// division, square roots and exponentials.
pub const OPTIONS: &[&str] = &["--std=c++17"];

/// Whether libnvrtc can be loaded (checked before any NVRTC call: cudarc panics otherwise).
pub fn available() -> bool {
    // SAFETY: only tries to dlopen the candidate library names.
    unsafe { sys::is_culib_present() }
}

/// NVRTC's `(major, minor)` version.
pub fn version() -> Result<(i32, i32), CudaError> {
    if !available() {
        return Err(CudaError::NoNvrtc);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| CudaError::driver("nvrtcVersion", format!("{e:?}")))?;
    Ok((major, minor))
}

/// A compiled module.
pub struct Compiled {
    pub cubin: Vec<u8>,
    /// NVRTC's log (warnings), possibly empty.
    pub log: String,
    /// Whether the cubin came from the disk cache.
    pub cached: bool,
    /// Where the cubin was (or would have been) cached.
    pub cache_path: Option<PathBuf>,
}

/// Compile `src` for `arch` (a real architecture such as `sm_90a`) to a cubin, without the cache.
pub fn compile_cubin(src: &str, arch: &str) -> Result<(Vec<u8>, String), CudaError> {
    if !available() {
        return Err(CudaError::NoNvrtc);
    }
    let csrc = CString::new(src)
        .map_err(|_| CudaError::Invalid("kernel source contains a NUL byte".into()))?;
    let name = c"redlite.cu";
    let prog = result::create_program(&csrc, Some(name))
        .map_err(|e| CudaError::driver("nvrtcCreateProgram", format!("{e:?}")))?;
    let mut options: Vec<String> = OPTIONS.iter().map(|s| s.to_string()).collect();
    options.push(format!("--gpu-architecture={arch}"));
    // SAFETY: `prog` is a live program until destroy_program below.
    let compiled = unsafe { result::compile_program(prog, &options) };
    let log = unsafe { result::get_program_log(prog) }
        .map(|raw| {
            // SAFETY: NVRTC's log is NUL-terminated.
            unsafe { CStr::from_ptr(raw.as_ptr() as *const c_char) }
                .to_string_lossy()
                .into_owned()
        })
        .unwrap_or_default();
    let out = match compiled {
        Err(_) => Err(CudaError::Compile {
            arch: arch.to_string(),
            log: log.clone(),
        }),
        Ok(()) => unsafe { get_cubin(prog) }
            .map_err(|e| CudaError::driver("nvrtcGetCUBIN", format!("{e:?}"))),
    };
    // SAFETY: the program is not used after this.
    let _ = unsafe { result::destroy_program(prog) };
    out.map(|cubin| (cubin, log))
}

/// # Safety
/// `prog` must be a live, successfully compiled program.
unsafe fn get_cubin(prog: sys::nvrtcProgram) -> Result<Vec<u8>, result::NvrtcError> {
    let mut size = 0usize;
    sys::nvrtcGetCUBINSize(prog, &mut size).result()?;
    let mut buf = vec![0u8; size];
    sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char).result()?;
    Ok(buf)
}

/// 64-bit FNV-1a over several byte strings (each followed by a 0xff separator).
pub fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in part.iter().chain(std::iter::once(&0xffu8)) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// The cache folder, if one can be named.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("REDLITE_CUDA_CACHE") {
        return Some(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(d).join("redlite").join("cuda"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/redlite/cuda"))
}

/// Kernel tuning switches for experiments: `REDLITE_CUDA_DEFINES="NAME=VALUE,..."` puts one
/// `#define NAME VALUE` line per entry before the source (so the cache key changes with them).
/// Unset: the source as it is, with its own defaults.
fn with_env_defines(src: &str) -> String {
    let mut out = String::new();
    for (name, value) in crate::kernels::env_defines() {
        out.push_str(&format!("#define {name} {value}\n"));
    }
    out.push_str(src);
    out
}

/// Compile through the disk cache.
pub fn compile_cached(src: &str, arch: &str) -> Result<Compiled, CudaError> {
    let src = &with_env_defines(src);
    let (major, minor) = version()?;
    let ver = format!("{major}.{minor}");
    let opts = OPTIONS.join(" ");
    let key = fnv1a(&[
        src.as_bytes(),
        arch.as_bytes(),
        opts.as_bytes(),
        ver.as_bytes(),
    ]);
    let cache_path = cache_dir().map(|d| d.join(format!("{key:016x}-{arch}.cubin")));
    if let Some(path) = &cache_path {
        if let Ok(cubin) = std::fs::read(path) {
            if !cubin.is_empty() {
                return Ok(Compiled {
                    cubin,
                    log: String::new(),
                    cached: true,
                    cache_path,
                });
            }
        }
    }
    // The whole module takes NVRTC about a minute: say so before the wait (once per source,
    // architecture and NVRTC version; later starts read the cache).
    eprintln!(
        "compiling the CUDA kernels for {arch} with NVRTC {ver} (about a minute, once; cached in {})",
        cache_path
            .as_ref()
            .and_then(|p| p.parent())
            .map_or("no cache directory".to_string(), |d| d.display().to_string())
    );
    let (cubin, log) = compile_cubin(src, arch)?;
    if let Some(path) = &cache_path {
        // Write to a temporary name and rename, so a concurrent reader never sees half a file.
        if let Some(dir) = path.parent() {
            if std::fs::create_dir_all(dir).is_ok() {
                let tmp = path.with_extension(format!("tmp{}", std::process::id()));
                if std::fs::write(&tmp, &cubin).is_ok() {
                    let _ = std::fs::rename(&tmp, path);
                }
            }
        }
    }
    Ok(Compiled {
        cubin,
        log,
        cached: false,
        cache_path,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv_separates_parts() {
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
        assert_eq!(fnv1a(&[b"x"]), fnv1a(&[b"x"]));
    }
}
