//! Mapping the whole weight file into the process's page tables at load.
//!
//! Weights are read in place from the memory map. Each first touch of a 4 KiB page of the map is
//! a minor page fault (the kernel maps it and ~15 neighbours), and routed experts are touched
//! for the first time over hundreds of tokens: on the full-size layout (21.5 GB, 24 576 experts)
//! a 64-token decode spent ≈ 4.5 % of its CPU samples in `do_fault`/`filemap_map_pages`.
//! llama.cpp maps with `MAP_POPULATE` for the same reason. Here the map is populated once after
//! load (`MADV_POPULATE_READ`), only when the file fits in the memory the kernel reports as
//! available, so a file larger than RAM (the bounded expert cache's case) is never read whole.
//! `REDLITE_NO_POPULATE=1` turns it off. It only changes when pages get mapped, never a value.

/// Memory kept free beside the file when deciding whether to populate it (bytes).
#[cfg(target_os = "linux")]
const MARGIN_BYTES: u64 = 1 << 30;

/// Maps every page of `map` (the weight file's bytes) now, where that is safe and useful; a
/// failure only means the pages get mapped on first touch, as without this call.
pub fn populate_map(map: &[u8]) {
    #[cfg(target_os = "linux")]
    {
        if std::env::var_os("REDLITE_NO_POPULATE").is_some() || map.is_empty() {
            return;
        }
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        let page = usize::try_from(page).unwrap_or(4096).max(1);
        // A page-aligned start is a memory map; bytes held in a `Vec` are resident already.
        if !(map.as_ptr() as usize).is_multiple_of(page) {
            return;
        }
        match mem_available() {
            Some(avail) if (map.len() as u64).saturating_add(MARGIN_BYTES) <= avail => {}
            _ => return,
        }
        // SAFETY: the range is one live read-only mapping owned by the caller's file;
        // MADV_POPULATE_READ only faults its pages in (it fails with EINVAL on kernels < 5.14,
        // which is ignored: the pages then map on first touch).
        let _ = unsafe {
            libc::madvise(
                map.as_ptr() as *mut libc::c_void,
                map.len(),
                libc::MADV_POPULATE_READ,
            )
        };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = map;
}

/// `MemAvailable` of `/proc/meminfo` in bytes (page cache counts as available).
#[cfg(target_os = "linux")]
fn mem_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}
