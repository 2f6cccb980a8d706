//! The `verl-core` binary: one module per command under [`commands`], over the verl-core
//! libraries (verl-config, verl-trainer, the plugin host). Errors reach the user as one
//! `error:` line; a panic is a bug, reported in one line with exit status 101.

mod args;
mod bench;
mod commands;
mod common;
mod config_audit;
mod inference;
mod launch;
mod quickstart;
mod report;

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser as _;

use crate::args::{Cli, Command};

/// The exit status of a panic (a bug): Rust's own, so scripts see what they always saw.
const PANIC_EXIT: u8 = 101;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    // With RUST_BACKTRACE set, the standard hook stays, for developers.
    if std::env::var_os("RUST_BACKTRACE").is_none() {
        quiet_panics();
    }
    let cli = Cli::parse();
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(cli))) {
        Ok(Ok(code)) => code,
        Ok(Err(e)) => {
            print_error(&error_chain(&e));
            ExitCode::FAILURE
        }
        Err(_) => {
            let panic = LAST_PANIC
                .lock()
                .ok()
                .and_then(|mut last| last.take())
                .unwrap_or_else(|| "unknown panic".to_owned());
            print_error(&format!(
                "internal error, a bug in verl-core (please report it): {panic}"
            ));
            ExitCode::from(PANIC_EXIT)
        }
    }
}

/// The last panic's reason and place, for `main` to print as one line.
static LAST_PANIC: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// Replaces the panic hook, whose `thread … panicked at …` text (and backtrace hint) is no message
/// for a user: a panic is recorded for `main`, which reports it in one line and exits with
/// [`PANIC_EXIT`]; one on another thread is a debug log, its error reaching `main` through the
/// thread's owner.
fn quiet_panics() {
    std::panic::set_hook(Box::new(|info| {
        let reason = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "non-string panic payload".to_owned());
        let place = info
            .location()
            .map(|l| format!(" ({}:{})", l.file(), l.line()))
            .unwrap_or_default();
        let text = format!("{}{place}", without_cpp_trace(&reason));
        tracing::debug!("panic: {text}");
        if let Ok(mut last) = LAST_PANIC.lock() {
            *last = Some(text);
        }
    }));
}

/// `text` without a C++ stack trace: libtorch appends one (`frame #0: …`, `Exception raised from
/// …`) to its errors, raw or escaped inside a quoted error. Plugins built with this release cut
/// it themselves; this keeps any other plugin's from reaching the user.
fn without_cpp_trace(text: &str) -> &str {
    let cut = ["\nframe #", "\\nframe #", "Exception raised from"]
        .iter()
        .filter_map(|marker| text.find(marker))
        .min()
        .unwrap_or(text.len());
    text[..cut].trim_end()
}

/// `error: {message}` on stderr in one write: the ranks of a job share the stream, and a line
/// written in pieces (as `eprintln!` may) can be cut by another rank's.
pub(crate) fn print_error(message: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("error: {message}\n").as_bytes());
}

/// The error and its causes joined with ": ", leaving out a cause whose text an outer message
/// already includes (many errors print their source as part of their own message).
fn error_chain(error: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in error.chain() {
        let text = without_cpp_trace(&cause.to_string()).to_owned();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let timeout = Duration::from_millis(cli.plugins.detect_timeout_ms);
    let plugins = &cli.plugins;
    match cli.command {
        Command::Plugins(command) => commands::plugins::run(plugins, timeout, command),
        Command::Platform { json } => commands::platform::run(plugins, timeout, json),
        Command::Run(args) => commands::train::run(plugins, timeout, args),
        Command::Sft(args) => commands::train::sft(plugins, timeout, args),
        Command::Config(command) => commands::config::run(plugins, timeout, command),
        Command::Data(command) => commands::data::run(command),
        Command::Generate(args) => commands::generate::run(plugins, timeout, args),
        Command::Score(args) => commands::score::run(plugins, timeout, args),
        Command::Bench(command) => commands::bench::run(plugins, timeout, command),
        Command::Launch(args) => commands::launch::run(plugins, args),
        Command::StartupProbe => commands::bench::startup_probe(plugins, timeout),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpp_stack_traces_are_cut() {
        let raw = "libtorch: not enough memory: you tried to allocate 8 bytes\nframe #0: c10::alloc_cpu(unsigned long) + 0x3a4";
        assert_eq!(
            without_cpp_trace(raw),
            "libtorch: not enough memory: you tried to allocate 8 bytes"
        );
        let escaped = r#"panicked in generate: Torch("oom\nframe #0: c10::Error")"#;
        assert_eq!(
            without_cpp_trace(escaped),
            r#"panicked in generate: Torch("oom"#
        );
        let raised = "bad shape\nException raised from view at aten/src/ATen/native/View.cpp:12";
        assert_eq!(without_cpp_trace(raised), "bad shape");
        let toml = "TOML parse error at line 1, column 6\n  |\n1 | [data\n";
        assert_eq!(without_cpp_trace(toml), toml.trim_end(), "other lines stay");
    }

    /// A panic is recorded for `main`'s one line, message and place, without the C++ trace.
    #[test]
    fn the_panic_hook_records_one_line() {
        quiet_panics();
        let outcome = std::panic::catch_unwind(|| {
            panic!("Torch(\"oom\\nframe #0: c10::Error\")");
        });
        assert!(outcome.is_err());
        let recorded = LAST_PANIC.lock().unwrap().take().unwrap();
        assert!(recorded.starts_with("Torch(\"oom ("), "{recorded}");
        assert!(recorded.contains("main.rs:"), "{recorded}");
        let _ = std::panic::take_hook();
    }
}
