//! Small pieces every backend's protocol needs: quoting answers in errors, and the check of a
//! weight handover directory before any server is asked to read it.

use std::path::Path;

use serde_json::Value;
use verl_plugin_api::{ErrorKind, PluginError};

/// An answer as quoted in an error: at most 300 characters of its JSON.
pub fn excerpt(v: &Value) -> String {
    let text = v.to_string();
    match text.char_indices().nth(300) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text,
    }
}

/// A reload from a directory without weights would leave a server half-loaded (vLLM points its
/// model at the directory before reading it; SGLang fails mid-load), so such a directory is
/// refused before any server is touched. The servers read the directory themselves: it must be
/// on a filesystem they see.
pub fn check_weights_dir(dir: &Path) -> Result<(), PluginError> {
    let entries = std::fs::read_dir(dir).map_err(|e| {
        PluginError::new(
            ErrorKind::IO,
            format!("weight handover {}: {e}", dir.display()),
        )
    })?;
    let has_weights = entries
        .flatten()
        .any(|e| e.path().extension().is_some_and(|x| x == "safetensors"));
    if has_weights {
        Ok(())
    } else {
        Err(PluginError::new(
            ErrorKind::IO,
            format!(
                "weight handover {}: no .safetensors file in it; the servers were not asked to reload",
                dir.display()
            ),
        ))
    }
}
