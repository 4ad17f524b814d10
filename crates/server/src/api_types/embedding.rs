//! `/v1/embeddings`' answer, as OpenAI's (vLLM sends the same shape).

use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct EmbeddingList {
    pub object: &'static str,
    pub data: Vec<EmbeddingData>,
    pub model: String,
    pub usage: EmbeddingUsage,
}

#[derive(Debug, Clone, Serialize)]
pub struct EmbeddingData {
    pub object: &'static str,
    pub index: usize,
    pub embedding: EmbeddingVector,
}

/// `encoding_format` `float`: numbers; `base64`: the little-endian f32 bytes, base64-encoded.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum EmbeddingVector {
    Float(Vec<f32>),
    Base64(String),
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct EmbeddingUsage {
    pub prompt_tokens: usize,
    pub total_tokens: usize,
}
