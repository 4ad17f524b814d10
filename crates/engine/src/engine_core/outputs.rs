//! From a drawn token to its client's event: the detokenizer's text, stop ids and stop strings
//! (held back until `min_tokens`), the length limits, the flush at a finish, and the
//! [`SampleOutput`] with its usage, queue time and prompt logprobs.

use super::EngineCore;
use crate::kv_manager::SeqId;
use crate::pooling::Pooler;
use crate::request::{EngineEvent, FinishReason, Finished, SampleOutput, StopMatch};
use crate::runner::ModelRunner;
use crate::sampler::TokenLogprobs;

impl<R: ModelRunner> EngineCore<R> {
    /// Record the drawn token `tok` of `seq`: detokenize, match stops, emit, finish
    /// (`grammar_done`: the token completed the sample's grammar, so nothing may follow).
    pub(super) fn sample_next(&mut self, seq: SeqId, tok: u32, logprobs: Vec<TokenLogprobs>, grammar_done: bool) {
        let Some(s) = self.samples.get_mut(&seq) else { return };
        s.generated += 1;
        self.counters.generation_tokens += 1;
        self.scheduler.append_token(seq, tok);
        let total_len = self.scheduler.tokens(seq).len();
        let mut text = String::new();
        let mut finished = None;
        if s.stop_ids.contains(&tok) {
            finished = Some(Finished { reason: FinishReason::Stop, stop: Some(StopMatch::Token(tok)) });
        } else {
            let piece = match s.decoder.push(&self.tokenizer, tok) {
                Ok(p) => p,
                Err(e) => {
                    let group = s.group;
                    self.fail_group(group, &e.to_string());
                    return;
                }
            };
            if s.generated < s.params.min_tokens {
                // As vLLM: stop strings only count once min_tokens are out; earlier text passes.
                text = s.stops.pass_through(&piece);
            } else {
                let out = s.stops.push(&piece);
                text = out.released;
                if let Some(m) = out.matched {
                    finished = Some(Finished { reason: FinishReason::Stop, stop: Some(StopMatch::Text(m)) });
                }
            }
        }
        if finished.is_none() && grammar_done {
            finished = Some(Finished { reason: FinishReason::Stop, stop: None });
        }
        let at_limit = s.generated >= s.params.max_tokens || total_len >= self.scheduler.config().max_model_len;
        if finished.is_none() && at_limit {
            finished = Some(Finished { reason: FinishReason::Length, stop: None });
        }
        let output_ids = vec![tok];
        match finished {
            Some(mut f) => {
                if !matches!(f.stop, Some(StopMatch::Text(_))) {
                    let (tail, matched) = self.flush(seq);
                    text.push_str(&tail);
                    if let Some(m) = matched {
                        // The flushed tail completed a stop string: that is why it ended.
                        f = Finished { reason: FinishReason::Stop, stop: Some(StopMatch::Text(m)) };
                    }
                }
                self.emit(seq, text, output_ids, logprobs, Some(f));
                self.remove_sample(seq);
            }
            None => self.emit(seq, text, output_ids, logprobs, None),
        }
    }

    /// Text still held by the detokenizer and the stop matcher, at a finish without a stop string,
    /// and the stop string that text completes, if any.
    fn flush(&mut self, seq: SeqId) -> (String, Option<String>) {
        let Some(s) = self.samples.get_mut(&seq) else { return (String::new(), None) };
        let rest = s.decoder.flush(&self.tokenizer).unwrap_or_default();
        let out = s.stops.push(&rest);
        let mut text = out.released;
        if out.matched.is_none() {
            text.push_str(&s.stops.flush());
        }
        (text, out.matched)
    }

    pub(super) fn emit(
        &mut self,
        seq: SeqId,
        text: String,
        token_ids: Vec<u32>,
        logprobs: Vec<TokenLogprobs>,
        finished: Option<Finished>,
    ) {
        let Some(s) = self.samples.get_mut(&seq) else { return };
        let cached_tokens = self.scheduler.cached_prompt_tokens(seq);
        let Some(g) = self.groups.get_mut(&s.group) else { return };
        let queue_secs = match (s.queue_reported, s.scheduled) {
            (false, Some(t)) => {
                s.queue_reported = true;
                Some(t.duration_since(g.added).as_secs_f64())
            }
            _ => None,
        };
        let prompt_logprobs = if s.index == 0 && !g.prompt_logprobs_sent && g.prompt_logprobs.is_some() {
            g.prompt_logprobs_sent = true;
            g.prompt_logprobs.as_ref().map(|(_, v)| v.clone())
        } else {
            None
        };
        let embedding = if finished.is_some() { s.pooler.as_ref().and_then(Pooler::finish) } else { None };
        let out = SampleOutput {
            index: s.index,
            text,
            token_ids,
            logprobs,
            finished,
            completion_tokens: s.generated,
            prompt_tokens: g.prompt_len,
            cached_tokens,
            prompt_logprobs,
            queue_secs,
            embedding,
        };
        if !(g.sink)(EngineEvent::Output(out)) {
            // The client is gone: stop its request and free its blocks now.
            let group = s.group;
            self.drop_group(group);
        }
    }
}
