//! Requests into and out of the core: a request becomes a group of `n` samples, each with its
//! scheduler sequence, sampler, detokenizer and stop matcher; it leaves by finishing, by abort,
//! or by failure (one error event to its sink), and every way out frees its blocks.

use std::sync::Arc;
use std::time::Instant;

use super::{EngineCore, EventSink, Group, Handle, Sample};
use crate::detokenizer::IncrementalDecoder;
use crate::kv_manager::SeqId;
use crate::request::{EngineEvent, FinishReason, Finished, Request};
use crate::runner::ModelRunner;
use crate::sampler::Sampler;
use crate::scheduler::SeqSpec;
use crate::speculative::Drafter;
use crate::stop::StopStrings;
use crate::structured::GrammarState;
use crate::EngineError;

impl<R: ModelRunner> EngineCore<R> {
    /// Queue `req`; its events go to `sink`. Invalid requests are refused here, nothing queued.
    pub fn add(&mut self, req: Request, sink: EventSink) -> Result<Handle, EngineError> {
        let handle = self.next_handle;
        self.next_handle += 1;
        self.add_with_handle(handle, req, sink)?;
        Ok(handle)
    }

    /// [`add`](Self::add) under a handle the caller chose (unique, below `1 << 63`).
    pub fn add_with_handle(&mut self, handle: Handle, req: Request, sink: EventSink) -> Result<(), EngineError> {
        crate::validation::validate(&req, &self.info, self.scheduler.config())?;
        self.add_validated(handle, req, sink)
    }

    /// [`add_with_handle`](Self::add_with_handle) for a request the caller validated against this
    /// engine already ([`Engine::submit`](crate::Engine::submit) does, on the caller's thread).
    pub(crate) fn add_validated(&mut self, handle: Handle, req: Request, sink: EventSink) -> Result<(), EngineError> {
        if self.groups.contains_key(&handle) {
            return Err(EngineError::Internal(format!("request handle {handle} is already in use")));
        }
        let params = Arc::new(req.params);
        let mut leader = None;
        for index in 0..params.n {
            let seq = self.next_seq;
            self.next_seq += 1;
            let mut sampling = params.sampling.clone();
            // Each sample draws its own stream; a seed still makes the whole request reproducible.
            sampling.seed = sampling.seed.map(|s| s.wrapping_add(index as u64));
            let mut sampler = Sampler::new(sampling, self.info.valid_vocab);
            sampler.set_prompt(&req.prompt);
            let mut stop_ids: Vec<u32> = if params.ignore_eos { Vec::new() } else { self.info.eos_token_ids.clone() };
            stop_ids.extend(params.stop_token_ids.iter().copied());
            let grammar = match &params.structured {
                Some(so) => Some(GrammarState::new(&so.grammar, so.after.as_deref()).map_err(EngineError::Internal)?),
                None => None,
            };
            let spec = SeqSpec {
                id: seq,
                prompt: req.prompt.clone(),
                max_tokens: params.max_tokens,
                cache_salt: params.cache_salt.clone(),
                prompt_logprobs: index == 0 && params.prompt_logprobs.is_some(),
                pooling: params.pooling.map(|p| p.config.pooling_type),
                after: leader,
            };
            self.scheduler.add(spec)?;
            leader.get_or_insert(seq);
            self.samples.insert(
                seq,
                Sample {
                    group: handle,
                    index,
                    params: params.clone(),
                    sampler,
                    decoder: IncrementalDecoder::new(params.skip_special_tokens),
                    stops: StopStrings::new(params.stop.clone(), params.include_stop_str_in_output),
                    stop_ids,
                    generated: 0,
                    scheduled: None,
                    queue_reported: false,
                    drafter: self.speculative.as_ref().map(Drafter::new),
                    grammar,
                    pooler: params.pooling.map(crate::pooling::Pooler::new),
                },
            );
        }
        self.counters.prompt_tokens += req.prompt.len() as u64;
        let prompt_logprobs = params.prompt_logprobs.map(|k| (k, vec![None; req.prompt.len()]));
        self.groups.insert(
            handle,
            Group {
                request_id: req.id,
                added: Instant::now(),
                sink,
                prompt_len: req.prompt.len(),
                live: params.n,
                prompt_logprobs,
                prompt_logprobs_sent: false,
            },
        );
        Ok(())
    }

    /// Stop every request with client id `id` now and free its blocks; each stream gets a final
    /// `abort` event.
    pub fn abort(&mut self, id: &str) {
        let handles: Vec<Handle> = self.groups.iter().filter(|(_, g)| g.request_id == id).map(|(&h, _)| h).collect();
        for h in handles {
            self.abort_handle(h);
        }
    }

    /// Stop the request submitted under `handle` (a no-op once it is over).
    pub fn abort_handle(&mut self, handle: Handle) {
        for seq in self.group_seqs(handle) {
            self.end_sample(seq, Finished { reason: FinishReason::Abort, stop: None }, String::new());
        }
    }

    pub(super) fn fail_group(&mut self, group: Handle, message: &str) {
        if let Some(mut g) = self.drop_group(group) {
            (g.sink)(EngineEvent::Error(format!("request failed: {message}")));
        }
    }

    /// End request `group` because its own constraint could not go on (logged: the compile's
    /// dry run is meant to find such grammars before they run).
    pub(super) fn reject_group(&mut self, group: Handle, message: &str) {
        tracing::warn!("a request's output constraint failed while generating: {message}");
        if let Some(mut g) = self.drop_group(group) {
            (g.sink)(EngineEvent::Rejected(message.to_string()));
        }
    }

    /// The samples of request `group`, in sample order.
    fn group_seqs(&self, group: Handle) -> Vec<SeqId> {
        let mut seqs: Vec<SeqId> = self.samples.iter().filter(|(_, s)| s.group == group).map(|(&q, _)| q).collect();
        seqs.sort_unstable();
        seqs
    }

    /// Remove request `group` and all its samples, freeing their blocks; no event is sent.
    pub(super) fn drop_group(&mut self, group: Handle) -> Option<Group> {
        for seq in self.group_seqs(group) {
            self.samples.remove(&seq);
            self.scheduler.finish(seq);
        }
        self.groups.remove(&group)
    }

    pub(super) fn end_sample(&mut self, seq: SeqId, f: Finished, text: String) {
        self.emit(seq, text, Vec::new(), Vec::new(), Some(f));
        self.remove_sample(seq);
    }

    pub(super) fn remove_sample(&mut self, seq: SeqId) {
        self.scheduler.finish(seq);
        if let Some(s) = self.samples.remove(&seq) {
            if let Some(g) = self.groups.get_mut(&s.group) {
                g.live = g.live.saturating_sub(1);
                if g.live == 0 {
                    self.groups.remove(&s.group);
                }
            }
        }
    }
}
