//! The KV block pool: which physical blocks are free, who holds which, and which full blocks are
//! remembered by content for prefix caching.
//!
//! A block is *held* while its reference count is above zero (one reference per sequence whose
//! table contains it) and *free* otherwise. Free blocks wait in a queue ordered by release time;
//! allocation takes the oldest. A free block that still carries a prefix-cache entry can be
//! revived by a cache hit until allocation reuses it, at which point its entry is evicted — so
//! cached blocks are evicted least-recently-used. Invariant: `free + held == total`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, RwLock};

/// A full block's identity for prefix caching: hash of (parent block hash, token ids, salt).
pub type BlockHash = u64;

/// What a cached block holds, kept so a hash hit is confirmed, never trusted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockKey {
    pub parent: Option<BlockHash>,
    pub tokens: Vec<u32>,
    pub salt: Option<BlockHash>,
}

/// The hashes of the blocks the prefix cache holds, published for readers on other threads
/// (the router prices a prompt on each worker by its cached prefix). Reading it never touches
/// the pool's LRU order.
#[derive(Debug, Default)]
pub struct PrefixIndex(RwLock<HashSet<BlockHash>>);

impl PrefixIndex {
    pub fn contains(&self, hash: BlockHash) -> bool {
        self.0.read().map(|s| s.contains(&hash)).unwrap_or(false)
    }

    pub fn len(&self) -> usize {
        self.0.read().map(|s| s.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn insert(&self, hash: BlockHash) {
        if let Ok(mut s) = self.0.write() {
            s.insert(hash);
        }
    }

    fn remove(&self, hash: BlockHash) {
        if let Ok(mut s) = self.0.write() {
            s.remove(&hash);
        }
    }
}

#[derive(Debug, Clone, Default)]
struct BlockMeta {
    ref_count: u32,
    /// Position in the free queue while free.
    free_stamp: Option<u64>,
    /// Set once the block is full, computed and registered.
    cached: Option<(BlockHash, BlockKey)>,
}

#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<BlockMeta>,
    free: BTreeMap<u64, u32>,
    next_stamp: u64,
    cache: HashMap<BlockHash, u32>,
    /// Blocks whose last reference went since [`take_freed`](Self::take_freed) last ran.
    freed: Vec<u32>,
    /// `cache`'s keys, for other threads.
    index: Arc<PrefixIndex>,
    pub stats: PoolStats,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Cached blocks dropped because their block was reallocated.
    pub evictions: u64,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        let mut pool = Self {
            blocks: vec![BlockMeta::default(); num_blocks],
            free: BTreeMap::new(),
            next_stamp: 0,
            cache: HashMap::new(),
            freed: Vec::new(),
            index: Arc::default(),
            stats: PoolStats::default(),
        };
        for b in 0..num_blocks as u32 {
            pool.push_free(b);
        }
        pool
    }

    pub fn num_total(&self) -> usize {
        self.blocks.len()
    }

    /// Free blocks, including cached ones that allocation may evict.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn num_held(&self) -> usize {
        self.blocks.iter().filter(|b| b.ref_count > 0).count()
    }

    pub fn num_cached(&self) -> usize {
        self.cache.len()
    }

    pub fn ref_count(&self, block: u32) -> u32 {
        self.blocks.get(block as usize).map_or(0, |b| b.ref_count)
    }

    pub fn is_cached(&self, block: u32) -> bool {
        self.blocks.get(block as usize).is_some_and(|b| b.cached.is_some())
    }

    fn push_free(&mut self, b: u32) {
        self.blocks[b as usize].free_stamp = Some(self.next_stamp);
        self.free.insert(self.next_stamp, b);
        self.next_stamp += 1;
    }

    /// Take the least recently released block, evicting its cache entry. `None` when exhausted.
    pub fn allocate(&mut self) -> Option<u32> {
        let (_, b) = self.free.pop_first()?;
        let meta = &mut self.blocks[b as usize];
        meta.free_stamp = None;
        meta.ref_count = 1;
        if let Some((hash, _)) = meta.cached.take() {
            self.cache.remove(&hash);
            self.index.remove(hash);
            self.stats.evictions += 1;
        }
        Some(b)
    }

    /// Add a reference to `b` (a prefix-cache hit, or a sequence sharing it).
    pub fn retain(&mut self, b: u32) {
        let meta = &mut self.blocks[b as usize];
        if let Some(stamp) = meta.free_stamp.take() {
            self.free.remove(&stamp);
        }
        meta.ref_count += 1;
    }

    /// Drop one reference to each block, last block first: the tail of a finished sequence is
    /// the least likely to be shared, so it is queued to be evicted first.
    pub fn release(&mut self, blocks: &[u32]) {
        for &b in blocks.iter().rev() {
            let meta = &mut self.blocks[b as usize];
            debug_assert!(meta.ref_count > 0, "double free of block {b}");
            meta.ref_count = meta.ref_count.saturating_sub(1);
            if meta.ref_count == 0 {
                self.push_free(b);
                self.freed.push(b);
            }
        }
    }

    /// The blocks that lost their last holder since the previous call (the model runner drops
    /// whatever it keeps per block for them: an int8 cache's staging of a partial block).
    pub fn take_freed(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.freed)
    }

    /// A cached block with exactly this content, if any (confirmed against its stored key).
    pub fn lookup(&self, hash: BlockHash, key: &BlockKey) -> Option<u32> {
        let &b = self.cache.get(&hash)?;
        let (_, stored) = self.blocks[b as usize].cached.as_ref()?;
        (stored == key).then_some(b)
    }

    /// Remember held block `b` (now full and computed) under `hash`. If another block already
    /// holds the same content, `b` stays private and the existing entry wins.
    pub fn register(&mut self, b: u32, hash: BlockHash, key: BlockKey) {
        let meta = &self.blocks[b as usize];
        if meta.cached.is_some() || self.cache.contains_key(&hash) {
            return;
        }
        self.cache.insert(hash, b);
        self.index.insert(hash);
        self.blocks[b as usize].cached = Some((hash, key));
    }

    /// Forget `b`'s cache entry (its content is about to change: a rollback into it).
    pub fn unregister(&mut self, b: u32) {
        if let Some((hash, _)) = self.blocks[b as usize].cached.take() {
            self.cache.remove(&hash);
            self.index.remove(hash);
        }
    }

    /// The cached blocks' hashes as other threads see them.
    pub fn prefix_index(&self) -> Arc<PrefixIndex> {
        self.index.clone()
    }

    /// Check every structural invariant; `Err` describes the first violation.
    pub fn check(&self) -> Result<(), String> {
        let held = self.num_held();
        if held + self.free.len() != self.blocks.len() {
            return Err(format!("free {} + held {held} != total {}", self.free.len(), self.blocks.len()));
        }
        for (&stamp, &b) in &self.free {
            let meta = &self.blocks[b as usize];
            if meta.ref_count != 0 || meta.free_stamp != Some(stamp) {
                return Err(format!("block {b} queued as free with {} references", meta.ref_count));
            }
        }
        for (&hash, &b) in &self.cache {
            match &self.blocks[b as usize].cached {
                Some((h, _)) if *h == hash => {}
                _ => return Err(format!("cache entry {hash:x} points at block {b} which does not carry it")),
            }
        }
        let carried = self.blocks.iter().filter(|m| m.cached.is_some()).count();
        if carried != self.cache.len() {
            return Err(format!("{carried} blocks carry cache entries but the index has {}", self.cache.len()));
        }
        let published = self.index.0.read().map_err(|_| "the published prefix index is poisoned".to_string())?;
        if published.len() != self.cache.len() || self.cache.keys().any(|h| !published.contains(h)) {
            return Err(format!(
                "the published prefix index has {} hashes, the cache {} (or other ones)",
                published.len(),
                self.cache.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(t: u32) -> BlockKey {
        BlockKey { parent: None, tokens: vec![t; 4], salt: None }
    }

    #[test]
    fn lru_eviction_releases_tail_first() {
        let mut p = BlockPool::new(4);
        let a: Vec<u32> = (0..4).map(|_| p.allocate().unwrap()).collect();
        assert!(p.allocate().is_none());
        for (i, &b) in a.iter().enumerate() {
            p.register(b, i as u64, key(i as u32));
        }
        p.release(&a[..2]); // tail (a[1]) queued before a[0]
        assert_eq!(p.num_free(), 2);
        assert_eq!(p.take_freed(), vec![a[1], a[0]]);
        assert!(p.take_freed().is_empty());
        p.check().unwrap();
        assert_eq!(p.lookup(0, &key(0)), Some(a[0]));
        let fresh = p.allocate().unwrap();
        assert_eq!(fresh, a[1], "the released tail is evicted first");
        assert_eq!(p.lookup(1, &key(1)), None);
        assert_eq!(p.stats.evictions, 1);
        // A hit on a free cached block revives it.
        p.retain(a[0]);
        assert_eq!(p.num_free(), 0);
        p.check().unwrap();
    }

    #[test]
    fn hash_hit_is_confirmed_against_content() {
        let mut p = BlockPool::new(2);
        let b = p.allocate().unwrap();
        p.register(b, 42, key(1));
        assert_eq!(p.lookup(42, &key(1)), Some(b));
        assert_eq!(p.lookup(42, &key(2)), None, "a colliding hash with other tokens is a miss");
        let c = p.allocate().unwrap();
        p.register(c, 42, key(1));
        assert!(!p.is_cached(c), "first registration wins");
        p.unregister(b);
        assert_eq!(p.lookup(42, &key(1)), None);
        p.check().unwrap();
    }
}
