//! CPU-time clocks for the kernel benchmarks (`#[ignore]`d tests) on a machine shared with other
//! work: wall time there measures the neighbours as much as the kernel.
#![allow(dead_code)] // each test binary uses one of the clocks

/// `clock_gettime(clock)` in ns (Linux), else `None`.
#[cfg(target_os = "linux")]
fn clock_ns(clock: i32) -> Option<u64> {
    #[repr(C)]
    struct Timespec {
        sec: i64,
        nsec: i64,
    }
    extern "C" {
        fn clock_gettime(clock: i32, tp: *mut Timespec) -> i32;
    }
    let mut t = Timespec { sec: 0, nsec: 0 };
    // SAFETY: `t` is a valid timespec for the C library's 64-bit Linux layout.
    let rc = unsafe { clock_gettime(clock, &mut t) };
    (rc == 0).then(|| t.sec as u64 * 1_000_000_000 + t.nsec as u64)
}

#[cfg(not(target_os = "linux"))]
fn clock_ns(_clock: i32) -> Option<u64> {
    None
}

/// This process's time on all CPUs so far, in ns (`CLOCK_PROCESS_CPUTIME_ID`; 0 where unknown).
pub fn process_cpu_ns() -> u64 {
    clock_ns(2).unwrap_or(0)
}

/// This thread's time on a CPU so far, in ns (`CLOCK_THREAD_CPUTIME_ID`), else `None`.
pub fn thread_cpu_ns() -> Option<u64> {
    clock_ns(3)
}
