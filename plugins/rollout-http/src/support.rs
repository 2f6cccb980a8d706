//! Small pieces every backend's protocol needs: reading its config section, quoting answers in
//! errors, and the check of a weight handover directory before any server is asked to read it.

use std::path::Path;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use verl_plugin_api::{ComponentInit, ErrorKind, PluginError};

use crate::ServerSettings;

/// A backend's own section (`engine_kwargs.<backend>` of verl's rollout section, at
/// `default_path` unless the host sent its path), read strictly as the shared server keys plus the
/// backend's own `T`, and the path it was read at. Without `urls` there, the comma-separated URLs
/// in the variable `urls_env` attach to running servers.
pub fn server_section<T: DeserializeOwned + Serialize>(
    init: &ComponentInit,
    engine_kwargs: &Value,
    backend: &str,
    default_path: &str,
    urls_env: &str,
) -> Result<(String, ServerSettings, T), PluginError> {
    let path = if init.section_path.is_empty() {
        default_path
    } else {
        &init.section_path
    };
    let section = engine_kwargs.get(backend).cloned().unwrap_or(Value::Null);
    let (mut server, own): (ServerSettings, T) =
        verl_plugin_api::config::parse_section2(path, &section.to_string(), &init.origins_json())?;
    server.validate(path).map_err(PluginError::invalid_config)?;
    if server.urls.is_empty()
        && let Some(urls) = std::env::var(urls_env)
            .ok()
            .filter(|u| !u.trim().is_empty())
    {
        server.urls = urls.split(',').map(|u| u.trim().to_owned()).collect();
        server
            .validate(urls_env)
            .map_err(PluginError::invalid_config)?;
    }
    Ok((path.to_owned(), server, own))
}

/// An answer as quoted in an error: at most 300 characters of its JSON.
pub fn excerpt(v: &Value) -> String {
    cut(&v.to_string(), 300)
}

/// `text`, or its first `max` characters and an ellipsis.
pub(crate) fn cut(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_owned(),
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

/// Whether `path` is a weights file of a Hugging Face directory (`*.safetensors`, or the index of
/// sharded ones).
pub fn is_weights_file(path: &Path) -> bool {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json")
}

/// Puts the weight files of `from` into `to` (created): hard links, else copies. The weight sync
/// removes its directory once an update returns, so a server that must read the weights later
/// (a restart) reads these.
pub fn link_weights(from: &Path, to: &Path) -> Result<(), PluginError> {
    let io = |what: &str, path: &Path, e: std::io::Error| {
        PluginError::new(ErrorKind::IO, format!("{what} {}: {e}", path.display()))
    };
    std::fs::create_dir_all(to).map_err(|e| io("creating", to, e))?;
    for entry in std::fs::read_dir(from).map_err(|e| io("reading", from, e))? {
        let path = entry.map_err(|e| io("reading", from, e))?.path();
        if is_weights_file(&path) {
            let target = to.join(path.file_name().unwrap_or_default());
            if std::fs::hard_link(&path, &target).is_err() {
                std::fs::copy(&path, &target).map_err(|e| io("copying", &path, e))?;
            }
        }
    }
    Ok(())
}
