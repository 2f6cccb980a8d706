//! The `fsdp` engine's worker: verl's actor/critic semantics (the shared
//! [`verl_actor::ActorWorker`], which normalises each rank's loss by the global
//! batch's counts) on the model where `fsdp_config` places it ([`Placement`]): sharded over the
//! ranks (ZeRO-3, [`crate::shard`]) on more than one rank or when offloading, else whole in this
//! process ([`LocalModel`]).

use std::time::Duration;

use verl_actor::{ActorConfig, ActorError, ActorWorker, PassLayout, Role};
use verl_model::{Head, NOT_SHARING_PROMPTS, parse_device};
use verl_plugin_api::ComponentInit;

use crate::config::FsdpConfig;
use crate::dist::Ranks;
use crate::local::LocalModel;
use crate::placement::Placement;
use crate::shard::strategy::ShardedStrategy;

/// verl's `nccl_timeout` default (seconds), for a host that does not send the key.
const DEFAULT_COLLECTIVE_TIMEOUT_S: u64 = 600;

/// The engine of one role: verl's semantics on the local or the sharded model.
pub type Worker = ActorWorker<Placement>;

pub fn new_worker(init: &ComponentInit) -> Result<(Worker, Ranks), ActorError> {
    let run = &init.run;
    let mut settings = init.config::<ActorConfig>("fsdp")?.validate()?;
    // Checked for unknown keys and types; `fsdp_size` and offloading place the model.
    let fsdp = FsdpConfig::of(init, settings.role)?;
    let optimizer = settings.role.trains().then_some(settings.optimizer);
    let path = FsdpConfig::path(init, settings.role);
    let sharding = fsdp.shard_options(&path, optimizer, run.world_size)?;
    // As verl's workers: the (global) mini-batch is split over the data-parallel ranks.
    let world = run.world_size.max(1) as usize;
    if settings.mini_batch % world != 0 {
        return Err(ActorError::Config {
            key: "ppo_mini_batch_size".into(),
            reason: format!(
                "{} sequences (ppo_mini_batch_size × rollout.n) do not split evenly over {world} data-parallel ranks",
                settings.mini_batch
            ),
        });
    }
    settings.mini_batch /= world;
    let timeout = init
        .config
        .get("nccl_timeout")
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(DEFAULT_COLLECTIVE_TIMEOUT_S);
    let ranks = Ranks::join(run, Duration::from_secs(timeout.max(1)))?;
    let device = parse_device(&run.device)?;
    let head = if settings.role == Role::Critic {
        Head::Value
    } else {
        Head::Lm
    };
    let mut model = settings.model.load(device, head, run.seed)?;
    // verl-core copies `trainer.deterministic` into every engine section: the batch-invariant
    // kernels, so log-probs match the native rollout's bit for bit (see `set_batch_invariant`).
    model.set_batch_invariant(
        init.config
            .get("deterministic")
            .and_then(serde_json::Value::as_bool)
            .unwrap_or(false),
    );
    if optimizer.is_none() {
        model.set_trainable(false);
    }
    let sharing = PassLayout::Packed {
        share_prompts: true,
    };
    if settings.layout == sharing && !model.shares_prompts() {
        // Left unset, prompt sharing is simply off where it cannot apply; asked for, it is an error.
        if init.config.get("use_prefix_grouper") == Some(&serde_json::Value::Bool(true)) {
            return Err(ActorError::Config {
                key: "use_prefix_grouper".into(),
                reason: format!("{NOT_SHARING_PROMPTS}; leave it unset or false"),
            });
        }
        settings.layout = PassLayout::Packed {
            share_prompts: false,
        };
    }
    let spec = settings.model.clone();
    let strategy = match sharding {
        Some(options) => {
            Placement::Sharded(ShardedStrategy::for_run(model, &ranks, run, options, spec)?)
        }
        None => Placement::Local(LocalModel::new(model, spec, optimizer, ranks.clone())),
    };
    Ok((ActorWorker::new(settings, strategy, run.seed), ranks))
}
