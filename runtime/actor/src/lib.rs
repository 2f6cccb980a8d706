//! Training a [`verl_model::CausalLM`] the way verl does, for every engine strategy (`fsdp`: one
//! rank holds the whole model or a ZeRO-3 shard of it; `megatron`: tensor/sequence/context
//! parallel shards): verl's actor and critic semantics over what the strategy supplies
//! ([`ActorWorker`] over a [`Strategy`]; config [`ActorConfig`], batch layout [`Rows`]), verl's
//! PPO losses ([`losses`]), the on-policy distillation loss ([`distill`]), and an AdamW optimiser
//! whose state saves and restores exactly ([`AdamW`], [`save_training_state`]). With the
//! `testing` feature, `testing` is the conformance suite that every engine's tests run.

mod config;
pub mod distill;
mod error;
pub mod losses;
mod optim;
mod rows;
#[cfg(feature = "testing")]
pub mod testing;
mod worker;

pub use config::{
    ActorConfig, ActorSettings, MicroBatching, OptimConfig, PassLayout, PolicyLossConfig, Role,
    RouterReplayConfig, RouterReplayMode, engine_section_keys,
};
pub use error::ActorError;
pub use optim::{
    AdamW, AdamWConfig, LrDecay, LrSchedule, OPTIMIZER_FILE, TRAIN_STATE_FILE, TrainState,
    load_training_state, load_training_state_from, save_training_state,
};
pub use rows::{Meta, Rows};
pub use worker::{ActorWorker, Reduction, SKIPPED_UPDATES, Strategy};
