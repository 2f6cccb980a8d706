//! Checkpoint directories in verl's layout: `<default_local_dir>/global_step_N/{actor,critic,…}`
//! and `latest_checkpointed_iteration.txt`. A checkpoint is written into a hidden temporary
//! directory, fsynced, renamed into place, and only then recorded as the latest, so a crash at any
//! point leaves either the previous checkpoint or the new one — never half of one that resume
//! would pick up.

use std::fs;
use std::path::{Path, PathBuf};

pub const LATEST_FILE: &str = "latest_checkpointed_iteration.txt";
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

    /// Starts a checkpoint for `step` in a fresh temporary directory.
    pub fn begin(&self, step: u64) -> Result<Pending, CheckpointError> {
        let dir = self.root.join(format!(".{STEP_PREFIX}{step}.partial"));
        if dir.exists() {
            fs::remove_dir_all(&dir).map_err(io(&dir))?;
        }
        fs::create_dir_all(&dir).map_err(io(&dir))?;
        Ok(Pending { step, dir })
    }

    /// Makes `pending` durable and visible, records it as the latest, and prunes old ones.
    pub fn commit(&self, pending: Pending) -> Result<PathBuf, CheckpointError> {
        sync_tree(&pending.dir)?;
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
    /// crash by one checkpoint). Partial directories are never considered.
    pub fn latest(&self) -> Result<Option<(u64, PathBuf)>, CheckpointError> {
        let recorded = fs::read_to_string(self.root.join(LATEST_FILE))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok());
        if let Some(step) = recorded.filter(|&s| self.step_dir(s).is_dir()) {
            return Ok(Some((step, self.step_dir(step))));
        }
        Ok(self
            .complete_steps()?
            .last()
            .map(|&s| (s, self.step_dir(s))))
    }

    /// Validates an explicit `resume_from_path`.
    pub fn resolve_path(path: &Path) -> Result<(u64, PathBuf), CheckpointError> {
        match step_of(path) {
            Some(step) if path.is_dir() => Ok((step, path.to_path_buf())),
            _ => Err(CheckpointError::NotACheckpoint(path.to_path_buf())),
        }
    }
}

fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(io(dir))
}

fn sync_tree(dir: &Path) -> Result<(), CheckpointError> {
    for entry in fs::read_dir(dir).map_err(io(dir))? {
        let path = entry.map_err(io(dir))?.path();
        if path.is_dir() {
            sync_tree(&path)?;
        } else {
            fs::File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(io(&path))?;
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
}
