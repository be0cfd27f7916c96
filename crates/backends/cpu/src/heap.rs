//! Keeping freed heap memory for the next forward pass.
//!
//! Every forward pass allocates its activation buffers (per layer, per row of a batch) and frees
//! them at the end. With glibc's default thresholds the freed memory goes back to the kernel —
//! large blocks through `munmap`, the top of each thread's heap through trimming — and the next
//! pass maps it again: a page fault and a page clear per 4 KiB (a 512-token prefill of the tiny
//! Q4_K_M fixture spent ≈ 10 % of its samples there). Raising the two thresholds keeps that memory
//! in the process: blocks under 64 MiB come from the heap and up to 256 MiB of free heap stays
//! mapped. The process then holds its peak working set between passes, which an inference
//! engine does anyway. A no-op off glibc, or when `GLIBC_TUNABLES` already sets malloc options.
//!
//! The `redlite` binary allocates through mimalloc (its `#[global_allocator]`), which keeps freed
//! memory for reuse by itself; these thresholds then govern what still goes through glibc's
//! `malloc` (C libraries, and programs that link this crate with the system allocator, such as
//! the test binaries).

/// Applies the thresholds above, once, before the first large allocation (start of `main`).
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        if std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("malloc")) {
            return;
        }
        // SAFETY: mallopt only changes allocator parameters; an unsupported value is refused
        // with a zero return, which leaves the defaults in place.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 20);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
        }
    }
}
