//! Property tests for the block pool and prefix cache: random interleavings of start (with prefix
//! hits), grow, compute, fork-by-sharing, roll back, free and eviction keep every invariant, and a
//! cache hit always returns blocks that really hold the requested tokens.
//!
//! A shadow copy records what each physical block was last written with; a hit whose blocks do
//! not hold exactly the looked-up tokens (a stale entry surviving reallocation, a wrong chain)
//! fails the test. Seeded, so a failure names a reproducible case.

use std::collections::HashMap;

use flint_engine::kv_manager::{KvManager, SeqId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const BS: usize = 4;

struct Live {
    tokens: Vec<u32>,
    computed: usize,
}

fn write(shadow: &mut HashMap<u32, Vec<Option<u32>>>, blocks: &[u32], tokens: &[u32], from: usize, to: usize) {
    for (pos, &tok) in tokens.iter().enumerate().take(to).skip(from) {
        let slot = shadow.entry(blocks[pos / BS]).or_insert_with(|| vec![None; BS]);
        slot[pos % BS] = Some(tok);
    }
}

fn run_case(seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let num_blocks = rng.random_range(4..40);
    let mut kv = KvManager::new(num_blocks, BS, true);
    let mut live: HashMap<SeqId, Live> = HashMap::new();
    let mut shadow: HashMap<u32, Vec<Option<u32>>> = HashMap::new();
    let mut next: SeqId = 0;
    // A tiny alphabet and shared stems make prefix hits frequent.
    let stems: Vec<Vec<u32>> =
        (0..3).map(|_| (0..rng.random_range(0..12)).map(|_| rng.random_range(0..3)).collect()).collect();
    for step in 0..300 {
        match rng.random_range(0..6) {
            // Start a sequence on whatever prefix the cache holds.
            0 | 1 => {
                let mut tokens = stems[rng.random_range(0..stems.len())].clone();
                tokens.extend((0..rng.random_range(1..10)).map(|_| rng.random_range(0..3)));
                let hit = kv.lookup(&tokens, None);
                for (i, b) in hit.blocks.iter().enumerate() {
                    let held: Vec<Option<u32>> = tokens[i * BS..(i + 1) * BS].iter().map(|&t| Some(t)).collect();
                    assert_eq!(shadow.get(b), Some(&held), "seed {seed} step {step}: hit block {b} holds other tokens");
                }
                let ctx = hit.blocks.len() * BS;
                if kv.can_allocate(next, tokens.len(), &hit) {
                    kv.start(next, hit, None);
                    assert!(kv.allocate(next, tokens.len()), "seed {seed}: can_allocate lied");
                    live.insert(next, Live { tokens, computed: ctx });
                    next += 1;
                }
            }
            // Compute some of a sequence's pending tokens, or append a generated one.
            2 | 3 => {
                let Some(&id) = live.keys().nth(rng.random_range(0..live.len().max(1))) else { continue };
                let s = live.get_mut(&id).unwrap();
                if s.computed == s.tokens.len() {
                    s.tokens.push(rng.random_range(0..3));
                    if !kv.allocate(id, s.tokens.len()) {
                        s.tokens.pop();
                        continue;
                    }
                }
                let to = rng.random_range(s.computed + 1..=s.tokens.len());
                write(&mut shadow, kv.blocks(id), &s.tokens, s.computed, to);
                s.computed = to;
                kv.commit(id, &s.tokens, to);
            }
            // Roll back (speculative rejection), performing any copy-on-write the manager asks for.
            4 => {
                let Some(&id) = live.keys().nth(rng.random_range(0..live.len().max(1))) else { continue };
                let s = live.get_mut(&id).unwrap();
                let len = rng.random_range(0..=s.computed);
                if let Some(copies) = kv.truncate(id, len) {
                    for (src, dst) in copies {
                        let c = shadow.get(&src).cloned();
                        if let Some(c) = c {
                            shadow.insert(dst, c);
                        }
                    }
                    s.tokens.truncate(len);
                    s.computed = len;
                }
            }
            // Finish.
            _ => {
                let Some(&id) = live.keys().nth(rng.random_range(0..live.len().max(1))) else { continue };
                kv.free(id);
                live.remove(&id);
            }
        }
        if let Err(e) = kv.check() {
            panic!("seed {seed} step {step}: {e}");
        }
    }
    for id in live.keys().copied().collect::<Vec<_>>() {
        kv.free(id);
    }
    kv.check().unwrap();
    assert_eq!(kv.pool().num_free(), kv.pool().num_total(), "seed {seed}: blocks leaked");
}

#[test]
fn random_operation_sequences_keep_every_invariant() {
    for seed in 0..300 {
        run_case(seed);
    }
}
