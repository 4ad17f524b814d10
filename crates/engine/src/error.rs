//! The engine's error type: every failure a request or a checkpoint can cause, typed, so the
//! CLI prints one line and the server (later) maps each kind to one HTTP status.

use crate::chat_template::ChatTemplateError;
use crate::tokenizer::TokenizerError;
use crate::validation::InvalidParam;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] flint_model::ModelError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    ChatTemplate(#[from] ChatTemplateError),
    /// A request parameter outside what flint accepts, with the parameter it concerns.
    #[error(transparent)]
    InvalidParam(#[from] InvalidParam),
    /// A request that can never run (too long for the context or the KV pool).
    #[error(transparent)]
    Admission(#[from] crate::scheduler::AdmissionError),
    /// A request or configuration the engine cannot run as given (not tied to one parameter).
    #[error("{0}")]
    InvalidRequest(String),
    /// A checkpoint that opened but lacks something serving needs (e.g. a tokenizer).
    #[error("{0}")]
    Load(String),
    /// Nothing can serve the request now (no worker is running); retrying later may work.
    #[error("{0}")]
    Unavailable(String),
    #[error("internal error: {0}")]
    Internal(String),
}
