//! The paged KV pool: per layer, `num_blocks` blocks of `block_size` token slots, stored as f32,
//! bf16 or int8 ([`KvCacheDtype`]). The engine's block manager decides which blocks a sequence
//! owns and passes them in each [`SeqChunk`]'s block table; this type only stores and reads.
//!
//! Layout of one block in one layer, per KV head: values `[block_size][head_dim]` and keys
//! transposed, `[head_dim][block_size]`, so one head's keys or values in a block are contiguous
//! and the attention kernel streams them (keys as 16-wide columns of scores, without a transpose
//! per step). int8 codes are laid out for integer dot products instead ([`kv_quant::key_code_at`],
//! [`kv_quant::value_code_at`]: four channels of 16 tokens per 64 bytes, token pairs), still one
//! contiguous run per head and block. An int8 block also holds, per head, each key channel's f16
//! minimum and scale code and each value row's scale code: statistics live with the block, so prefix sharing, eviction
//! and copy-on-write move them along with the codes.
//!
//! **int8: the block being filled stays at f32** (KIVI's full-precision residual). Its keys and
//! values go to a per-block f32 *staging* copy; when the block fills, it is quantized from that
//! copy in one go, deterministically, so a full block's codes depend only on its 16–128 tokens'
//! exact values — never on how they were batched or chunked. A query always reads its own block
//! exact and earlier blocks quantized (whether its own block filled in this very pass or not), so
//! its result does not depend on the chunking either. Staging is taken when a block gets its first
//! token and handed back when it fills, or when the engine frees it ([`PagedKvCache::release`]);
//! it is at most one block per running sequence, plus the blocks a prefill chunk spans.
//!
//! Rollback (speculative decoding) addresses positions through the block table: discarding
//! drafted tokens is the engine shortening the sequence. A rollback into a full int8 block first
//! [reopens](PagedKvCache::reopen_block) it: the kept tokens return to staging from their codes.

use std::collections::HashMap;

use candle_core::{Device, Tensor};

use crate::batch::ForwardBatch;
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::kernels::attention::{paged_attention, ExactBlock, KvStore, PagedLayer, SeqView};
use crate::kernels::huge_buf::HugeBuf;
use crate::kernels::kv_quant::{self, dequantize_key, dequantize_value};
use crate::kernels::pool::{self, Disjoint};
use crate::kernels::rowwise::with_f32;
use crate::kv_cache::KvCache;
use crate::kv_dtype::KvCacheDtype;

/// One layer's pool.
enum LayerStore {
    F32 { k: HugeBuf<f32>, v: HugeBuf<f32> },
    Bf16 { k: HugeBuf<u16>, v: HugeBuf<u16> },
    Int8 { k: HugeBuf<u8>, k_min: HugeBuf<u16>, k_scale: HugeBuf<u8>, v: HugeBuf<i8>, v_scale: HugeBuf<u8> },
}

impl LayerStore {
    fn view(&self) -> KvStore<'_> {
        match self {
            Self::F32 { k, v } => KvStore::F32 { k, v },
            Self::Bf16 { k, v } => KvStore::Bf16 { k, v },
            Self::Int8 { k, k_min, k_scale, v, v_scale } => KvStore::Int8 { k, k_min, k_scale, v, v_scale },
        }
    }
}

/// Spare staging buffers kept for reuse (each is one block of every layer at f32).
const SPARE_STAGING: usize = 8;

pub struct PagedKvCache {
    dtype: KvCacheDtype,
    block_size: usize,
    num_blocks: usize,
    kv_heads: usize,
    head_dim: usize,
    layers: Vec<LayerStore>,
    /// Int8: full-precision copies of blocks being filled, per layer `[K: kv_heads·d·bs][V: …]`.
    staging: HashMap<u32, Box<[f32]>>,
    spare: Vec<Box<[f32]>>,
    /// Int8: blocks that fill during the current forward pass (staging handed back after the
    /// last layer has read them).
    filling: Vec<u32>,
}

impl PagedKvCache {
    /// A zeroed pool. Zero pages are mapped lazily by the OS, so a large pool costs memory only
    /// as blocks are first written (in 2 MiB steps where it gets huge pages).
    pub fn new(cfg: &ModelConfig, dtype: KvCacheDtype, block_size: usize, num_blocks: usize) -> Result<Self> {
        if block_size == 0 || num_blocks == 0 {
            return Err(ModelError::Batch(format!(
                "a paged cache needs at least one block of at least one token (got {num_blocks} × {block_size})"
            )));
        }
        let (hkv, d) = (cfg.num_key_value_heads, cfg.head_dim);
        if dtype == KvCacheDtype::Int8 && !kv_quant::int8_layout_fits(d, block_size) {
            return Err(ModelError::Batch(format!(
                "the int8 KV cache needs an even block size and a head size that is a multiple of 4 (got block \
                 size {block_size}, head size {d}): choose another --block-size or --kv-cache-dtype"
            )));
        }
        let n = num_blocks * hkv * block_size * d;
        let layers = (0..cfg.num_hidden_layers)
            .map(|_| match dtype {
                KvCacheDtype::F32 => LayerStore::F32 { k: HugeBuf::zeroed(n), v: HugeBuf::zeroed(n) },
                KvCacheDtype::Bf16 => LayerStore::Bf16 { k: HugeBuf::zeroed(n), v: HugeBuf::zeroed(n) },
                KvCacheDtype::Int8 => LayerStore::Int8 {
                    k: HugeBuf::zeroed(n),
                    k_min: HugeBuf::zeroed(num_blocks * hkv * d),
                    k_scale: HugeBuf::zeroed(num_blocks * hkv * d),
                    v: HugeBuf::zeroed(n),
                    v_scale: HugeBuf::zeroed(num_blocks * hkv * block_size),
                },
            })
            .collect();
        Ok(Self {
            dtype,
            block_size,
            num_blocks,
            kv_heads: hkv,
            head_dim: d,
            layers,
            staging: HashMap::new(),
            spare: Vec::new(),
            filling: Vec::new(),
        })
    }

    pub fn dtype(&self) -> KvCacheDtype {
        self.dtype
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Blocks currently held at f32 while they fill (int8 only).
    pub fn staging_blocks(&self) -> usize {
        self.staging.len()
    }

    /// Elements of one layer in a staging buffer (K then V).
    fn staging_layer(&self) -> usize {
        2 * self.kv_heads * self.head_dim * self.block_size
    }

    /// Forget the staging of blocks the engine freed (a partial block's content dies with its
    /// sequence; full blocks have none). Call before the pass that may reuse them.
    pub fn release(&mut self, blocks: &[u32]) {
        for b in blocks {
            if let Some(buf) = self.staging.remove(b) {
                self.recycle(buf);
            }
        }
    }

    fn recycle(&mut self, buf: Box<[f32]>) {
        if self.spare.len() < SPARE_STAGING {
            self.spare.push(buf);
        }
    }

    /// A fresh zeroed staging buffer for `block` (replacing any stale one).
    fn stage(&mut self, block: u32) {
        let len = self.layers.len() * self.staging_layer();
        let buf = match self.spare.pop() {
            Some(mut b) => {
                b.fill(0.0);
                b
            }
            None => vec![0f32; len].into_boxed_slice(),
        };
        if let Some(old) = self.staging.insert(block, buf) {
            self.recycle(old);
        }
    }

    /// Copy block `src` into `dst` in every layer (copy-on-write of a shared block), statistics
    /// and staging included.
    pub fn copy_block(&mut self, src: u32, dst: u32) -> Result<()> {
        let (s, d) = (src as usize, dst as usize);
        if s >= self.num_blocks || d >= self.num_blocks {
            return Err(ModelError::Batch(format!("copy of block {src} to {dst} outside the pool")));
        }
        let n = self.kv_heads * self.block_size * self.head_dim;
        let per_head = self.kv_heads * self.head_dim;
        let rows = self.kv_heads * self.block_size;
        fn copy<T: Copy>(buf: &mut [T], s: usize, d: usize, n: usize) {
            buf.copy_within(s * n..(s + 1) * n, d * n);
        }
        for layer in &mut self.layers {
            match layer {
                LayerStore::F32 { k, v } => (copy(k, s, d, n), copy(v, s, d, n)),
                LayerStore::Bf16 { k, v } => (copy(k, s, d, n), copy(v, s, d, n)),
                LayerStore::Int8 { k, k_min, k_scale, v, v_scale } => {
                    copy(k, s, d, n);
                    copy(v, s, d, n);
                    copy(k_min, s, d, per_head);
                    copy(k_scale, s, d, per_head);
                    (copy(v_scale, s, d, rows), ())
                }
            };
        }
        match self.staging.get(&src).cloned() {
            Some(buf) => {
                if let Some(old) = self.staging.insert(dst, buf) {
                    self.recycle(old);
                }
            }
            None => self.release(&[dst]),
        }
        Ok(())
    }

    /// Make full block `block` writable again from token `keep` on (a rollback into it): an int8
    /// block's first `keep` tokens go back to staging, as their codes read. f32 and bf16 blocks
    /// need nothing.
    pub fn reopen_block(&mut self, block: u32, keep: usize) -> Result<()> {
        if block as usize >= self.num_blocks || keep >= self.block_size {
            return Err(ModelError::Batch(format!("reopening block {block} at token {keep} is outside the pool")));
        }
        if self.dtype != KvCacheDtype::Int8 || self.staging.contains_key(&block) {
            return Ok(());
        }
        self.stage(block);
        let (hkv, d, bs, per) = (self.kv_heads, self.head_dim, self.block_size, self.staging_layer());
        let Some(buf) = self.staging.get_mut(&block) else { return Ok(()) };
        for (l, layer) in self.layers.iter().enumerate() {
            let LayerStore::Int8 { k, k_min, k_scale, v, v_scale } = layer else { continue };
            let (ks, vs) = buf[l * per..(l + 1) * per].split_at_mut(per / 2);
            for h in 0..hkv {
                let bh = block as usize * hkv + h;
                for t in 0..keep {
                    for c in 0..d {
                        let i = (h * d + c) * bs + t;
                        let (kc, vc) = (kv_quant::key_code_at(d, bs, c, t), kv_quant::value_code_at(d, t, c));
                        ks[i] = dequantize_key(k[bh * d * bs + kc], k_min[bh * d + c], k_scale[bh * d + c]);
                        let j = (h * bs + t) * d + c;
                        vs[j] = dequantize_value(v[bh * bs * d + vc], v_scale[bh * bs + t]);
                    }
                }
            }
        }
        Ok(())
    }

    /// Every chunk's block table must cover its context and name blocks of the pool; for int8,
    /// take staging for the blocks this pass starts and note those it fills.
    fn begin_pass(&mut self, batch: &ForwardBatch) -> Result<()> {
        let bs = self.block_size;
        for s in &batch.seqs {
            let end = s.context_len + s.num_tokens;
            let needed = end.div_ceil(bs);
            if s.blocks.len() < needed {
                return Err(ModelError::Batch(format!(
                    "sequence {} needs {needed} blocks for {end} tokens but its table has {}",
                    s.seq,
                    s.blocks.len()
                )));
            }
            if let Some(b) = s.blocks[..needed].iter().find(|&&b| b as usize >= self.num_blocks) {
                return Err(ModelError::Batch(format!("block {b} is outside the pool of {}", self.num_blocks)));
            }
        }
        self.filling.clear();
        if self.dtype != KvCacheDtype::Int8 {
            return Ok(());
        }
        for s in &batch.seqs {
            let end = s.context_len + s.num_tokens;
            for b in s.context_len / bs..end.div_ceil(bs) {
                let block = s.blocks[b];
                if b * bs >= s.context_len {
                    self.stage(block);
                } else if !self.staging.contains_key(&block) {
                    return Err(ModelError::Batch(format!(
                        "sequence {}: block {block} holds {} tokens but has no full-precision copy (freed too early?)",
                        s.seq,
                        s.context_len - b * bs
                    )));
                }
                if (b + 1) * bs <= end {
                    self.filling.push(block);
                }
            }
        }
        Ok(())
    }

    /// Store the new tokens' keys and values of `layer` (int8: into staging, then quantize the
    /// blocks that are now full).
    fn write(&mut self, layer: usize, batch: &ForwardBatch, kv_new: &[f32], vv_new: &[f32]) {
        let (bs, hkv, d) = (self.block_size, self.kv_heads, self.head_dim);
        let shape = (bs, hkv, d);
        match &mut self.layers[layer] {
            LayerStore::F32 { k, v } => return store_by_head(k, v, &slots(batch, bs), shape, kv_new, vv_new, |x| x),
            LayerStore::Bf16 { k, v } => {
                return store_by_head(k, v, &slots(batch, bs), shape, kv_new, vv_new, kv_quant::to_bf16)
            }
            LayerStore::Int8 { .. } => {}
        }
        let per = self.staging_layer();
        let mut row = 0;
        for s in &batch.seqs {
            for t in 0..s.num_tokens {
                let pos = s.context_len + t;
                let (block, off) = (s.blocks[pos / bs], pos % bs);
                for h in 0..hkv {
                    let src = ((row + t) * hkv + h) * d;
                    let (kn, vn) = (&kv_new[src..src + d], &vv_new[src..src + d]);
                    // Offsets of this token's key column and value row within a block's layer.
                    let (kcol, vrow) = (h * d * bs + off, (h * bs + off) * d);
                    // `begin_pass` staged every block this pass writes.
                    let Some(buf) = self.staging.get_mut(&block) else { continue };
                    let (ks, vs) = buf[layer * per..(layer + 1) * per].split_at_mut(per / 2);
                    vs[vrow..vrow + d].copy_from_slice(vn);
                    for (c, &x) in kn.iter().enumerate() {
                        ks[kcol + c * bs] = x;
                    }
                }
            }
            row += s.num_tokens;
        }
        if let LayerStore::Int8 { k, k_min, k_scale, v, v_scale } = &mut self.layers[layer] {
            for &block in &self.filling {
                let Some(buf) = self.staging.get(&block) else { continue };
                let (ks, vs) = buf[layer * per..(layer + 1) * per].split_at(per / 2);
                for h in 0..hkv {
                    let bh = block as usize * hkv + h;
                    let (src_k, src_v) = (&ks[h * d * bs..][..d * bs], &vs[h * bs * d..][..bs * d]);
                    kv_quant::quantize_keys(
                        src_k,
                        bs,
                        &mut k[bh * d * bs..][..d * bs],
                        &mut k_min[bh * d..][..d],
                        &mut k_scale[bh * d..][..d],
                    );
                    kv_quant::quantize_values(src_v, d, &mut v[bh * bs * d..][..bs * d], &mut v_scale[bh * bs..][..bs]);
                }
            }
        }
    }
}

/// Where one new token goes: its row in the pass's `[rows][kv_heads][head_dim]` keys and values,
/// its physical block and slot, and whether it is the first of its sequence's chunk.
#[derive(Clone, Copy)]
struct Slot {
    row: usize,
    block: usize,
    off: usize,
    first: bool,
}

/// The pass's new tokens in row order (block tables already checked by `begin_pass`).
fn slots(batch: &ForwardBatch, bs: usize) -> Vec<Slot> {
    let mut out = Vec::with_capacity(batch.seqs.iter().map(|s| s.num_tokens).sum());
    for s in &batch.seqs {
        for t in 0..s.num_tokens {
            let pos = s.context_len + t;
            out.push(Slot { row: out.len(), block: s.blocks[pos / bs] as usize, off: pos % bs, first: t == 0 });
        }
    }
    out
}

/// Passes with at least this many new tokens store them on the kernel pool; a single
/// sequence's decode step stores 2 · kv_heads · head_dim values, less than a task hand-out costs.
const PARALLEL_STORE_TOKENS: usize = 4;

/// Store the new keys and values into an f32 or bf16 pool (`to` converts a value), the KV heads
/// spread over the kernel pool: one head's keys (or values) in a block are a range of their own,
/// so no two tasks touch the same memory. Each task first asks for every line it will store into.
/// A key is stored transposed, one line per channel (128 lines a token and head) in a pool that is
/// mostly out of the caches: stored one after another, each line's fetch waited for the one before
/// (qwen3-30b-a3b, 16 sequences: 0.33 ms a layer, 1/17 of the step); prefetched, the fetches
/// overlap, and the attention that follows reads those lines from the cache. Done by one thread
/// while the others waited, they still took 0.31 ms a layer on the AMX Xeon (14.8–15.4 ms of a
/// 16-sequence step, bf16 pool); split between its two threads, 0.14–0.17 ms (6.8–8.3 ms).
fn store_by_head<T: Copy + Send>(
    k: &mut [T],
    v: &mut [T],
    slots: &[Slot],
    (bs, hkv, d): (usize, usize, usize),
    kv_new: &[f32],
    vv_new: &[f32],
    to: impl Fn(f32) -> T + Sync,
) {
    let line_values = (64 / std::mem::size_of::<T>()).max(1);
    let (ks, vs) = (Disjoint::new(k), Disjoint::new(v));
    // Where head `h` of a slot's block starts in the keys, and where the slot's value row is.
    let at = |s: &Slot, h: usize| (s.block * hkv * bs * d + h * d * bs, (s.block * hkv * bs + h * bs + s.off) * d);
    let heads = |task: usize, tasks: usize| {
        let (kp, vp) = (ks.start(), vs.start());
        for h in (task..hkv).step_by(tasks) {
            for s in slots {
                let (k0, vrow) = at(s, h);
                let kcol = k0 + s.off;
                // A prefill chunk's consecutive keys share their lines: ask once per line.
                if s.first || (s.off * std::mem::size_of::<T>()).is_multiple_of(64) {
                    for c in 0..d {
                        prefetch(kp.wrapping_add(kcol + c * bs).cast());
                    }
                }
                for c in (0..d).step_by(line_values) {
                    prefetch(vp.wrapping_add(vrow + c).cast());
                }
            }
        }
        for h in (task..hkv).step_by(tasks) {
            for s in slots {
                let src = (s.row * hkv + h) * d;
                let (kn, vn) = (&kv_new[src..src + d], &vv_new[src..src + d]);
                let (k0, v0) = at(s, h);
                // SAFETY: head `h`'s keys in a block and this token's value row of head `h` are
                // ranges only the task of head `h` takes, one at a time.
                let (kh, vh) = unsafe { (ks.part(k0..k0 + d * bs), vs.part(v0..v0 + d)) };
                for (c, (&x, &y)) in kn.iter().zip(vn).enumerate() {
                    kh[s.off + c * bs] = to(x);
                    vh[c] = to(y);
                }
            }
        }
    };
    let tasks = pool::threads().min(hkv);
    if slots.len() >= PARALLEL_STORE_TOKENS && tasks > 1 {
        pool::run(tasks, |t| heads(t, tasks));
    } else {
        heads(0, 1);
    }
}

impl KvCache for PagedKvCache {
    fn attention(
        &mut self,
        layer: usize,
        batch: &ForwardBatch,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        window: Option<usize>,
    ) -> Result<Tensor> {
        if layer >= self.layers.len() {
            return Err(ModelError::Batch(format!("layer {layer} out of range")));
        }
        if layer == 0 {
            self.begin_pass(batch)?;
        }
        let (n, q_heads, d) = q.dims3()?;
        let (bs, hkv) = (self.block_size, self.kv_heads);
        if k.dims3()? != (n, hkv, d) || v.dims3()? != (n, hkv, d) || d != self.head_dim {
            return Err(ModelError::Batch(format!("k of shape {:?} does not fit the cache", k.dims())));
        }
        tracing::trace_span!("kv_write")
            .in_scope(|| with_f32(k, |kv_new| with_f32(v, |vv_new| self.write(layer, batch, kv_new, vv_new))))??;
        let per = self.staging_layer();
        // Int8: each sequence's exact copies of the blocks its queries sit in.
        let exact: Vec<Vec<ExactBlock>> = batch
            .seqs
            .iter()
            .map(|s| {
                if self.dtype != KvCacheDtype::Int8 {
                    return Ok(Vec::new());
                }
                (s.context_len / bs..(s.context_len + s.num_tokens).div_ceil(bs))
                    .map(|b| {
                        let buf = self.staging.get(&s.blocks[b]).ok_or_else(|| {
                            ModelError::Batch(format!("block {} lost its full-precision copy", s.blocks[b]))
                        })?;
                        let (k, v) = buf[layer * per..(layer + 1) * per].split_at(per / 2);
                        Ok(ExactBlock { k, v })
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<_>>()?;
        let mut views = Vec::with_capacity(batch.seqs.len());
        let mut row = 0;
        for (s, exact) in batch.seqs.iter().zip(&exact) {
            views.push(SeqView { row, context_len: s.context_len, num_tokens: s.num_tokens, blocks: &s.blocks, exact });
            row += s.num_tokens;
        }
        let pool = PagedLayer { store: self.layers[layer].view(), block_size: bs, kv_heads: hkv, head_dim: d };
        let mut out = vec![0f32; n * q_heads * d];
        with_f32(q, |qv| paged_attention(qv, q_heads, &views, &pool, window, &mut out))?;
        drop(views);
        drop(exact);
        if layer + 1 == self.layers.len() {
            // Every layer has read the blocks that filled: their staging is no longer needed.
            let filled = std::mem::take(&mut self.filling);
            self.release(&filled);
        }
        let device: &Device = q.device();
        Ok(Tensor::from_vec(out, (n, q_heads * d), device)?.to_dtype(q.dtype())?)
    }
}

/// A hint to bring the line at `p` into the cache (nothing where there is no such instruction).
/// Never a fault: the address is not dereferenced.
#[inline(always)]
fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHT0 is SSE (every x86-64 CPU) and only a hint: it reads nothing the
    // program sees and never faults.
    unsafe {
        std::arch::x86_64::_mm_prefetch(p as *const i8, std::arch::x86_64::_MM_HINT_T0)
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

#[cfg(test)]
mod tests;
