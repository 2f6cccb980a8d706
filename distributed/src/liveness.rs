//! Which peer is gone. c10d reports a dead peer as "Connection closed by peer [addr]:port" on
//! the ranks next to it and as nothing at all on the others (they wait for their timeout), so
//! every rank keeps a heartbeat in the store and a waiting rank reads its peers': a heartbeat
//! that stops names the lost rank, a "closed" one a rank that left. The first rank to tell
//! publishes its verdict, so the others report the same rank at once.
//!
//! Store keys: `verl/rank/<r>` (world size, backend, pid and host of rank r, written once),
//! `verl/hb/<r>` (`"<beat> <collectives started>"`, or `"closed <n>"`), `verl/lost`
//! (`"<rank>\t<reporter>\t<how>"`, empty while every rank is fine).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::shim::Store;

pub(crate) const LOST_KEY: &str = "verl/lost";

pub(crate) fn rank_key(rank: u32) -> String {
    format!("verl/rank/{rank}")
}

pub(crate) fn heartbeat_key(rank: u32) -> String {
    format!("verl/hb/{rank}")
}

/// The value a closed rank leaves in its heartbeat key.
pub(crate) fn closed_value(collectives: u64) -> String {
    format!("closed {collectives}")
}

/// This rank's heartbeat writer: a thread with its own store client, so a long collective or
/// computation on the main thread never delays it.
pub(crate) struct Heartbeat {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: JoinHandle<()>,
}

impl Heartbeat {
    pub(crate) fn start(
        store: Store,
        rank: u32,
        collectives: Arc<AtomicU64>,
        interval: Duration,
    ) -> Self {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let signal = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name(format!("verl-dist-heartbeat-{rank}"))
            .spawn(move || {
                let key = heartbeat_key(rank);
                let (lock, wake) = &*signal;
                let mut beat: u64 = 1;
                let mut stopped = lock.lock().unwrap_or_else(|e| e.into_inner());
                while !*stopped {
                    let value = format!("{beat} {}", collectives.load(Ordering::Relaxed));
                    // A failed write (the store's host is gone) is for the waiting main
                    // thread to report: it reads the store too.
                    let _ = store.set(&key, value.as_bytes());
                    beat += 1;
                    stopped = wake
                        .wait_timeout(stopped, interval)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            })
            .expect("spawning the heartbeat thread");
        Self { stop, thread }
    }

    pub(crate) fn stop(self) {
        let (lock, wake) = &*self.stop;
        *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
        wake.notify_all();
        let _ = self.thread.join();
    }
}

/// A lost peer: which rank, what was seen, and who saw it first.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Lost {
    pub rank: u32,
    pub how: String,
    /// The rank that published this verdict, when it was not this one.
    pub reported_by: Option<u32>,
}

impl Lost {
    fn publish_value(&self, reporter: u32) -> String {
        format!("{}\t{reporter}\t{}", self.rank, self.how)
    }

    fn parse_published(value: &str) -> Option<Self> {
        let mut parts = value.splitn(3, '\t');
        let rank = parts.next()?.parse().ok()?;
        let reported_by = parts.next()?.parse().ok()?;
        Some(Self {
            rank,
            how: parts.next()?.to_owned(),
            reported_by: Some(reported_by),
        })
    }
}

/// One peer's heartbeat as last read.
struct Seen {
    beat: String,
    changed: Instant,
    collectives: u64,
    closed: bool,
}

/// This rank's view of its peers' heartbeats.
pub(crate) struct Peers {
    me: u32,
    others: Vec<u32>,
    /// The heartbeat keys of `others`, then [`LOST_KEY`].
    keys: Vec<String>,
    seen: Vec<Option<Seen>>,
    lost_after: Duration,
}

impl Peers {
    pub(crate) fn new(me: u32, world_size: u32, lost_after: Duration) -> Self {
        let others: Vec<u32> = (0..world_size).filter(|&r| r != me).collect();
        let mut keys: Vec<String> = others.iter().map(|&r| heartbeat_key(r)).collect();
        keys.push(LOST_KEY.to_owned());
        let seen = others.iter().map(|_| None).collect();
        Self {
            me,
            others,
            keys,
            seen,
            lost_after,
        }
    }

    /// Reads every peer's heartbeat once, during collective number `started`, and returns the
    /// first lost peer: one another rank published, else one that closed its group before
    /// reaching this collective (one that closed after reaching it failed on it too, and is
    /// not the cause), else one silent for `lost_after`. `Err` is the store failing (its host,
    /// rank 0, is gone).
    pub(crate) fn poll(&mut self, store: &Store, started: u64) -> Result<Option<Lost>, String> {
        let values = store.multi_get(&self.keys)?;
        let (lost, beats) = values.split_last().expect("keys end with LOST_KEY");
        let now = Instant::now();
        for (seen, value) in self.seen.iter_mut().zip(beats) {
            let value = String::from_utf8_lossy(value);
            let (beat, collectives) = value.split_once(' ').unwrap_or((&value, "0"));
            let collectives = collectives.parse().unwrap_or(0);
            match seen {
                Some(s) if s.beat == beat => s.collectives = collectives,
                _ => {
                    *seen = Some(Seen {
                        beat: beat.to_owned(),
                        changed: now,
                        collectives,
                        closed: beat == "closed",
                    })
                }
            }
        }
        if let Some(published) = Lost::parse_published(&String::from_utf8_lossy(lost)) {
            return Ok(Some(published));
        }
        for (rank, seen) in self.others.iter().zip(&self.seen) {
            let Some(seen) = seen else { continue };
            if seen.closed && seen.collectives < started {
                return Ok(Some(Lost {
                    rank: *rank,
                    how: "closed its process group (it stopped or failed)".to_owned(),
                    reported_by: None,
                }));
            }
        }
        for (rank, seen) in self.others.iter().zip(&self.seen) {
            let Some(seen) = seen else { continue };
            let silent = now.duration_since(seen.changed);
            if silent >= self.lost_after {
                return Ok(Some(Lost {
                    rank: *rank,
                    how: format!(
                        "stopped responding: no heartbeat for {:.1} s (the process died or hangs)",
                        silent.as_secs_f64()
                    ),
                    reported_by: None,
                }));
            }
        }
        Ok(None)
    }

    /// The verdict another rank published, if any.
    pub(crate) fn published(&self, store: &Store) -> Option<Lost> {
        let value = store.multi_get(&[LOST_KEY.to_owned()]).ok()?;
        Lost::parse_published(&String::from_utf8_lossy(&value[0]))
    }

    /// Makes this rank's verdict the one every other rank reports.
    pub(crate) fn publish(&self, store: &Store, lost: &Lost) {
        if lost.reported_by.is_none() {
            // Best effort: the store may be the thing that is gone.
            let _ = store.set(LOST_KEY, lost.publish_value(self.me).as_bytes());
        }
    }

    /// Peers that, at the last read, had started fewer collectives than `started`, with the
    /// number they had started.
    pub(crate) fn behind(&self, started: u64) -> Vec<(u32, u64)> {
        self.others
            .iter()
            .zip(&self.seen)
            .filter_map(|(rank, seen)| {
                let n = seen.as_ref()?.collectives;
                (n < started).then_some((*rank, n))
            })
            .collect()
    }

    /// Whether every peer has closed its group or gone silent (polls once).
    pub(crate) fn all_gone(&mut self, store: &Store) -> bool {
        if self.poll(store, 0).is_err() {
            return true;
        }
        let now = Instant::now();
        self.seen.iter().all(|seen| {
            seen.as_ref()
                .is_some_and(|s| s.closed || now.duration_since(s.changed) >= self.lost_after)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn published_verdicts_round_trip() {
        let lost = Lost {
            rank: 3,
            how: "stopped responding: no heartbeat for 3.1 s".to_owned(),
            reported_by: None,
        };
        let parsed = Lost::parse_published(&lost.publish_value(1)).unwrap();
        assert_eq!(parsed.rank, 3);
        assert_eq!(parsed.how, lost.how);
        assert_eq!(parsed.reported_by, Some(1));
        assert_eq!(Lost::parse_published(""), None);
        assert_eq!(Lost::parse_published("x\t1\ty"), None);
    }
}
