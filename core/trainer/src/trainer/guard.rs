//! The non-finite guard: what makes a step's update unusable. Engines skip an update whose loss or
//! gradient norm is not finite (verl's actor does so for the gradient norm) and report it in their
//! metrics; ours also refuse an update whose result would be non-finite and count every update
//! left out in `<role>/skipped_updates`. The trainer reads these here and applies
//! `trainer.nan_policy`; weights that reach the weight sync are checked there
//! ([`crate::workers::first_non_finite`]).

use std::fmt;

use verl_plugin_api::Metric;

use verl_config::NanPolicy;

/// The engine metric (`actor/…`, `critic/…`) counting optimizer updates of one call that were not
/// applied because the loss, the gradient norm or the updated weights were not finite.
pub const SKIPPED_UPDATES: &str = "skipped_updates";

/// What was not finite in a step.
#[derive(Debug, Clone, PartialEq)]
pub enum NonFinite {
    /// A loss or gradient norm an engine reported for its update (`actor/pg_loss`,
    /// `critic/grad_norm`, …); the engine did not apply that update.
    Metric { key: String, value: f64 },
    /// The engine refused `updates` updates whose weights would have been non-finite.
    RefusedWeights { role: String, updates: f64 },
    /// The weights the actor lent for the weight sync hold a NaN or an infinity: the update was
    /// applied, and cannot be skipped.
    Weights { tensor: String },
}

impl NonFinite {
    /// Whether the engine left its weights as they were (the step can be skipped).
    pub fn skippable(&self) -> bool {
        !matches!(self, Self::Weights { .. })
    }
}

impl fmt::Display for NonFinite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Metric { key, value } => write!(f, "{key} is {value}"),
            Self::RefusedWeights { role, updates } => write!(
                f,
                "the {role}'s weights would have become non-finite ({role}/{SKIPPED_UPDATES} = {updates})"
            ),
            Self::Weights { tensor } => write!(
                f,
                "the actor's weights hold non-finite values after its update (tensor `{tensor}`)"
            ),
        }
    }
}

/// The first sign of a non-finite update in the metrics `role`'s engine returned for it: a loss or
/// gradient norm that is not finite, else updates the engine skipped for its weights' sake.
pub fn check_update(role: &str, metrics: &[Metric]) -> Option<NonFinite> {
    let leaf = |m: &Metric| {
        let key = m.key.as_str();
        key.rsplit('/').next().unwrap_or(key).to_owned()
    };
    if let Some(m) = metrics.iter().find(|m| {
        let leaf = leaf(m);
        (leaf.ends_with("loss") || leaf == "grad_norm") && !m.value.is_finite()
    }) {
        return Some(NonFinite::Metric {
            key: m.key.to_string(),
            value: m.value,
        });
    }
    let skipped = format!("{role}/{SKIPPED_UPDATES}");
    metrics
        .iter()
        .find(|m| m.key.as_str() == skipped && m.value != 0.0)
        .map(|m| NonFinite::RefusedWeights {
            role: role.to_owned(),
            updates: m.value,
        })
}

/// Applies `policy` to the metrics of `role`'s update at `step`: `Ok(true)` when the engine left
/// the update out and `policy` skips it (with a warning), `Ok(false)` when all is finite, else
/// what training must stop for.
pub fn apply_policy(
    policy: NanPolicy,
    step: u64,
    role: &str,
    metrics: &[Metric],
) -> Result<bool, NonFinite> {
    match check_update(role, metrics) {
        None => Ok(false),
        Some(what) if policy == NanPolicy::Skip && what.skippable() => {
            tracing::warn!(
                "step {step}: {what}; the {role} update was not applied (trainer.nan_policy=skip)"
            );
            Ok(true)
        }
        Some(what) => Err(what),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(pairs: &[(&str, f64)]) -> Vec<Metric> {
        pairs.iter().map(|(k, v)| Metric::new(*k, *v)).collect()
    }

    #[test]
    fn losses_and_gradient_norms_are_checked_before_refused_updates() {
        let finite = metrics(&[
            ("actor/pg_loss", 0.5),
            ("actor/grad_norm", 2.0),
            ("actor/skipped_updates", 0.0),
            // Other metrics may be anything.
            ("actor/ppo_kl", f64::NAN),
        ]);
        assert_eq!(check_update("actor", &finite), None);

        let nan_norm = metrics(&[
            ("actor/pg_loss", 0.5),
            ("actor/grad_norm", f64::NAN),
            ("actor/skipped_updates", 1.0),
        ]);
        let found = check_update("actor", &nan_norm).unwrap();
        assert!(
            matches!(&found, NonFinite::Metric { key, value } if key == "actor/grad_norm" && value.is_nan())
        );
        assert_eq!(found.to_string(), "actor/grad_norm is NaN");
        assert!(found.skippable());

        let inf_loss = metrics(&[("critic/vf_loss", f64::INFINITY), ("critic/grad_norm", 1.0)]);
        assert_eq!(
            check_update("critic", &inf_loss).unwrap().to_string(),
            "critic/vf_loss is inf"
        );

        let refused = metrics(&[("actor/pg_loss", 0.5), ("actor/skipped_updates", 2.0)]);
        let found = check_update("actor", &refused).unwrap();
        assert_eq!(
            found,
            NonFinite::RefusedWeights {
                role: "actor".into(),
                updates: 2.0
            }
        );
        assert!(
            found
                .to_string()
                .contains("weights would have become non-finite")
        );
        // Another role's count is not this role's.
        assert_eq!(check_update("critic", &refused), None);
        assert!(!NonFinite::Weights { tensor: "w".into() }.skippable());
    }

    #[test]
    fn the_policy_skips_what_the_engine_left_out() {
        let nan = metrics(&[("actor/grad_norm", f64::NAN)]);
        let fine = metrics(&[("actor/grad_norm", 1.0)]);
        for policy in [NanPolicy::Error, NanPolicy::Skip] {
            assert_eq!(apply_policy(policy, 3, "actor", &fine), Ok(false));
        }
        assert_eq!(apply_policy(NanPolicy::Skip, 3, "actor", &nan), Ok(true));
        let stop = apply_policy(NanPolicy::Error, 3, "actor", &nan).unwrap_err();
        assert!(matches!(stop, NonFinite::Metric { ref key, .. } if key == "actor/grad_norm"));
    }
}
