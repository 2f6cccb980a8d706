//! Checkpoint directories in verl's layout: `<default_local_dir>/global_step_N/{actor,critic,…}`
//! and `latest_checkpointed_iteration.txt`. A checkpoint is written into a hidden temporary
//! directory, fsynced, renamed into place, and only then recorded as the latest, so a crash at any
//! point leaves either the previous checkpoint or the new one — never half of one that resume
//! would pick up.
//!
//! Before the rename, a manifest ([`MANIFEST_FILE`]: relative path, size and sha256 of every file)
//! is written next to the components' files; loading verifies every file against it before any
//! component reads one, so a flipped byte or a truncated file is an error naming the file, and
//! `resume_mode=auto` passes over a corrupt checkpoint for the newest intact one. A checkpoint
//! without a manifest (written before manifests existed) loads unverified.

use std::fs;
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};
use verl_plugin_host::vet::sha256;

/// The sha256 of a file's content, as lowercase hex.
fn sha256_file(path: &Path) -> std::io::Result<String> {
    sha256(std::fs::File::open(path)?)
}

pub const LATEST_FILE: &str = "latest_checkpointed_iteration.txt";
/// The per-file digests of a checkpoint, at the root of its `global_step_N` directory.
pub const MANIFEST_FILE: &str = "manifest.sha256.json";
const STEP_PREFIX: &str = "global_step_";

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{}: {error}", path.display())]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("resume path {} is not a checkpoint directory (expected …/global_step_N)", .0.display())]
    NotACheckpoint(PathBuf),
    /// A file disagrees with the checkpoint's manifest (or the manifest itself is unreadable).
    #[error("checkpoint {} is corrupt: {file}: {reason}", dir.display())]
    Corrupt {
        dir: PathBuf,
        /// Relative to `dir`.
        file: String,
        reason: String,
    },
    /// `resume_mode=auto` found checkpoints, but none is intact.
    #[error(
        "no intact checkpoint in {} to resume from ({}); remove the corrupt ones or set trainer.resume_mode=disable",
        root.display(),
        corrupt.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
    )]
    NoneIntact {
        root: PathBuf,
        corrupt: Vec<CheckpointError>,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |error| CheckpointError::Io {
        path: path.to_path_buf(),
        error,
    }
}

/// The step of a `global_step_N` directory name.
pub fn step_of(dir: &Path) -> Option<u64> {
    dir.file_name()?
        .to_str()?
        .strip_prefix(STEP_PREFIX)?
        .parse()
        .ok()
}

/// [`MANIFEST_FILE`]'s content.
#[derive(Debug, Serialize, Deserialize)]
struct Manifest {
    files: Vec<ManifestEntry>,
}

#[derive(Debug, Serialize, Deserialize)]
struct ManifestEntry {
    /// Relative to the checkpoint directory, `/`-separated.
    path: String,
    size: u64,
    sha256: String,
}

/// What [`CheckpointManager::verify`] could vouch for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Integrity {
    /// Every file of the manifest is present with its size and digest.
    Verified { files: usize, bytes: u64 },
    /// No manifest: written before manifests existed; nothing could be checked.
    Unverified,
}

/// A checkpoint to resume from, as [`CheckpointManager::latest_intact`] chose it.
#[derive(Debug)]
pub struct Resumable {
    pub step: u64,
    pub dir: PathBuf,
    pub integrity: Integrity,
    /// Newer checkpoints passed over because they are corrupt, newest first.
    pub passed_over: Vec<CheckpointError>,
}

#[derive(Debug, Clone)]
pub struct CheckpointManager {
    root: PathBuf,
    max_keep: Option<usize>,
}

/// A checkpoint being written; components write under [`Pending::dir`].
#[derive(Debug)]
pub struct Pending {
    step: u64,
    dir: PathBuf,
}

impl Pending {
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl CheckpointManager {
    /// `max_keep`: how many checkpoints to keep (oldest removed first); `None` keeps all.
    pub fn new(root: impl Into<PathBuf>, max_keep: Option<usize>) -> Self {
        Self {
            root: root.into(),
            max_keep,
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn step_dir(&self, step: u64) -> PathBuf {
        self.root.join(format!("{STEP_PREFIX}{step}"))
    }

    /// Removes what an interrupted save left (`.global_step_N.partial` directories, a half-written
    /// latest-step file); returns what was removed. Complete checkpoints are never touched.
    pub fn clean_leftovers(&self) -> Result<Vec<PathBuf>, CheckpointError> {
        let entries = match fs::read_dir(&self.root) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io(&self.root)(e)),
        };
        let mut removed = Vec::new();
        for entry in entries.filter_map(Result::ok) {
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = entry.path();
            if name.starts_with(&format!(".{STEP_PREFIX}")) && name.ends_with(".partial") {
                fs::remove_dir_all(&path).map_err(io(&path))?;
            } else if name == format!(".{LATEST_FILE}.tmp") {
                fs::remove_file(&path).map_err(io(&path))?;
            } else {
                continue;
            }
            removed.push(path);
        }
        Ok(removed)
    }

    /// Where the checkpoint of `step` is written before its commit (what [`Self::begin`] makes).
    pub fn partial_dir(&self, step: u64) -> PathBuf {
        self.root.join(format!(".{STEP_PREFIX}{step}.partial"))
    }

    /// Syncs the files under `dir` to disk: a rank's own files, before it reports them written.
    /// Other ranks may still be writing there: a file that vanishes meanwhile (a temporary renamed
    /// into place) is theirs to sync.
    pub fn sync(dir: &Path) -> Result<(), CheckpointError> {
        sync_tree(dir, true)
    }

    /// Starts a checkpoint for `step` in a fresh temporary directory.
    pub fn begin(&self, step: u64) -> Result<Pending, CheckpointError> {
        let dir = self.partial_dir(step);
        if dir.exists() {
            fs::remove_dir_all(&dir).map_err(io(&dir))?;
        }
        fs::create_dir_all(&dir).map_err(io(&dir))?;
        Ok(Pending { step, dir })
    }

    /// Seals `pending` with its manifest, makes it durable and visible, records it as the latest,
    /// and prunes old ones.
    pub fn commit(&self, pending: Pending) -> Result<PathBuf, CheckpointError> {
        write_manifest(&pending.dir)?;
        sync_tree(&pending.dir, false)?;
        let target = self.step_dir(pending.step);
        if target.exists() {
            fs::remove_dir_all(&target).map_err(io(&target))?;
        }
        fs::rename(&pending.dir, &target).map_err(io(&target))?;
        sync_dir(&self.root)?;
        let latest = self.root.join(LATEST_FILE);
        let tmp = self.root.join(format!(".{LATEST_FILE}.tmp"));
        fs::write(&tmp, pending.step.to_string()).map_err(io(&tmp))?;
        fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(io(&tmp))?;
        fs::rename(&tmp, &latest).map_err(io(&latest))?;
        sync_dir(&self.root)?;
        self.prune()?;
        Ok(target)
    }

    fn complete_steps(&self) -> Result<Vec<u64>, CheckpointError> {
        let entries = match fs::read_dir(&self.root) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => {
                return Err(CheckpointError::Io {
                    path: self.root.clone(),
                    error: e,
                });
            }
        };
        let mut steps: Vec<u64> = entries
            .filter_map(|e| e.ok())
            .filter(|e| e.path().is_dir())
            .filter_map(|e| step_of(&e.path()))
            .collect();
        steps.sort_unstable();
        Ok(steps)
    }

    fn prune(&self) -> Result<(), CheckpointError> {
        let Some(keep) = self.max_keep.filter(|&k| k > 0) else {
            return Ok(());
        };
        let steps = self.complete_steps()?;
        for step in &steps[..steps.len().saturating_sub(keep)] {
            let dir = self.step_dir(*step);
            fs::remove_dir_all(&dir).map_err(io(&dir))?;
        }
        Ok(())
    }

    /// The checkpoint `resume_mode=auto` continues from: the one `latest_checkpointed_iteration.txt`
    /// names if it exists, else the highest complete `global_step_N` (the tracker file may lag a
    /// crash by one checkpoint). Partial directories are never considered. Not verified.
    pub fn latest(&self) -> Result<Option<(u64, PathBuf)>, CheckpointError> {
        Ok(self.candidates()?.first().map(|&s| (s, self.step_dir(s))))
    }

    /// Resume candidates, best first: the recorded latest (if its directory exists), then every
    /// other complete checkpoint, newest first.
    fn candidates(&self) -> Result<Vec<u64>, CheckpointError> {
        let recorded = fs::read_to_string(self.root.join(LATEST_FILE))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .filter(|&s| self.step_dir(s).is_dir());
        let mut steps = self.complete_steps()?;
        steps.reverse();
        if let Some(recorded) = recorded {
            steps.retain(|&s| s != recorded);
            steps.insert(0, recorded);
        }
        Ok(steps)
    }

    /// [`CheckpointManager::latest`], verified: a corrupt checkpoint is passed over for the next
    /// candidate (reported in [`Resumable::passed_over`]). `None` when there is no checkpoint; an
    /// error when there are some but none is intact.
    pub fn latest_intact(&self) -> Result<Option<Resumable>, CheckpointError> {
        let mut passed_over = Vec::new();
        for step in self.candidates()? {
            let dir = self.step_dir(step);
            match Self::verify(&dir) {
                Ok(integrity) => {
                    return Ok(Some(Resumable {
                        step,
                        dir,
                        integrity,
                        passed_over,
                    }));
                }
                Err(e @ CheckpointError::Corrupt { .. }) => passed_over.push(e),
                Err(e) => return Err(e),
            }
        }
        if passed_over.is_empty() {
            Ok(None)
        } else {
            Err(CheckpointError::NoneIntact {
                root: self.root.clone(),
                corrupt: passed_over,
            })
        }
    }

    /// Checks every file of `dir`'s manifest: present, of its size, with its digest. Sizes are
    /// checked first (a truncated or missing file fails before anything is hashed). Files the
    /// manifest does not list are not part of the checkpoint and are ignored.
    pub fn verify(dir: &Path) -> Result<Integrity, CheckpointError> {
        let corrupt = |file: &str, reason: String| CheckpointError::Corrupt {
            dir: dir.to_path_buf(),
            file: file.to_owned(),
            reason,
        };
        let manifest_path = dir.join(MANIFEST_FILE);
        let text = match fs::read(&manifest_path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Integrity::Unverified),
            Err(e) => return Err(io(&manifest_path)(e)),
        };
        let manifest: Manifest = serde_json::from_slice(&text)
            .map_err(|e| corrupt(MANIFEST_FILE, format!("unreadable manifest: {e}")))?;
        let mut files = Vec::with_capacity(manifest.files.len());
        for entry in &manifest.files {
            let relative = Path::new(&entry.path);
            if !relative
                .components()
                .all(|c| matches!(c, Component::Normal(_)))
            {
                return Err(corrupt(
                    MANIFEST_FILE,
                    format!("lists `{}`, which is not inside the checkpoint", entry.path),
                ));
            }
            let path = dir.join(relative);
            let size = match fs::metadata(&path) {
                Ok(meta) if meta.is_file() => meta.len(),
                Ok(_) => return Err(corrupt(&entry.path, "is not a regular file".to_owned())),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(corrupt(&entry.path, "missing".to_owned()));
                }
                Err(e) => return Err(io(&path)(e)),
            };
            if size != entry.size {
                return Err(corrupt(
                    &entry.path,
                    format!(
                        "{size} bytes, the manifest says {} (truncated or replaced)",
                        entry.size
                    ),
                ));
            }
            files.push((entry, path));
        }
        for (entry, path) in &files {
            let digest = sha256_file(path).map_err(io(path))?;
            if digest != entry.sha256 {
                return Err(corrupt(
                    &entry.path,
                    format!(
                        "sha256 {digest} differs from the manifest's {} (the file changed after it was saved)",
                        entry.sha256
                    ),
                ));
            }
        }
        Ok(Integrity::Verified {
            files: files.len(),
            bytes: manifest.files.iter().map(|e| e.size).sum(),
        })
    }

    /// Validates an explicit `resume_from_path`.
    pub fn resolve_path(path: &Path) -> Result<(u64, PathBuf), CheckpointError> {
        match step_of(path) {
            Some(step) if path.is_dir() => Ok((step, path.to_path_buf())),
            _ => Err(CheckpointError::NotACheckpoint(path.to_path_buf())),
        }
    }
}

/// Every file under `dir`, as `/`-separated relative paths (with `prefix`), sorted.
fn list_files(
    dir: &Path,
    prefix: &str,
    out: &mut Vec<(String, PathBuf)>,
) -> Result<(), CheckpointError> {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .map_err(io(dir))?
        .collect::<Result<_, _>>()
        .map_err(io(dir))?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let path = entry.path();
        let name = format!("{prefix}{}", entry.file_name().to_string_lossy());
        if entry.file_type().map_err(io(&path))?.is_dir() {
            list_files(&path, &format!("{name}/"), out)?;
        } else {
            out.push((name, path));
        }
    }
    Ok(())
}

/// Writes `dir`'s manifest: the size and sha256 of every file in it (fsynced with the rest by
/// [`sync_tree`]).
fn write_manifest(dir: &Path) -> Result<(), CheckpointError> {
    let mut listed = Vec::new();
    list_files(dir, "", &mut listed)?;
    let files = listed
        .into_iter()
        .filter(|(name, _)| name != MANIFEST_FILE)
        .map(|(name, path)| {
            let size = fs::metadata(&path).map_err(io(&path))?.len();
            let sha256 = sha256_file(&path).map_err(io(&path))?;
            Ok(ManifestEntry {
                path: name,
                size,
                sha256,
            })
        })
        .collect::<Result<_, CheckpointError>>()?;
    let path = dir.join(MANIFEST_FILE);
    let text = serde_json::to_vec_pretty(&Manifest { files }).expect("the manifest serialises");
    fs::write(&path, text).map_err(io(&path))
}

fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(io(dir))
}

/// `skip_vanished`: an entry gone between listing and opening is passed over.
fn sync_tree(dir: &Path, skip_vanished: bool) -> Result<(), CheckpointError> {
    for entry in fs::read_dir(dir).map_err(io(dir))? {
        let path = entry.map_err(io(dir))?.path();
        let synced = if path.is_dir() {
            sync_tree(&path, skip_vanished)
        } else {
            fs::File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(io(&path))
        };
        match synced {
            Err(CheckpointError::Io { error, .. })
                if skip_vanished && error.kind() == std::io::ErrorKind::NotFound => {}
            other => other?,
        }
    }
    sync_dir(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_step(manager: &CheckpointManager, step: u64) -> PathBuf {
        let pending = manager.begin(step).unwrap();
        fs::create_dir_all(pending.dir().join("actor")).unwrap();
        fs::write(pending.dir().join("actor/model.bin"), step.to_string()).unwrap();
        manager.commit(pending).unwrap()
    }

    #[test]
    fn commits_atomically_records_latest_and_prunes() {
        let root = tempfile::tempdir().unwrap();
        let manager = CheckpointManager::new(root.path().join("ckpt"), Some(2));
        assert!(manager.latest().unwrap().is_none());
        for step in [2, 4, 6] {
            let dir = write_step(&manager, step);
            assert_eq!(step_of(&dir), Some(step));
        }
        assert_eq!(
            fs::read_to_string(root.path().join("ckpt").join(LATEST_FILE)).unwrap(),
            "6"
        );
        assert!(!manager.step_dir(2).exists(), "oldest pruned");
        assert!(manager.step_dir(4).exists() && manager.step_dir(6).exists());
        assert_eq!(manager.latest().unwrap().unwrap().0, 6);
    }

    #[test]
    fn a_crash_mid_save_leaves_the_previous_checkpoint_as_latest() {
        let root = tempfile::tempdir().unwrap();
        let manager = CheckpointManager::new(root.path(), None);
        write_step(&manager, 3);
        // Killed while writing step 5: only the partial directory exists.
        let pending = manager.begin(5).unwrap();
        fs::write(pending.dir().join("half"), "x").unwrap();
        drop(pending);
        assert_eq!(manager.latest().unwrap().unwrap().0, 3);
        // Killed after the rename but before the latest file was updated: the complete step 5 wins.
        write_step(&manager, 5);
        fs::write(root.path().join(LATEST_FILE), "3").unwrap();
        assert_eq!(
            manager.latest().unwrap().unwrap().0,
            3,
            "the recorded latest is honoured while it exists"
        );
        fs::remove_dir_all(manager.step_dir(3)).unwrap();
        assert_eq!(manager.latest().unwrap().unwrap().0, 5);
    }

    #[test]
    fn resume_path_must_be_a_step_directory() {
        let root = tempfile::tempdir().unwrap();
        let manager = CheckpointManager::new(root.path(), None);
        let dir = write_step(&manager, 7);
        assert_eq!(CheckpointManager::resolve_path(&dir).unwrap().0, 7);
        let err = CheckpointManager::resolve_path(root.path())
            .unwrap_err()
            .to_string();
        assert!(err.contains("global_step_N"), "{err}");
    }

    /// Flips one bit of `path` in place.
    fn flip_byte(path: &Path) {
        let mut bytes = fs::read(path).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0x01;
        fs::write(path, bytes).unwrap();
    }

    fn corrupt_file(err: CheckpointError) -> (PathBuf, String, String) {
        match err {
            CheckpointError::Corrupt { dir, file, reason } => (dir, file, reason),
            other => panic!("expected a corrupt checkpoint, got {other}"),
        }
    }

    #[test]
    fn the_manifest_lists_every_file_and_verifies() {
        let root = tempfile::tempdir().unwrap();
        let manager = CheckpointManager::new(root.path(), None);
        let pending = manager.begin(3).unwrap();
        fs::create_dir_all(pending.dir().join("actor/sub")).unwrap();
        fs::write(pending.dir().join("actor/model.bin"), vec![7u8; 5000]).unwrap();
        fs::write(pending.dir().join("actor/sub/state.json"), "{}").unwrap();
        fs::write(pending.dir().join("trainer_state.json"), "{\"a\": 1}").unwrap();
        let dir = manager.commit(pending).unwrap();

        let manifest: Manifest =
            serde_json::from_slice(&fs::read(dir.join(MANIFEST_FILE)).unwrap()).unwrap();
        let listed: Vec<(&str, u64)> = manifest
            .files
            .iter()
            .map(|e| (e.path.as_str(), e.size))
            .collect();
        assert_eq!(
            listed,
            [
                ("actor/model.bin", 5000),
                ("actor/sub/state.json", 2),
                ("trainer_state.json", 8)
            ]
        );
        let digest = &manifest.files[1].sha256;
        assert_eq!(
            digest,
            &sha256_file(&dir.join("actor/sub/state.json")).unwrap()
        );
        assert_eq!(
            CheckpointManager::verify(&dir).unwrap(),
            Integrity::Verified {
                files: 3,
                bytes: 5010
            }
        );
        // A file the manifest does not list is not part of the checkpoint.
        fs::write(dir.join("notes.txt"), "mine").unwrap();
        assert!(matches!(
            CheckpointManager::verify(&dir).unwrap(),
            Integrity::Verified { files: 3, .. }
        ));
    }

    #[test]
    fn a_flipped_byte_a_truncated_or_missing_file_names_the_file() {
        let root = tempfile::tempdir().unwrap();
        let manager = CheckpointManager::new(root.path(), None);
        let dir = write_step(&manager, 10);
        let model = dir.join("actor/model.bin");
        fs::write(&model, vec![1u8; 4096]).unwrap();
        // Rewrite the manifest for the new content, as a save would have.
        write_manifest(&dir).unwrap();
        CheckpointManager::verify(&dir).unwrap();

        flip_byte(&model);
        let (bad_dir, file, reason) = corrupt_file(CheckpointManager::verify(&dir).unwrap_err());
        assert_eq!(
            (bad_dir.as_path(), file.as_str()),
            (dir.as_path(), "actor/model.bin")
        );
        assert!(reason.contains("sha256"), "{reason}");

        fs::write(&model, vec![1u8; 100]).unwrap();
        let err = CheckpointManager::verify(&dir).unwrap_err();
        let message = err.to_string();
        let (_, file, reason) = corrupt_file(err);
        assert_eq!(file, "actor/model.bin");
        assert!(
            reason.contains("100 bytes, the manifest says 4096"),
            "{reason}"
        );
        assert!(
            message.contains("global_step_10") && message.contains("actor/model.bin"),
            "{message}"
        );

        fs::remove_file(&model).unwrap();
        let (_, file, reason) = corrupt_file(CheckpointManager::verify(&dir).unwrap_err());
        assert_eq!(
            (file.as_str(), reason.as_str()),
            ("actor/model.bin", "missing")
        );

        fs::write(dir.join(MANIFEST_FILE), "{\"files\": [").unwrap();
        let (_, file, _) = corrupt_file(CheckpointManager::verify(&dir).unwrap_err());
        assert_eq!(file, MANIFEST_FILE);

        let escaping = r#"{"files": [{"path": "../elsewhere", "size": 1, "sha256": "00"}]}"#;
        fs::write(dir.join(MANIFEST_FILE), escaping).unwrap();
        let (_, file, reason) = corrupt_file(CheckpointManager::verify(&dir).unwrap_err());
        assert_eq!(file, MANIFEST_FILE);
        assert!(reason.contains("../elsewhere"), "{reason}");
    }

    #[test]
    fn a_checkpoint_without_a_manifest_is_unverified() {
        let root = tempfile::tempdir().unwrap();
        let manager = CheckpointManager::new(root.path(), None);
        let dir = write_step(&manager, 4);
        fs::remove_file(dir.join(MANIFEST_FILE)).unwrap();
        assert_eq!(
            CheckpointManager::verify(&dir).unwrap(),
            Integrity::Unverified
        );
        let found = manager.latest_intact().unwrap().unwrap();
        assert_eq!((found.step, found.integrity), (4, Integrity::Unverified));
    }

    #[test]
    fn auto_resume_passes_over_corrupt_checkpoints_newest_first() {
        let root = tempfile::tempdir().unwrap();
        let manager = CheckpointManager::new(root.path(), None);
        assert!(manager.latest_intact().unwrap().is_none());
        for step in [2, 4, 6] {
            write_step(&manager, step);
        }
        let found = manager.latest_intact().unwrap().unwrap();
        assert_eq!(found.step, 6);
        assert!(found.passed_over.is_empty());

        flip_byte(&manager.step_dir(6).join("actor/model.bin"));
        fs::write(manager.step_dir(4).join("actor/model.bin"), "").unwrap();
        let found = manager.latest_intact().unwrap().unwrap();
        assert_eq!((found.step, &found.dir), (2, &manager.step_dir(2)));
        let passed: Vec<(PathBuf, String)> = found
            .passed_over
            .into_iter()
            .map(|e| {
                let (dir, file, _) = corrupt_file(e);
                (dir, file)
            })
            .collect();
        assert_eq!(
            passed,
            [
                (manager.step_dir(6), "actor/model.bin".to_owned()),
                (manager.step_dir(4), "actor/model.bin".to_owned())
            ]
        );

        fs::remove_file(manager.step_dir(2).join("actor/model.bin")).unwrap();
        let err = manager.latest_intact().unwrap_err();
        assert!(matches!(&err, CheckpointError::NoneIntact { corrupt, .. } if corrupt.len() == 3));
        let message = err.to_string();
        for step in [2, 4, 6] {
            assert!(
                message.contains(&format!("global_step_{step}")),
                "{message}"
            );
        }
        assert!(message.contains("resume_mode=disable"), "{message}");
    }

    #[test]
    fn the_recorded_latest_is_tried_first() {
        let root = tempfile::tempdir().unwrap();
        let manager = CheckpointManager::new(root.path(), None);
        for step in [2, 4, 6] {
            write_step(&manager, step);
        }
        fs::write(root.path().join(LATEST_FILE), "4").unwrap();
        assert_eq!(manager.candidates().unwrap(), [4, 6, 2]);
        assert_eq!(manager.latest_intact().unwrap().unwrap().step, 4);
        flip_byte(&manager.step_dir(4).join("actor/model.bin"));
        assert_eq!(manager.latest_intact().unwrap().unwrap().step, 6);
    }
}
