//! The small endpoints' bodies: models, health, version, tokenize, detokenize.

use serde::Serialize;

/// `GET /v1/models`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelList<'a> {
    /// `list`.
    pub object: &'static str,
    pub data: Vec<ModelCard<'a>>,
}

/// The served model, as `/v1/models` lists it and `/v1/models/{id}` answers.
#[derive(Debug, Clone, Serialize)]
pub struct ModelCard<'a> {
    pub id: &'a str,
    /// `model`.
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub root: &'a str,
    /// `null` while the model loads.
    pub max_model_len: Option<usize>,
}

impl<'a> ModelCard<'a> {
    pub fn new(id: &'a str, created: u64, max_model_len: Option<usize>) -> Self {
        Self { id, object: "model", created, owned_by: "flint", root: id, max_model_len }
    }
}

/// `GET /health` when some worker serves.
#[derive(Debug, Clone, Serialize)]
pub struct Health {
    /// `ok`, or `degraded` when some workers have stopped.
    pub status: &'static str,
    pub workers: Vec<WorkerHealth>,
}

#[derive(Debug, Clone, Serialize)]
pub struct WorkerHealth {
    pub name: String,
    pub healthy: bool,
}

/// `GET /version`.
#[derive(Debug, Clone, Serialize)]
pub struct Version {
    pub version: &'static str,
    /// Where the model runs (`cpu`, `cuda:0`; one per worker), once it has loaded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub devices: Option<Vec<String>>,
}

/// The test hook's answer.
#[derive(Debug, Clone, Serialize)]
pub struct FaultInjected {
    pub worker: usize,
    /// `injected`.
    pub fault: &'static str,
}

/// `POST /tokenize`.
#[derive(Debug, Clone, Serialize)]
pub struct TokenizeResponse {
    pub count: usize,
    pub max_model_len: usize,
    pub tokens: Vec<u32>,
    /// The rendered chat prompt, when `messages` were tokenized.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    /// With `return_token_strs`: each token's vocabulary string.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_strs: Option<Vec<Option<String>>>,
}

/// `POST /detokenize`.
#[derive(Debug, Clone, Serialize)]
pub struct DetokenizeResponse {
    pub prompt: String,
}

/// `GET /tokenizer_info`: what vLLM's endpoint of the name answers (the tokenizer config's
/// fields), which lm-eval's remote tokenizer reads to render chat prompts and find EOS.
#[derive(Debug, Serialize)]
pub struct TokenizerInfo {
    pub tokenizer_class: &'static str,
    pub eos_token: Option<String>,
    pub bos_token: Option<String>,
    pub pad_token: Option<String>,
    pub chat_template: Option<String>,
    pub model_max_length: usize,
    /// The tokenizer's own vocabulary (the model's may be padded beyond it).
    pub vocab_size: usize,
    /// Every id that ends a generation.
    pub eos_token_ids: Vec<u32>,
}
