//! `tokenizer.json` through the `tokenizers` crate, with errors naming the file.

use std::path::{Path, PathBuf};

use crate::error::{ModelError, Result};

/// A Hugging Face fast tokenizer.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .finish()
    }
}

impl Tokenizer {
    pub fn from_file(path: &Path) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| ModelError::Tokenizer {
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
        Ok(Self {
            inner,
            path: path.to_owned(),
        })
    }

    /// Reads `<dir>/tokenizer.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        Self::from_file(&dir.join("tokenizer.json"))
    }

    fn error(&self, e: tokenizers::Error) -> ModelError {
        ModelError::Tokenizer {
            path: self.path.clone(),
            reason: e.to_string(),
        }
    }

    /// Token ids of `text`; `add_special_tokens` as transformers' tokenizer call (default true).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<i64>> {
        let encoding = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| self.error(e))?;
        Ok(encoding.get_ids().iter().map(|&id| i64::from(id)).collect())
    }

    pub fn decode(&self, ids: &[i64], skip_special_tokens: bool) -> Result<String> {
        let ids = ids
            .iter()
            .map(|&id| {
                u32::try_from(id).map_err(|_| {
                    ModelError::invalid_input("ids", format!("{id} is not a token id"))
                })
            })
            .collect::<Result<Vec<u32>>>()?;
        self.inner
            .decode(&ids, skip_special_tokens)
            .map_err(|e| self.error(e))
    }

    pub fn token_to_id(&self, token: &str) -> Option<i64> {
        self.inner.token_to_id(token).map(i64::from)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unreadable_tokenizer_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains("tokenizer.json"), "{err}");
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, "{\"model\": 1}").unwrap();
        let err = Tokenizer::from_file(&path).unwrap_err().to_string();
        assert!(err.contains(&path.display().to_string()), "{err}");
    }
}
