//! A model runner without a model: it keeps the tokens themselves in a simulated paged pool and
//! derives each logit row from the tokens it reads back through the block table. A scheduling or
//! block-table bug (a wrong block, a prefix shared that should not be, a stale block reused)
//! changes what it reads and so the tokens it "generates".

#![allow(dead_code)]

use std::sync::Arc;

use flint_engine::engine_core::ModelInfo;
use flint_engine::scheduler::{SchedulerConfig, StepPlan};
use flint_engine::tokenizer::Tokenizer;
use flint_engine::{DraftRequest, EngineCore, EngineError, ModelRunner, StepLogits};

pub const VOCAB: usize = 151_936;
pub const EOS: u32 = 151_645;
/// Ordinary word tokens the fake chooses among (all decode to plain text).
pub const WORDS: std::ops::Range<u32> = 1000..1064;

pub struct FakeRunner {
    block_size: usize,
    slots: Vec<u32>,
    /// Any chunk containing this token fails the step (error injection).
    pub fail_on: Option<u32>,
    /// Any chunk containing this token panics inside the runner.
    pub panic_on: Option<u32>,
    /// 1 in `eos_every` contexts make EOS the most likely token (0: never).
    pub eos_every: u64,
    /// Derive each row from the last `window` tokens only (`None`: the whole context), so greedy
    /// output falls into cycles that n-gram lookup can predict.
    pub window: Option<usize>,
    /// A draft model: proposes the fake's own greedy continuation, except that one proposal in
    /// `n` (by position) is replaced by another word, so drafts are partly rejected.
    pub draft_wrong_every: Option<u64>,
    /// Each step sleeps this long per token it computes (a worker of known speed).
    pub delay_per_token: Option<std::time::Duration>,
}

impl FakeRunner {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self {
            block_size,
            slots: vec![u32::MAX; num_blocks * block_size],
            fail_on: None,
            panic_on: None,
            eos_every: 0,
            window: None,
            draft_wrong_every: None,
            delay_per_token: None,
        }
    }

    fn read(&self, blocks: &[u32], pos: usize) -> u32 {
        self.slots[blocks[pos / self.block_size] as usize * self.block_size + pos % self.block_size]
    }

    fn row(&self, blocks: &[u32], last: usize, out: &mut Vec<f32>) {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for p in self.window.map_or(0, |w| (last + 1).saturating_sub(w))..=last {
            h = (h ^ self.read(blocks, p) as u64).wrapping_mul(0x100_0000_01b3);
        }
        let start = out.len();
        out.resize(start + VOCAB, -30.0);
        let row = &mut out[start..];
        for (i, w) in WORDS.enumerate() {
            let x = (h.rotate_left(i as u32 * 7) ^ (i as u64).wrapping_mul(0x9E37_79B9)) % 1000;
            row[w as usize] = x as f32 / 100.0;
        }
        if self.eos_every > 0 && h.is_multiple_of(self.eos_every) {
            row[EOS as usize] = 20.0;
        }
    }
}

impl FakeRunner {
    fn write(&mut self, blocks: &[u32], pos: usize, t: u32) {
        self.slots[blocks[pos / self.block_size] as usize * self.block_size + pos % self.block_size] = t;
    }
}

impl ModelRunner for FakeRunner {
    fn propose(&mut self, reqs: &[DraftRequest]) -> Result<Vec<Vec<u32>>, EngineError> {
        let Some(every) = self.draft_wrong_every else { return Ok(vec![Vec::new(); reqs.len()]) };
        let mut out = Vec::new();
        for r in reqs {
            // As a draft model does: write each token into the cache, read its row, take the best.
            let (mut tok, mut draft, mut row) = (r.token, Vec::new(), Vec::new());
            for i in 0..r.k {
                let pos = r.position + i;
                self.write(&r.blocks, pos, tok);
                row.clear();
                self.row(&r.blocks, pos, &mut row);
                tok = flint_engine::sampler::argmax(&row);
                if (pos as u64 * 7 + r.seq).is_multiple_of(every) {
                    tok = WORDS.start + (tok + 1 - WORDS.start) % (WORDS.end - WORDS.start);
                }
                draft.push(tok);
            }
            out.push(draft);
        }
        Ok(out)
    }

    fn execute(&mut self, plan: &StepPlan) -> Result<StepLogits, EngineError> {
        if let Some(d) = self.delay_per_token {
            std::thread::sleep(d * plan.chunks.iter().map(|c| c.tokens.len() as u32).sum::<u32>());
        }
        let mut data = Vec::new();
        for c in &plan.chunks {
            if self.fail_on.is_some_and(|t| c.tokens.contains(&t)) {
                return Err(EngineError::Internal("injected failure".into()));
            }
            if self.panic_on.is_some_and(|t| c.tokens.contains(&t)) {
                panic!("injected panic");
            }
            for (i, &t) in c.tokens.iter().enumerate() {
                let pos = c.context_len + i;
                let slot = c.blocks[pos / self.block_size] as usize * self.block_size + pos % self.block_size;
                self.slots[slot] = t;
            }
            for r in c.logits().rows(c.tokens.len()) {
                self.row(&c.blocks, c.context_len + r, &mut data);
            }
        }
        Ok(StepLogits { width: VOCAB, data, ..Default::default() })
    }
}

pub fn tokenizer() -> Arc<Tokenizer> {
    Arc::new(Tokenizer::builtin_qwen().unwrap())
}

pub fn config(num_blocks: usize, budget: usize, max_seqs: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_num_batched_tokens: budget,
        max_num_seqs: max_seqs,
        max_model_len: 4096,
        block_size: 4,
        num_blocks,
        enable_prefix_caching: true,
        quantize_full_blocks: false,
    }
}

pub fn core(cfg: SchedulerConfig) -> EngineCore<FakeRunner> {
    let runner = FakeRunner::new(cfg.num_blocks, cfg.block_size);
    let info = ModelInfo { vocab_size: VOCAB, valid_vocab: 151_665, eos_token_ids: vec![EOS] };
    let mut c = EngineCore::new(runner, cfg, tokenizer(), info);
    c.check_invariants = true;
    c
}
