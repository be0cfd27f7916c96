//! The expert cache: routed experts live in the GGUF file and stream into a bounded set of slots.
//!
//! The unit is one expert of one block (its gate, up and down slabs). A backend asks for the
//! experts a layer routed to ([`ExpertCache::run`]); the cache hands back their bytes, resident
//! ones first, loading misses into free or evicted slots, in as many rounds as the slots allow
//! (at the minimum size, one expert per layer, one at a time). The same kernels then run on the
//! same bytes, so results do not depend on the cache size.
//!
//! * [`directory`]: which slot holds which expert, pins, and the eviction policy (LRU, LFU,
//!   per-layer quotas). It knows nothing of where slots live, so a GPU cache can reuse it.
//! * [`reader`]: `pread` of an expert's slabs, with `O_DIRECT` into aligned buffers when the file
//!   system allows it (so the page cache does not hide the cost of a miss), buffered otherwise.
//! * [`ExpertCache`]: slots in host RAM (allocated once) or, unbounded, the memory map itself:
//!   every expert resident is the same code path with the map as the store and no copies.
//! * [`CacheStats`]: hits, misses, bytes read and stall time, and what prefetching did.
//!
//! Prefetch ([`ExpertCache::run_then_prefetch`]): while a layer computes, a backend can name the
//! experts it expects the next layer to route to (e.g. that layer's router applied to this
//! layer's input); reader threads load them into slots in the background. A guess only moves
//! bytes earlier: the real routing still decides what runs, a wrong guess costs a read and a slot.

pub mod directory;
pub mod reader;
mod store;

pub use directory::{Directory, Key, Lookup, Policy};
pub use store::{slot_bytes, CacheShape, ExpertBytes, ExpertCache, ExpertRequest, PARTS};

use std::time::Duration;

/// How large the cache is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CacheSize {
    /// Every expert resident (on the CPU: read in place from the memory map).
    #[default]
    Unbounded,
    /// One expert per block.
    Min,
    /// At most this many bytes of slots (at least one expert per block; at least all experts
    /// means unbounded).
    Bytes(u64),
}

/// Cache settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheConfig {
    pub size: CacheSize,
    pub policy: Policy,
    /// Read misses with `O_DIRECT` when the file system allows it.
    pub direct_io: bool,
    /// Compute with the resident experts of a layer while its misses load (an I/O thread).
    pub overlap: bool,
    /// Load the experts a backend predicts for a later layer in the background (bounded caches).
    pub prefetch: bool,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            size: CacheSize::Unbounded,
            policy: Policy::Lru,
            direct_io: true,
            overlap: true,
            prefetch: true,
        }
    }
}

/// Errors of setting up or filling the cache.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("expert cache of {requested} bytes is below the minimum of one expert per block ({min} bytes: {layers} blocks × {slot} bytes)")]
    TooSmall {
        requested: u64,
        min: u64,
        layers: usize,
        slot: u64,
    },
    #[error("allocating {bytes} bytes of expert slots: {message}")]
    Alloc { bytes: u64, message: String },
    #[error("reading experts from {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// Counters since the cache was built (subtract two snapshots for an interval).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Experts found resident.
    pub hits: u64,
    /// Experts loaded from the file.
    pub misses: u64,
    /// Bytes read from the file (with `O_DIRECT`, including the alignment slack).
    pub bytes_read: u64,
    /// Time the caller waited for loads (its own reads, or prefetches still in flight).
    pub stall: Duration,
    /// Experts loaded by prefetching (their bytes count in `bytes_read`).
    pub prefetched: u64,
    /// Hits on a prefetched expert's first use (part of `hits`).
    pub prefetch_hits: u64,
    /// Slots (0 when unbounded).
    pub slots: u64,
    /// Bytes per slot.
    pub slot_bytes: u64,
    /// Whether misses are read with `O_DIRECT`.
    pub direct_io: bool,
}

impl CacheStats {
    /// `self − earlier` for the counters; sizes and flags of `self`.
    pub fn since(&self, earlier: &CacheStats) -> CacheStats {
        CacheStats {
            hits: self.hits - earlier.hits,
            misses: self.misses - earlier.misses,
            bytes_read: self.bytes_read - earlier.bytes_read,
            stall: self.stall.saturating_sub(earlier.stall),
            prefetched: self.prefetched - earlier.prefetched,
            prefetch_hits: self.prefetch_hits - earlier.prefetch_hits,
            ..*self
        }
    }

    /// Hits over lookups (1 when nothing was looked up).
    pub fn hit_rate(&self) -> f64 {
        let n = self.hits + self.misses;
        if n == 0 {
            1.0
        } else {
            self.hits as f64 / n as f64
        }
    }
}
