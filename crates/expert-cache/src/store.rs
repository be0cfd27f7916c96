//! [`ExpertCache`]: expert bytes for the kernels, from slots in host RAM filled from the file, or
//! (unbounded) straight from the memory map.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use redlite_gguf::GgufFile;

use crate::directory::{Directory, Key, Lookup};
use crate::reader::{buffer_bytes, ExpertReader, ALIGN};
use crate::{CacheConfig, CacheError, CacheSize, CacheStats};

/// Gate, up, down.
pub const PARTS: usize = 3;

/// The bytes of one expert's gate, up and down slabs.
pub type ExpertBytes<'a> = [&'a [u8]; PARTS];

/// One expert a kernel wants: its key and the file byte ranges of its three slabs.
#[derive(Debug, Clone)]
pub struct ExpertRequest {
    pub key: Key,
    pub parts: [Range<usize>; PARTS],
}

/// What the cache must be able to hold, gathered while the weights load.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheShape {
    /// Blocks with routed experts.
    pub layers: usize,
    /// The largest gate, up and down slab of any expert.
    pub part_bytes: [u64; PARTS],
    /// Bytes of every expert of every block.
    pub all_expert_bytes: u64,
}

impl CacheShape {
    /// Bytes of one RAM slot for this shape (see [`slot_bytes`]).
    pub fn slot_bytes(&self) -> u64 {
        slot_bytes(self.part_bytes)
    }
}

/// Where each part's buffer lies in a slot, `(offset, size)`, and the slot's size. Each buffer
/// can take an `O_DIRECT` read of that part at any file offset ([`buffer_bytes`]).
fn slot_regions(part_bytes: [u64; PARTS]) -> ([(usize, usize); PARTS], usize) {
    let mut regions = [(0usize, 0usize); PARTS];
    let mut size = 0usize;
    for (r, &b) in regions.iter_mut().zip(&part_bytes) {
        *r = (size, buffer_bytes(b as usize));
        size += r.1;
    }
    (regions, size)
}

/// Bytes of one RAM slot holding an expert whose gate, up and down slabs are at most
/// `part_bytes`: each part rounded up to [`ALIGN`] plus one [`ALIGN`] of `O_DIRECT` slack, so a
/// slot is up to 3 × 2 × 4 KiB larger than the expert. A byte budget of `b` holds
/// `b / slot_bytes` slots; the memory planner counts with this same size.
pub fn slot_bytes(part_bytes: [u64; PARTS]) -> u64 {
    slot_regions(part_bytes).1 as u64
}

/// Routed-expert bytes on demand (see the crate docs).
pub struct ExpertCache {
    file: Arc<GgufFile>,
    store: Store,
    counters: Arc<Counters>,
    /// Prefetch reader threads (bounded caches with prefetch on), stopped on drop.
    prefetchers: Vec<JoinHandle<()>>,
    /// Every requested expert in order, while tracing (routing statistics).
    trace: Mutex<Option<Vec<Key>>>,
}

enum Store {
    /// Every expert resident: the memory map is the store.
    Mapped,
    Slots(Arc<Slots>),
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    bytes_read: AtomicU64,
    stall_ns: AtomicU64,
    prefetched: AtomicU64,
    prefetch_hits: AtomicU64,
}

impl Counters {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// Bounded slots in RAM.
struct Slots {
    inner: Mutex<Inner>,
    released: Condvar,
    memory: SlotMemory,
    /// Offset and size of each part's region inside a slot.
    regions: [(usize, usize); PARTS],
    reader: ExpertReader,
    /// Compute with resident experts while misses load.
    overlap: bool,
    /// Blocks with experts.
    layers: usize,
    /// Prefetches waiting for a reader thread.
    queue: Mutex<PrefetchQueue>,
    /// Signals the reader threads: a job was queued, the demand reads finished, or shut down.
    queued: Condvar,
    /// Batches of demand reads in flight: prefetches wait for them (the disk's bandwidth goes
    /// to what a layer needs now first).
    demand: AtomicUsize,
}

struct Inner {
    dir: Directory,
    /// Per slot, where each part's bytes start inside its region and how many there are.
    data: Vec<[(usize, usize); PARTS]>,
    /// Per slot: filled by a prefetch and not used since.
    ahead: Vec<bool>,
    /// Prefetched (or being prefetched) experts and their slots whose block has not run yet.
    guesses: Vec<(Key, usize)>,
}

/// One prefetch: the slot claimed for `key` (pinned, not ready) and the file ranges to read.
struct Job {
    key: Key,
    slot: usize,
    parts: [Range<usize>; PARTS],
}

#[derive(Default)]
struct PrefetchQueue {
    jobs: VecDeque<Job>,
    shutdown: bool,
}

/// Per slot: where each part's bytes start inside its region and their length.
type SlotData = [(usize, usize); PARTS];

/// One allocation of `slots × slot_bytes`, [`ALIGN`]-aligned, made once.
struct SlotMemory {
    ptr: *mut u8,
    layout: Layout,
    slot_bytes: usize,
}

// SAFETY: the memory is only reached through `slot`/`slot_mut`, whose callers hold the directory's
// guarantee that a slot being filled (claimed, not ready) is touched by its filler alone and a
// pinned ready slot is only read.
unsafe impl Send for SlotMemory {}
unsafe impl Sync for SlotMemory {}

impl SlotMemory {
    fn new(slots: usize, slot_bytes: usize) -> Result<SlotMemory, CacheError> {
        let bytes = slots
            .checked_mul(slot_bytes)
            .filter(|&b| b > 0)
            .ok_or_else(|| CacheError::Alloc {
                bytes: (slots as u64).saturating_mul(slot_bytes as u64),
                message: "size overflow".into(),
            })?;
        let layout = Layout::from_size_align(bytes, ALIGN).map_err(|e| CacheError::Alloc {
            bytes: bytes as u64,
            message: e.to_string(),
        })?;
        // Zeroed: large allocations come from fresh zero pages, touched only when filled.
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(CacheError::Alloc {
                bytes: bytes as u64,
                message: "out of memory".into(),
            });
        }
        Ok(SlotMemory {
            ptr,
            layout,
            slot_bytes,
        })
    }

    /// Slot `s`, to read (the slot must be pinned and ready).
    fn slot(&self, s: usize) -> &[u8] {
        // SAFETY: `s` is a valid slot index; the range lies inside the allocation.
        unsafe { std::slice::from_raw_parts(self.ptr.add(s * self.slot_bytes), self.slot_bytes) }
    }

    /// Slot `s`, to fill.
    ///
    /// # Safety
    /// The caller claimed `s` in the directory (pinned, not ready) and no one else touches it.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slot_mut(&self, s: usize) -> &mut [u8] {
        unsafe {
            std::slice::from_raw_parts_mut(self.ptr.add(s * self.slot_bytes), self.slot_bytes)
        }
    }
}

impl Drop for SlotMemory {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

/// Most concurrent reads of one batch of misses (queue depth for the disk).
const MAX_READERS: usize = 8;

/// Prefetch reader threads. One read in flight already reaches the disk's bandwidth here (see
/// docs/expert-cache.md), and a demand read waits behind at most this many prefetches.
const PREFETCH_READERS: usize = 1;

impl ExpertCache {
    /// A cache over the experts of `file` (whose shape the loader gathered), sized by `config`.
    /// Unbounded, at least as large as every expert, or an in-memory file: the map is the store.
    pub fn new(
        file: Arc<GgufFile>,
        shape: CacheShape,
        config: &CacheConfig,
    ) -> Result<ExpertCache, CacheError> {
        let (regions, slot_bytes) = slot_regions(shape.part_bytes);
        let layers = shape.layers.max(1);
        let slots = match config.size {
            CacheSize::Unbounded => None,
            CacheSize::Min => Some(layers),
            CacheSize::Bytes(b) if b >= shape.all_expert_bytes => None,
            CacheSize::Bytes(b) => {
                let n = (b / slot_bytes.max(1) as u64) as usize;
                if n < layers {
                    return Err(CacheError::TooSmall {
                        requested: b,
                        min: (layers * slot_bytes) as u64,
                        layers,
                        slot: slot_bytes as u64,
                    });
                }
                Some(n)
            }
        };
        let store = match (slots, file.path()) {
            (Some(n), Some(path)) if shape.layers > 0 => {
                let reader =
                    ExpertReader::open(path, config.direct_io).map_err(|e| CacheError::Io {
                        path: path.display().to_string(),
                        source: e,
                    })?;
                Store::Slots(Arc::new(Slots {
                    inner: Mutex::new(Inner {
                        dir: Directory::new(n, layers, config.policy),
                        data: vec![[(0, 0); PARTS]; n],
                        ahead: vec![false; n],
                        guesses: Vec::new(),
                    }),
                    released: Condvar::new(),
                    memory: SlotMemory::new(n, slot_bytes)?,
                    regions,
                    reader,
                    overlap: config.overlap,
                    layers,
                    queue: Mutex::new(PrefetchQueue::default()),
                    queued: Condvar::new(),
                    demand: AtomicUsize::new(0),
                }))
            }
            _ => Store::Mapped,
        };
        let counters = Arc::new(Counters::default());
        let prefetchers = match &store {
            Store::Slots(slots) if config.prefetch => (0..PREFETCH_READERS)
                .map(|i| {
                    let (slots, counters) = (slots.clone(), counters.clone());
                    std::thread::Builder::new()
                        .name(format!("expert-prefetch-{i}"))
                        .spawn(move || slots.prefetch_loop(&counters))
                        .map_err(|e| CacheError::Alloc {
                            bytes: 0,
                            message: format!("starting a prefetch thread: {e}"),
                        })
                })
                .collect::<Result<Vec<_>, _>>()?,
            _ => Vec::new(),
        };
        Ok(ExpertCache {
            file,
            store,
            counters,
            prefetchers,
            trace: Mutex::new(None),
        })
    }

    /// Whether [`ExpertCache::run_then_prefetch`] loads anything (a bounded cache with prefetch
    /// on), so a backend can skip predicting otherwise.
    pub fn prefetches(&self) -> bool {
        !self.prefetchers.is_empty()
    }

    /// Starts (`true`) or stops recording every requested expert.
    pub fn set_trace(&self, on: bool) {
        let mut t = self.trace.lock().unwrap_or_else(|e| e.into_inner());
        *t = on.then(Vec::new);
    }

    /// The experts requested since the last call (empty when not tracing).
    pub fn take_trace(&self) -> Vec<Key> {
        let mut t = self.trace.lock().unwrap_or_else(|e| e.into_inner());
        t.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Whether every expert is resident (the map is the store).
    pub fn is_unbounded(&self) -> bool {
        matches!(self.store, Store::Mapped)
    }

    /// Counters so far.
    pub fn stats(&self) -> CacheStats {
        let c = &self.counters;
        let (slots, slot_bytes, direct_io) = match &self.store {
            Store::Mapped => (0, 0, false),
            Store::Slots(s) => (
                s.memory.layout.size() as u64 / s.memory.slot_bytes as u64,
                s.memory.slot_bytes as u64,
                s.reader.is_direct(),
            ),
        };
        CacheStats {
            hits: c.hits.load(Ordering::Relaxed),
            misses: c.misses.load(Ordering::Relaxed),
            bytes_read: c.bytes_read.load(Ordering::Relaxed),
            stall: Duration::from_nanos(c.stall_ns.load(Ordering::Relaxed)),
            slots,
            slot_bytes,
            direct_io,
            prefetched: c.prefetched.load(Ordering::Relaxed),
            prefetch_hits: c.prefetch_hits.load(Ordering::Relaxed),
        }
    }

    /// Runs `f` over the requested experts, in rounds of experts resident together: each call
    /// gets indices into `requests` and their bytes. Every request is passed exactly once. In a
    /// round, resident experts come first and misses fill the remaining unpinned slots.
    pub fn run<F>(&self, requests: &[ExpertRequest], f: F) -> Result<(), CacheError>
    where
        F: FnMut(&[usize], &[ExpertBytes]),
    {
        self.run_then_prefetch(requests, &[], f)
    }

    /// [`ExpertCache::run`], and once the first round's experts are pinned, starts loading the
    /// `ahead` experts (best guess first; those already held are skipped) on the prefetch reader
    /// threads, into slots the policy frees. At most a block's share of the slots is taken per
    /// call. Prefetches of the requests' block still waiting for a reader are dropped first
    /// (their experts load as ordinary misses). Bit-exactness is untouched: only where bytes come
    /// from changes.
    pub fn run_then_prefetch<F>(
        &self,
        requests: &[ExpertRequest],
        ahead: &[ExpertRequest],
        mut f: F,
    ) -> Result<(), CacheError>
    where
        F: FnMut(&[usize], &[ExpertBytes]),
    {
        if let Some(t) = self
            .trace
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            t.extend(requests.iter().map(|r| r.key));
        }
        match &self.store {
            Store::Mapped => {
                let map = self.file.bytes();
                let bytes: Vec<ExpertBytes> = requests
                    .iter()
                    .map(|r| [0, 1, 2].map(|p| &map[r.parts[p].clone()]))
                    .collect();
                let idx: Vec<usize> = (0..requests.len()).collect();
                self.counters
                    .hits
                    .fetch_add(requests.len() as u64, Ordering::Relaxed);
                f(&idx, &bytes);
                Ok(())
            }
            Store::Slots(s) => {
                let ahead = if self.prefetches() { ahead } else { &[] };
                s.run(requests, ahead, &self.counters, f)
            }
        }
    }
}

impl Drop for ExpertCache {
    fn drop(&mut self) {
        if let Store::Slots(s) = &self.store {
            s.queue.lock().unwrap_or_else(|e| e.into_inner()).shutdown = true;
            s.queued.notify_all();
        }
        for h in self.prefetchers.drain(..) {
            let _ = h.join();
        }
    }
}

impl Slots {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves consistent bookkeeping (pins at worst leak).
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn run<F>(
        &self,
        requests: &[ExpertRequest],
        mut ahead: &[ExpertRequest],
        counters: &Counters,
        mut f: F,
    ) -> Result<(), CacheError>
    where
        F: FnMut(&[usize], &[ExpertBytes]),
    {
        if let Some(first) = requests.first() {
            self.cancel_prefetches(first.key.layer);
            self.demote_missed_guesses(first.key.layer);
        }
        let mut pending: Vec<usize> = (0..requests.len()).collect();
        while !pending.is_empty() {
            // One round: pin what is resident, claim slots for what is not.
            let (resident, to_fill) = {
                let mut inner = self.lock();
                let (resident, to_fill) = loop {
                    let mut resident = Vec::new();
                    let mut missing = Vec::new();
                    let mut later = Vec::new();
                    for &i in &pending {
                        match inner.dir.lookup(requests[i].key) {
                            Lookup::Hit(s) => resident.push((i, s)),
                            Lookup::Miss => missing.push(i),
                            Lookup::Busy => later.push(i),
                        }
                    }
                    let mut to_fill = Vec::new();
                    for i in missing {
                        match inner.dir.claim(requests[i].key) {
                            Some(s) => to_fill.push((i, s)),
                            None => later.push(i),
                        }
                    }
                    if resident.is_empty() && to_fill.is_empty() {
                        // Every slot is pinned or being filled (by a prefetch or another caller).
                        let t = Instant::now();
                        inner = self.released.wait(inner).unwrap_or_else(|e| e.into_inner());
                        Counters::add(&counters.stall_ns, t.elapsed().as_nanos() as u64);
                        continue;
                    }
                    pending = later;
                    break (resident, to_fill);
                };
                let mut first_uses = 0;
                for &(_, s) in &resident {
                    first_uses += u64::from(std::mem::take(&mut inner.ahead[s]));
                }
                for &(_, s) in &to_fill {
                    inner.ahead[s] = false;
                }
                Counters::add(&counters.prefetch_hits, first_uses);
                // This round's experts are pinned: the prefetch may evict around them.
                let jobs = self.claim_ahead(&mut inner, std::mem::take(&mut ahead));
                drop(inner);
                self.queue_prefetches(jobs);
                (resident, to_fill)
            };
            counters
                .hits
                .fetch_add(resident.len() as u64, Ordering::Relaxed);

            // Misses load on an I/O thread while the caller computes with the resident experts
            // (with `overlap`); the caller's stall is only the time it then waits.
            let unpin_all = |this: &Slots| {
                let mut inner = this.lock();
                for &(_, s) in resident.iter().chain(&to_fill) {
                    inner.dir.unpin(s);
                }
                drop(inner);
                this.released.notify_all();
            };
            let filled = std::thread::scope(|scope| {
                let loader = (self.overlap && !to_fill.is_empty() && !resident.is_empty())
                    .then(|| scope.spawn(|| self.fill(requests, &to_fill)));
                if loader.is_some() {
                    self.hand_out(&resident, &mut f);
                }
                let t = Instant::now();
                let filled = match loader {
                    Some(h) => h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
                    None => self.fill(requests, &to_fill),
                };
                counters
                    .stall_ns
                    .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                filled
            });
            let overlapped = self.overlap && !to_fill.is_empty() && !resident.is_empty();
            let mut inner = self.lock();
            let mut failure = None;
            let mut read = 0u64;
            for (&(_, s), r) in to_fill.iter().zip(filled) {
                match r {
                    Ok((data, n)) => {
                        inner.data[s] = data;
                        inner.dir.filled(s, true);
                        read += n;
                    }
                    Err(e) => {
                        inner.dir.filled(s, false);
                        failure.get_or_insert(e);
                    }
                }
            }
            drop(inner);
            if let Some(e) = failure {
                unpin_all(self);
                return Err(CacheError::Io {
                    path: self.reader.path().display().to_string(),
                    source: e,
                });
            }
            counters
                .misses
                .fetch_add(to_fill.len() as u64, Ordering::Relaxed);
            counters.bytes_read.fetch_add(read, Ordering::Relaxed);
            if overlapped {
                self.hand_out(&to_fill, &mut f);
            } else {
                let round: Vec<(usize, usize)> = resident.iter().chain(&to_fill).copied().collect();
                self.hand_out(&round, &mut f);
            }
            unpin_all(self);
        }
        Ok(())
    }

    /// Calls `f` with the request indices and bytes of the ready, pinned slots `(request, slot)`.
    fn hand_out<F>(&self, round: &[(usize, usize)], f: &mut F)
    where
        F: FnMut(&[usize], &[ExpertBytes]),
    {
        if round.is_empty() {
            return;
        }
        let layout: Vec<[(usize, usize); PARTS]> = {
            let inner = self.lock();
            round.iter().map(|&(_, s)| inner.data[s]).collect()
        };
        let idx: Vec<usize> = round.iter().map(|&(i, _)| i).collect();
        let bytes: Vec<ExpertBytes> = round
            .iter()
            .zip(&layout)
            .map(|(&(_, s), data)| {
                let slot = self.memory.slot(s);
                [0, 1, 2].map(|p| {
                    let start = self.regions[p].0 + data[p].0;
                    &slot[start..start + data[p].1]
                })
            })
            .collect();
        f(&idx, &bytes);
    }

    /// Claims slots for the `ahead` experts not held yet (at most a block's share of the slots;
    /// stops when every slot is pinned).
    fn claim_ahead(&self, inner: &mut Inner, ahead: &[ExpertRequest]) -> Vec<Job> {
        let share = (inner.dir.len() / self.layers).max(1);
        let mut jobs = Vec::new();
        for r in ahead.iter().take(share) {
            if inner.dir.contains(r.key) {
                continue;
            }
            let Some(slot) = inner.dir.claim_ahead(r.key) else {
                break;
            };
            inner.ahead[slot] = false;
            inner.guesses.push((r.key, slot));
            jobs.push(Job {
                key: r.key,
                slot,
                parts: r.parts.clone(),
            });
        }
        jobs
    }

    fn queue_prefetches(&self, jobs: Vec<Job>) {
        if jobs.is_empty() {
            return;
        }
        self.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .jobs
            .extend(jobs);
        self.queued.notify_all();
    }

    /// Drops the queued (not yet started) prefetches of `layer`, freeing their slots: the caller
    /// is about to need that block, and its own reads come first.
    fn cancel_prefetches(&self, layer: u32) {
        let dropped: Vec<Job> = {
            let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            if q.jobs.is_empty() {
                return;
            }
            let (dropped, kept): (Vec<Job>, Vec<Job>) =
                q.jobs.drain(..).partition(|j| j.key.layer == layer);
            q.jobs = kept.into();
            dropped
        };
        if dropped.is_empty() {
            return;
        }
        let mut inner = self.lock();
        for j in dropped {
            inner.dir.filled(j.slot, false);
            inner.dir.unpin(j.slot);
        }
        drop(inner);
        self.released.notify_all();
    }

    /// Guesses for blocks other than `layer` (whose run is over) that were loaded and not used
    /// become the next victims; guesses still loading are looked at again on the next call.
    fn demote_missed_guesses(&self, layer: u32) {
        let mut inner = self.lock();
        let inner = &mut *inner;
        let (dir, ahead) = (&mut inner.dir, &inner.ahead);
        inner.guesses.retain(|&(key, s)| {
            if key.layer == layer {
                return true; // about to be used
            }
            if dir.key_of(s) != Some(key) {
                return false; // the slot holds something else since
            }
            if !dir.is_ready(s) {
                return true; // still loading
            }
            if ahead[s] {
                dir.demote(s);
            }
            false
        });
    }

    /// A prefetch reader thread: takes queued jobs until the cache is dropped.
    fn prefetch_loop(&self, counters: &Counters) {
        loop {
            let job = {
                let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    if q.shutdown {
                        return;
                    }
                    if self.demand.load(Ordering::Acquire) == 0 {
                        if let Some(j) = q.jobs.pop_front() {
                            break j;
                        }
                    }
                    q = self.queued.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            // SAFETY: the job's slot was claimed for it (pinned, not ready); only this thread
            // touches it until `filled`.
            let result = unsafe { self.read_slot(job.slot, &job.parts) };
            let mut inner = self.lock();
            match result {
                Ok((data, n)) => {
                    inner.data[job.slot] = data;
                    inner.dir.filled(job.slot, true);
                    inner.ahead[job.slot] = true;
                    Counters::add(&counters.bytes_read, n);
                    Counters::add(&counters.prefetched, 1);
                }
                // A failed guess is only a lost guess: the expert loads again if it is used.
                Err(_) => inner.dir.filled(job.slot, false),
            }
            inner.dir.unpin(job.slot);
            drop(inner);
            self.released.notify_all();
        }
    }

    /// Reads an expert's three slabs (file ranges `parts`) into slot `s`. Per part: where its
    /// bytes start in its region and their length; and the bytes transferred.
    ///
    /// # Safety
    /// The caller claimed `s` (pinned, not ready) and no one else touches it until `filled`.
    unsafe fn read_slot(
        &self,
        s: usize,
        parts: &[Range<usize>; PARTS],
    ) -> std::io::Result<(SlotData, u64)> {
        // SAFETY: forwarded from the caller.
        let slot = unsafe { self.memory.slot_mut(s) };
        let mut data = [(0usize, 0usize); PARTS];
        let mut total = 0u64;
        for (p, range) in parts.iter().enumerate() {
            let (off, size) = self.regions[p];
            let region = &mut slot[off..off + size];
            let (start, n) = self
                .reader
                .read(range.start as u64..range.end as u64, region)?;
            data[p] = (start, range.len());
            total += n;
        }
        Ok((data, total))
    }

    /// Reads the claimed slots `(request, slot)` from the file, several at a time. Per slot: where
    /// each part's bytes start in its region and their length, and the bytes transferred.
    fn fill(
        &self,
        requests: &[ExpertRequest],
        to_fill: &[(usize, usize)],
    ) -> Vec<std::io::Result<(SlotData, u64)>> {
        if to_fill.is_empty() {
            return Vec::new();
        }
        self.demand.fetch_add(1, Ordering::AcqRel);
        let out = self.fill_now(requests, to_fill);
        if self.demand.fetch_sub(1, Ordering::AcqRel) == 1 {
            // Under the queue's lock, so a reader cannot miss the wake-up between its check
            // and its wait.
            let _q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            self.queued.notify_all();
        }
        out
    }

    /// [`Slots::fill`]'s reads.
    fn fill_now(
        &self,
        requests: &[ExpertRequest],
        to_fill: &[(usize, usize)],
    ) -> Vec<std::io::Result<(SlotData, u64)>> {
        // SAFETY: slot `s` was just claimed by this caller (pinned, not ready).
        let read_one = |&(i, s): &(usize, usize)| unsafe { self.read_slot(s, &requests[i].parts) };
        let threads = to_fill.len().min(MAX_READERS);
        if threads <= 1 {
            return to_fill.iter().map(read_one).collect();
        }
        let mut out: Vec<Option<std::io::Result<_>>> = (0..to_fill.len()).map(|_| None).collect();
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let read_one = &read_one;
                    scope.spawn(move || {
                        (t..to_fill.len())
                            .step_by(threads)
                            .map(|k| (k, read_one(&to_fill[k])))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            for h in handles {
                match h.join() {
                    Ok(results) => {
                        for (k, r) in results {
                            out[k] = Some(r);
                        }
                    }
                    Err(p) => std::panic::resume_unwind(p),
                }
            }
        });
        out.into_iter()
            .map(|r| r.unwrap_or_else(|| Err(std::io::Error::other("expert read not run"))))
            .collect()
    }
}
