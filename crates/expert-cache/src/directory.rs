//! Slot bookkeeping and eviction, independent of where the slots live (host RAM here; GPU memory
//! for a CUDA cache): which expert each slot holds, pins (slots in use by a running kernel are
//! never evicted), readiness (a slot being filled is not handed out), and the victim choice.
//!
//! Slots are kept in ordered sets by eviction rank, so a victim is found in O(log n):
//! * [`Policy::Lru`]: the least recently used slot of the whole cache;
//! * [`Policy::Lfu`]: the slot whose expert was used least often over the whole run (counts survive
//!   eviction), least recently used among equals;
//! * [`Policy::LayerQuota`]: each block owns an equal share of the slots and evicts its own least
//!   recently used one, so a block with scattered routing cannot flush the others.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::str::FromStr;

/// One expert of one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    pub layer: u32,
    pub expert: u32,
}

/// The eviction policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    #[default]
    Lru,
    Lfu,
    LayerQuota,
}

impl Policy {
    pub const NAMES: &'static [&'static str] = &["lru", "lfu", "layer-quota"];

    pub fn name(self) -> &'static str {
        match self {
            Policy::Lru => "lru",
            Policy::Lfu => "lfu",
            Policy::LayerQuota => "layer-quota",
        }
    }
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Policy, String> {
        match s {
            "lru" => Ok(Policy::Lru),
            "lfu" => Ok(Policy::Lfu),
            "layer-quota" | "quota" => Ok(Policy::LayerQuota),
            other => Err(format!(
                "unknown eviction policy '{other}' ({})",
                Policy::NAMES.join(", ")
            )),
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What [`Directory::lookup`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// Resident and ready: pinned for the caller.
    Hit(usize),
    /// Being filled by another caller: ask again later.
    Busy,
    Miss,
}

#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    key: Option<Key>,
    last_use: u64,
    pins: u32,
    ready: bool,
}

/// Eviction rank: smaller is evicted first. `(frequency or 0, last use, slot)`.
type Rank = (u64, u64, usize);

/// Which expert each slot holds, and the eviction order.
#[derive(Debug)]
pub struct Directory {
    policy: Policy,
    slots: Vec<Slot>,
    index: HashMap<Key, usize>,
    /// Uses per expert since the start (LFU).
    uses: HashMap<Key, u64>,
    /// Eviction order per partition (one partition, or one per block for quotas).
    order: Vec<BTreeSet<Rank>>,
    /// Partition of each slot.
    partition_of: Vec<usize>,
    tick: u64,
}

impl Directory {
    /// `slots` empty slots for `layers` blocks. Quotas give each block `slots / layers` slots (the
    /// first `slots % layers` blocks one more); `slots >= layers` is the caller's check.
    pub fn new(slots: usize, layers: usize, policy: Policy) -> Directory {
        let parts = if policy == Policy::LayerQuota {
            layers.max(1)
        } else {
            1
        };
        let (q, r) = (slots / parts, slots % parts);
        let mut partition_of = Vec::with_capacity(slots);
        for p in 0..parts {
            partition_of.extend(std::iter::repeat_n(p, q + usize::from(p < r)));
        }
        let mut order = vec![BTreeSet::new(); parts];
        for (s, &p) in partition_of.iter().enumerate() {
            order[p].insert((0, 0, s));
        }
        Directory {
            policy,
            slots: vec![Slot::default(); slots],
            index: HashMap::new(),
            uses: HashMap::new(),
            order,
            partition_of,
            tick: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    fn rank(&self, s: usize) -> Rank {
        let slot = &self.slots[s];
        let freq = match (self.policy, slot.key) {
            (Policy::Lfu, Some(k)) => self.uses.get(&k).copied().unwrap_or(0),
            _ => 0,
        };
        (freq, slot.last_use, s)
    }

    /// Records a use of slot `s` (now holding `key`): new recency and, when `counted`, frequency.
    fn touch(&mut self, s: usize, key: Key, counted: bool) {
        let p = self.partition_of[s];
        let old = self.rank(s);
        self.order[p].remove(&old);
        self.tick += 1;
        self.slots[s].last_use = self.tick;
        if counted {
            *self.uses.entry(key).or_insert(0) += 1;
        }
        let new = self.rank(s);
        self.order[p].insert(new);
    }

    /// Whether `key` holds a slot (ready or being filled); no use is recorded.
    pub fn contains(&self, key: Key) -> bool {
        self.index.contains_key(&key)
    }

    /// Looks `key` up; a ready hit is pinned and counts as a use.
    pub fn lookup(&mut self, key: Key) -> Lookup {
        match self.index.get(&key) {
            None => Lookup::Miss,
            Some(&s) if !self.slots[s].ready => Lookup::Busy,
            Some(&s) => {
                self.slots[s].pins += 1;
                self.touch(s, key, true);
                Lookup::Hit(s)
            }
        }
    }

    /// A slot for `key` (not resident): the policy's victim among unpinned slots, rebound to
    /// `key`, pinned and not ready until [`Directory::filled`]. `None` when every candidate is pinned.
    pub fn claim(&mut self, key: Key) -> Option<usize> {
        self.claim_counted(key, true)
    }

    /// [`Directory::claim`] for a prefetch: recent, but no use is counted (LFU frequencies stay
    /// those of real routing).
    pub fn claim_ahead(&mut self, key: Key) -> Option<usize> {
        self.claim_counted(key, false)
    }

    fn claim_counted(&mut self, key: Key, counted: bool) -> Option<usize> {
        let p = if self.policy == Policy::LayerQuota {
            key.layer as usize % self.order.len()
        } else {
            0
        };
        let victim = self.order[p]
            .iter()
            .map(|&(_, _, s)| s)
            .find(|&s| self.slots[s].pins == 0)?;
        if let Some(old) = self.slots[victim].key.take() {
            self.index.remove(&old);
        }
        self.slots[victim].key = Some(key);
        self.slots[victim].ready = false;
        self.slots[victim].pins = 1;
        self.index.insert(key, victim);
        self.touch(victim, key, counted);
        Some(victim)
    }

    /// Slot `s` now holds its expert's bytes. When `ok` is false the fill failed: the slot is
    /// emptied instead.
    pub fn filled(&mut self, s: usize, ok: bool) {
        if ok {
            self.slots[s].ready = true;
        } else if let Some(k) = self.slots[s].key.take() {
            self.index.remove(&k);
        }
    }

    /// Makes slot `s` the next victim of its partition (an expert fetched ahead and then not
    /// used: holding it would push out experts that are used).
    pub fn demote(&mut self, s: usize) {
        let p = self.partition_of[s];
        let old = self.rank(s);
        self.order[p].remove(&old);
        self.slots[s].last_use = 0;
        let new = self.rank(s);
        self.order[p].insert(new);
    }

    /// Releases one pin of slot `s`.
    pub fn unpin(&mut self, s: usize) {
        let pins = &mut self.slots[s].pins;
        *pins = pins.saturating_sub(1);
    }

    /// Whether slot `s` holds its expert's bytes (not being filled).
    pub fn is_ready(&self, s: usize) -> bool {
        self.slots[s].ready
    }

    /// The expert slot `s` holds.
    pub fn key_of(&self, s: usize) -> Option<Key> {
        self.slots[s].key
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(layer: u32, expert: u32) -> Key {
        Key { layer, expert }
    }

    fn use_key(d: &mut Directory, key: Key) -> bool {
        match d.lookup(key) {
            Lookup::Hit(s) => {
                d.unpin(s);
                true
            }
            Lookup::Miss => {
                let s = d.claim(key).expect("a free slot");
                d.filled(s, true);
                d.unpin(s);
                false
            }
            Lookup::Busy => unreachable!(),
        }
    }

    #[test]
    fn lru_evicts_the_least_recent() {
        let mut d = Directory::new(2, 1, Policy::Lru);
        assert!(!use_key(&mut d, k(0, 1)));
        assert!(!use_key(&mut d, k(0, 2)));
        assert!(use_key(&mut d, k(0, 1)));
        assert!(!use_key(&mut d, k(0, 3))); // evicts 2
        assert!(use_key(&mut d, k(0, 1)));
        assert!(!use_key(&mut d, k(0, 2)));
    }

    #[test]
    fn lfu_keeps_the_frequent() {
        let mut d = Directory::new(2, 1, Policy::Lfu);
        for _ in 0..3 {
            use_key(&mut d, k(0, 1));
        }
        use_key(&mut d, k(0, 2));
        use_key(&mut d, k(0, 3)); // evicts 2 (1 use) not 1 (3 uses)
        assert!(use_key(&mut d, k(0, 1)));
        assert!(!use_key(&mut d, k(0, 2)));
    }

    #[test]
    fn quotas_keep_layers_apart() {
        let mut d = Directory::new(2, 2, Policy::LayerQuota);
        use_key(&mut d, k(0, 1));
        use_key(&mut d, k(1, 1));
        use_key(&mut d, k(1, 2)); // layer 1 evicts its own slot
        assert!(use_key(&mut d, k(0, 1)));
        assert!(!use_key(&mut d, k(1, 1)));
    }

    #[test]
    fn a_demoted_slot_is_the_next_victim() {
        let mut d = Directory::new(2, 1, Policy::Lru);
        use_key(&mut d, k(0, 1));
        let s = d.claim_ahead(k(0, 2)).unwrap();
        d.filled(s, true);
        d.unpin(s);
        assert!(d.contains(k(0, 2)));
        d.demote(s);
        use_key(&mut d, k(0, 3)); // evicts the demoted 2, not the older 1
        assert!(d.contains(k(0, 1)) && !d.contains(k(0, 2)));
    }

    #[test]
    fn pinned_slots_are_not_evicted() {
        let mut d = Directory::new(1, 1, Policy::Lru);
        let s = d.claim(k(0, 1)).unwrap();
        assert_eq!(d.lookup(k(0, 1)), Lookup::Busy);
        assert_eq!(d.claim(k(0, 2)), None);
        d.filled(s, true);
        d.unpin(s);
        assert!(d.claim(k(0, 2)).is_some());
    }
}
