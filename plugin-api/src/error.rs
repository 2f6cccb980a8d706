//! The error type that crosses the ABI, and the panic guard that keeps unwinding on its side.

use std::cell::Cell;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Once;

use abi_stable::StableAbi;
use abi_stable::std_types::{RResult, RString};

/// What went wrong, coarse enough for the host to react (e.g. report a panic differently).
#[repr(transparent)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ErrorKind(pub u8);

impl ErrorKind {
    pub const OTHER: Self = Self(0);
    pub const INVALID_CONFIG: Self = Self(1);
    pub const IO: Self = Self(2);
    pub const UNSUPPORTED: Self = Self(3);
    pub const PANIC: Self = Self(4);
    pub const UNAVAILABLE: Self = Self(5);
    pub const TIMEOUT: Self = Self(6);

    pub fn as_str(self) -> &'static str {
        match self {
            Self::INVALID_CONFIG => "invalid config",
            Self::IO => "i/o",
            Self::UNSUPPORTED => "unsupported",
            Self::PANIC => "panic",
            Self::UNAVAILABLE => "unavailable",
            Self::TIMEOUT => "timeout",
            _ => "error",
        }
    }
}

/// An error returned by any plugin method.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Eq)]
pub struct PluginError {
    pub kind: ErrorKind,
    pub message: RString,
}

impl PluginError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: RString::from(message.into()),
        }
    }
    pub fn other(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::OTHER, message)
    }
    pub fn invalid_config(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::INVALID_CONFIG, message)
    }
    pub fn unsupported(operation: &str) -> Self {
        Self::new(
            ErrorKind::UNSUPPORTED,
            format!("this component does not support `{operation}`"),
        )
    }
    pub fn message(&self) -> &str {
        self.message.as_str()
    }
}

impl fmt::Display for PluginError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for PluginError {}

impl From<std::io::Error> for PluginError {
    fn from(e: std::io::Error) -> Self {
        Self::new(ErrorKind::IO, e.to_string())
    }
}

impl From<serde_json::Error> for PluginError {
    fn from(e: serde_json::Error) -> Self {
        Self::invalid_config(e.to_string())
    }
}

impl From<String> for PluginError {
    fn from(message: String) -> Self {
        Self::other(message)
    }
}

impl From<&str> for PluginError {
    fn from(message: &str) -> Self {
        Self::other(message)
    }
}

thread_local! {
    /// How many [`guard`]s this thread is inside.
    static GUARDED: Cell<usize> = const { Cell::new(0) };
}

/// Wraps the panic hook once so that it stays silent for panics [`guard`] turns into errors: they
/// reach the user as those errors, and the hook's `thread … panicked at …` text (with, for a
/// libtorch error, a C++ stack trace) would only repeat them badly. A plugin links its own copy of
/// std, so the host's hook never sees them. Panics elsewhere still reach the previous hook.
fn silence_guarded_panics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if GUARDED.with(Cell::get) == 0 {
                previous(info);
            }
        }));
    });
}

/// A panic's reason up to its first line break, raw or escaped (`\n` inside a quoted error):
/// what follows in a libtorch error is its C++ stack trace.
fn first_line(reason: &str) -> &str {
    let end = [reason.find('\n'), reason.find("\\n")]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(reason.len());
    reason[..end].trim_end()
}

/// Runs `f`, turning a panic into a `PluginError` of kind `PANIC` so it never unwinds across the ABI
/// (unwinding out of an `extern "C"` function aborts the whole process). The panic prints nothing
/// and its reason is cut to its first line.
pub fn guard<T>(
    operation: &str,
    f: impl FnOnce() -> Result<T, PluginError>,
) -> RResult<T, PluginError> {
    silence_guarded_panics();
    GUARDED.with(|g| g.set(g.get() + 1));
    let outcome = catch_unwind(AssertUnwindSafe(f));
    GUARDED.with(|g| g.set(g.get() - 1));
    match outcome {
        Ok(result) => result.into(),
        Err(payload) => {
            let reason = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic payload".to_owned());
            RResult::RErr(PluginError::new(
                ErrorKind::PANIC,
                format!("panicked in {operation}: {}", first_line(&reason)),
            ))
        }
    }
}
