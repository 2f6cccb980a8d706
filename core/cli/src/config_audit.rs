//! The config audit of a run ([`verl_config::audit`]) with what it needs from outside the
//! config: the world size, and what the run's components (resolved from the registry by the names
//! the config gives) declare about the keys of their sections. Warnings are logged once per key;
//! errors stop the run before anything is made.

use verl_plugin_api::{
    CheckpointCapabilities, ComponentKind, ConfigKeys, EngineCapabilities, RolloutCapabilities,
};
use verl_plugin_host::Registry;

use verl_config::{AuditContext, AuditScope, Config, EngineRole, Finding, Severity, audit};

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

/// What the component `name` of `kind` that runs on `device_type` declares about its section's
/// keys (`None`: the registry lacks it; the command names it when it resolves components).
fn declared_keys(
    registry: &Registry,
    device_type: &str,
    kind: ComponentKind,
    name: &str,
) -> Option<ConfigKeys> {
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
}

/// The audit's context for a training command: the world size `trainer.nnodes ×
/// trainer.n_gpus_per_node` must equal (`None`: not checked), and the declarations of the
/// components `config` uses on `device_type` devices.
pub fn context(
    config: &Config,
    registry: &Registry,
    device_type: &str,
    world_size: Option<u32>,
) -> AuditContext {
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
    let mut components: Vec<(&str, ComponentKind, &str)> = roles
        .into_iter()
        .filter(|(_, _, used)| *used)
        .map(|(role, section, _)| (section, ComponentKind::ENGINE, config.engine_strategy(role)))
        .collect();
    components.extend([
        (
            "actor_rollout_ref.rollout",
            ComponentKind::ROLLOUT,
            rollout.name.as_str(),
        ),
        (
            "actor_rollout_ref.rollout.checkpoint_engine",
            ComponentKind::CHECKPOINT,
            rollout.checkpoint_engine.backend.as_str(),
        ),
    ]);
    AuditContext {
        world_size,
        ..command_context(registry, device_type, AuditScope::Training, &components)
    }
}

/// The audit's context for a one-off command reading `scope`, with the declarations of its
/// `components` (section, kind, name) on `device_type` devices; its ranks are the launcher's.
pub fn command_context(
    registry: &Registry,
    device_type: &str,
    scope: AuditScope,
    components: &[(&str, ComponentKind, &str)],
) -> AuditContext {
    AuditContext {
        world_size: None,
        components: components
            .iter()
            .filter_map(|&(section, kind, name)| {
                Some((
                    section.to_owned(),
                    declared_keys(registry, device_type, kind, name)?,
                ))
            })
            .collect(),
        scope,
    }
}

/// Audits `config` in `ctx` (see [`context`], [`command_context`]): logs each warning once and
/// fails with every error. Returns the findings (warnings only).
pub fn check(config: &Config, ctx: &AuditContext) -> Result<Vec<Finding>, Unsupported> {
    let findings = audit(config, ctx);
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
