//! verl-core: the library behind the `verl-core` binary.

pub mod bench;
pub mod report;
