//! A double-buffered weight store on disk: two slots and a pointer, so that a reader always gets
//! one complete version while the next one is written, and never an older version than one it
//! has seen.
//!
//! Layout of the store directory:
//! - `slot_0/`, `slot_1/`: one payload file each (e.g. `model.safetensors`) and `SLOT`, the
//!   slot's own record `version crc32 length` written after the payload;
//! - `slot_0.lock`, `slot_1.lock`: `flock` locks; the writer holds a slot's lock exclusively
//!   while it rewrites the slot, a reader holds it shared while it reads;
//! - `CURRENT`: `slot version crc32 length` of the newest complete slot, replaced atomically
//!   (write a temporary file, fsync, rename).
//!
//! The writer fills the slot `CURRENT` does not point to and then flips `CURRENT`. A reader
//! follows `CURRENT`, locks that slot shared and trusts the slot's own record (the slot may have
//! been rewritten with a newer version between reading `CURRENT` and taking the lock — never
//! with an older one), then checks the payload's CRC-32 against it. Because the writer cannot
//! take a slot a reader holds, a reader never sees a torn payload; a CRC mismatch means the
//! files were damaged outside this protocol (or a writer died mid-write in a slot that
//! `CURRENT` already named, which the protocol never does) and is an error, not a retry.
//!
//! The price of two slots: a writer that comes back to a slot a slow reader still holds waits for
//! that reader (a third slot would let it skip ahead instead).

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// Why the store could not publish or read.
#[derive(Debug, thiserror::Error)]
pub enum SlotError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: malformed slot record `{text}` (expected `slot version crc32 length`)")]
    Record { path: PathBuf, text: String },
    #[error(
        "{path}: checksum mismatch for version {version}: the record says crc32 {expected:08x} over {length} bytes, the file has {found:08x} over {found_length} bytes"
    )]
    Checksum {
        path: PathBuf,
        version: u64,
        expected: u32,
        length: u64,
        found: u32,
        found_length: u64,
    },
    #[error("version {version} is not newer than the store's version {current}")]
    NotNewer { version: u64, current: u64 },
    #[error("read version {version} after version {seen}: versions went backwards")]
    Backwards { version: u64, seen: u64 },
    #[error("{path}: the store has no published version yet")]
    Empty { path: PathBuf },
    #[error("writing the payload of version {version}: {message}")]
    Payload { version: u64, message: String },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SlotError + '_ {
    move |source| SlotError::Io {
        path: path.to_owned(),
        source,
    }
}

/// One slot's identity: which slot, the version it holds, its payload's CRC-32 and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotRecord {
    pub slot: usize,
    pub version: u64,
    pub crc32: u32,
    pub length: u64,
}

impl SlotRecord {
    fn text(&self) -> String {
        format!(
            "{} {} {:08x} {}\n",
            self.slot, self.version, self.crc32, self.length
        )
    }

    fn parse(path: &Path, text: &str) -> Result<Self, SlotError> {
        let bad = || SlotError::Record {
            path: path.to_owned(),
            text: text.trim().to_owned(),
        };
        let fields: Vec<&str> = text.split_whitespace().collect();
        let [slot, version, crc, length] = fields[..] else {
            return Err(bad());
        };
        let record = SlotRecord {
            slot: slot.parse().map_err(|_| bad())?,
            version: version.parse().map_err(|_| bad())?,
            crc32: u32::from_str_radix(crc, 16).map_err(|_| bad())?,
            length: length.parse().map_err(|_| bad())?,
        };
        if record.slot > 1 {
            return Err(bad());
        }
        Ok(record)
    }
}

/// An `flock` held until dropped (closing the file releases it).
struct Lock {
    _file: File,
}

impl Lock {
    fn take(path: &Path, exclusive: bool) -> Result<Lock, SlotError> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(path)
            .map_err(io(path))?;
        let op = if exclusive {
            libc::LOCK_EX
        } else {
            libc::LOCK_SH
        };
        loop {
            // SAFETY: flock on a file descriptor this function owns.
            if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
                return Ok(Lock { _file: file });
            }
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::Interrupted {
                return Err(io(path)(err));
            }
        }
    }
}

/// The CRC-32 and length of a file's content.
fn checksum(path: &Path) -> Result<(u32, u64), SlotError> {
    let mut file = File::open(path).map_err(io(path))?;
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut length = 0u64;
    loop {
        let n = file.read(&mut buf).map_err(io(path))?;
        if n == 0 {
            return Ok((hasher.finalize(), length));
        }
        hasher.update(&buf[..n]);
        length += n as u64;
    }
}

/// Writes `text` to `path` atomically: a temporary file in the same directory, fsynced, renamed.
fn write_atomically(path: &Path, text: &str) -> Result<(), SlotError> {
    let tmp = path.with_extension("tmp");
    let mut file = File::create(&tmp).map_err(io(&tmp))?;
    file.write_all(text.as_bytes()).map_err(io(&tmp))?;
    file.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

fn read_record(path: &Path) -> Result<Option<SlotRecord>, SlotError> {
    match std::fs::read_to_string(path) {
        Ok(text) => SlotRecord::parse(path, &text).map(Some),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io(path)(e)),
    }
}

/// A two-slot store in a directory; writer and readers may be different threads or processes,
/// each with its own `SlotStore` value on the same directory. One writer at a time.
#[derive(Debug, Clone)]
pub struct SlotStore {
    dir: PathBuf,
    file_name: String,
}

/// The pointer file's name.
pub const CURRENT: &str = "CURRENT";
const SLOT_RECORD: &str = "SLOT";

impl SlotStore {
    /// A store in `dir` (created if missing) whose slots hold one payload file named
    /// `file_name`.
    pub fn open(dir: impl Into<PathBuf>, file_name: &str) -> Result<Self, SlotError> {
        let dir = dir.into();
        for slot in 0..2 {
            let path = dir.join(format!("slot_{slot}"));
            std::fs::create_dir_all(&path).map_err(io(&path))?;
        }
        Ok(SlotStore {
            dir,
            file_name: file_name.to_owned(),
        })
    }

    /// The store a slot directory belongs to, when `dir` is one (`<store>/slot_N` beside a
    /// `CURRENT`): how the sync recognises a handover it must read under the slot's lock.
    pub fn of_slot_dir(dir: &Path, file_name: &str) -> Option<SlotStore> {
        let name = dir.file_name()?.to_str()?;
        let store = dir.parent()?;
        (matches!(name, "slot_0" | "slot_1") && store.join(CURRENT).is_file()).then(|| SlotStore {
            dir: store.to_owned(),
            file_name: file_name.to_owned(),
        })
    }

    /// Removes every published version (a new run starts its own sequence of versions).
    pub fn clear(&self) -> Result<(), SlotError> {
        let current = self.dir.join(CURRENT);
        match std::fs::remove_file(&current) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(&current)(e)),
            _ => {}
        }
        for slot in 0..2 {
            let _lock = Lock::take(&self.lock_path(slot), true)?;
            for name in [SLOT_RECORD, self.file_name.as_str()] {
                let path = self.slot_dir(slot).join(name);
                match std::fs::remove_file(&path) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                        return Err(io(&path)(e));
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }

    /// The directory of slot `slot` (what a reader loads from while it holds the slot).
    pub fn slot_dir(&self, slot: usize) -> PathBuf {
        self.dir.join(format!("slot_{slot}"))
    }

    fn lock_path(&self, slot: usize) -> PathBuf {
        self.dir.join(format!("slot_{slot}.lock"))
    }

    /// The newest complete version, as `CURRENT` names it.
    pub fn current(&self) -> Result<Option<SlotRecord>, SlotError> {
        read_record(&self.dir.join(CURRENT))
    }

    /// Publishes `version` (newer than the current one): `write` fills the payload file at the
    /// path it is given, in the slot no reader is directed to; then `CURRENT` flips to it.
    /// Waits while a reader still holds that slot.
    pub fn publish(
        &self,
        version: u64,
        write: impl FnOnce(&Path) -> Result<(), String>,
    ) -> Result<SlotRecord, SlotError> {
        let current = self.current()?;
        if let Some(c) = current.filter(|c| c.version >= version) {
            return Err(SlotError::NotNewer {
                version,
                current: c.version,
            });
        }
        let slot = current.map_or(0, |c| 1 - c.slot);
        let _lock = Lock::take(&self.lock_path(slot), true)?;
        let dir = self.slot_dir(slot);
        let payload = dir.join(&self.file_name);
        write(&payload).map_err(|message| SlotError::Payload { version, message })?;
        File::open(&payload)
            .and_then(|f| f.sync_all())
            .map_err(io(&payload))?;
        let (crc32, length) = checksum(&payload)?;
        let record = SlotRecord {
            slot,
            version,
            crc32,
            length,
        };
        write_atomically(&dir.join(SLOT_RECORD), &record.text())?;
        write_atomically(&self.dir.join(CURRENT), &record.text())?;
        Ok(record)
    }

    /// Reads the newest complete version: `read` gets the payload file's path while the slot is
    /// held (no writer can touch it), after its checksum was verified.
    pub fn read<T>(
        &self,
        read: impl FnOnce(&Path, &SlotRecord) -> T,
    ) -> Result<(SlotRecord, T), SlotError> {
        let Some(pointer) = self.current()? else {
            return Err(SlotError::Empty {
                path: self.dir.clone(),
            });
        };
        let _lock = Lock::take(&self.lock_path(pointer.slot), false)?;
        let dir = self.slot_dir(pointer.slot);
        // The slot's own record is the truth: it may hold a newer version than the pointer said.
        let record_path = dir.join(SLOT_RECORD);
        let record = read_record(&record_path)?.ok_or_else(|| SlotError::Record {
            path: record_path.clone(),
            text: String::new(),
        })?;
        if record.version < pointer.version {
            return Err(SlotError::Backwards {
                version: record.version,
                seen: pointer.version,
            });
        }
        let payload = dir.join(&self.file_name);
        let (found, found_length) = checksum(&payload)?;
        if (found, found_length) != (record.crc32, record.length) {
            return Err(SlotError::Checksum {
                path: payload,
                version: record.version,
                expected: record.crc32,
                length: record.length,
                found,
                found_length,
            });
        }
        let value = read(&payload, &record);
        Ok((record, value))
    }
}

/// A reader that also checks that the versions it sees never go backwards.
#[derive(Debug)]
pub struct SlotReader {
    store: SlotStore,
    seen: Option<u64>,
}

impl SlotReader {
    pub fn new(store: SlotStore) -> Self {
        SlotReader { store, seen: None }
    }

    /// [`SlotStore::read`], failing if the version is older than one read before.
    pub fn read<T>(
        &mut self,
        read: impl FnOnce(&Path, &SlotRecord) -> T,
    ) -> Result<(SlotRecord, T), SlotError> {
        let (record, value) = self.store.read(read)?;
        if let Some(seen) = self.seen.filter(|&s| record.version < s) {
            return Err(SlotError::Backwards {
                version: record.version,
                seen,
            });
        }
        self.seen = Some(record.version);
        Ok((record, value))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    /// A payload whose every byte depends on the version, with a version-dependent length.
    fn payload(version: u64) -> Vec<u8> {
        let len = 1 + (version as usize * 7919) % 65_536;
        (0..len)
            .map(|i| (version.wrapping_mul(31).wrapping_add(i as u64 * 131) % 251) as u8)
            .collect()
    }

    fn publish(store: &SlotStore, version: u64) -> Result<SlotRecord, SlotError> {
        store.publish(version, |path| {
            std::fs::write(path, payload(version)).map_err(|e| e.to_string())
        })
    }

    #[test]
    fn publishes_alternate_slots_and_reads_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        let store = SlotStore::open(dir.path(), "w.bin").unwrap();
        assert!(matches!(
            store.read(|_, _| ()),
            Err(SlotError::Empty { .. })
        ));
        let a = publish(&store, 1).unwrap();
        let b = publish(&store, 2).unwrap();
        let c = publish(&store, 5).unwrap();
        assert_eq!((a.slot, b.slot, c.slot), (0, 1, 0));
        let (record, bytes) = store.read(|p, _| std::fs::read(p).unwrap()).unwrap();
        assert_eq!(record, c);
        assert_eq!(bytes, payload(5));
        // The other slot still holds the previous complete version.
        assert_eq!(
            std::fs::read(store.slot_dir(1).join("w.bin")).unwrap(),
            payload(2)
        );
        let err = publish(&store, 5).unwrap_err();
        assert!(
            matches!(
                err,
                SlotError::NotNewer {
                    version: 5,
                    current: 5
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn a_damaged_slot_is_reported_not_returned() {
        let dir = tempfile::tempdir().unwrap();
        let store = SlotStore::open(dir.path(), "w.bin").unwrap();
        let r = publish(&store, 3).unwrap();
        let path = store.slot_dir(r.slot).join("w.bin");
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[0] ^= 1;
        std::fs::write(&path, bytes).unwrap();
        let err = store.read(|_, _| ()).unwrap_err();
        assert!(
            matches!(err, SlotError::Checksum { version: 3, .. })
                && err.to_string().contains("w.bin"),
            "{err}"
        );
        std::fs::write(dir.path().join(CURRENT), "7 x").unwrap();
        let err = store.read(|_, _| ()).unwrap_err();
        assert!(err.to_string().contains("CURRENT"), "{err}");
    }

    #[test]
    fn a_failed_write_leaves_the_current_version() {
        let dir = tempfile::tempdir().unwrap();
        let store = SlotStore::open(dir.path(), "w.bin").unwrap();
        publish(&store, 1).unwrap();
        let err = store
            .publish(2, |path| {
                std::fs::write(path, b"half").unwrap();
                Err("disk full".into())
            })
            .unwrap_err();
        assert!(err.to_string().contains("disk full"), "{err}");
        let (record, bytes) = store.read(|p, _| std::fs::read(p).unwrap()).unwrap();
        assert_eq!((record.version, bytes), (1, payload(1)));
    }

    /// The environment variable that turns [`reader_process`] into a reader of the store it names.
    const READER_STORE: &str = "VERL_WEIGHT_SLOTS_READER_STORE";

    /// Not a test of its own: the reader process of
    /// [`writer_and_reader_processes_agree`] (this test binary, started again with
    /// [`READER_STORE`] set); without the variable it returns at once. It reads until the
    /// store's `STOP` file appears, checking every read, and prints how many reads and versions
    /// it saw.
    #[test]
    fn reader_process() {
        let Ok(dir) = std::env::var(READER_STORE) else {
            return;
        };
        let dir = PathBuf::from(dir);
        let mut reader = SlotReader::new(SlotStore::open(&dir, "w.bin").unwrap());
        let (mut reads, mut distinct, mut last) = (0u64, 0u64, 0u64);
        while !dir.join("STOP").exists() {
            let (record, bytes) = reader
                .read(|p, _| std::fs::read(p).unwrap())
                .unwrap_or_else(|e| panic!("read {reads}: {e}"));
            assert_eq!(bytes, payload(record.version), "version {}", record.version);
            distinct += u64::from(record.version != last);
            last = record.version;
            reads += 1;
        }
        println!("READS {reads} {distinct}");
    }

    /// The same as the thread test across processes: two reader processes and this process
    /// writing 2,000 versions.
    #[test]
    fn writer_and_reader_processes_agree() {
        let dir = tempfile::tempdir().unwrap();
        let store = SlotStore::open(dir.path(), "w.bin").unwrap();
        publish(&store, 1).unwrap();
        let exe = std::env::current_exe().unwrap();
        let readers: Vec<_> = (0..2)
            .map(|_| {
                std::process::Command::new(&exe)
                    .args([
                        "--exact",
                        "weight_slots::tests::reader_process",
                        "--nocapture",
                    ])
                    .env(READER_STORE, dir.path())
                    .stdout(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for version in 2..=2000 {
            publish(&store, version).unwrap();
        }
        std::fs::write(dir.path().join("STOP"), b"").unwrap();
        for reader in readers {
            let out = reader.wait_with_output().unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "reader failed: {stdout}");
            let line = stdout
                .lines()
                .find_map(|l| l.strip_prefix("READS "))
                .unwrap_or_else(|| panic!("no count in {stdout}"));
            let counts: Vec<u64> = line.split(' ').map(|n| n.parse().unwrap()).collect();
            assert!(
                counts[0] > 0 && counts[1] > 1,
                "reads, versions: {counts:?}"
            );
        }
    }

    /// A writer flips thousands of versions while readers read continuously: every read is a
    /// complete version (its bytes are exactly that version's payload, the checksum holds) and
    /// each reader's versions never go backwards.
    #[test]
    fn concurrent_writer_and_readers_never_see_a_torn_or_older_version() {
        const FLIPS: u64 = 2000;
        let dir = tempfile::tempdir().unwrap();
        let store = SlotStore::open(dir.path(), "w.bin").unwrap();
        publish(&store, 1).unwrap();
        let done = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = (0..3)
            .map(|_| {
                // Each reader opens the store itself, as another process would.
                let store = SlotStore::open(dir.path(), "w.bin").unwrap();
                let done = Arc::clone(&done);
                std::thread::spawn(move || {
                    let mut reader = SlotReader::new(store);
                    let (mut reads, mut distinct, mut last) = (0u64, 0u64, 0u64);
                    while !done.load(Ordering::Relaxed) {
                        let (record, bytes) = reader
                            .read(|p, _| std::fs::read(p).unwrap())
                            .unwrap_or_else(|e| panic!("read {reads}: {e}"));
                        assert_eq!(bytes, payload(record.version), "version {}", record.version);
                        assert!(record.version >= last);
                        distinct += u64::from(record.version != last);
                        last = record.version;
                        reads += 1;
                    }
                    (reads, distinct, last)
                })
            })
            .collect();
        for version in 2..=FLIPS {
            publish(&store, version).unwrap();
        }
        done.store(true, Ordering::Relaxed);
        for reader in readers {
            let (reads, distinct, last) = reader.join().unwrap();
            assert!(
                reads > 0 && distinct > 1,
                "reads {reads}, distinct {distinct}"
            );
            assert!(last <= FLIPS);
        }
        assert_eq!(store.current().unwrap().unwrap().version, FLIPS);
    }
}
