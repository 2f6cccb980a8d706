//! The config audit of a run ([`crate::config::audit`]) with what it needs from outside the
//! config: the world size, and what the run's components (resolved from the registry by the names
//! the config gives) declare about the keys of their sections. Warnings are logged once per key;
//! errors stop the run before anything is made.

use verl_plugin_api::{
    CheckpointCapabilities, ComponentKind, ConfigKeys, EngineCapabilities, RolloutCapabilities,
};
use verl_plugin_host::Registry;

use crate::config::{AuditContext, Config, EngineRole, Finding, Severity, audit};

/// Keys set to values that nothing here supports; `trainer.strict_config=false` runs anyway.
#[derive(Debug, thiserror::Error)]
#[error("{}", unsupported_message(.0))]
pub struct Unsupported(pub Vec<Finding>);

fn unsupported_message(findings: &[Finding]) -> String {
    let lines: Vec<String> = findings.iter().map(|f| format!("\n  {f}")).collect();
    format!(
        "the config sets {} key(s) that would change what is trained, and nothing here does that yet:{}",
        findings.len(),
        lines.concat()
    )
}

/// The audit's context: the world size `trainer.nnodes × trainer.n_gpus_per_node` must equal
/// (`None`: not checked), and the declarations of the components `config` uses on `device_type`
/// devices (a name the registry lacks is left out: the trainer names it when it resolves
/// components).
pub fn context(
    config: &Config,
    registry: &Registry,
    device_type: &str,
    world_size: Option<u32>,
) -> AuditContext {
    let declared = |kind: ComponentKind, name: &str| {
        let component = match kind {
            ComponentKind::ENGINE => registry.resolve_engine(name, device_type),
            _ => registry.resolve(kind, name),
        }
        .ok()?;
        Some(match kind {
            ComponentKind::ENGINE => component.capabilities::<EngineCapabilities>().config_keys,
            ComponentKind::ROLLOUT => component.capabilities::<RolloutCapabilities>().config_keys,
            _ => {
                component
                    .capabilities::<CheckpointCapabilities>()
                    .config_keys
            }
        })
    };
    let rollout = &config.actor_rollout_ref.rollout;
    let roles = [
        (EngineRole::Actor, "actor_rollout_ref.actor", true),
        (
            EngineRole::Ref,
            "actor_rollout_ref.ref",
            config.ref_enabled(),
        ),
        (EngineRole::Critic, "critic", config.critic_enabled()),
    ];
    let engines = roles
        .into_iter()
        .filter(|(_, _, used)| *used)
        .map(|(role, section, _)| {
            (
                section,
                declared(ComponentKind::ENGINE, config.engine_strategy(role)),
            )
        });
    let components: Vec<(String, ConfigKeys)> = engines
        .chain([
            (
                "actor_rollout_ref.rollout",
                declared(ComponentKind::ROLLOUT, &rollout.name),
            ),
            (
                "actor_rollout_ref.rollout.checkpoint_engine",
                declared(
                    ComponentKind::CHECKPOINT,
                    &rollout.checkpoint_engine.backend,
                ),
            ),
        ])
        .filter_map(|(section, keys)| Some((section.to_owned(), keys?)))
        .collect();
    AuditContext {
        world_size,
        components,
    }
}

/// Audits `config` for a command on `device_type` devices (and `world_size` ranks, see
/// [`context`]): logs each warning once and fails with every error. Returns the findings
/// (warnings only).
pub fn check(
    config: &Config,
    registry: &Registry,
    device_type: &str,
    world_size: Option<u32>,
) -> Result<Vec<Finding>, Unsupported> {
    let findings = audit(config, &context(config, registry, device_type, world_size));
    let (errors, warnings): (Vec<&Finding>, Vec<&Finding>) =
        findings.iter().partition(|f| f.severity == Severity::Error);
    for finding in warnings {
        tracing::warn!("{finding}");
    }
    if !errors.is_empty() {
        return Err(Unsupported(errors.into_iter().cloned().collect()));
    }
    Ok(findings)
}
