//! A light fork-join for the small parallel regions of a decode step, run by the pool threads
//! that a pass keeps warm ([`CpuBackend::run_pass`](crate::CpuBackend)).
//!
//! A one-token step of a small model is a dozen parallel regions of 2–50 µs each. Through rayon
//! every region pays a job push, steals through the epoch-guarded deques, and rounds of
//! `sched_yield` on the side that waits: several µs per region, as much as the work itself on
//! the tiny fixture. Here a region is one published job: a single atomic word holds the job's
//! id, its task count and the next task to claim, next to a pointer to the task function. The
//! warm threads poll that word ([`help`]) and claim task indices by compare-and-swap, as does the
//! publishing thread, which returns once every task has finished.
//!
//! Without warm threads (no pass running alone, or `REDLITE_NO_KEEP_WARM=1`), or while another
//! job is out (a task that starts a region, or a second caller), a region runs on rayon's pool
//! as before. Which thread runs a task never changes what it computes.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};

use rayon::prelude::*;

/// Bits of the task count and of the next index in the job word; the id takes the rest.
const INDEX_BITS: u32 = 20;
const INDEX_MASK: u64 = (1 << INDEX_BITS) - 1;
/// Bits of the job id (bits `2 · INDEX_BITS ..` of the word).
const ID_MASK: u64 = (1 << (64 - 2 * INDEX_BITS)) - 1;
/// The most tasks one job can hold; larger regions go to rayon.
const MAX_TASKS: usize = INDEX_MASK as usize;

/// The published job: id (bits 40..64), task count (20..40), next task to claim (0..20). A word
/// with `next < count` is the job being run; a finished job has `next == count`.
static JOB: AtomicU64 = AtomicU64::new(0);
/// The running job's task function: points to a [`Task`] on the publisher's stack.
static FUNC: AtomicPtr<()> = AtomicPtr::new(null_mut());
/// Tasks of the running job that have finished.
static DONE: AtomicUsize = AtomicUsize::new(0);
/// Set while a job is out (one at a time).
static BUSY: AtomicBool = AtomicBool::new(false);
/// Threads polling for jobs now ([`Helper`]).
static HELPERS: AtomicUsize = AtomicUsize::new(0);
/// Set by a task that panicked; the publisher panics after the job.
static PANICKED: AtomicBool = AtomicBool::new(false);

type Task<'a> = &'a (dyn Fn(usize) + Sync);

/// Registers the current thread as polling for jobs while it lives.
pub(crate) struct Helper(());

impl Helper {
    pub(crate) fn enter() -> Helper {
        HELPERS.fetch_add(1, Ordering::AcqRel);
        Helper(())
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        HELPERS.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The id of the latest published job: a warm thread that sees it change knows the pass is still
/// publishing, even when the publisher claimed every task itself.
pub(crate) fn latest_job() -> u64 {
    JOB.load(Ordering::Relaxed) >> (2 * INDEX_BITS)
}

/// Runs one task of the published job, if one is left to claim; `true` if it ran one.
pub(crate) fn help() -> bool {
    let mut w = JOB.load(Ordering::Acquire);
    loop {
        let (count, next) = ((w >> INDEX_BITS) & INDEX_MASK, w & INDEX_MASK);
        if next >= count {
            return false;
        }
        // The id in the word makes a claim on a job that has since finished fail (a reused id
        // would need 2^24 jobs to run between this load and the exchange).
        match JOB.compare_exchange_weak(w, w + 1, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => break,
            Err(now) => w = now,
        }
    }
    let i = (w & INDEX_MASK) as usize;
    // SAFETY: the publisher stored FUNC before publishing this job (the claim above read the
    // job word with acquire ordering), and keeps the `Task` it points to alive until every task
    // of the job has finished, this one included (it waits for DONE to reach the count).
    let task: Task = unsafe { *(FUNC.load(Ordering::Acquire) as *const Task) };
    if catch_unwind(AssertUnwindSafe(|| task(i))).is_err() {
        PANICKED.store(true, Ordering::Release);
    }
    DONE.fetch_add(1, Ordering::AcqRel);
    true
}

/// `f(i)` for every `i` in `0..n`, spread over the warm threads and this one (see the module
/// docs); on rayon's pool when there are none.
pub fn for_each(n: usize, f: impl Fn(usize) + Sync + Send) {
    if n <= 1 || rayon::current_num_threads() <= 1 {
        (0..n).for_each(f);
        return;
    }
    if !try_publish(n) {
        (0..n).into_par_iter().for_each(f);
        return;
    }
    run_published(n, &f);
}

/// [`for_each`] for work too small for rayon: on the calling thread when no thread is warm.
pub fn for_each_or_serial(n: usize, f: impl Fn(usize) + Sync + Send) {
    if n <= 1 || !try_publish(n) {
        (0..n).for_each(f);
        return;
    }
    run_published(n, &f);
}

/// Whether a job of `n` tasks may be published now (then the caller holds [`BUSY`]).
fn try_publish(n: usize) -> bool {
    n <= MAX_TASKS && HELPERS.load(Ordering::Acquire) > 0 && !BUSY.swap(true, Ordering::AcqRel)
}

/// Publishes `f` as a job of `n` tasks (the caller holds [`BUSY`]), takes part, and returns
/// when every task has finished.
fn run_published(n: usize, f: &(dyn Fn(usize) + Sync)) {
    let task: Task = f;
    FUNC.store(&task as *const Task as *mut (), Ordering::Relaxed);
    DONE.store(0, Ordering::Relaxed);
    let id = ((JOB.load(Ordering::Relaxed) >> (2 * INDEX_BITS)) + 1) & ID_MASK;
    JOB.store(
        id << (2 * INDEX_BITS) | (n as u64) << INDEX_BITS,
        Ordering::Release,
    );
    while help() {}
    // The helpers' last tasks; `task` must outlive them.
    let mut spins = 0u32;
    while DONE.load(Ordering::Acquire) < n {
        if spins < 1 << 14 {
            spins += 1;
            std::hint::spin_loop();
        } else {
            // A helper that was descheduled mid-task: let it run.
            std::thread::yield_now();
        }
    }
    BUSY.store(false, Ordering::Release);
    if PANICKED.swap(false, Ordering::AcqRel) {
        panic!("a task of a parallel region panicked");
    }
}

/// A pointer into a slice whose elements the tasks of one region visit once each.
struct Items<T>(*mut T);

// SAFETY: each element is handed to exactly one task (each index runs once), and `T: Send`.
unsafe impl<T: Send> Send for Items<T> {}
unsafe impl<T: Send> Sync for Items<T> {}

impl<T> Items<T> {
    /// # Safety
    /// `i` is in bounds and no other reference to element `i` exists.
    #[allow(clippy::mut_from_ref)]
    unsafe fn get(&self, i: usize) -> &mut T {
        &mut *self.0.add(i)
    }
}

/// `f(item)` for every element of `items`, as [`for_each`] spreads indices.
pub fn for_each_mut<T: Send>(items: &mut [T], f: impl Fn(&mut T) + Sync + Send) {
    let n = items.len();
    let items = Items(items.as_mut_ptr());
    // SAFETY: `for_each` runs each index in 0..n once, so each element has one borrower.
    for_each(n, |i| f(unsafe { items.get(i) }));
}

/// `f(i, &mut items[i])` for every element of `items`, as [`for_each`] spreads tasks: small
/// items (a row's norm, its quantization) in contiguous runs, about 4 a thread, so that a region
/// of many tiny items does not pay a claim on the shared job word per item (64 claims cost more
/// than 64 additions of 384 values: the cache line moves between cores at each).
pub fn for_each_indexed<T: Send>(items: &mut [T], f: impl Fn(usize, &mut T) + Sync + Send) {
    let n = items.len();
    let runs = n.min(4 * rayon::current_num_threads().max(1));
    let items = Items(items.as_mut_ptr());
    // SAFETY: the runs `[c·n/runs, (c+1)·n/runs)` cover 0..n once, and `for_each` runs each
    // run once, so each element has one borrower.
    for_each(runs, |c| {
        for i in c * n / runs..(c + 1) * n / runs {
            f(i, unsafe { items.get(i) });
        }
    });
}

/// `[f(0), …, f(n − 1)]`, the calls spread as [`for_each`] spreads indices.
pub fn map<R: Send>(n: usize, f: impl Fn(usize) -> R + Sync + Send) -> Vec<R> {
    let mut slots: Vec<Option<R>> = (0..n).map(|_| None).collect();
    for_each_indexed(&mut slots, |i, slot| *slot = Some(f(i)));
    slots
        .into_iter()
        .map(|r| r.expect("for_each visits every index"))
        .collect()
}

/// Runs of at least this many rows do their per-row work (quantizing, SwiGLU, weighted sums)
/// as one job ([`map_rows`]); shorter ones on the calling thread. The model's threshold for its
/// per-token work, so a run is spread by both or by neither.
pub const ROWS_IN_PARALLEL: usize = redlite_model::backend::PARALLEL_ROWS;

/// [`map`] for `n` rows' per-row work: spread from [`ROWS_IN_PARALLEL`] rows, else here.
pub fn map_rows<R: Send>(n: usize, f: impl Fn(usize) -> R + Sync + Send) -> Vec<R> {
    if n >= ROWS_IN_PARALLEL {
        map(n, f)
    } else {
        (0..n).map(f).collect()
    }
}

/// `f(item)` for every element of `items`, as [`for_each_or_serial`] spreads indices.
pub fn for_each_mut_or_serial<T: Send>(items: &mut [T], f: impl Fn(&mut T) + Sync + Send) {
    let n = items.len();
    let items = Items(items.as_mut_ptr());
    // SAFETY: as in `for_each_mut`.
    for_each_or_serial(n, |i| f(unsafe { items.get(i) }));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_index_once_with_and_without_helpers() {
        for helpers in [false, true] {
            let stop = AtomicBool::new(false);
            std::thread::scope(|s| {
                if helpers {
                    s.spawn(|| {
                        let _h = Helper::enter();
                        while !stop.load(Ordering::Acquire) {
                            help();
                        }
                    });
                }
                for n in [0, 1, 2, 3, 17, 1000] {
                    let mut hits = vec![0u32; n];
                    for_each_mut(&mut hits, |h| *h += 1);
                    assert!(hits.iter().all(|&h| h == 1), "n = {n}");
                }
                stop.store(true, Ordering::Release);
            });
        }
    }
}
