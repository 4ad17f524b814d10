//! From a step's logit rows to each sample's tokens: which rows belong to which sample (the
//! chunk's [`logits`](crate::scheduler::ScheduledChunk::logits) rule), prompt logprobs, the
//! draws themselves spread over the kernel threads (with a draft, its verification and the
//! grammar mask before each token), and what the draws mean for the samples and the scheduler.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use super::{EngineCore, Sample};
use crate::kv_manager::SeqId;
use crate::pooling::Pooler;
use crate::request::{FinishReason, Finished};
use crate::runner::{ModelRunner, StepLogits};
use crate::sampler::{token_logprobs, TokenLogprobs};
use crate::scheduler::StepPlan;
use crate::structured::MaskHistogram;

/// What one sample's rows of a step produced: its new tokens (with logprobs) and how many draft
/// tokens were proposed and accepted.
struct Drawn {
    tokens: Vec<(u32, Vec<TokenLogprobs>)>,
    proposed: usize,
    accepted: usize,
    /// The grammar is complete after the last token: the sample ends there.
    grammar_done: bool,
    /// The grammar failed (nothing it allows, or a token it refuses): the request ends.
    grammar_error: Option<String>,
    masks: MaskHistogram,
}

impl<R: ModelRunner> EngineCore<R> {
    pub(super) fn process(&mut self, plan: &StepPlan, logits: &StepLogits) {
        self.pool_hidden(plan, logits);
        let mut row = 0;
        let mut picks = Vec::new();
        for chunk in &plan.chunks {
            let first_row = row;
            row += chunk.num_logit_rows();
            if self.samples.get(&chunk.seq).is_some_and(|s| s.params.max_tokens == 0) {
                // Prompt scoring (max_tokens 0): the prompt is in, nothing is drawn.
                continue;
            }
            if let Some(first) = chunk.first_sampled_row() {
                picks.push((chunk.seq, first_row + first, chunk.tokens[chunk.tokens.len() - chunk.draft..].to_vec()));
            }
        }
        let mut drawn = self.draw(&picks, logits);
        let mut row = 0;
        for chunk in &plan.chunks {
            let rows = chunk.num_logit_rows();
            let first_row = row;
            row += rows;
            if chunk.prompt_logprobs {
                self.collect_prompt_logprobs(chunk.seq, chunk.context_len, first_row, rows, logits);
            }
            if chunk.sample && chunk.pooling.is_some() {
                self.end_embedding(chunk.seq);
            } else if chunk.sample {
                if let Some(d) = drawn.remove(&chunk.seq) {
                    self.take_drawn(chunk.seq, d);
                } else if self.samples.get(&chunk.seq).is_some_and(|s| s.params.max_tokens == 0) {
                    self.end_sample(chunk.seq, Finished { reason: FinishReason::Length, stop: None }, String::new());
                }
            }
        }
    }

    /// Fold each embedding chunk's hidden rows into its sample's pooler.
    fn pool_hidden(&mut self, plan: &StepPlan, logits: &StepLogits) {
        let w = logits.hidden_width;
        let mut row = 0;
        for chunk in &plan.chunks {
            let sel = chunk.hidden().rows(chunk.tokens.len());
            let n = sel.len();
            if n == 0 {
                continue;
            }
            let rows = logits.hidden.get(row * w..(row + n) * w);
            row += n;
            if let (Some(rows), Some(p)) = (rows, self.samples.get_mut(&chunk.seq).and_then(|s| s.pooler.as_mut())) {
                p.push(rows, w, chunk.context_len + sel.start);
            }
        }
    }

    /// An embedding's prompt is in: its vector goes out with the final event.
    fn end_embedding(&mut self, seq: SeqId) {
        let Some(s) = self.samples.get(&seq) else { return };
        if s.pooler.as_ref().is_none_or(Pooler::is_empty) {
            let group = s.group;
            self.fail_group(group, "internal error: the model returned no hidden states to pool");
            return;
        }
        self.end_sample(seq, Finished { reason: FinishReason::Stop, stop: None }, String::new());
    }

    /// Emit a sample's new tokens in order, stopping where it finishes; after a verification,
    /// keep the accepted draft tokens in the cache and roll back the rest.
    fn take_drawn(&mut self, seq: SeqId, d: Drawn) {
        self.mask_times.merge(&d.masks);
        if let Some(e) = d.grammar_error {
            if let Some(g) = self.samples.get(&seq).map(|s| s.group) {
                self.reject_group(g, &e);
            }
            return;
        }
        if d.proposed > 0 {
            self.spec_counters.record(d.proposed, d.accepted);
            if let Some(dr) = self.samples.get_mut(&seq).and_then(|s| s.drafter.as_mut()) {
                dr.observe(d.proposed, d.accepted);
            }
        }
        let emitted = d.tokens.len();
        for (i, (tok, lp)) in d.tokens.into_iter().enumerate() {
            self.sample_next(seq, tok, lp, d.grammar_done && i + 1 == emitted);
            if !self.samples.contains_key(&seq) {
                return;
            }
        }
        if d.proposed > 0 {
            // Still running: the last token is the target's own, the ones before it accepted drafts.
            if let Err(e) = self.scheduler.accept_draft(seq, emitted - 1) {
                if let Some(g) = self.samples.get(&seq).map(|s| s.group) {
                    self.fail_group(g, &format!("internal error: {e}"));
                }
            }
        }
    }

    /// Draw the next token (and its logprobs, if asked) of every `(seq, logits row, draft)` at
    /// once, spread over the kernel threads: each sample's sampler is its own state (its own
    /// seeded generator), so the draws do not depend on which thread makes them or in what
    /// order. With a draft, rows `row..=row + draft.len()` verify it token by token.
    fn draw(&mut self, picks: &[(SeqId, usize, Vec<u32>)], logits: &StepLogits) -> HashMap<SeqId, Drawn> {
        type Slot<'a> = Mutex<(SeqId, &'a mut Sample, usize, &'a [u32], Option<Drawn>)>;
        let rows: HashMap<SeqId, (usize, &[u32])> = picks.iter().map(|(q, r, d)| (*q, (*r, &d[..]))).collect();
        let valid_vocab = self.info.valid_vocab;
        let work: Vec<Slot> = self
            .samples
            .iter_mut()
            .filter_map(|(&seq, s)| rows.get(&seq).map(|&(r, d)| Mutex::new((seq, s, r, d, None))))
            .collect();
        flint_model::kernels::pool::run(work.len(), |i| {
            let mut slot = work[i].lock().unwrap_or_else(|e| e.into_inner());
            let (_, s, r, draft, out) = &mut *slot;
            *out = Some(draw_rows(s, logits, *r, draft, valid_vocab));
        });
        work.into_iter()
            .filter_map(|m| {
                let (seq, _, _, _, out) = m.into_inner().unwrap_or_else(|e| e.into_inner());
                out.map(|o| (seq, o))
            })
            .collect()
    }

    fn collect_prompt_logprobs(&mut self, seq: SeqId, ctx: usize, first_row: usize, rows: usize, logits: &StepLogits) {
        let Some(s) = self.samples.get(&seq) else { return };
        let prompt = self.scheduler.tokens(seq);
        let Some(g) = self.groups.get_mut(&s.group) else { return };
        let Some((k, slots)) = g.prompt_logprobs.as_mut() else { return };
        for r in 0..rows {
            // Row r (position ctx + r) predicts the prompt token at ctx + r + 1.
            let pos = ctx + r + 1;
            if pos < g.prompt_len && slots[pos].is_none() {
                slots[pos] = Some(token_logprobs(logits.row(first_row + r), self.info.valid_vocab, prompt[pos], *k));
            }
        }
    }
}

/// One sample's tokens from its rows: a plain draw from `first`, or with a draft, the pending
/// token's row and then one row per draft token, each verifying the next proposal, until one is
/// rejected (the target's token replaces it) or all pass (the last row adds the target's next
/// token). Penalties and `min_tokens` see each token before the next row is read, as they would
/// one step at a time.
fn draw_rows(s: &mut Sample, logits: &StepLogits, first: usize, draft: &[u32], valid_vocab: usize) -> Drawn {
    let mut d = Drawn {
        tokens: Vec::with_capacity(draft.len() + 1),
        proposed: draft.len(),
        accepted: 0,
        grammar_done: false,
        grammar_error: None,
        masks: MaskHistogram::default(),
    };
    for i in 0..=draft.len() {
        let row = logits.row(first + i);
        let generated = s.generated + i;
        let mut banned: &[u32] = if generated < s.params.min_tokens { &s.stop_ids } else { &[] };
        // The grammar's time for this token: its mask and then taking the token.
        let mut grammar_secs = None;
        if let Some(g) = s.grammar.as_mut().filter(|g| g.is_active()) {
            let t = Instant::now();
            // The mask is written straight into the sampler's buffer.
            let stop_ids = &s.stop_ids;
            let r = s.sampler.set_allowed_with(|words| g.mask(stop_ids, words));
            grammar_secs = Some(t.elapsed().as_secs_f64());
            if let Err(e) = r {
                d.grammar_error = Some(e);
                return d;
            }
            // min_tokens holds the stop ids back unless the grammar allows nothing else.
            if !banned.is_empty() && !allows_other_than(s.sampler.allowed().unwrap_or_default(), banned) {
                banned = &[];
            }
        } else {
            s.sampler.set_allowed(None);
        }
        let (tok, ok) = match draft.get(i) {
            Some(&d) => s.sampler.verify(row, banned, d),
            None => (s.sampler.sample(row, banned), false),
        };
        s.sampler.record(tok);
        let lp = s.params.logprobs.map(|k| token_logprobs(row, valid_vocab, tok, k)).into_iter().collect();
        d.tokens.push((tok, lp));
        d.accepted += usize::from(ok);
        if let Some(g) = s.grammar.as_mut() {
            let t = Instant::now();
            let r = g.advance(tok, &s.stop_ids);
            if let Some(secs) = grammar_secs {
                d.masks.observe(secs + t.elapsed().as_secs_f64());
            }
            if let Err(e) = r {
                d.grammar_error = Some(e);
                return d;
            }
            d.grammar_done = g.is_finished();
        }
        // A rejection ends the draft; so does a stop id or a complete grammar, which end the sample.
        if !ok || s.stop_ids.contains(&tok) || d.grammar_done {
            break;
        }
    }
    d
}

/// Whether bitset `mask` allows some id not in `ids`.
fn allows_other_than(mask: &[u32], ids: &[u32]) -> bool {
    mask.iter().enumerate().any(|(i, &w)| {
        let listed = ids.iter().filter(|&&id| id as usize / 32 == i).fold(0u32, |m, &id| m | 1 << (id % 32));
        w & !listed != 0
    })
}
