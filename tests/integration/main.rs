//! Integration tests: the real release binary, the real plugin libraries, fake machines.

mod bad_inputs;
mod bad_plugins;
mod certify;
mod compute;
mod config;
mod distill;
mod engines;
mod helpers;
mod launch;
mod moe;
mod platform;
mod rewards;
mod sglang;
mod spmd;
mod train;
mod vendor;
mod vllm;
