//! One error type for everything that reads a checkpoint or runs the model. Every variant that a
//! file can cause names the file (and the tensor), so the CLI prints one actionable line.

use std::path::{Path, PathBuf};

pub type Result<T, E = ModelError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{0}")]
    Config(String),
    #[error("unsupported architecture: {0}")]
    UnsupportedArchitecture(String),
    #[error("{}: {inner}", path.display())]
    InFile { path: PathBuf, inner: Box<ModelError> },
    #[error("{}: tensor `{name}` is missing", file.display())]
    MissingTensor { file: PathBuf, name: String },
    #[error("{}: tensor `{name}` has shape {found:?}, expected {expected:?}", file.display())]
    ShapeMismatch { file: PathBuf, name: String, expected: Vec<usize>, found: Vec<usize> },
    #[error("{}: tensor `{name}`: {msg}", file.display())]
    BadTensor { file: PathBuf, name: String, msg: String },
    #[error("{}: not a valid safetensors file: {msg}", file.display())]
    Safetensors { file: PathBuf, msg: String },
    #[error("{}: not a valid GGUF file: {msg}", file.display())]
    Gguf { file: PathBuf, msg: String },
    /// A hub id that could not be resolved; the message names the id and what to do.
    #[error("{0}")]
    Hub(String),
    /// A device that cannot be opened, or a combination not validated on it; the message says
    /// what to run instead.
    #[error("{0}")]
    Device(String),
    #[error("invalid batch: {0}")]
    Batch(String),
    #[error("tensor op failed: {0}")]
    Candle(#[from] candle_core::Error),
}

impl ModelError {
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        Self::Io { path: path.to_path_buf(), source }
    }

    /// Attach the file a config-level error came from (no-op for errors that already name one).
    pub fn in_file(self, path: &Path) -> Self {
        match self {
            e @ (Self::Io { .. }
            | Self::InFile { .. }
            | Self::MissingTensor { .. }
            | Self::ShapeMismatch { .. }
            | Self::BadTensor { .. }
            | Self::Safetensors { .. }
            | Self::Gguf { .. }) => e,
            other => Self::InFile { path: path.to_path_buf(), inner: Box::new(other) },
        }
    }
}
