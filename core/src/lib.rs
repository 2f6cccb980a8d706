//! verl-core: the library behind the `verl-core` binary.

pub mod algo;
pub mod batch;
pub mod bench;
pub mod builtin;
pub mod checkpoint;
pub mod config;
pub mod config_audit;
pub mod data;
pub mod inference;
pub mod launch;
pub mod limits;
pub mod placement;
pub mod quickstart;
pub mod report;
pub mod reward;
pub mod sft;
pub mod trainer;
pub mod weight_slots;
pub mod workers;
