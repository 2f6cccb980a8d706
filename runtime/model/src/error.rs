//! Typed errors. Every error about a file names the file; every error about a tensor names the tensor.

use std::path::PathBuf;

/// Errors of running, loading and saving a model (and of the training built on it).
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },

    #[error("{}: invalid JSON: {source}", path.display())]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },

    /// `supported`: the names that would have loaded, from `Architecture::ALL`.
    #[error("{}: unsupported architecture {architecture:?} (supported: {supported})", path.display())]
    UnsupportedArchitecture {
        path: PathBuf,
        architecture: String,
        supported: String,
    },

    #[error("{}: invalid config: {reason}", path.display())]
    InvalidConfig { path: PathBuf, reason: String },

    #[error("{}: corrupt safetensors file: {reason}", path.display())]
    CorruptSafetensors { path: PathBuf, reason: String },

    #[error("{}: tensor {tensor:?} is missing", path.display())]
    MissingTensor { path: PathBuf, tensor: String },

    #[error("{}: tensor {tensor:?} has shape {found:?}, the model needs {expected:?}", path.display())]
    ShapeMismatch {
        path: PathBuf,
        tensor: String,
        found: Vec<i64>,
        expected: Vec<i64>,
    },

    #[error("{}: tensor {tensor:?} has unsupported dtype {dtype}", path.display())]
    UnsupportedDtype {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },

    #[error("{}: tokenizer error: {reason}", path.display())]
    Tokenizer { path: PathBuf, reason: String },

    /// An argument tensor (or list) with the wrong shape, dtype or value.
    #[error("invalid input {tensor:?}: {reason}")]
    InvalidInput { tensor: String, reason: String },

    /// More than the memory available would be needed (checked before allocating).
    #[error("{what} needs about {needed}, more than the {available} of memory available")]
    OutOfMemory {
        what: String,
        needed: String,
        available: String,
    },

    /// A named tensor handed to the model (weight sync) that it does not have or cannot take.
    #[error("tensor {tensor:?}: {reason}")]
    Tensor { tensor: String, reason: String },

    /// A libtorch failure, cut to its first line: libtorch appends a C++ stack trace (`frame #0:
    /// …`, `Exception raised from …`) that means nothing to a user.
    #[error("libtorch: {0}")]
    Torch(String),
}

impl From<tch::TchError> for ModelError {
    fn from(e: tch::TchError) -> Self {
        let text = match e {
            tch::TchError::Torch(message) => message,
            other => other.to_string(),
        };
        Self::Torch(first_line(&text).to_owned())
    }
}

/// The first non-empty line of `text`, trimmed.
fn first_line(text: &str) -> &str {
    text.lines()
        .map(str::trim)
        .find(|line| !line.is_empty())
        .unwrap_or("(no message)")
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    /// An [`ModelError::InvalidInput`] about `tensor`.
    pub fn invalid_input(tensor: &str, reason: impl Into<String>) -> Self {
        Self::InvalidInput {
            tensor: tensor.to_owned(),
            reason: reason.into(),
        }
    }
}

/// Reads and parses a JSON file, naming the file in any error.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &std::path::Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    serde_json::from_str(&text).map_err(|source| ModelError::Json {
        path: path.to_owned(),
        source,
    })
}

/// Writes pretty JSON to a file, naming the file in any error.
pub fn write_json<T: serde::Serialize>(path: &std::path::Path, value: &T) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|source| ModelError::Json {
        path: path.to_owned(),
        source,
    })?;
    std::fs::write(path, text).map_err(|e| ModelError::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libtorch_errors_keep_their_first_line_only() {
        let raw = tch::Tensor::zeros([2, 3], (tch::Kind::Float, tch::Device::Cpu))
            .f_view([7])
            .unwrap_err();
        assert!(
            raw.to_string().lines().count() > 1,
            "libtorch's own text carries a stack trace: {raw}"
        );
        let error = ModelError::from(raw).to_string();
        assert!(error.starts_with("libtorch: "), "{error}");
        assert!(error.contains("shape '[7]' is invalid"), "{error}");
        assert!(
            !error.contains('\n')
                && !error.contains("frame #")
                && !error.contains("Exception raised"),
            "{error}"
        );
    }
}
