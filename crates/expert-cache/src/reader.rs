//! Reads byte ranges of the model file into slot memory: `pread` with `O_DIRECT` (the page cache
//! neither serves nor keeps the bytes, so a miss costs what the disk costs) when the file system
//! accepts it, buffered `pread` otherwise.
//!
//! `O_DIRECT` needs the buffer address, file offset and length aligned to the logical block size;
//! the reader widens each range to [`ALIGN`] boundaries and returns where the wanted bytes start
//! inside the buffer.

use std::fs::{File, OpenOptions};
use std::io;
use std::ops::Range;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

/// Alignment of `O_DIRECT` transfers (covers 512-byte and 4 KiB logical blocks).
pub const ALIGN: usize = 4096;

/// Linux's `O_DIRECT` flag (x86-64 and aarch64 values).
#[cfg(all(target_os = "linux", target_arch = "aarch64"))]
const O_DIRECT: i32 = 0o200000;
#[cfg(all(target_os = "linux", not(target_arch = "aarch64")))]
const O_DIRECT: i32 = 0o40000;

/// Bytes a buffer must have to read `len` bytes at any offset with `O_DIRECT`.
pub fn buffer_bytes(len: usize) -> usize {
    len.div_ceil(ALIGN) * ALIGN + ALIGN
}

/// A file opened for reading experts.
#[derive(Debug)]
pub struct ExpertReader {
    path: PathBuf,
    buffered: File,
    direct: Option<File>,
    /// Cleared when a direct read fails with `EINVAL` (then every read is buffered).
    direct_ok: AtomicBool,
}

impl ExpertReader {
    /// Opens `path`; with `direct`, also an `O_DIRECT` handle when the system allows one.
    pub fn open(path: &Path, direct: bool) -> io::Result<ExpertReader> {
        let buffered = File::open(path)?;
        let direct = if direct && cfg!(target_os = "linux") {
            OpenOptions::new()
                .read(true)
                .custom_flags(O_DIRECT)
                .open(path)
                .ok()
        } else {
            None
        };
        let direct_ok = AtomicBool::new(direct.is_some());
        Ok(ExpertReader {
            path: path.to_path_buf(),
            buffered,
            direct,
            direct_ok,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether reads currently go through `O_DIRECT`.
    pub fn is_direct(&self) -> bool {
        self.direct_ok.load(Ordering::Relaxed)
    }

    /// Reads `range` of the file into `buf` (at least [`buffer_bytes`]`(range.len())` bytes,
    /// [`ALIGN`]-aligned). Returns `(offset of the first wanted byte in buf, bytes transferred)`.
    pub fn read(&self, range: Range<u64>, buf: &mut [u8]) -> io::Result<(usize, u64)> {
        if let (Some(f), true) = (&self.direct, self.is_direct()) {
            match read_direct(f, range.clone(), buf) {
                Ok(r) => return Ok(r),
                Err(e) if e.raw_os_error() == Some(22) => {
                    // EINVAL: this file system refuses O_DIRECT after all.
                    self.direct_ok.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(e),
            }
        }
        let len = (range.end - range.start) as usize;
        self.buffered.read_exact_at(&mut buf[..len], range.start)?;
        Ok((0, len as u64))
    }
}

fn read_direct(f: &File, range: Range<u64>, buf: &mut [u8]) -> io::Result<(usize, u64)> {
    let a = ALIGN as u64;
    let start = range.start / a * a;
    let end = range.end.div_ceil(a) * a;
    let len = (end - start) as usize;
    if buf.len() < len || !(buf.as_ptr() as usize).is_multiple_of(ALIGN) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "expert buffer too small or misaligned for O_DIRECT",
        ));
    }
    let mut done = 0usize;
    while done < len {
        let n = f.read_at(&mut buf[done..len], start + done as u64)?;
        if n == 0 {
            break; // end of file inside the last aligned block
        }
        done += n;
    }
    if start + (done as u64) < range.end {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("short read at {}..{}", range.start, range.end),
        ));
    }
    Ok(((range.start - start) as usize, done as u64))
}
