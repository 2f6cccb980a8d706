//! # verl-plugin-host
//!
//! The host side of the plugin system, shared by the `verl-core` binary and by `verl-testkit`:
//! discovery ([`PluginSearch`]), the checks made before a library is loaded ([`vet`]), loading of
//! exactly the checked file with abi_stable's layout and version checks, one [`Registry`] for built-in and loaded components, and
//! device platform selection ([`detect_platform`]). The built-in `cpu` and `cuda` devices live here
//! so every host, including plugin authors' tests, selects platforms the same way.

mod builtin;
mod discovery;
mod engines;
mod handle;
mod load;
mod platform;
mod registry;
pub mod vet;

use std::path::{Path, PathBuf};

pub use builtin::{CpuDevice, CudaDevice};
pub use discovery::{
    ALLOW_LIST_ENV, Candidate, DEFAULT_DIR_ENV, DirSource, PLUGIN_PATH_ENV, PluginSearch,
    default_plugin_dir,
};
pub use handle::{
    CheckpointHandle, DeviceHandle, EngineHandle, RewardHandle, RolloutHandle, TrackerHandle,
};
pub use load::load_manifest;
pub use platform::{
    DEFAULT_DETECT_TIMEOUT, DeviceReport, PLATFORM_ENV, PROBE_ROOT_ENV, PlatformError,
    PlatformReport, detect_platform, process_probe,
};
pub use registry::{
    BuiltinPlugin, Component, ComponentStatus, Conflict, LookupError, Origin, PluginRecord,
    Registry,
};
pub use verl_plugin_api as api;

/// Why a plugin library was rejected. Every variant names the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    #[error("{}: cannot read plugin directory: {reason}", path.display())]
    Directory { path: PathBuf, reason: String },
    #[error("{}: cannot read: {reason}", path.display())]
    Unreadable { path: PathBuf, reason: String },
    #[error("{}: not a regular file", path.display())]
    NotRegularFile { path: PathBuf },
    #[error("{}: refused before loading: {noun} {} {}", path.display(), culprit.display(), rule.explain(*mode))]
    Writable {
        path: PathBuf,
        culprit: PathBuf,
        noun: &'static str,
        mode: u32,
        rule: WriteRule,
    },
    #[error("{}: refused before loading: {noun} {} is owned by uid {owner}, neither root nor you (uid {euid}); only root's and your own files and directories are trusted", path.display(), culprit.display())]
    NotOwned {
        path: PathBuf,
        culprit: PathBuf,
        noun: &'static str,
        owner: u32,
        euid: u32,
    },
    #[error("{}: changed while it was being checked ({reason}); not loaded", path.display())]
    Changed { path: PathBuf, reason: String },
    #[error("{}: sha256 {digest} is not in the allow-list {}", path.display(), allow_list.display())]
    NotAllowListed {
        path: PathBuf,
        digest: String,
        allow_list: PathBuf,
    },
    #[error("allow-list {}: {reason}", path.display())]
    AllowList { path: PathBuf, reason: String },
    #[error("{}: not a loadable verl-core plugin: {reason}", path.display())]
    Open { path: PathBuf, reason: String },
    #[error("{}: incompatible plugin: {reason}", path.display())]
    Version { path: PathBuf, reason: String },
    #[error("{}: ABI layout check failed: {reason}", path.display())]
    Abi { path: PathBuf, reason: String },
    #[error("{}: plugin registration failed: {reason}", path.display())]
    Registration { path: PathBuf, reason: String },
    #[error("{}: plugin `{name}` is already loaded from {}, found earlier in the search order; this copy (another file name) was opened, its components are ignored", path.display(), first.display())]
    Duplicate {
        path: PathBuf,
        name: String,
        first: PathBuf,
    },
    #[error("{}: not opened: a plugin file of the same name is already loaded from {}, found earlier in the search order", path.display(), first.display())]
    DuplicateFile { path: PathBuf, first: PathBuf },
}

/// The write-permission rule a plugin file or a directory on the way to it broke (see [`vet`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteRule {
    /// The plugin file and the directory holding it (or a link to it): nobody else may write.
    GroupOrOthers,
    /// Any other directory on the way: writable by others only with the sticky bit.
    OthersNotSticky,
    /// Any other directory on the way: group-writable, without the sticky bit, by a group that is
    /// neither root's nor the user's.
    ForeignGroupNotSticky { gid: u32 },
}

impl WriteRule {
    fn explain(self, mode: u32) -> String {
        match self {
            Self::GroupOrOthers => {
                format!("is writable by group or others (mode {mode:o}); run `chmod go-w` on it")
            }
            Self::OthersNotSticky => format!(
                "is writable by others without the sticky bit (mode {mode:o}); run `chmod o-w` on it (or `chmod +t` for a shared directory like /tmp)"
            ),
            Self::ForeignGroupNotSticky { gid } => format!(
                "is writable by group {gid}, neither root's nor yours, without the sticky bit (mode {mode:o}); run `chmod g-w` on it"
            ),
        }
    }
}

impl LoadError {
    /// The plugin file (or directory) the error is about.
    pub fn path(&self) -> &Path {
        match self {
            Self::Directory { path, .. }
            | Self::Unreadable { path, .. }
            | Self::NotRegularFile { path }
            | Self::Writable { path, .. }
            | Self::NotOwned { path, .. }
            | Self::Changed { path, .. }
            | Self::NotAllowListed { path, .. }
            | Self::AllowList { path, .. }
            | Self::Open { path, .. }
            | Self::Version { path, .. }
            | Self::Abi { path, .. }
            | Self::Registration { path, .. }
            | Self::Duplicate { path, .. }
            | Self::DuplicateFile { path, .. } => path,
        }
    }
}
