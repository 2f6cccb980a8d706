//! Integration tests: the real release binary, the real plugin libraries, fake machines.

mod bad_plugins;
mod certify;
mod compute;
mod helpers;
mod platform;
mod train;
mod vendor;
mod vllm;
