//! An inference server this plugin started: its own process group (so stopping it also stops the
//! engine processes it forks), its output captured in a log file, and a parent-death signal so it
//! does not outlive the trainer when the trainer is killed without running destructors.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::log::{LOG_TAIL_LINES, log_error_line, log_tail};
use crate::{HttpError, LogExcerpt};

/// How to start a server.
#[derive(Debug, Clone)]
pub struct Launch {
    /// For messages: "vLLM server on 127.0.0.1:8000".
    pub name: String,
    pub program: PathBuf,
    pub args: Vec<String>,
    /// Set on top of the plugin's environment.
    pub env: Vec<(String, String)>,
    /// Receives the server's stdout and stderr.
    pub log: PathBuf,
}

/// How long a server gets to stop after SIGTERM before its process group is killed.
const STOP_GRACE: Duration = Duration::from_secs(10);

#[derive(Debug)]
pub struct ServerProcess {
    name: String,
    pid: u32,
    child: Mutex<Child>,
    log: PathBuf,
}

impl ServerProcess {
    pub fn spawn(launch: &Launch) -> Result<Self, HttpError> {
        let io = |what: &str, source| HttpError::Io {
            server: launch.name.clone(),
            what: format!("{what} {}", launch.log.display()),
            source,
        };
        if let Some(dir) = launch.log.parent() {
            std::fs::create_dir_all(dir).map_err(|e| io("creating the log directory of", e))?;
        }
        let out = File::create(&launch.log).map_err(|e| io("creating the log", e))?;
        let err = out.try_clone().map_err(|e| io("opening the log", e))?;
        let mut command = Command::new(&launch.program);
        command
            .args(&launch.args)
            .envs(launch.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            // Its own group: stopping it signals the whole group, engine workers included, and a
            // Ctrl-C meant for the trainer's terminal does not reach it half-way.
            .process_group(0);
        // SAFETY: the closure runs in the forked child before exec and only makes
        // async-signal-safe calls (prctl, getppid, _exit).
        unsafe {
            command.pre_exec(|| {
                // The server gets SIGTERM when the thread that started it ends (the trainer's main
                // thread, normally: when the trainer dies, even by SIGKILL).
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() == 1 {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        let child = command.spawn().map_err(|source| HttpError::Spawn {
            server: launch.name.clone(),
            program: launch.program.display().to_string(),
            source,
        })?;
        Ok(Self {
            name: format!("{} (pid {})", launch.name, child.id()),
            pid: child.id(),
            child: Mutex::new(child),
            log: launch.log.clone(),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn log(&self) -> &Path {
        &self.log
    }

    /// How the process ended, if it has. A multi-threaded server killed shows as a zombie before
    /// its other threads have exited and it can be reaped: a zombie is dead, and is waited for.
    pub fn exit_status(&self) -> Option<String> {
        let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        let status = match child.try_wait() {
            Ok(None) if is_zombie(self.pid) => child.wait().map(Some),
            other => other,
        };
        match status {
            Ok(Some(status)) => Some(status.to_string()),
            Ok(None) => None,
            Err(e) => Some(format!("unknown state: {e}")),
        }
    }

    /// The error to report when the process has exited, else `None`.
    pub fn died(&self, when: &'static str) -> Option<HttpError> {
        self.exit_status().map(|status| HttpError::Died {
            server: self.name.clone(),
            status,
            when,
            log: Box::new(self.log_excerpt()),
        })
    }

    /// What the server's log shows now: its path, last lines and error line.
    pub fn log_excerpt(&self) -> LogExcerpt {
        LogExcerpt {
            path: self.log.clone(),
            tail: self.log_tail(),
            error_line: self.error_line(),
        }
    }

    /// The last lines of the server's log.
    pub fn log_tail(&self) -> String {
        log_tail(&self.log, LOG_TAIL_LINES)
    }

    /// The line of the server's log that looks like the error, cut at 300 characters: the first
    /// Python exception line (`RuntimeError: …`) of the log's end, with its logger's prefix
    /// removed, else its first line saying `Error`, `error:`, `Exception` or `Unsupported`; lines
    /// logged at DEBUG, INFO or WARNING are left out. `None` when no line looks like one.
    pub fn error_line(&self) -> Option<String> {
        log_error_line(&self.log)
    }

    /// SIGTERM to the process group, SIGKILL to what is left after a grace period; waits for the
    /// leader. Idempotent.
    pub fn stop(&self) {
        let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        let group = -(self.pid as libc::pid_t);
        if matches!(child.try_wait(), Ok(None)) {
            // SAFETY: signals the process group this process created; no memory is involved.
            unsafe { libc::kill(group, libc::SIGTERM) };
            let deadline = Instant::now() + STOP_GRACE;
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        // Whatever the leader left behind in its group (engine processes) goes too.
        // SAFETY: as above; ESRCH when the group is already empty.
        unsafe { libc::kill(group, libc::SIGKILL) };
        let _ = child.wait();
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Whether process `pid` is a zombie (state `Z` in `/proc/<pid>/stat`).
pub(crate) fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit(')')
            .next()
            .is_some_and(|s| s.trim_start().starts_with('Z'))
    })
}

/// A TCP port on `host` that nothing listens on now (the OS's choice).
pub fn free_port(host: &str) -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind((host, 0))?.local_addr()?.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(dir: &Path, script: &str) -> Launch {
        Launch {
            name: "test server".into(),
            program: "sh".into(),
            args: vec!["-c".into(), script.into()],
            env: vec![("GREETING".into(), "hello from the server".into())],
            log: dir.join("logs/server.log"),
        }
    }

    fn alive(pid: u32) -> bool {
        Path::new(&format!("/proc/{pid}")).exists() && !is_zombie(pid)
    }

    #[test]
    fn an_exited_server_reports_its_status_and_log() {
        let dir = tempfile::tempdir().unwrap();
        let p = ServerProcess::spawn(&launch(dir.path(), "echo \"$GREETING\"; exit 3")).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let err = loop {
            if let Some(e) = p.died("while starting") {
                break e;
            }
            assert!(Instant::now() < deadline, "the script did not exit");
            std::thread::sleep(Duration::from_millis(20));
        };
        let text = err.to_string();
        assert!(text.contains("exit status: 3"), "{text}");
        assert!(text.contains("while starting"), "{text}");
        assert!(text.contains("| hello from the server"), "{text}");
        assert!(text.contains(&format!("pid {}", p.pid())), "{text}");
    }

    #[test]
    fn stop_ends_the_whole_process_group() {
        let dir = tempfile::tempdir().unwrap();
        // A forked worker that ignores SIGTERM, as a stuck engine process would.
        let p = ServerProcess::spawn(&launch(
            dir.path(),
            "(trap '' TERM; exec sleep 1000) & echo worker $!; wait",
        ))
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let worker = loop {
            let log = std::fs::read_to_string(p.log()).unwrap_or_default();
            if let Some(pid) = log.strip_prefix("worker ") {
                break pid.trim().parse::<u32>().unwrap();
            }
            assert!(Instant::now() < deadline, "no worker started: {log}");
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(alive(p.pid()) && alive(worker));
        p.stop();
        assert!(p.exit_status().is_some());
        assert!(!alive(p.pid()), "the leader survived");
        // The worker is reparented when the leader dies; give init a moment to reap it.
        let deadline = Instant::now() + Duration::from_secs(5);
        while alive(worker) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(!alive(worker), "the worker in the group survived");
    }

    #[test]
    fn a_missing_program_names_it() {
        let dir = tempfile::tempdir().unwrap();
        let mut l = launch(dir.path(), "");
        l.program = dir.path().join("no-such-python");
        let err = ServerProcess::spawn(&l).unwrap_err().to_string();
        assert!(
            err.contains("no-such-python") && err.contains("test server"),
            "{err}"
        );
    }
}
