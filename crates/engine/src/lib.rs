//! flint's engine layer: requests, the paged KV block pool and prefix cache, the scheduler,
//! sampler, incremental detokenizer and stop strings, and the threaded step loop that serves many
//! requests over one model. Knows tensors only through the model's API, and nothing of HTTP.

pub mod block_pool;
pub mod chat_template;
pub mod detokenizer;
pub mod engine;
pub mod engine_core;
pub mod error;
pub mod generate;
pub mod kv_manager;
pub mod launch;
pub mod loader;
pub mod pooling;
pub mod request;
pub mod router;
pub mod runner;
pub mod sampler;
pub mod scheduler;
pub mod speculative;
pub mod stop;
pub mod structured;
pub mod tokenizer;
pub mod validation;

pub use engine::{Engine, EngineStats, EngineThread, EventStream};
pub use engine_core::{EngineCore, ModelInfo};
pub use error::EngineError;
/// Progress of long work (the model crate's), for the server's loading status.
pub use flint_model::progress;
pub use generate::{generate, GenerateOutcome, GenerateRequest};
pub use launch::{build_core, draft_kv_dtype, load_draft, plan, same_vocabulary, CacheInfo, EngineConfig, PoolPlan};
pub use loader::LoadedModel;
pub use request::{EngineEvent, FinishReason, Finished, Request, RequestParams, SampleOutput, StopMatch};
pub use router::{RoutePolicy, Router, WorkerStatus};
pub use runner::{DraftModel, DraftRequest, ModelRunner, PagedModelRunner, StepLogits};
pub use sampler::{Sampler, SamplingParams};
pub use scheduler::{SchedulerConfig, StepPlan};
pub use speculative::{SpecCounters, SpecMethod, SpeculativeConfig};
pub use validation::{InvalidParam, Param};
