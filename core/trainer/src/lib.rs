//! verl's training loop over the plugins (generate → reward → log-probs → advantage → update →
//! weight sync → validate → checkpoint), the workers that host each component, checkpoints and
//! the two-slot weight store, the built-in components (console and file trackers, naive/disk
//! weight sync, the rule reward), where each rank runs (placement), the size limits checked before
//! anything is allocated, and SFT.

pub mod batch;
pub mod builtin;
pub mod checkpoint;
pub mod limits;
pub mod placement;
pub mod reward_select;
pub mod sft;
pub mod trainer;
pub mod weight_slots;
pub mod workers;
