//! One module per command (ripgrep's shape): each parses nothing, takes its clap arguments and
//! returns the process's exit status.

pub mod bench;
pub mod config;
pub mod data;
pub mod generate;
pub mod launch;
pub mod platform;
pub mod plugins;
pub mod score;
pub mod train;
