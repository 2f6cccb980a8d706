//! Where plugins are looked for, in order: every `--plugin-dir`, then `VERL_PLUGIN_PATH`
//! (colon-separated), then the `plugins` directory next to the running binary. When the same plugin
//! (by name) is found twice, the first one found is used, so `--plugin-dir` overrides an installed
//! copy.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use crate::LoadError;
use crate::vet::{AllowList, has_library_extension};

pub const PLUGIN_PATH_ENV: &str = "VERL_PLUGIN_PATH";
pub const ALLOW_LIST_ENV: &str = "VERL_PLUGIN_ALLOWLIST";
/// Replaces the default plugin directory; empty disables it (packagers, hermetic tests).
pub const DEFAULT_DIR_ENV: &str = "VERL_PLUGIN_DEFAULT_DIR";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirSource {
    CommandLine,
    EnvPath,
    Default,
}

#[derive(Debug, Clone, Default)]
pub struct PluginSearch {
    pub dirs: Vec<(PathBuf, DirSource)>,
    pub allow_list: Option<AllowList>,
}

pub enum Candidate {
    Library(PathBuf),
    Unreadable(LoadError),
}

impl PluginSearch {
    /// The standard search: `plugin_dirs`, then `VERL_PLUGIN_PATH`, then `<binary dir>/plugins`;
    /// `VERL_PLUGIN_ALLOWLIST` (or `allow_list`) names a sha256 allow-list file.
    pub fn standard(plugin_dirs: &[PathBuf], allow_list: Option<&Path>) -> Result<Self, LoadError> {
        let mut dirs: Vec<(PathBuf, DirSource)> = plugin_dirs
            .iter()
            .map(|d| (d.clone(), DirSource::CommandLine))
            .collect();
        if let Some(path) = std::env::var_os(PLUGIN_PATH_ENV) {
            dirs.extend(
                std::env::split_paths(&path)
                    .filter(|p| !p.as_os_str().is_empty())
                    .map(|p| (p, DirSource::EnvPath)),
            );
        }
        if let Some(dir) = default_plugin_dir() {
            dirs.push((dir, DirSource::Default));
        }
        let allow_list = match allow_list
            .map(Path::to_path_buf)
            .or_else(|| std::env::var_os(ALLOW_LIST_ENV).map(PathBuf::from))
        {
            Some(path) => Some(AllowList::from_file(&path)?),
            None => None,
        };
        Ok(Self { dirs, allow_list })
    }

    /// Library files in search order; a path listed twice (a directory given twice) is listed
    /// once. Nothing is resolved here: which file a path leads to is decided, and checked, when it
    /// is opened. Missing directories given explicitly are reported; a missing default directory
    /// is not.
    pub fn candidates(&self) -> Vec<Candidate> {
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        for (dir, source) in &self.dirs {
            let entries = match std::fs::read_dir(dir) {
                Ok(entries) => entries,
                Err(_) if *source == DirSource::Default => continue,
                Err(e) => {
                    out.push(Candidate::Unreadable(LoadError::Directory {
                        path: dir.clone(),
                        reason: e.to_string(),
                    }));
                    continue;
                }
            };
            let mut files: Vec<PathBuf> =
                entries.filter_map(|e| e.ok()).map(|e| e.path()).collect();
            files.sort();
            for file in files {
                if !has_library_extension(&file) {
                    tracing::debug!(path = %file.display(), "not a plugin library, skipped");
                    continue;
                }
                if seen.insert(file.clone()) {
                    out.push(Candidate::Library(file));
                }
            }
        }
        out
    }
}

/// `<directory of the running binary>/plugins`, where a release puts its bundled plugins, unless
/// `VERL_PLUGIN_DEFAULT_DIR` says otherwise.
pub fn default_plugin_dir() -> Option<PathBuf> {
    match std::env::var_os(DEFAULT_DIR_ENV) {
        Some(dir) if dir.is_empty() => None,
        Some(dir) => Some(PathBuf::from(dir)),
        None => std::env::current_exe()
            .ok()?
            .parent()
            .map(|dir| dir.join("plugins")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_libraries_in_order_once_and_reports_missing_dirs() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let ext = std::env::consts::DLL_EXTENSION;
        for (dir, name) in [
            (&a, format!("libz.{ext}")),
            (&a, format!("liba.{ext}")),
            (&b, format!("libb.{ext}")),
        ] {
            std::fs::write(dir.path().join(name), b"x").unwrap();
        }
        std::fs::write(a.path().join("README.md"), b"x").unwrap();
        let search = PluginSearch {
            dirs: vec![
                (a.path().into(), DirSource::CommandLine),
                (b.path().into(), DirSource::EnvPath),
                (a.path().into(), DirSource::EnvPath),
                (a.path().join("missing"), DirSource::CommandLine),
                (a.path().join("missing-default"), DirSource::Default),
            ],
            allow_list: None,
        };
        let found: Vec<String> = search
            .candidates()
            .into_iter()
            .map(|c| match c {
                Candidate::Library(p) => p.file_name().unwrap().to_string_lossy().into_owned(),
                Candidate::Unreadable(e) => {
                    format!("error: {}", e.path().file_name().unwrap().to_string_lossy())
                }
            })
            .collect();
        assert_eq!(
            found,
            vec![
                format!("liba.{ext}"),
                format!("libz.{ext}"),
                format!("libb.{ext}"),
                "error: missing".into()
            ]
        );
    }
}
