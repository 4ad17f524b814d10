//! Causal attention that reads keys and values where and as they are stored: in fixed-size blocks
//! of a paged pool, found through each sequence's block table, as f32, bf16 or int8 (see
//! [`super::kv_quant`]). Nothing is gathered or dequantized into a copy of the cache.
//!
//! **One arithmetic per query row**, whatever the batch, the chunking, the thread count or the
//! instruction set. A row at position `pos` attends to keys `lo..=pos`. The keys are cut into
//! fixed *segments* of [`SEGMENT_TOKENS`] positions (whole blocks). Per segment: an online softmax
//! starting afresh (max, sum, weighted values), one step per block — scores in *key tiles* of
//! [`KEY_TILE`] positions, the block's maximum, one rescale, the weighted values; then the segments
//! are folded in order with the log-sum-exp merge. Every operation's order is fixed (see
//! [`Portable`]): the AVX-512 path does the same operations, only 16 keys or channels at a time, so
//! every path gives the same bits. Stored int8 blocks are read in integer arithmetic ([`int8`]:
//! quantized query and weights, exact integer sums, so any order of addition is the same). A row's
//! result depends only on its own query and the stored keys and values.
//!
//! That makes the parallel split free to choose:
//! - **Prefill**: one task per (sequence, KV head, [`QUERY_TILE`] query tokens): the rows of all
//!   the query heads sharing the KV head and of several tokens read each key and value tile once,
//!   and tiles a row cannot see (past its position) are skipped whole.
//! - **Decode** (flash-decoding): when sequences × KV heads give the threads too little to do, each
//!   segment of a short chunk becomes a task of its own; partial (max, sum, values) per segment are
//!   folded afterwards in segment order — the same fold a single task does as it goes.
//!
//! An int8 cache keeps the block a query sits in at full precision (KIVI's residual window): a row
//! reads its own block from the [`ExactBlock`]s its sequence supplies and every earlier block from
//! the codes, so whether a block was already full when a row ran never changes the row.

use super::{pool, Isa};

mod int8;
mod portable;
#[cfg(target_arch = "x86_64")]
mod x86;

pub(super) use portable::exp;
use portable::{exp_fma, load_tile_len, Portable, LN2_HI, LN2_LO};

/// Keys per online-softmax step: one 16-lane vector of scores.
pub const KEY_TILE: usize = 16;
/// Positions per segment, the unit a long context is split into across threads (rounded to whole
/// blocks; at least one block).
pub const SEGMENT_TOKENS: usize = 512;
/// Query tokens per prefill task.
const QUERY_TILE: usize = 16;

/// One layer of the paged pool, as stored. Per block and KV head, keys are transposed
/// (`[head_dim][block_size]`: a channel's keys for a tile are 16 consecutive numbers) and values
/// are rows (`[block_size][head_dim]`).
#[derive(Clone, Copy)]
pub enum KvStore<'a> {
    F32 {
        k: &'a [f32],
        v: &'a [f32],
    },
    Bf16 {
        k: &'a [u16],
        v: &'a [u16],
    },
    /// Key codes (u8, per-channel f16 minimum and scale code per block and head) and value codes
    /// (i8, a scale code per token), laid out by [`super::kv_quant::key_code_at`] and
    /// [`super::kv_quant::value_code_at`].
    Int8 {
        k: &'a [u8],
        k_min: &'a [u16],
        k_scale: &'a [u8],
        v: &'a [i8],
        v_scale: &'a [u8],
    },
}

pub struct PagedLayer<'a> {
    pub store: KvStore<'a>,
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// One block of one layer at full precision, laid out as the f32 store: K `[kv_heads][head_dim]
/// [block_size]`, V `[kv_heads][block_size][head_dim]`.
#[derive(Clone, Copy)]
pub struct ExactBlock<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
}

/// One sequence's share of the batch: its new query rows start at `row`, the first sits at
/// position `context_len`; `blocks` maps position `p` to block `blocks[p / block_size]`.
pub struct SeqView<'a> {
    pub row: usize,
    pub context_len: usize,
    pub num_tokens: usize,
    pub blocks: &'a [u32],
    /// Int8 caches: the exact keys and values of blocks `context_len / bs ..= (context_len +
    /// num_tokens − 1) / bs` (those holding this chunk's queries), in order. Empty otherwise.
    pub exact: &'a [ExactBlock<'a>],
}

/// `q`: `[N, q_heads, head_dim]` (all sequences' new tokens). Writes `out`: `[N, q_heads·head_dim]`.
/// The keys and values of the new tokens must already be stored (int8: in `exact`).
pub fn paged_attention(
    q: &[f32],
    q_heads: usize,
    seqs: &[SeqView],
    kv: &PagedLayer,
    window: Option<usize>,
    out: &mut [f32],
) {
    // Whole tasks first; if they give the threads too little, split the short chunks by segment.
    let units: usize = seqs.iter().map(|s| kv.kv_heads * s.num_tokens.div_ceil(QUERY_TILE)).sum();
    let split = units < 2 * pool::threads();
    attention_with(q, q_heads, seqs, kv, window, out, split, Isa::detected());
}

/// The widest path [`segment`] has for head size `d` on this CPU: AVX-512 where the head size
/// suits it, with VNNI for the int8 cache's integer sums (one instruction per 64 key or 32 value
/// products; the same sums plain AVX-512 builds from `vpmaddwd`); else AVX2; else scalar.
pub(super) fn widest_path(d: usize) -> Isa {
    let isa = Isa::detected().min(Isa::Avx512Vnni);
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx512 && !x86::handles(d) {
        return Isa::Avx2;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = d;
    isa
}

/// [`paged_attention`] with the split chosen by the caller, on `isa` or the widest path below it
/// (the tests try them all).
#[allow(clippy::too_many_arguments)]
pub(super) fn attention_with(
    q: &[f32],
    q_heads: usize,
    seqs: &[SeqView],
    kv: &PagedLayer,
    window: Option<usize>,
    out: &mut [f32],
    split: bool,
    isa: Isa,
) {
    let (d, hkv, bs) = (kv.head_dim, kv.kv_heads, kv.block_size);
    let path = isa.min(widest_path(d));
    let g = q_heads / hkv;
    let seg_blocks = (SEGMENT_TOKENS / bs).max(1);
    let mut tasks = Vec::new();
    for (s, seq) in seqs.iter().enumerate() {
        let segs = (seq.context_len + seq.num_tokens - 1) / bs / seg_blocks + 1;
        for h in 0..hkv {
            if split && seq.num_tokens <= QUERY_TILE && segs > 1 {
                for seg in 0..segs {
                    tasks.push(Task { s, h, t0: 0, t1: seq.num_tokens, seg: Some(seg) });
                }
            } else {
                for t0 in (0..seq.num_tokens).step_by(QUERY_TILE) {
                    tasks.push(Task { s, h, t0, t1: (t0 + QUERY_TILE).min(seq.num_tokens), seg: None });
                }
            }
        }
    }
    let ctx = Ctx { q, q_heads, seqs, kv, window, seg_blocks, scale: 1.0 / (d as f32).sqrt(), path };
    // One buffer for every task's result, each task writing its own range.
    let mut offsets = Vec::with_capacity(tasks.len() + 1);
    offsets.push(0);
    for t in &tasks {
        let width = if t.seg.is_some() { d + 3 } else { d };
        offsets.push(offsets.last().copied().unwrap_or(0) + (t.t1 - t.t0) * g * width);
    }
    let mut results = vec![0f32; offsets.last().copied().unwrap_or(0)];
    // Threads take tasks in turn from a shared counter, so a thread's next task is most likely
    // the one `threads` further on: its first keys are fetched while this one ends (a wrong
    // guess costs only the hint).
    let threads = pool::threads();
    pool::run_parts(&mut results, &offsets, |i, dst| ctx.run(&tasks[i], dst, tasks.get(i + threads)));
    // Whole tasks hold their rows' outputs; split tasks one segment's partials each, folded here
    // in segment order (the tasks of one (sequence, head) are consecutive, segments ascending).
    let mut i = 0;
    while i < tasks.len() {
        let Task { s, h, t0, t1, seg } = tasks[i];
        let rows = (t1 - t0) * g;
        let mut j = i + 1;
        let folded;
        let res = if seg.is_none() {
            &results[offsets[i]..offsets[i + 1]]
        } else {
            while j < tasks.len() && tasks[j].seg.is_some() && (tasks[j].s, tasks[j].h) == (s, h) {
                j += 1;
            }
            let mut total = Totals::default();
            total.reset(rows, d);
            for part in results[offsets[i]..offsets[j]].chunks_exact(rows * (d + 3)) {
                for r in 0..rows {
                    let p = &part[r * (d + 3)..][..d + 3];
                    if p[0] != 0.0 {
                        total.fold_on(path, r, p[1], p[2], &p[3..]);
                    }
                }
            }
            folded = total.finish(d);
            &folded[..]
        };
        let row0 = seqs[s].row;
        for t in t0..t1 {
            let src = &res[(t - t0) * g * d..][..g * d];
            out[((row0 + t) * q_heads + h * g) * d..][..g * d].copy_from_slice(src);
        }
        i = j;
    }
}

/// Query tokens `t0..t1` of sequence `s` (all query heads of KV head `h`): every segment, folded
/// into finished outputs `[rows][d]`; or segment `seg` alone, as `[rows][1 + 2 + d]` partials
/// (touched flag, max, sum, weighted values).
#[derive(Clone, Copy)]
struct Task {
    s: usize,
    h: usize,
    t0: usize,
    t1: usize,
    seg: Option<usize>,
}

struct Ctx<'a> {
    q: &'a [f32],
    q_heads: usize,
    seqs: &'a [SeqView<'a>],
    kv: &'a PagedLayer<'a>,
    window: Option<usize>,
    seg_blocks: usize,
    scale: f32,
    path: Isa,
}

/// A query row of a task: its query (already multiplied by 1/√d) at `q[r·d..]`, the keys it sees
/// (`lo..=pos`) and the block its position is in.
#[derive(Clone, Copy)]
pub(super) struct Row {
    pub pos: usize,
    pub lo: usize,
    pub own: usize,
}

/// The rows of one task and what they read.
pub(super) struct Rows<'a> {
    pub q: Vec<f32>,
    pub rows: Vec<Row>,
    pub d: usize,
    pub h: usize,
    pub seq: &'a SeqView<'a>,
    pub kv: &'a PagedLayer<'a>,
    /// The last block this task reads (of its segment, for a split task).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub last: usize,
    /// The keys this thread's next task starts with, asked for during block `last`.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub then: Region,
}

/// Bytes a kernel asks the cache for ahead of use (a hint: nothing is read through it).
#[derive(Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) struct Region {
    pub start: *const u8,
    pub bytes: usize,
}

impl Region {
    pub const NONE: Region = Region { start: std::ptr::null(), bytes: 0 };
}

impl PagedLayer<'_> {
    /// The stored keys of (physical block · KV heads + head) `head`, whole; the stored values of
    /// its tokens `a..e`. Only f32 and bf16 stores (int8 blocks are prefetched whole, none here).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) fn regions(&self, head: usize, (a, e): (usize, usize)) -> (Region, Region) {
        let n = self.head_dim * self.block_size;
        let of = |p: *const u8, size: usize, at: usize, len: usize| Region {
            start: p.wrapping_add(at * size),
            bytes: len * size,
        };
        let (k, v, size): (*const u8, *const u8, usize) = match self.store {
            KvStore::F32 { k, v } => (k.as_ptr().cast(), v.as_ptr().cast(), 4),
            KvStore::Bf16 { k, v } => (k.as_ptr().cast(), v.as_ptr().cast(), 2),
            KvStore::Int8 { .. } => return (Region::NONE, Region::NONE),
        };
        let values = of(v, size, head * n + a * self.head_dim, (e - a) * self.head_dim);
        (of(k, size, head * n, n), values)
    }
}

/// Where a (row, block) pair reads from.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Source {
    /// The stored block (whatever the cache's dtype).
    Store,
    /// The row's own block of an int8 cache, at full precision.
    Exact,
}

impl Rows<'_> {
    /// The keys row `r` sees in the tile of positions `t0..t0 + len`, as a position range
    /// (empty when `a >= e`).
    pub fn live(&self, r: usize, t0: usize, len: usize) -> (usize, usize) {
        let row = self.rows[r];
        (row.lo.max(t0), (row.pos + 1).min(t0 + len))
    }

    /// Which source row `r` reads block `b` from (`None`: nothing there for it).
    pub fn source(&self, r: usize, b: usize) -> Option<Source> {
        let bs = self.kv.block_size;
        let row = self.rows[r];
        if b > row.own || (b + 1) * bs <= row.lo {
            None
        } else if b == row.own && !self.seq.exact.is_empty() {
            Some(Source::Exact)
        } else {
            Some(Source::Store)
        }
    }

    /// The exact block `b` of this task's KV head: (K `[d][bs]`, V `[bs][d]`).
    pub fn exact(&self, b: usize) -> (&[f32], &[f32]) {
        let (bs, d) = (self.kv.block_size, self.d);
        let e = &self.seq.exact[b - self.seq.context_len / bs];
        (&e.k[self.h * d * bs..][..d * bs], &e.v[self.h * bs * d..][..bs * d])
    }

    /// Offset of (physical block of `b`, this head) in the store's per-head arrays, in heads.
    pub fn store_head(&self, b: usize) -> usize {
        self.seq.blocks[b] as usize * self.kv.kv_heads + self.h
    }
}

/// Per-row state of one segment's online softmax.
#[derive(Default)]
pub(super) struct SegState {
    pub touched: Vec<bool>,
    pub m: Vec<f32>,
    pub l: Vec<f32>,
    pub o: Vec<f32>,
}

impl SegState {
    /// Empty state for `rows` rows (reusing the buffers).
    fn reset(&mut self, rows: usize, d: usize) {
        for (v, x) in [(&mut self.m, f32::NEG_INFINITY), (&mut self.l, 0.0)] {
            v.clear();
            v.resize(rows, x);
        }
        self.touched.clear();
        self.touched.resize(rows, false);
        self.o.clear();
        self.o.resize(rows * d, 0.0);
    }
}

/// Per-row running fold of the segments.
#[derive(Default)]
struct Totals {
    has: Vec<bool>,
    m: Vec<f32>,
    l: Vec<f32>,
    o: Vec<f32>,
    d: usize,
}

impl Totals {
    /// Nothing folded yet, for `rows` rows (reusing the buffers).
    fn reset(&mut self, rows: usize, d: usize) {
        self.has.clear();
        self.has.resize(rows, false);
        for v in [&mut self.m, &mut self.l] {
            v.clear();
            v.resize(rows, 0.0);
        }
        self.o.clear();
        self.o.resize(rows * d, 0.0);
        self.d = d;
    }

    /// [`fold`](Self::fold) compiled with FMA where the path has it (a call per element otherwise).
    fn fold_on(&mut self, path: Isa, r: usize, m: f32, l: f32, o: &[f32]) {
        match path {
            // SAFETY: the AVX2 and AVX-512 paths are only chosen where AVX2 and FMA exist.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 | Isa::Avx512Vnni | Isa::Avx512Bf16 | Isa::AmxBf16 | Isa::Amx => unsafe {
                self.fold_fma(r, m, l, o)
            },
            _ => self.fold(r, m, l, o),
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn fold_fma(&mut self, r: usize, m: f32, l: f32, o: &[f32]) {
        self.fold(r, m, l, o)
    }

    /// The log-sum-exp merge of one segment's partial into row `r`: both sides rescaled to the
    /// larger maximum. The first segment is taken as is.
    #[inline(always)]
    fn fold(&mut self, r: usize, m: f32, l: f32, o: &[f32]) {
        let acc = &mut self.o[r * self.d..][..self.d];
        if !self.has[r] {
            self.has[r] = true;
            (self.m[r], self.l[r]) = (m, l);
            acc.copy_from_slice(o);
            return;
        }
        let mx = self.m[r].max(m);
        let (a, b) = (exp_fma(self.m[r] - mx), exp_fma(m - mx));
        self.l[r] = l.mul_add(b, self.l[r] * a);
        for (x, &y) in acc.iter_mut().zip(o) {
            *x = y.mul_add(b, *x * a);
        }
        self.m[r] = mx;
    }

    /// Normalised outputs `[rows][d]` (rows that saw no key, which a causal row cannot be, give 0).
    fn finish(mut self, d: usize) -> Vec<f32> {
        self.normalise(d);
        self.o
    }

    fn normalise(&mut self, d: usize) {
        for (r, acc) in self.o.chunks_exact_mut(d).enumerate() {
            if self.has[r] {
                let inv = 1.0 / self.l[r];
                acc.iter_mut().for_each(|x| *x *= inv);
            }
        }
    }
}

/// What a task works in, kept per thread between tasks (decode runs thousands a token).
#[derive(Default)]
struct TaskScratch {
    q: Vec<f32>,
    rows: Vec<Row>,
    state: SegState,
    totals: Totals,
}

thread_local! {
    static TASK_SCRATCH: std::cell::RefCell<TaskScratch> = std::cell::RefCell::new(TaskScratch::default());
}

impl Ctx<'_> {
    /// Run `task`, writing its result (outputs or partials, see [`Task`]) to `dst`.
    fn run(&self, task: &Task, dst: &mut [f32], next: Option<&Task>) {
        let then = next.map_or(Region::NONE, |t| self.first_keys(t));
        TASK_SCRATCH.with(|scratch| match scratch.try_borrow_mut() {
            Ok(mut s) => self.run_in(task, dst, &mut s, then),
            // A task that runs another kernel which runs tasks on this thread: fresh buffers.
            Err(_) => self.run_in(task, dst, &mut TaskScratch::default(), then),
        })
    }

    /// The first key a query at position `pos` sees: 0, or the sliding window's start.
    fn first_visible(&self, pos: usize) -> usize {
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }

    /// The stored keys of the first block `task` reads (f32 and bf16 stores; none for int8,
    /// whose x86 path asks for each next block whole instead).
    fn first_keys(&self, task: &Task) -> Region {
        let seq = &self.seqs[task.s];
        let bs = self.kv.block_size;
        let pos = seq.context_len + task.t0;
        let lo = self.first_visible(pos) / bs;
        let b = task.seg.map_or(lo, |sg| lo.max(sg * self.seg_blocks));
        let Some(&block) = seq.blocks.get(b) else { return Region::NONE };
        self.kv.regions(block as usize * self.kv.kv_heads + task.h, (0, 0)).0
    }

    fn run_in(&self, task: &Task, dst: &mut [f32], scratch: &mut TaskScratch, then: Region) {
        let seq = &self.seqs[task.s];
        let (d, bs) = (self.kv.head_dim, self.kv.block_size);
        let g = self.q_heads / self.kv.kv_heads;
        let n = (task.t1 - task.t0) * g;
        let TaskScratch { q, rows, state, totals } = scratch;
        q.clear();
        rows.clear();
        for t in task.t0..task.t1 {
            let pos = seq.context_len + t;
            let lo = self.first_visible(pos);
            for j in 0..g {
                let src = &self.q[((seq.row + t) * self.q_heads + task.h * g + j) * d..][..d];
                q.extend(src.iter().map(|&y| y * self.scale));
                rows.push(Row { pos, lo, own: pos / bs });
            }
        }
        let lo_block = rows.iter().map(|r| r.lo / bs).min().unwrap_or(0);
        let hi_block = rows.iter().map(|r| r.own).max().unwrap_or(0);
        let last = match task.seg {
            Some(s) => ((s + 1) * self.seg_blocks).min(hi_block + 1) - 1,
            None => hi_block,
        };
        let view =
            Rows { q: std::mem::take(q), rows: std::mem::take(rows), d, h: task.h, seq, kv: self.kv, last, then };
        let segments = match task.seg {
            Some(s) => s..s + 1,
            None => lo_block / self.seg_blocks..hi_block / self.seg_blocks + 1,
        };
        totals.reset(n, d);
        for seg in segments {
            state.reset(n, d);
            let b0 = (seg * self.seg_blocks).max(lo_block);
            let b1 = ((seg + 1) * self.seg_blocks).min(hi_block + 1);
            segment(&view, b0, b1, state, self.path);
            if task.seg.is_some() {
                for (r, p) in dst.chunks_exact_mut(d + 3).enumerate() {
                    p[0] = if state.touched[r] { 1.0 } else { 0.0 };
                    (p[1], p[2]) = (state.m[r], state.l[r]);
                    p[3..].copy_from_slice(&state.o[r * d..][..d]);
                }
            } else {
                for r in 0..n {
                    if state.touched[r] {
                        totals.fold_on(self.path, r, state.m[r], state.l[r], &state.o[r * d..][..d]);
                    }
                }
            }
        }
        if task.seg.is_none() {
            totals.normalise(d);
            dst.copy_from_slice(&totals.o);
        }
        // Hand the buffers back for the next task.
        (*q, *rows) = (view.q, view.rows);
    }
}

/// One segment (blocks `b0..b1`) for every row of `rows`, on `path`.
fn segment(rows: &Rows, b0: usize, b1: usize, st: &mut SegState, path: Isa) {
    match path {
        // SAFETY: `attention_with` capped the path at `widest_path`: AVX-512F/BW are there and
        // the head size is one it handles.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::segment(rows, b0, b1, st, false) },
        // SAFETY: as above, and AVX-512 VNNI is there.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni | Isa::Avx512Bf16 | Isa::AmxBf16 | Isa::Amx => unsafe { x86::segment(rows, b0, b1, st, true) },
        // SAFETY: as above, AVX2 and FMA are there.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { Portable::segment_avx2(rows, b0, b1, st) },
        _ => Portable::segment(rows, b0, b1, st),
    }
}

#[cfg(test)]
mod tests;
