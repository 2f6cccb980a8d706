//! Checks made before a library is opened: dlopen runs the library's constructors, so a file that
//! anyone but its owner could have replaced is never opened.

use std::collections::HashSet;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::LoadError;

/// Whether `path` looks like a plugin at all (the platform's library extension). Other files in a
/// plugin directory (READMEs, checksums, debug info) are skipped without a word.
pub fn has_library_extension(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e == std::env::consts::DLL_EXTENSION)
}

/// sha256 digests that plugins must match, read from a file in `sha256sum` format
/// (`<hex digest>  <name>`; `#` comments and blank lines allowed).
#[derive(Debug, Clone, Default)]
pub struct AllowList {
    source: PathBuf,
    digests: HashSet<String>,
}

impl AllowList {
    pub fn from_file(path: &Path) -> Result<Self, LoadError> {
        let text = fs::read_to_string(path).map_err(|e| LoadError::AllowList {
            path: path.into(),
            reason: e.to_string(),
        })?;
        let mut digests = HashSet::new();
        for (line_no, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let digest = line
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .to_ascii_lowercase();
            if digest.len() != 64 || !digest.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(LoadError::AllowList {
                    path: path.into(),
                    reason: format!(
                        "line {}: `{digest}` is not a sha256 hex digest",
                        line_no + 1
                    ),
                });
            }
            digests.insert(digest);
        }
        Ok(Self {
            source: path.into(),
            digests,
        })
    }

    pub fn source(&self) -> &Path {
        &self.source
    }

    fn check(&self, path: &Path) -> Result<(), LoadError> {
        let digest = sha256_file(path).map_err(|e| LoadError::Unreadable {
            path: path.into(),
            reason: e.to_string(),
        })?;
        if self.digests.contains(&digest) {
            Ok(())
        } else {
            Err(LoadError::NotAllowListed {
                path: path.into(),
                digest,
                allow_list: self.source.clone(),
            })
        }
    }
}

pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut file = fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Refuses anything but a regular file (links are followed) that neither group nor others may write,
/// in a directory neither group nor others may write, and, with an allow-list, whose digest is listed.
pub fn vet(path: &Path, allow_list: Option<&AllowList>) -> Result<(), LoadError> {
    let resolved = fs::canonicalize(path).map_err(|e| LoadError::Unreadable {
        path: path.into(),
        reason: e.to_string(),
    })?;
    let meta = fs::metadata(&resolved).map_err(|e| LoadError::Unreadable {
        path: path.into(),
        reason: e.to_string(),
    })?;
    if !meta.is_file() {
        return Err(LoadError::NotRegularFile { path: path.into() });
    }
    check_not_shared_writable(path, &resolved, &meta, "file")?;
    if let Some(dir) = resolved.parent() {
        let dir_meta = fs::metadata(dir).map_err(|e| LoadError::Unreadable {
            path: dir.into(),
            reason: e.to_string(),
        })?;
        check_not_shared_writable(path, dir, &dir_meta, "directory")?;
    }
    if let Some(list) = allow_list {
        list.check(&resolved)?;
    }
    check_complete_elf(path, &resolved, meta.len())
}

/// dlopen maps a library's segments without checking that they lie inside the file; touching a
/// page past the end raises SIGBUS and kills the host. A truncated ELF file is refused here instead.
/// Only the headers are read (lazily, through `ReadCache`). Non-ELF files are left to dlopen.
fn check_complete_elf(plugin: &Path, resolved: &Path, len: u64) -> Result<(), LoadError> {
    use object::{Object, ObjectSegment};
    let truncated = |reason: String| LoadError::Open {
        path: plugin.into(),
        reason: format!("truncated or corrupt library: {reason}"),
    };
    let file = fs::File::open(resolved).map_err(|e| LoadError::Unreadable {
        path: plugin.into(),
        reason: e.to_string(),
    })?;
    let cache = object::ReadCache::new(file);
    let mut magic = [0u8; 4];
    if object::ReadRef::read_bytes_at(&cache, 0, 4)
        .map(|b| magic.copy_from_slice(b))
        .is_err()
        || &magic != b"\x7fELF"
    {
        return Ok(());
    }
    let elf = object::File::parse(&cache).map_err(|e| truncated(e.to_string()))?;
    for segment in elf.segments() {
        let (offset, size) = segment.file_range();
        if offset.saturating_add(size) > len {
            return Err(truncated(format!(
                "a segment spans bytes {offset}..{} but the file has {len}",
                offset + size
            )));
        }
    }
    Ok(())
}

#[cfg(unix)]
fn check_not_shared_writable(
    plugin: &Path,
    what: &Path,
    meta: &fs::Metadata,
    noun: &'static str,
) -> Result<(), LoadError> {
    use std::os::unix::fs::PermissionsExt;
    let mode = meta.permissions().mode();
    if mode & 0o022 != 0 {
        return Err(LoadError::Writable {
            path: plugin.into(),
            culprit: what.into(),
            noun,
            mode: mode & 0o7777,
        });
    }
    Ok(())
}

#[cfg(not(unix))]
fn check_not_shared_writable(
    _: &Path,
    _: &Path,
    _: &fs::Metadata,
    _: &'static str,
) -> Result<(), LoadError> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn plugin_file(dir: &Path, mode: u32) -> PathBuf {
        let p = dir.join(format!("libx.{}", std::env::consts::DLL_EXTENSION));
        fs::write(&p, b"bytes").unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
        p
    }

    #[test]
    fn refuses_writable_files_and_directories() {
        let dir = tempfile::tempdir().unwrap();
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
        let ok = plugin_file(dir.path(), 0o644);
        vet(&ok, None).unwrap();
        fs::set_permissions(&ok, fs::Permissions::from_mode(0o666)).unwrap();
        let err = vet(&ok, None).unwrap_err().to_string();
        assert!(
            err.contains("writable by group or others") && err.contains("666"),
            "{err}"
        );
        fs::set_permissions(&ok, fs::Permissions::from_mode(0o644)).unwrap();
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o777)).unwrap();
        let err = vet(&ok, None).unwrap_err().to_string();
        assert!(err.contains("directory") && err.contains("777"), "{err}");
    }

    #[test]
    fn truncated_elf_files_are_refused_before_dlopen() {
        let dir = tempfile::tempdir().unwrap();
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
        // This test binary is a complete ELF file; a prefix of it is a truncated one.
        let exe = fs::read(std::env::current_exe().unwrap()).unwrap();
        let whole = dir.path().join("libwhole.so");
        fs::write(&whole, &exe).unwrap();
        vet(&whole, None).unwrap();
        for keep in [exe.len() / 2, 64 * 1024, 100] {
            let cut = dir.path().join("libcut.so");
            fs::write(&cut, &exe[..keep]).unwrap();
            let err = vet(&cut, None).unwrap_err().to_string();
            assert!(
                err.contains("truncated or corrupt library") && err.contains("libcut.so"),
                "{keep}: {err}"
            );
        }
    }

    #[test]
    fn allow_list_matches_digests() {
        let dir = tempfile::tempdir().unwrap();
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
        let p = plugin_file(dir.path(), 0o644);
        let digest = sha256_file(&p).unwrap();
        assert_eq!(
            digest,
            "277089d91c0bdf4f2e6862ba7e4a07605119431f5d13f726dd352b06f1b206a9"
        ); // `sha256sum` of "bytes"
        let list_path = dir.path().join("allow.sha256");
        fs::write(&list_path, format!("# plugins\n{digest}  libx.so\n")).unwrap();
        vet(&p, Some(&AllowList::from_file(&list_path).unwrap())).unwrap();
        fs::write(&list_path, format!("{}  other.so\n", "0".repeat(64))).unwrap();
        let err = vet(&p, Some(&AllowList::from_file(&list_path).unwrap()))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&digest) && err.contains("allow.sha256"),
            "{err}"
        );
        fs::write(&list_path, "nothex  x\n").unwrap();
        assert!(
            AllowList::from_file(&list_path)
                .unwrap_err()
                .to_string()
                .contains("line 1")
        );
    }
}
