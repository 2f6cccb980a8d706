//! Loading one checked plugin library: abi_stable's header, version and layout checks, then its
//! manifest.

use std::path::Path;

use abi_stable::library::{LibraryError, lib_header_from_path};
use verl_plugin_api::{ABI_VERSION, PluginManifest, PluginModule_Ref, check_abi_compatible};

use crate::LoadError;
use crate::vet::CheckedLibrary;

/// Loads `library` through its descriptor and returns the manifest its root module declares.
///
/// abi_stable checks its own header and a C-ABI self-test when reading the header; our semver rule
/// runs next, before abi_stable's layout check of every type reachable from the root module, so a
/// version mismatch is reported as such rather than as a layout difference. Libraries are never
/// unloaded: objects they created may outlive any handle.
pub fn load_manifest(library: CheckedLibrary) -> Result<PluginManifest, LoadError> {
    let path = library.path().to_path_buf();
    let loader_path = library.loader_path();
    let header = lib_header_from_path(&loader_path);
    library.keep_open();
    // The loader's messages name `/proc/self/fd/N`; the user knows the file by its path.
    let in_terms_of_path = |text: &str| {
        first_lines(&text.replace(&*loader_path.to_string_lossy(), &path.display().to_string()))
    };
    let header = header.map_err(|e| LoadError::Open {
        path: path.clone(),
        reason: match e {
            _ if !Path::new("/proc/self/fd").is_dir() => {
                "/proc is not mounted: plugins are loaded through /proc/self/fd".to_owned()
            }
            // dlopen's own one-line message (`<file>: invalid ELF header`, a missing dependency),
            // without the file's name that the error already starts with.
            LibraryError::OpenError { err, .. } => {
                let text = in_terms_of_path(&err.to_string());
                let lead = format!("{}: ", path.display());
                text.strip_prefix(&lead).map_or(text.clone(), str::to_owned)
            }
            other => in_terms_of_path(&other.to_string()),
        },
    })?;
    let plugin_abi = header.version_strings().version.to_string();
    check_abi_compatible(ABI_VERSION, &plugin_abi).map_err(|reason| LoadError::Version {
        path: path.clone(),
        reason,
    })?;
    let module = header
        .init_root_module::<PluginModule_Ref>()
        .map_err(|e| LoadError::Abi {
            path: path.clone(),
            reason: in_terms_of_path(&e.to_string()),
        })?;
    (module.manifest())()
        .into_result()
        .map_err(|e| LoadError::Registration {
            path,
            reason: e.to_string(),
        })
}

/// abi_stable's layout errors can run to hundreds of lines; keep the head, which names the problem.
fn first_lines(text: &str) -> String {
    tracing::debug!("{text}");
    const MAX_LINES: usize = 12;
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    if lines.len() <= MAX_LINES {
        lines.join("\n")
    } else {
        format!(
            "{}\n… ({} more lines; RUST_LOG=debug shows them)",
            lines[..MAX_LINES].join("\n"),
            lines.len() - MAX_LINES
        )
    }
}
