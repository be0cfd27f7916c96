//! NVTX ranges for the profiler, from `libnvToolsExt.so.1` opened at run time (the library ships
//! with the CUDA toolkit and Nsight; nothing links against it). When it cannot be opened the
//! ranges are skipped and [`Nvtx::load`] says why.

use libloading::{Library, Symbol};
use std::ffi::{c_char, c_int, CString};

type PushFn = unsafe extern "C" fn(*const c_char) -> c_int;
type PopFn = unsafe extern "C" fn() -> c_int;

/// `nvtxRangePushA` / `nvtxRangePop` of a loaded NVTX library.
pub struct Nvtx {
    push: PushFn,
    pop: PopFn,
    // Last: the library outlives the function pointers taken from it.
    _lib: Library,
}

impl Nvtx {
    /// Open the NVTX library: `Err` with the reason when it is not there.
    pub fn load() -> Result<Nvtx, String> {
        let mut last = String::new();
        for name in ["libnvToolsExt.so.1", "libnvToolsExt.so"] {
            // SAFETY: loading a shared library runs its initialisers; NVTX's only set up its
            // injection hook.
            match unsafe { Library::new(name) } {
                Ok(lib) => {
                    // SAFETY: the symbols have these C signatures in every NVTX version.
                    let (push, pop) = unsafe {
                        let push: Symbol<PushFn> = lib
                            .get(b"nvtxRangePushA\0")
                            .map_err(|e| format!("{name}: {e}"))?;
                        let pop: Symbol<PopFn> = lib
                            .get(b"nvtxRangePop\0")
                            .map_err(|e| format!("{name}: {e}"))?;
                        (*push, *pop)
                    };
                    return Ok(Nvtx {
                        push,
                        pop,
                        _lib: lib,
                    });
                }
                Err(e) => last = format!("{name}: {e}"),
            }
        }
        Err(last)
    }

    /// Open a range named `name` (nested ranges close in reverse order with [`Nvtx::pop`]).
    pub fn push(&self, name: &str) {
        if let Ok(c) = CString::new(name) {
            // SAFETY: a valid NUL-terminated string; NVTX copies what it keeps.
            unsafe { (self.push)(c.as_ptr()) };
        }
    }

    /// Close the innermost open range.
    pub fn pop(&self) {
        // SAFETY: no arguments.
        unsafe { (self.pop)() };
    }
}
