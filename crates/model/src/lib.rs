//! flint's model layer: Qwen2 on candle. Reads checkpoints (safetensors directories, GGUF files,
//! hub ids), builds RoPE/YaRN tables, and runs a forward pass over a batch plan against a KV cache
//! that the caller (the engine) owns. Knows nothing of requests, sampling or HTTP.

pub mod batch;
pub mod config;
pub mod decoder;
pub mod device;
pub mod device_cache;
pub mod error;
mod file_pages;
pub mod gguf;
pub mod gguf_export;
pub mod gguf_scan;
pub mod kernels;
pub mod kv_cache;
pub mod kv_dtype;
pub mod kv_pool;
#[cfg(test)]
mod kv_test_support;
pub mod linear;
pub mod paged_cache;
pub mod progress;
pub mod rope;
pub mod scripted;
pub mod source;
pub mod synth;
pub mod weights;

pub use batch::{ForwardBatch, LogitsRows, SeqChunk};
pub use config::{GenerationConfig, ModelConfig, RopeConfig, RopeScaling};
pub use decoder::{DecoderModel, StepOutput};
pub use device_cache::DeviceKvCache;
pub use error::{ModelError, Result};
pub use kv_cache::{ContiguousKvCache, KvCache};
pub use kv_dtype::KvCacheDtype;
pub use kv_pool::KvPool;
pub use paged_cache::PagedKvCache;
