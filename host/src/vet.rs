//! Checks made before a library is loaded: loading runs the library's constructors, so a file that
//! anyone but root or the invoking user could have written or replaced is never loaded.
//!
//! The rules, like ssh's `StrictModes`:
//! - the plugin file, every directory on the way to it from `/` and every symbolic link followed
//!   is owned by root or by the effective user;
//! - the plugin file and the directory holding it (and the directory holding a link to it) are
//!   writable by neither group nor others;
//! - any other directory on the way is writable by others only with the sticky bit (`/tmp`), and
//!   by its group only with the sticky bit or when the group is root's or the user's own.
//!
//! Every directory that could redirect the path is thereby writable only by trusted users (in a
//! sticky directory, others cannot rename or remove our entries). The file is then opened once,
//! without following a link, its ownership and mode are checked on the descriptor, an allow-list
//! digest is taken from the descriptor, and the library is loaded through `/proc/self/fd/N`, which
//! names the opened file whatever the path names by then.

use std::collections::{HashSet, VecDeque};
use std::ffi::OsString;
use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::{AsRawFd, IntoRawFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::{LoadError, WriteRule};

/// Set to `1` to load plugins that fail the ownership and write-permission rules, with a warning
/// each (a container running as root over a bind mount owned by the developer, for example). Every
/// other check still applies.
pub const INSECURE_ENV: &str = "VERL_PLUGIN_INSECURE_PERMISSIONS";

/// Linux's limit on symbolic links followed while resolving one path.
const MAX_LINKS: usize = 40;

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

    /// Checks the content of the opened `file` (the one that will be loaded).
    fn check(&self, path: &Path, mut file: &fs::File) -> Result<(), LoadError> {
        let digest = file
            .seek(SeekFrom::Start(0))
            .and_then(|_| sha256(file))
            .map_err(|e| LoadError::Unreadable {
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

/// The sha256 of everything `reader` yields, as lowercase hex (what `sha256sum` prints).
pub fn sha256(mut reader: impl Read) -> std::io::Result<String> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = reader.read(&mut buf)?;
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

/// Whose files are trusted: root's and the effective user's.
#[derive(Debug, Clone, Copy)]
struct Trust {
    uid: u32,
    gid: u32,
    /// `VERL_PLUGIN_INSECURE_PERMISSIONS=1`: ownership and write-permission refusals only warn.
    insecure: bool,
}

impl Trust {
    fn current() -> Self {
        // SAFETY: geteuid and getegid cannot fail and touch no memory.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        Self {
            uid,
            gid,
            insecure: std::env::var_os(INSECURE_ENV).is_some_and(|v| v == "1"),
        }
    }

    fn owns(&self, uid: u32) -> bool {
        uid == 0 || uid == self.uid
    }

    /// The write rule a file or directory with `mode` and group `gid` breaks, if any. `holds_entry`:
    /// the plugin file itself or the directory holding it or a link to it.
    fn broken_write_rule(&self, mode: u32, gid: u32, holds_entry: bool) -> Option<WriteRule> {
        if holds_entry {
            return (mode & 0o022 != 0).then_some(WriteRule::GroupOrOthers);
        }
        if mode & 0o1000 != 0 {
            None
        } else if mode & 0o002 != 0 {
            Some(WriteRule::OthersNotSticky)
        } else if mode & 0o020 != 0 && gid != 0 && gid != self.gid {
            Some(WriteRule::ForeignGroupNotSticky { gid })
        } else {
            None
        }
    }

    /// Checks the owner and mode of `culprit` (on the way to `entry`).
    fn check(
        &self,
        entry: &Path,
        culprit: &Path,
        noun: &'static str,
        meta: &fs::Metadata,
        holds_entry: bool,
    ) -> Result<(), LoadError> {
        let refusal = if !self.owns(meta.uid()) {
            Some(LoadError::NotOwned {
                path: entry.into(),
                culprit: culprit.into(),
                noun,
                owner: meta.uid(),
                euid: self.uid,
            })
        } else {
            // A link's own mode is meaningless (always 777); its directory is checked instead.
            let mode = meta.mode() & 0o7777;
            (!meta.file_type().is_symlink())
                .then(|| self.broken_write_rule(mode, meta.gid(), holds_entry))
                .flatten()
                .map(|rule| LoadError::Writable {
                    path: entry.into(),
                    culprit: culprit.into(),
                    noun,
                    mode,
                    rule,
                })
        };
        match refusal {
            None => Ok(()),
            Some(refusal) if self.insecure => {
                tracing::warn!("{refusal} (loaded anyway: {INSECURE_ENV}=1)");
                Ok(())
            }
            Some(refusal) => Err(refusal),
        }
    }
}

/// The plugin file a path leads to, every directory and link on the way checked.
struct Resolved {
    file: PathBuf,
    /// `lstat` of `file`, to recognise the file once it is open.
    meta: fs::Metadata,
}

/// Resolves `entry` one component at a time from `/`, checking each directory as it is entered and
/// each symbolic link before it is followed, as the kernel would walk it.
fn resolve(entry: &Path, trust: &Trust) -> Result<Resolved, LoadError> {
    let unreadable = |at: &Path, e: std::io::Error| LoadError::Unreadable {
        path: entry.into(),
        reason: if at == entry {
            e.to_string()
        } else {
            format!("{}: {e}", at.display())
        },
    };
    let absolute = if entry.is_absolute() {
        entry.to_path_buf()
    } else {
        std::env::current_dir()
            .map_err(|e| unreadable(Path::new("."), e))?
            .join(entry)
    };
    let mut pending: VecDeque<OsString> = VecDeque::new();
    push_front(&mut pending, &absolute);
    // Each directory is checked as it is entered, strictly when the next name is the last one (it
    // holds the entry). `strict` says whether `dir` was; one reached by `..` or by a link back to
    // `/` is checked strictly once it turns out to hold the entry.
    let mut dir = PathBuf::from("/");
    let root = fs::symlink_metadata(&dir).map_err(|e| unreadable(&dir, e))?;
    let mut strict = holds_next(&pending);
    trust.check(entry, &dir, "directory", &root, strict)?;
    let mut links = 0;
    while let Some(name) = pending.pop_front() {
        if name == ".." {
            dir.pop();
            strict = false;
            continue;
        }
        let last = pending.is_empty();
        let here = dir.join(&name);
        let meta = fs::symlink_metadata(&here).map_err(|e| unreadable(&here, e))?;
        if last && !strict {
            check_holding_dir(entry, &dir, trust)?;
            strict = true;
        }
        if meta.file_type().is_symlink() {
            links += 1;
            if links > MAX_LINKS {
                return Err(unreadable(
                    entry,
                    std::io::Error::other("too many levels of symbolic links"),
                ));
            }
            trust.check(entry, &here, "symbolic link", &meta, false)?;
            let target = fs::read_link(&here).map_err(|e| unreadable(&here, e))?;
            if target.is_absolute() {
                dir = PathBuf::from("/");
                strict = false;
            }
            push_front(&mut pending, &target);
        } else if last {
            if !meta.is_file() {
                return Err(LoadError::NotRegularFile { path: entry.into() });
            }
            return Ok(Resolved { file: here, meta });
        } else {
            if !meta.is_dir() {
                return Err(unreadable(
                    &here,
                    std::io::Error::from(std::io::ErrorKind::NotADirectory),
                ));
            }
            strict = holds_next(&pending);
            trust.check(entry, &here, "directory", &meta, strict)?;
            dir = here;
        }
    }
    // The path ended in `/`, `.` or `..`: a directory.
    Err(LoadError::NotRegularFile { path: entry.into() })
}

/// Whether the directory about to be entered holds the entry: one name is left after it.
fn holds_next(pending: &VecDeque<OsString>) -> bool {
    pending.len() == 1 && pending[0] != ".."
}

/// Queues `path`'s components (`.` dropped, `..` kept) ahead of those already pending.
fn push_front(pending: &mut VecDeque<OsString>, path: &Path) {
    for component in path.components().rev() {
        match component {
            Component::Normal(name) => pending.push_front(name.to_owned()),
            Component::ParentDir => pending.push_front("..".into()),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
}

/// The directory holding the plugin file or a link to it: writable by nobody else, sticky or not.
fn check_holding_dir(entry: &Path, dir: &Path, trust: &Trust) -> Result<(), LoadError> {
    let meta = fs::symlink_metadata(dir).map_err(|e| LoadError::Unreadable {
        path: entry.into(),
        reason: format!("{}: {e}", dir.display()),
    })?;
    trust.check(entry, dir, "directory", &meta, true)
}

/// A plugin library opened once and checked on its descriptor. It is loaded through that
/// descriptor, so the file checked is the file loaded.
#[derive(Debug)]
pub struct CheckedLibrary {
    path: PathBuf,
    file: fs::File,
    /// Device and inode: the same file reached by two paths is one library.
    identity: (u64, u64),
}

impl CheckedLibrary {
    /// The path the library was found at.
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn identity(&self) -> (u64, u64) {
        self.identity
    }

    /// The path the loader is given: `/proc/self/fd/N` resolves to this descriptor's file, even
    /// after the original path has been renamed over or removed.
    pub fn loader_path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}", self.file.as_raw_fd()))
    }

    /// Leaves the descriptor open for the life of the process once the loader has seen it: the
    /// loader knows a library by the name `/proc/self/fd/N` and would hand this one out again for
    /// a later file opened under the same number.
    pub(crate) fn keep_open(self) {
        let _fd = self.file.into_raw_fd();
    }
}

/// Checks `path` and everything on the way to it, opens it once and checks the descriptor:
/// a regular file owned by root or the effective user, writable by neither group nor others,
/// listed in `allow_list` when there is one, and a complete ELF file.
pub fn open(path: &Path, allow_list: Option<&AllowList>) -> Result<CheckedLibrary, LoadError> {
    open_with(path, allow_list, &Trust::current())
}

fn open_with(
    path: &Path,
    allow_list: Option<&AllowList>,
    trust: &Trust,
) -> Result<CheckedLibrary, LoadError> {
    let resolved = resolve(path, trust)?;
    open_resolved(path, &resolved, allow_list, trust)
}

/// Opens the file `resolve` found and checks the descriptor: it must still be that file.
fn open_resolved(
    path: &Path,
    resolved: &Resolved,
    allow_list: Option<&AllowList>,
    trust: &Trust,
) -> Result<CheckedLibrary, LoadError> {
    let changed = |what: &str| LoadError::Changed {
        path: path.into(),
        reason: format!("{} {what}", resolved.file.display()),
    };
    // O_NOFOLLOW: a link swapped in after the check is not followed; O_NONBLOCK: a FIFO swapped in
    // cannot stall the open (it is refused below as no regular file).
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&resolved.file)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => changed("became a symbolic link"),
            _ => LoadError::Unreadable {
                path: path.into(),
                reason: e.to_string(),
            },
        })?;
    let meta = file.metadata().map_err(|e| LoadError::Unreadable {
        path: path.into(),
        reason: e.to_string(),
    })?;
    if (meta.dev(), meta.ino()) != (resolved.meta.dev(), resolved.meta.ino()) {
        return Err(changed("was replaced"));
    }
    if !meta.is_file() {
        return Err(LoadError::NotRegularFile { path: path.into() });
    }
    trust.check(path, &resolved.file, "file", &meta, true)?;
    if let Some(list) = allow_list {
        list.check(path, &file)?;
    }
    check_complete_elf(path, &file, meta.len())?;
    Ok(CheckedLibrary {
        path: path.into(),
        file,
        identity: (meta.dev(), meta.ino()),
    })
}

/// dlopen maps a library's segments without checking that they lie inside the file; touching a
/// page past the end raises SIGBUS and kills the host. A truncated ELF file is refused here instead.
/// Only the headers are read (lazily, through `ReadCache`). Non-ELF files are left to dlopen.
fn check_complete_elf(plugin: &Path, file: &fs::File, len: u64) -> Result<(), LoadError> {
    use object::{Object, ObjectSegment};
    let truncated = |reason: String| LoadError::Open {
        path: plugin.into(),
        reason: format!("truncated or corrupt library: {reason}"),
    };
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A uid and gid nobody on a test machine has.
    const STRANGER: u32 = 12345;

    fn plugin_file(dir: &Path, mode: u32) -> PathBuf {
        let p = dir.join(format!("libx.{}", std::env::consts::DLL_EXTENSION));
        fs::write(&p, b"bytes").unwrap();
        set_mode(&p, mode);
        p
    }

    fn set_mode(path: &Path, mode: u32) {
        fs::set_permissions(path, fs::Permissions::from_mode(mode)).unwrap();
    }

    fn safe_dir() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        set_mode(dir.path(), 0o755);
        dir
    }

    fn vet(path: &Path, allow_list: Option<&AllowList>) -> Result<CheckedLibrary, LoadError> {
        open_with(path, allow_list, &Trust::current())
    }

    fn refusal(path: &Path) -> String {
        vet(path, None).unwrap_err().to_string()
    }

    fn chown(path: &Path, uid: Option<u32>, gid: Option<u32>) {
        std::os::unix::fs::lchown(path, uid, gid).unwrap();
    }

    #[test]
    fn write_rules_for_entries_and_ancestors() {
        let user = Trust {
            uid: 1000,
            gid: 1000,
            insecure: false,
        };
        let root = Trust {
            uid: 0,
            gid: 0,
            insecure: false,
        };
        use WriteRule::*;
        // (trust, mode, gid, holds_entry, broken rule)
        let cases = [
            (user, 0o755, 1000, true, None),
            (user, 0o775, 1000, true, Some(GroupOrOthers)),
            (user, 0o757, 1000, true, Some(GroupOrOthers)),
            // The directory holding a plugin is no shared drop box, sticky or not.
            (user, 0o1777, 0, true, Some(GroupOrOthers)),
            (user, 0o1777, 0, false, None),
            (user, 0o777, 0, false, Some(OthersNotSticky)),
            (user, 0o757, 1000, false, Some(OthersNotSticky)),
            // Group-writable ancestors: fine for root's group and the user's own group.
            (user, 0o775, 0, false, None),
            (user, 0o775, 1000, false, None),
            (
                user,
                0o775,
                100,
                false,
                Some(ForeignGroupNotSticky { gid: 100 }),
            ),
            (user, 0o1775, 100, false, None),
            (
                root,
                0o775,
                1000,
                false,
                Some(ForeignGroupNotSticky { gid: 1000 }),
            ),
            (root, 0o775, 0, false, None),
        ];
        for (trust, mode, gid, holds_entry, want) in cases {
            assert_eq!(
                trust.broken_write_rule(mode, gid, holds_entry),
                want,
                "uid {} mode {mode:o} gid {gid} holds_entry {holds_entry}",
                trust.uid
            );
        }
        assert!(user.owns(0) && user.owns(1000) && !user.owns(1001));
        assert!(root.owns(0) && !root.owns(1000));
    }

    #[test]
    fn refuses_writable_files_and_directories() {
        let dir = safe_dir();
        let ok = plugin_file(dir.path(), 0o644);
        vet(&ok, None).unwrap();
        set_mode(&ok, 0o666);
        let err = refusal(&ok);
        assert!(
            err.contains("file")
                && err.contains("writable by group or others")
                && err.contains("666"),
            "{err}"
        );
        set_mode(&ok, 0o644);
        set_mode(dir.path(), 0o777);
        let err = refusal(&ok);
        assert!(err.contains("directory") && err.contains("777"), "{err}");
        set_mode(dir.path(), 0o1777);
        let err = refusal(&ok);
        assert!(err.contains("directory") && err.contains("1777"), "{err}");
    }

    #[test]
    fn world_writable_ancestors_need_the_sticky_bit() {
        let top = safe_dir();
        let plugins = top.path().join("a/plugins");
        fs::create_dir_all(&plugins).unwrap();
        let file = plugin_file(&plugins, 0o644);
        vet(&file, None).unwrap();
        let open = top.path().join("a");
        set_mode(&open, 0o777);
        let err = refusal(&file);
        assert!(
            err.starts_with(&file.display().to_string())
                && err.contains(&format!("directory {} ", open.display()))
                && err.contains("writable by others without the sticky bit (mode 777)"),
            "{err}"
        );
        // Like /tmp: others may create entries but not rename or remove ours.
        set_mode(&open, 0o1777);
        vet(&file, None).unwrap();
        // A relative path with `..` is resolved from the working directory, as the kernel does.
        set_mode(&open, 0o777);
        let err = refusal(&relative_to_cwd(&file));
        assert!(
            err.contains(&format!("directory {} ", open.display())),
            "{err}"
        );
    }

    /// `file` relative to the working directory (`..` up to `/`, then down).
    fn relative_to_cwd(file: &Path) -> PathBuf {
        let cwd = std::env::current_dir().unwrap();
        let mut relative: PathBuf =
            std::iter::repeat_n("..", cwd.components().count() - 1).collect();
        relative.push(file.strip_prefix("/").unwrap());
        relative
    }

    #[test]
    fn a_link_in_a_writable_directory_is_refused_though_its_target_is_safe() {
        let top = safe_dir();
        let safe = top.path().join("safe");
        fs::create_dir(&safe).unwrap();
        let target = plugin_file(&safe, 0o644);
        let open = top.path().join("open");
        fs::create_dir(&open).unwrap();
        let link = open.join("liblink.so");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        vet(&link, None).unwrap();
        for mode in [0o777, 0o1777, 0o775] {
            set_mode(&open, mode);
            let err = refusal(&link);
            assert!(
                err.contains(&format!("directory {} ", open.display()))
                    && err.contains("writable by group or others"),
                "{mode:o}: {err}"
            );
        }
        // And the target's own directory is checked too.
        set_mode(&open, 0o755);
        set_mode(&safe, 0o777);
        let err = refusal(&link);
        assert!(
            err.contains(&format!("directory {} ", safe.display())),
            "{err}"
        );
        // A relative link through `..` resolves the way the kernel resolves it.
        set_mode(&safe, 0o755);
        let relative = open.join("librel.so");
        std::os::unix::fs::symlink("../safe/libx.so", &relative).unwrap();
        vet(&relative, None).unwrap();
        // A link to a link in an open directory: that directory holds an entry too.
        let hop = top.path().join("hop");
        fs::create_dir(&hop).unwrap();
        std::os::unix::fs::symlink(&target, hop.join("libhop.so")).unwrap();
        let chained = open.join("libchain.so");
        std::os::unix::fs::symlink(hop.join("libhop.so"), &chained).unwrap();
        vet(&chained, None).unwrap();
        set_mode(&hop, 0o1777);
        assert!(refusal(&chained).contains(&format!("directory {} ", hop.display())));
    }

    #[test]
    fn link_loops_and_non_files_are_refused() {
        let dir = safe_dir();
        let a = dir.path().join("liba.so");
        let b = dir.path().join("libb.so");
        std::os::unix::fs::symlink(&b, &a).unwrap();
        std::os::unix::fs::symlink(&a, &b).unwrap();
        assert!(
            refusal(&a).contains("too many levels of symbolic links"),
            "{}",
            refusal(&a)
        );
        let sub = dir.path().join("libdir.so");
        fs::create_dir(&sub).unwrap();
        assert!(refusal(&sub).contains("not a regular file"));
        let missing = dir.path().join("libmissing.so");
        assert!(refusal(&missing).contains("cannot read"));
    }

    #[test]
    fn files_and_directories_of_another_uid_are_refused() {
        let me = Trust::current();
        let dir = safe_dir();
        let file = plugin_file(dir.path(), 0o644);
        if me.uid != 0 {
            // Only root can give files away. To a host running as another (non-root) uid, this
            // process's files are another uid's; the first one met on the way is named.
            let stranger = Trust {
                uid: me.uid + 1,
                ..me
            };
            let err = open_with(&file, None, &stranger).unwrap_err().to_string();
            assert!(
                err.contains(&format!("is owned by uid {}", me.uid)),
                "{err}"
            );
            eprintln!("not root: layouts owned by another uid were not built");
            return;
        }
        chown(&file, Some(STRANGER), None);
        let err = refusal(&file);
        assert!(
            err.contains(&format!(
                "file {} is owned by uid {STRANGER}",
                file.display()
            )),
            "{err}"
        );
        chown(&file, Some(0), None);
        vet(&file, None).unwrap();
        chown(dir.path(), Some(STRANGER), None);
        let err = refusal(&file);
        assert!(
            err.contains(&format!(
                "directory {} is owned by uid {STRANGER}",
                dir.path().display()
            )),
            "{err}"
        );
        chown(dir.path(), Some(0), None);
        // A link owned by another uid is not followed, wherever it points.
        let link = dir.path().join("liblink.so");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        chown(&link, Some(STRANGER), None);
        let err = refusal(&link);
        assert!(
            err.contains(&format!(
                "symbolic link {} is owned by uid {STRANGER}",
                link.display()
            )),
            "{err}"
        );
        // A group-writable ancestor of a group that is neither root's nor ours.
        let shared = dir.path().join("shared");
        let nested = shared.join("plugins");
        fs::create_dir_all(&nested).unwrap();
        let inner = plugin_file(&nested, 0o644);
        set_mode(&shared, 0o775);
        vet(&inner, None).unwrap();
        chown(&shared, None, Some(STRANGER));
        let err = refusal(&inner);
        assert!(
            err.contains(&format!("writable by group {STRANGER}")),
            "{err}"
        );
        set_mode(&shared, 0o1775);
        vet(&inner, None).unwrap();
    }

    #[test]
    fn the_insecure_switch_only_relaxes_ownership_and_modes() {
        let dir = safe_dir();
        let file = plugin_file(dir.path(), 0o666);
        set_mode(dir.path(), 0o777);
        let insecure = Trust {
            insecure: true,
            ..Trust::current()
        };
        assert!(vet(&file, None).is_err());
        open_with(&file, None, &insecure).unwrap();
        let list = dir.path().join("allow.sha256");
        fs::write(&list, format!("{}  other.so\n", "0".repeat(64))).unwrap();
        let err = open_with(
            &file,
            Some(&AllowList::from_file(&list).unwrap()),
            &insecure,
        )
        .unwrap_err();
        assert!(matches!(err, LoadError::NotAllowListed { .. }), "{err}");
    }

    #[test]
    fn the_opened_file_is_the_checked_file_after_a_swap() {
        let dir = safe_dir();
        let file = plugin_file(dir.path(), 0o644);
        let original = fs::metadata(&file).unwrap().ino();
        let opened = vet(&file, None).unwrap();
        // The path is renamed over after the check: the loader's path still names the checked file.
        let other = dir.path().join("other");
        fs::write(&other, b"evil").unwrap();
        fs::rename(&other, &file).unwrap();
        let loader_path = opened.loader_path();
        assert_eq!(fs::metadata(&loader_path).unwrap().ino(), original);
        assert_eq!(fs::read(&loader_path).unwrap(), b"bytes");
        assert_eq!(fs::read(&file).unwrap(), b"evil");
    }

    #[test]
    fn a_swap_between_resolving_and_opening_is_refused() {
        let dir = safe_dir();
        let file = plugin_file(dir.path(), 0o644);
        let trust = Trust::current();
        let resolved = resolve(&file, &trust).unwrap();
        let other = dir.path().join("other");
        fs::write(&other, b"evil").unwrap();
        fs::rename(&other, &file).unwrap();
        let err = open_resolved(&file, &resolved, None, &trust).unwrap_err();
        assert!(err.to_string().contains("was replaced"), "{err}");
        let resolved = resolve(&file, &trust).unwrap();
        fs::remove_file(&file).unwrap();
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), &file).unwrap();
        let err = open_resolved(&file, &resolved, None, &trust).unwrap_err();
        assert!(err.to_string().contains("became a symbolic link"), "{err}");
    }

    #[test]
    fn truncated_elf_files_are_refused_before_dlopen() {
        let dir = safe_dir();
        // This test binary is a complete ELF file; a prefix of it is a truncated one.
        let exe = fs::read(std::env::current_exe().unwrap()).unwrap();
        let whole = dir.path().join("libwhole.so");
        fs::write(&whole, &exe).unwrap();
        set_mode(&whole, 0o644);
        vet(&whole, None).unwrap();
        for keep in [exe.len() / 2, 64 * 1024, 100] {
            let cut = dir.path().join("libcut.so");
            fs::write(&cut, &exe[..keep]).unwrap();
            set_mode(&cut, 0o644);
            let err = refusal(&cut);
            assert!(
                err.contains("truncated or corrupt library") && err.contains("libcut.so"),
                "{keep}: {err}"
            );
        }
    }

    #[test]
    fn allow_list_matches_digests() {
        let dir = safe_dir();
        let p = plugin_file(dir.path(), 0o644);
        let digest = sha256(fs::File::open(&p).unwrap()).unwrap();
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
