//! flint's engine layer: tokenizer, chat template, sampler, incremental detokenizer and the
//! generation loop over a model from `flint-model`. Knows tensors only through the model's API,
//! and nothing of HTTP.

pub mod chat_template;
pub mod detokenizer;
pub mod error;
pub mod generate;
pub mod loader;
pub mod sampler;
pub mod tokenizer;

pub use error::EngineError;
pub use generate::{generate, FinishReason, GenerateOutcome, GenerateRequest};
pub use loader::LoadedModel;
pub use sampler::{Sampler, SamplingParams};
