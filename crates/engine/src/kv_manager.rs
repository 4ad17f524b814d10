//! Per-sequence block tables over the [`BlockPool`], and prefix caching on top of them.
//!
//! Block `i` of a sequence holds positions `i·B .. (i+1)·B`. Once a block is full and its keys and
//! values computed, it is registered under the hash chain `hash(parent, tokens, salt)` and any
//! later sequence with the same prefix (and salt) reuses it — even while its first owner still
//! runs. Shared blocks are never written: a sequence only writes positions past its cached
//! prefix, and a rollback into a shared block first moves to a private copy.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use crate::block_pool::{BlockHash, BlockKey, BlockPool, PrefixIndex};

pub type SeqId = u64;

#[derive(Debug, Default, Clone)]
struct SeqBlocks {
    blocks: Vec<u32>,
    /// Hashes of the first `hashes.len()` blocks (those full, computed and registered or hit).
    hashes: Vec<BlockHash>,
    salt: Option<BlockHash>,
}

#[derive(Debug)]
pub struct KvManager {
    pool: BlockPool,
    block_size: usize,
    prefix_caching: bool,
    seqs: HashMap<SeqId, SeqBlocks>,
}

/// A prefix-cache lookup's result: reuse `blocks` (covering `blocks.len()·B` tokens).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixHit {
    pub blocks: Vec<u32>,
    pub hashes: Vec<BlockHash>,
}

fn hash_of<T: Hash>(v: &T) -> u64 {
    // SipHash with fixed keys: stable for the life of the process, which is all a cache needs.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    v.hash(&mut h);
    h.finish()
}

pub fn salt_hash(salt: &str) -> BlockHash {
    hash_of(&("salt", salt))
}

fn block_hash(key: &BlockKey) -> BlockHash {
    hash_of(&(key.parent, &key.tokens, key.salt))
}

/// Prompt tokens of `tokens` that a [`KvManager::lookup`] on the pool behind `index` would find
/// cached now, computed on any thread from the published hashes alone (a hash match is not
/// confirmed against content as `lookup` does: this is an estimate for routing, and a false hit
/// needs a 64-bit collision).
pub fn cached_prefix_tokens(index: &PrefixIndex, block_size: usize, tokens: &[u32], salt: Option<BlockHash>) -> usize {
    if tokens.is_empty() || block_size == 0 || index.is_empty() {
        return 0;
    }
    let mut parent = None;
    let mut hit = 0;
    for chunk in tokens[..tokens.len() - 1].chunks_exact(block_size) {
        let h = block_hash(&BlockKey { parent, tokens: chunk.to_vec(), salt });
        if !index.contains(h) {
            break;
        }
        hit += block_size;
        parent = Some(h);
    }
    hit
}

impl KvManager {
    pub fn new(num_blocks: usize, block_size: usize, prefix_caching: bool) -> Self {
        Self { pool: BlockPool::new(num_blocks), block_size, prefix_caching, seqs: HashMap::new() }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Blocks no sequence holds any more since the previous call.
    pub fn take_freed(&mut self) -> Vec<u32> {
        self.pool.take_freed()
    }

    pub fn prefix_caching(&self) -> bool {
        self.prefix_caching
    }

    pub fn blocks(&self, seq: SeqId) -> &[u32] {
        self.seqs.get(&seq).map_or(&[], |s| &s.blocks)
    }

    /// Fraction of blocks held by sequences.
    pub fn usage(&self) -> f64 {
        1.0 - self.pool.num_free() as f64 / self.pool.num_total().max(1) as f64
    }

    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// The longest cached prefix of `tokens` in whole blocks, leaving at least one token to
    /// compute (the last prompt token's logits are needed).
    pub fn lookup(&self, tokens: &[u32], salt: Option<BlockHash>) -> PrefixHit {
        let mut hit = PrefixHit::default();
        if !self.prefix_caching || tokens.is_empty() {
            return hit;
        }
        let mut parent = None;
        for chunk in tokens[..tokens.len() - 1].chunks_exact(self.block_size) {
            let key = BlockKey { parent, tokens: chunk.to_vec(), salt };
            let h = block_hash(&key);
            match self.pool.lookup(h, &key) {
                Some(b) => {
                    hit.blocks.push(b);
                    hit.hashes.push(h);
                    parent = Some(h);
                }
                None => break,
            }
        }
        hit
    }

    /// Blocks that giving `seq` room for `num_tokens` would take from the free queue, counting
    /// `hit` blocks that are currently free (reviving them takes them off the queue).
    pub fn blocks_needed(&self, seq: SeqId, num_tokens: usize, hit: &PrefixHit) -> usize {
        let have = self.seqs.get(&seq).map_or(0, |s| s.blocks.len()).max(hit.blocks.len());
        let revived = hit.blocks.iter().filter(|&&b| self.pool.ref_count(b) == 0).count();
        self.blocks_for(num_tokens).saturating_sub(have) + revived
    }

    pub fn can_allocate(&self, seq: SeqId, num_tokens: usize, hit: &PrefixHit) -> bool {
        self.blocks_needed(seq, num_tokens, hit) <= self.pool.num_free()
    }

    /// Start `seq` on the cached prefix `hit` (possibly empty).
    pub fn start(&mut self, seq: SeqId, hit: PrefixHit, salt: Option<BlockHash>) {
        for &b in &hit.blocks {
            self.pool.retain(b);
        }
        self.seqs.insert(seq, SeqBlocks { blocks: hit.blocks, hashes: hit.hashes, salt });
    }

    /// Grow `seq`'s table to hold `num_tokens` tokens. All or nothing: `false` (and no change)
    /// when the pool is short.
    pub fn allocate(&mut self, seq: SeqId, num_tokens: usize) -> bool {
        let need = self.blocks_for(num_tokens);
        let have = self.seqs.get(&seq).map_or(0, |s| s.blocks.len());
        if need.saturating_sub(have) > self.pool.num_free() {
            return false;
        }
        let mut fresh = Vec::with_capacity(need.saturating_sub(have));
        for _ in have..need {
            match self.pool.allocate() {
                Some(b) => fresh.push(b),
                None => {
                    self.pool.release(&fresh);
                    return false;
                }
            }
        }
        self.seqs.entry(seq).or_default().blocks.extend(fresh);
        true
    }

    /// `tokens[..num_computed]` of `seq` now have their keys and values in the cache: register
    /// every block that became full.
    pub fn commit(&mut self, seq: SeqId, tokens: &[u32], num_computed: usize) {
        if !self.prefix_caching {
            return;
        }
        let Some(s) = self.seqs.get_mut(&seq) else { return };
        let full = (num_computed / self.block_size).min(s.blocks.len());
        while s.hashes.len() < full {
            let i = s.hashes.len();
            let key = BlockKey {
                parent: s.hashes.last().copied(),
                tokens: tokens[i * self.block_size..(i + 1) * self.block_size].to_vec(),
                salt: s.salt,
            };
            let h = block_hash(&key);
            self.pool.register(s.blocks[i], h, key);
            s.hashes.push(h);
        }
    }

    /// Release all of `seq`'s blocks (tail first); cached ones stay reusable until evicted.
    pub fn free(&mut self, seq: SeqId) {
        if let Some(s) = self.seqs.remove(&seq) {
            self.pool.release(&s.blocks);
        }
    }

    /// Roll `seq` back to its first `len` tokens: free blocks past them, and if the new last
    /// block is partial, make sure it is private and uncached before it is written again.
    /// Returns `(src, dst)` block copies the model runner must perform first (copy-on-write of a
    /// shared block), or `None` if the pool has no block for the copy.
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> Option<Vec<(u32, u32)>> {
        let bs = self.block_size;
        let keep = self.blocks_for(len);
        let s = self.seqs.get(&seq)?;
        let shared_last = (!len.is_multiple_of(bs) && s.blocks.len() >= keep && keep > 0)
            .then(|| s.blocks[keep - 1])
            .filter(|&b| self.pool.ref_count(b) > 1);
        // All or nothing: take the copy's block before changing anything.
        let fresh = match shared_last {
            Some(_) => Some(self.pool.allocate()?),
            None => None,
        };
        let s = self.seqs.get_mut(&seq)?;
        if s.blocks.len() > keep {
            let tail = s.blocks.split_off(keep);
            self.pool.release(&tail);
        }
        s.hashes.truncate(len / bs);
        let mut copies = Vec::new();
        match (shared_last, fresh) {
            (Some(last), Some(fresh)) => {
                self.pool.release(&[last]);
                if let Some(slot) = s.blocks.last_mut() {
                    *slot = fresh;
                }
                copies.push((last, fresh));
            }
            _ => {
                if !len.is_multiple_of(bs) {
                    if let Some(&last) = s.blocks.last() {
                        self.pool.unregister(last);
                    }
                }
            }
        }
        Some(copies)
    }

    /// Pool invariants plus: every reference is accounted for by exactly the tables holding it.
    pub fn check(&self) -> Result<(), String> {
        self.pool.check()?;
        let mut refs: HashMap<u32, u32> = HashMap::new();
        for s in self.seqs.values() {
            for &b in &s.blocks {
                *refs.entry(b).or_default() += 1;
            }
        }
        for b in 0..self.pool.num_total() as u32 {
            let want = refs.get(&b).copied().unwrap_or(0);
            if self.pool.ref_count(b) != want {
                return Err(format!("block {b}: {} references, {want} tables hold it", self.pool.ref_count(b)));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn published_index_agrees_with_lookup() {
        let mut m = KvManager::new(4, 4, true);
        let index = m.pool().prefix_index();
        let prompt: Vec<u32> = (0..10).collect();
        assert_eq!(cached_prefix_tokens(&index, 4, &prompt, None), 0);
        m.start(1, PrefixHit::default(), None);
        assert!(m.allocate(1, 10));
        m.commit(1, &prompt, 10);
        for len in 1..=prompt.len() {
            let p = &prompt[..len];
            assert_eq!(cached_prefix_tokens(&index, 4, p, None), m.lookup(p, None).blocks.len() * 4, "{len}");
        }
        assert_eq!(cached_prefix_tokens(&index, 4, &prompt, Some(salt_hash("x"))), 0);
        let mut other = prompt.clone();
        other[5] = 99;
        assert_eq!(cached_prefix_tokens(&index, 4, &other, None), 4, "the chain stops at the first differing block");
        // Freed blocks stay cached until reallocation evicts them; then the index forgets them.
        m.free(1);
        assert_eq!(cached_prefix_tokens(&index, 4, &prompt, None), 8);
        m.start(2, PrefixHit::default(), None);
        assert!(m.allocate(2, 16));
        assert_eq!(cached_prefix_tokens(&index, 4, &prompt, None), 0);
        m.pool().check().unwrap();
    }

    #[test]
    fn shared_prefix_is_reused_while_first_owner_runs() {
        let mut m = KvManager::new(8, 4, true);
        let prompt: Vec<u32> = (0..10).collect();
        assert!(m.lookup(&prompt, None).blocks.is_empty());
        m.start(1, PrefixHit::default(), None);
        assert!(m.allocate(1, 10));
        m.commit(1, &prompt, 10);
        // Two full blocks are registered; a second request with the same prompt hits both.
        let hit = m.lookup(&prompt, None);
        assert_eq!(hit.blocks, m.blocks(1)[..2].to_vec());
        // A prompt that is exactly 8 tokens keeps its last token to compute: one block hit.
        assert_eq!(m.lookup(&prompt[..8], None).blocks.len(), 1);
        // Different salt: no hit.
        assert!(m.lookup(&prompt, Some(salt_hash("x"))).blocks.is_empty());
        m.start(2, hit, None);
        assert!(m.allocate(2, 12));
        assert_eq!(m.pool().ref_count(m.blocks(1)[0]), 2);
        m.check().unwrap();
        m.free(1);
        m.free(2);
        m.check().unwrap();
        assert_eq!(m.pool().num_free(), 8);
        // Still cached after both finished.
        assert_eq!(m.lookup(&prompt, None).blocks.len(), 2);
    }

    #[test]
    fn allocation_is_all_or_nothing() {
        let mut m = KvManager::new(3, 4, false);
        m.start(1, PrefixHit::default(), None);
        assert!(m.allocate(1, 8));
        assert!(!m.allocate(1, 16), "needs 2 more, 1 free");
        assert_eq!(m.blocks(1).len(), 2);
        m.check().unwrap();
    }

    #[test]
    fn truncate_into_shared_block_copies_it() {
        let mut m = KvManager::new(8, 4, true);
        let toks: Vec<u32> = (0..9).collect();
        m.start(1, PrefixHit::default(), None);
        assert!(m.allocate(1, 9));
        m.commit(1, &toks, 9);
        let hit = m.lookup(&toks, None);
        m.start(2, hit, None);
        assert!(m.allocate(2, 9));
        let shared = m.blocks(2)[1];
        let copies = m.truncate(2, 6).unwrap();
        assert_eq!(copies.len(), 1);
        assert_eq!(copies[0].0, shared);
        assert_ne!(m.blocks(2)[1], shared);
        assert_eq!(m.blocks(2).len(), 2);
        // Sequence 1 owns its blocks alone: rolling back unregisters instead of copying.
        // (First: with no free block for the copy, a rollback into a shared block changes nothing.)
        let mut full = KvManager::new(3, 4, true);
        full.start(1, PrefixHit::default(), None);
        assert!(full.allocate(1, 8));
        full.commit(1, &toks[..8], 8);
        let hit = full.lookup(&toks[..9], None);
        full.start(2, hit, None);
        assert!(full.allocate(2, 9));
        assert_eq!(full.pool().num_free(), 0);
        let before = full.blocks(2).to_vec();
        assert_eq!(full.truncate(2, 6), None);
        assert_eq!(full.blocks(2), &before[..]);
        full.check().unwrap();
        assert_eq!(m.truncate(1, 5).unwrap(), vec![]);
        assert!(!m.pool().is_cached(m.blocks(1)[1]));
        m.check().unwrap();
    }
}
