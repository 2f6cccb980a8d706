//! Integration tests: the real release binary, the real plugin libraries, fake machines.

mod bad_plugins;
mod helpers;
mod platform;
mod vendor;
