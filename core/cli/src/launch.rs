//! `verl-core launch`: starts one node's ranks as children of this binary, torchrun-style.
//!
//! Each child gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`,
//! `MASTER_ADDR` and `MASTER_PORT` (torchrun's names and meaning), so [`verl_trainer::placement`] reads
//! them as it would under torchrun. Rank 0 keeps this process's terminal; every other rank's
//! lines are prefixed with `[rank R]`. SIGINT and SIGTERM are forwarded to every rank (each runs
//! in its own process group, so a terminal's Ctrl-C reaches a rank once, through here). When a
//! rank fails, the others get a 5 s grace to end on their own, then SIGTERM, then SIGKILL after
//! a bound, and the launch fails naming the rank and its exit status. A rank outlives the
//! launcher by no more than a SIGTERM: children are told to receive one when it dies.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use verl_trainer::placement::DEFAULT_MASTER_PORT;

/// The subcommands a launch may run: the ones that place themselves by rank.
pub const LAUNCHABLE: [&str; 5] = ["run", "sft", "score", "generate", "platform"];

/// How often the supervisor looks at its children and at received signals.
const POLL: Duration = Duration::from_millis(20);
/// After a rank fails, how long the others get to end on their own before SIGTERM: ranks that
/// fail together (a config error, a lost peer) all get to say why. A rank waiting in a collective
/// names a killed peer within about 3.4 s (verl-distributed's heartbeat bound), hence 5 s.
const FAILURE_GRACE: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("{flag}: {reason}")]
    Arg { flag: &'static str, reason: String },
    #[error("starting rank {rank} ({program}): {source}")]
    Spawn {
        rank: u32,
        program: String,
        source: std::io::Error,
    },
    #[error("installing the SIGINT/SIGTERM handler: {0}")]
    Signals(std::io::Error),
    #[error("rank {rank} failed ({status}); {others}")]
    RankFailed {
        rank: u32,
        status: String,
        /// How the other ranks ended.
        others: String,
    },
    #[error("interrupted by {signal}, forwarded to every rank; {outcome}")]
    Interrupted {
        signal: &'static str,
        signal_number: i32,
        outcome: String,
    },
}

/// One node's share of a job.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchSpec {
    pub nproc_per_node: u32,
    pub nnodes: u32,
    pub node_rank: u32,
    /// Host of node 0; default `127.0.0.1` on a single node, required with several.
    pub master_addr: Option<String>,
    /// Default: a free port on a single node, torchrun's 29500 with several.
    pub master_port: Option<u16>,
    /// After a rank fails (or a signal is forwarded), how long the others get to exit before
    /// SIGKILL.
    pub stop_timeout: Duration,
}

/// Where the ranks' output goes.
#[derive(Clone)]
pub enum Output {
    /// Rank 0 writes straight to this process's stdout and stderr (a terminal stays a terminal,
    /// for progress bars); the other ranks' lines are prefixed.
    Inherit,
    /// Every rank's lines into one buffer (rank 0's without prefix): for tests.
    #[cfg(test)]
    Capture(std::sync::Arc<std::sync::Mutex<Vec<u8>>>),
}

/// The rendezvous every rank of the job is given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendezvous {
    pub world_size: u32,
    pub master_addr: String,
    pub master_port: u16,
}

impl LaunchSpec {
    /// Checks the flags and settles the master address and port.
    pub fn rendezvous(&self) -> Result<Rendezvous, LaunchError> {
        let arg = |flag, reason: String| Err(LaunchError::Arg { flag, reason });
        if self.nproc_per_node == 0 {
            return arg("--nproc-per-node", "must be at least 1".to_owned());
        }
        if self.nnodes == 0 {
            return arg("--nnodes", "must be at least 1".to_owned());
        }
        if self.node_rank >= self.nnodes {
            return arg(
                "--node-rank",
                format!("{} must be below --nnodes {}", self.node_rank, self.nnodes),
            );
        }
        let Some(world_size) = self.nproc_per_node.checked_mul(self.nnodes) else {
            return arg("--nnodes", "nnodes × nproc-per-node overflows".to_owned());
        };
        let multi_node = self.nnodes > 1;
        let master_addr = match (&self.master_addr, multi_node) {
            (Some(addr), _) if !addr.trim().is_empty() => addr.trim().to_owned(),
            (_, true) => {
                return arg(
                    "--master-addr",
                    format!(
                        "required with --nnodes {}: the address of node 0, where rank 0 hosts the rendezvous store",
                        self.nnodes
                    ),
                );
            }
            (_, false) => "127.0.0.1".to_owned(),
        };
        let master_port = match (self.master_port, multi_node) {
            (Some(0), _) => return arg("--master-port", "must not be 0".to_owned()),
            (Some(port), _) => port,
            (None, true) => DEFAULT_MASTER_PORT,
            (None, false) => free_port().map_err(|e| LaunchError::Arg {
                flag: "--master-port",
                reason: format!("no free local port to default to: {e}"),
            })?,
        };
        Ok(Rendezvous {
            world_size,
            master_addr,
            master_port,
        })
    }
}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn signal_name(signal: i32) -> &'static str {
    match signal {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        libc::SIGKILL => "SIGKILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGBUS => "SIGBUS",
        libc::SIGHUP => "SIGHUP",
        _ => "a signal",
    }
}

fn status_text(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(signal)) => format!("killed by {} ({signal})", signal_name(signal)),
        _ => status.to_string(),
    }
}

/// The last SIGINT/SIGTERM received and not yet forwarded (0: none).
static RECEIVED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(signal: libc::c_int) {
    RECEIVED.store(signal, Ordering::SeqCst);
}

/// Makes SIGINT and SIGTERM wait for [`take_received_signal`] instead of ending this process.
pub fn install_signal_forwarding() -> Result<(), LaunchError> {
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a zeroed sigaction with an empty mask and a handler that only stores to an
        // atomic (async-signal-safe).
        let failed = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as *const () as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut()) != 0
        };
        if failed {
            return Err(LaunchError::Signals(std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

/// The signal delivered to this process since the last call, if any.
pub fn take_received_signal() -> Option<i32> {
    match RECEIVED.swap(0, Ordering::SeqCst) {
        0 => None,
        signal => Some(signal),
    }
}

/// A started rank.
struct Rank {
    rank: u32,
    child: Child,
    status: Option<ExitStatus>,
    pumps: Vec<JoinHandle<()>>,
}

impl Rank {
    /// Signals the rank's whole process group (its own children too).
    fn signal(&self, signal: i32) {
        if self.status.is_none() {
            let group = self.child.id() as libc::pid_t;
            // SAFETY: plain kill(2) on the group this child leads.
            unsafe { libc::kill(-group, signal) };
        }
    }
}

/// Copies `from` line by line into `sink`, each line starting with `prefix`.
fn pump(
    from: impl Read + Send + 'static,
    prefix: String,
    sink: impl Fn(&[u8]) + Send + 'static,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(from);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    if !line.ends_with(b"\n") {
                        line.push(b'\n');
                    }
                    let mut out = prefix.as_bytes().to_vec();
                    out.extend_from_slice(&line);
                    sink(&out);
                }
            }
        }
    })
}

fn stdout_sink(bytes: &[u8]) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(bytes);
    let _ = out.flush();
}

fn stderr_sink(bytes: &[u8]) {
    let _ = std::io::stderr().lock().write_all(bytes);
}

/// Starts every local rank of `spec` as `program args…`, supervises them until all have
/// exited, and says how it ended. `signals` yields a signal received by the launcher
/// ([`take_received_signal`] once [`install_signal_forwarding`] ran).
pub fn launch(
    spec: &LaunchSpec,
    program: &Path,
    args: &[OsString],
    output: &Output,
    signals: &mut dyn FnMut() -> Option<i32>,
) -> Result<(), LaunchError> {
    let rendezvous = spec.rendezvous()?;
    let mut ranks: Vec<Rank> = Vec::new();
    for local_rank in 0..spec.nproc_per_node {
        let rank = spec.node_rank * spec.nproc_per_node + local_rank;
        match start(spec, &rendezvous, rank, local_rank, program, args, output) {
            Ok(started) => ranks.push(started),
            Err(error) => {
                stop(&mut ranks, libc::SIGTERM, spec.stop_timeout);
                return Err(error);
            }
        }
    }
    let mut failed: Option<(u32, ExitStatus, Instant)> = None;
    let mut interrupted: Option<i32> = None;
    let mut kill_at: Option<Instant> = None;
    while ranks.iter().any(|r| r.status.is_none()) {
        if let Some(signal) = signals() {
            for rank in &ranks {
                rank.signal(signal);
            }
            interrupted.get_or_insert(signal);
            kill_at.get_or_insert(Instant::now() + spec.stop_timeout);
        }
        for rank in ranks.iter_mut().filter(|r| r.status.is_none()) {
            let Ok(Some(status)) = rank.child.try_wait() else {
                continue;
            };
            rank.status = Some(status);
            if !status.success() && failed.is_none() && interrupted.is_none() {
                failed = Some((rank.rank, status, Instant::now()));
            }
        }
        let grace_over = failed.is_some_and(|(_, _, at)| at.elapsed() >= FAILURE_GRACE);
        if grace_over && kill_at.is_none() {
            for rank in &ranks {
                rank.signal(libc::SIGTERM);
            }
            kill_at = Some(Instant::now() + spec.stop_timeout);
        }
        if kill_at.is_some_and(|at| Instant::now() >= at) {
            for rank in &ranks {
                rank.signal(libc::SIGKILL);
            }
        }
        std::thread::sleep(POLL);
    }
    for rank in &mut ranks {
        for pump in rank.pumps.drain(..) {
            let _ = pump.join();
        }
    }
    let others = |except: Option<u32>| -> String {
        let list: Vec<String> = ranks
            .iter()
            .filter(|r| Some(r.rank) != except)
            .map(|r| {
                format!(
                    "rank {}: {}",
                    r.rank,
                    status_text(r.status.expect("reaped"))
                )
            })
            .collect();
        list.join(", ")
    };
    if let Some(signal) = interrupted {
        return Err(LaunchError::Interrupted {
            signal: signal_name(signal),
            signal_number: signal,
            outcome: others(None),
        });
    }
    if let Some((rank, status, _)) = failed {
        let others = others(Some(rank));
        return Err(LaunchError::RankFailed {
            rank,
            status: status_text(status),
            others: if others.is_empty() {
                "no other rank on this node".to_owned()
            } else {
                format!("other ranks: {others}")
            },
        });
    }
    Ok(())
}

/// Sends `signal` to every running rank and waits for them, SIGKILL after `bound`.
fn stop(ranks: &mut [Rank], signal: i32, bound: Duration) {
    for rank in ranks.iter() {
        rank.signal(signal);
    }
    let deadline = Instant::now() + bound;
    for rank in ranks.iter_mut() {
        while rank.status.is_none() {
            rank.status = rank.child.try_wait().ok().flatten();
            if Instant::now() >= deadline {
                rank.signal(libc::SIGKILL);
                rank.status = rank.child.wait().ok();
                break;
            }
            std::thread::sleep(POLL);
        }
    }
}

fn start(
    spec: &LaunchSpec,
    rendezvous: &Rendezvous,
    rank: u32,
    local_rank: u32,
    program: &Path,
    args: &[OsString],
    output: &Output,
) -> Result<Rank, LaunchError> {
    let mut command = Command::new(program);
    command
        .args(args)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", rendezvous.world_size.to_string())
        .env("LOCAL_RANK", local_rank.to_string())
        .env("LOCAL_WORLD_SIZE", spec.nproc_per_node.to_string())
        .env("GROUP_RANK", spec.node_rank.to_string())
        .env("MASTER_ADDR", &rendezvous.master_addr)
        .env("MASTER_PORT", rendezvous.master_port.to_string())
        // Its own process group: signals reach a rank once, forwarded from here.
        .process_group(0)
        .stdin(Stdio::null());
    // SAFETY: prctl and signal are async-signal-safe; the closure allocates nothing.
    unsafe {
        command.pre_exec(|| {
            // The rank gets SIGTERM if the launcher dies (even by SIGKILL).
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The signals the launcher forwards must reach the rank, also when the launcher was
            // started with them ignored (`verl-core launch … &` from a script ignores SIGINT).
            for signal in [libc::SIGINT, libc::SIGTERM] {
                if libc::signal(signal, libc::SIG_DFL) == libc::SIG_ERR {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let console = rank == 0 && matches!(output, Output::Inherit);
    if !console {
        command.stdout(Stdio::piped()).stderr(Stdio::piped());
    }
    let mut child = command.spawn().map_err(|source| LaunchError::Spawn {
        rank,
        program: program.display().to_string(),
        source,
    })?;
    let prefix = if rank == 0 {
        String::new()
    } else {
        format!("[rank {rank}] ")
    };
    let mut pumps = Vec::new();
    if let (Some(out), Some(err)) = (child.stdout.take(), child.stderr.take()) {
        match output {
            Output::Inherit => {
                pumps.push(pump(out, prefix.clone(), stdout_sink));
                pumps.push(pump(err, prefix, stderr_sink));
            }
            #[cfg(test)]
            Output::Capture(buffer) => {
                for stream in [Box::new(out) as Box<dyn Read + Send>, Box::new(err)] {
                    let buffer = std::sync::Arc::clone(buffer);
                    pumps.push(pump(stream, prefix.clone(), move |bytes| {
                        buffer
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .extend_from_slice(bytes)
                    }));
                }
            }
        }
    }
    Ok(Rank {
        rank,
        child,
        status: None,
        pumps,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    fn spec(n: u32) -> LaunchSpec {
        LaunchSpec {
            nproc_per_node: n,
            nnodes: 1,
            node_rank: 0,
            master_addr: None,
            master_port: None,
            stop_timeout: Duration::from_secs(5),
        }
    }

    /// Runs `script` under sh as every rank, capturing the output.
    fn sh(
        spec: &LaunchSpec,
        script: &str,
        signals: &mut dyn FnMut() -> Option<i32>,
    ) -> (Result<(), LaunchError>, String, Duration) {
        let buffer = Arc::new(Mutex::new(Vec::new()));
        let started = Instant::now();
        let result = launch(
            spec,
            Path::new("/bin/sh"),
            &["-c".into(), script.into()],
            &Output::Capture(Arc::clone(&buffer)),
            signals,
        );
        let text = String::from_utf8(buffer.lock().unwrap().clone()).unwrap();
        (result, text, started.elapsed())
    }

    #[test]
    fn ranks_get_torchrun_variables_and_prefixed_output() {
        let (result, text, _) = sh(
            &spec(3),
            r#"echo "rank=$RANK world=$WORLD_SIZE local=$LOCAL_RANK/$LOCAL_WORLD_SIZE group=$GROUP_RANK master=$MASTER_ADDR:$MASTER_PORT"; echo "to stderr" >&2"#,
            &mut || None,
        );
        result.unwrap();
        let mut lines: Vec<&str> = text.lines().collect();
        lines.sort();
        let port = lines
            .iter()
            .find_map(|l| l.strip_prefix("rank=0 world=3 local=0/3 group=0 master=127.0.0.1:"))
            .expect("rank 0's line, without prefix")
            .parse::<u16>()
            .unwrap();
        assert!(port > 0);
        for rank in 1..3 {
            let expected = format!(
                "[rank {rank}] rank={rank} world=3 local={rank}/3 group=0 master=127.0.0.1:{port}"
            );
            assert!(lines.contains(&expected.as_str()), "{expected} in\n{text}");
            let err = format!("[rank {rank}] to stderr");
            assert!(lines.contains(&err.as_str()), "{text}");
        }
        assert!(lines.contains(&"to stderr"), "{text}");
    }

    #[test]
    fn a_second_node_numbers_its_ranks_after_the_first() {
        let mut two_nodes = spec(2);
        two_nodes.nnodes = 2;
        two_nodes.node_rank = 1;
        two_nodes.master_addr = Some("10.1.2.3".into());
        let (result, text, _) = sh(
            &two_nodes,
            r#"echo "rank=$RANK world=$WORLD_SIZE local=$LOCAL_RANK master=$MASTER_ADDR:$MASTER_PORT""#,
            &mut || None,
        );
        result.unwrap();
        assert!(
            text.contains("[rank 2] rank=2 world=4 local=0 master=10.1.2.3:29500"),
            "{text}"
        );
        assert!(
            text.contains("[rank 3] rank=3 world=4 local=1 master=10.1.2.3:29500"),
            "{text}"
        );
    }

    #[test]
    fn bad_flags_are_named() {
        let mut s = spec(2);
        s.nnodes = 2;
        let err = s.rendezvous().unwrap_err().to_string();
        assert!(
            err.starts_with("--master-addr: required with --nnodes 2"),
            "{err}"
        );
        s.node_rank = 2;
        s.master_addr = Some("h".into());
        assert_eq!(
            s.rendezvous().unwrap_err().to_string(),
            "--node-rank: 2 must be below --nnodes 2"
        );
        assert_eq!(
            spec(0).rendezvous().unwrap_err().to_string(),
            "--nproc-per-node: must be at least 1"
        );
        let mut fixed = spec(2);
        fixed.master_port = Some(4242);
        assert_eq!(fixed.rendezvous().unwrap().master_port, 4242);
    }

    #[test]
    fn a_failed_rank_stops_the_others_and_is_named() {
        // Rank 1 fails at once; the others would run for a minute.
        let (result, text, elapsed) = sh(
            &spec(3),
            r#"if [ "$RANK" = 1 ]; then echo "rank 1 fails"; exit 3; fi; exec sleep 60"#,
            &mut || None,
        );
        let err = result.unwrap_err();
        assert!(
            matches!(&err, LaunchError::RankFailed { rank: 1, .. }),
            "{err}"
        );
        let message = err.to_string();
        assert!(
            message
                == "rank 1 failed (exit status 3); other ranks: rank 0: killed by SIGTERM (15), rank 2: killed by SIGTERM (15)",
            "{message}"
        );
        assert!(text.contains("[rank 1] rank 1 fails"), "{text}");
        assert!(
            elapsed >= FAILURE_GRACE && elapsed < Duration::from_secs(10),
            "{elapsed:?}"
        );
    }

    #[test]
    fn ranks_failing_together_all_report_before_any_is_stopped() {
        // Rank 0 fails a moment after rank 1, within the grace: it is not killed.
        let (result, text, _) = sh(
            &spec(2),
            r#"if [ "$RANK" = 0 ]; then sleep 0.5; fi; echo "rank $RANK: cannot run"; exit 1"#,
            &mut || None,
        );
        assert_eq!(
            result.unwrap_err().to_string(),
            "rank 1 failed (exit status 1); other ranks: rank 0: exit status 1"
        );
        assert!(
            text.contains("rank 0: cannot run") && text.contains("[rank 1] rank 1: cannot run"),
            "{text}"
        );
    }

    #[test]
    fn a_rank_ignoring_sigterm_is_killed_after_the_bound() {
        let mut s = spec(2);
        s.stop_timeout = Duration::from_millis(500);
        let (result, _, elapsed) = sh(
            &s,
            r#"if [ "$RANK" = 1 ]; then exit 4; fi; trap '' TERM; sleep 60 & wait; wait"#,
            &mut || None,
        );
        let message = result.unwrap_err().to_string();
        assert!(
            message == "rank 1 failed (exit status 4); other ranks: rank 0: killed by SIGKILL (9)",
            "{message}"
        );
        assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");
    }

    #[test]
    fn signals_are_forwarded_to_every_rank() {
        // Each rank reports the SIGINT it receives and exits 5; the launcher "receives" one
        // once every rank has set its trap (a fixed delay raced a slow start under load).
        let ready = tempfile::tempdir().unwrap();
        let all_ready = || (0..2).all(|rank| ready.path().join(format!("ready.{rank}")).exists());
        let mut sent = false;
        let mut signals = || {
            if !sent && all_ready() {
                sent = true;
                return Some(libc::SIGINT);
            }
            None
        };
        let script = format!(
            r#"trap 'echo "rank $RANK got SIGINT"; kill $child; exit 5' INT; sleep 60 & child=$!; touch "{}/ready.$RANK"; wait"#,
            ready.path().display()
        );
        let (result, text, elapsed) = sh(&spec(2), &script, &mut signals);
        let err = result.unwrap_err();
        assert!(
            matches!(
                err,
                LaunchError::Interrupted {
                    signal_number: libc::SIGINT,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(
            err.to_string(),
            "interrupted by SIGINT, forwarded to every rank; rank 0: exit status 5, rank 1: exit status 5"
        );
        assert!(text.contains("rank 0 got SIGINT"), "{text}");
        assert!(text.contains("[rank 1] rank 1 got SIGINT"), "{text}");
        assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");
    }
}
