//! The JSON each plugin component receives: its verl section plus what it cannot see on its own
//! (`role`, `model`, values verl interpolates from other sections).

use serde_json::{Value, json};

use super::{Config, ConfigError};
use verl_data::expand_home;

/// Which model an engine instance holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineRole {
    Actor,
    Ref,
    Critic,
    /// The distillation teacher (`distillation.teacher_model`): a frozen model that scores the
    /// student's samples.
    Teacher,
}

impl EngineRole {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Actor => "actor",
            Self::Ref => "ref",
            Self::Critic => "critic",
            Self::Teacher => "teacher",
        }
    }
}

/// A per-rank micro-batch size, else verl's older global one (divided by the world size in verl;
/// one rank here, where the two are the same). Setting both is rejected at start.
fn per_gpu(per_gpu: Option<usize>, global: Option<usize>) -> Option<usize> {
    per_gpu.or(global)
}

/// The `megatron` keys the reference role takes from the actor's section unless it sets them: the
/// process grid verl builds from the actor's and the keys `megatron_ref.yaml` interpolates.
pub const REF_INHERITS_MEGATRON: [&str; 10] = [
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "seed",
    "override_transformer_config",
    "use_mbridge",
    "vanilla_mbridge",
];

fn section<T: serde::Serialize>(value: &T) -> Value {
    serde_json::to_value(value).expect("config sections serialise")
}

/// A token budget of verl's `use_dynamic_bsz` in effect: the key it comes from and its value.
pub type TokenBudget = (&'static str, usize);

impl Config {
    /// The token budgets `role`'s engine batches by (verl's `use_dynamic_bsz`), with verl's
    /// interpolated defaults: `[forward, update]` — its forward passes (`compute_log_prob` with
    /// the rollout's or the ref's `log_prob_*` keys, `compute_values` with the critic's
    /// `forward_max_token_len_per_gpu`) and its updates; `None` where it batches by rows.
    pub fn token_budgets(&self, role: EngineRole) -> [Option<TokenBudget>; 2] {
        let arr = &self.actor_rollout_ref;
        let actor = &arr.actor;
        let actor_budget: TokenBudget = (
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
            actor.ppo_max_token_len_per_gpu,
        );
        let log_prob = |on: Option<bool>, budget: Option<usize>, key: &'static str| {
            on.unwrap_or(actor.use_dynamic_bsz)
                .then(|| budget.map_or(actor_budget, |b| (key, b)))
        };
        match role {
            EngineRole::Actor => [
                log_prob(
                    arr.rollout.log_prob_use_dynamic_bsz,
                    arr.rollout.log_prob_max_token_len_per_gpu,
                    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
                ),
                actor.use_dynamic_bsz.then_some(actor_budget),
            ],
            EngineRole::Ref | EngineRole::Teacher => [
                log_prob(
                    arr.reference.log_prob_use_dynamic_bsz,
                    arr.reference.log_prob_max_token_len_per_gpu,
                    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
                ),
                None,
            ],
            EngineRole::Critic => {
                let c = &self.critic;
                let update: TokenBudget = (
                    "critic.ppo_max_token_len_per_gpu",
                    c.ppo_max_token_len_per_gpu,
                );
                let on = c.use_dynamic_bsz.unwrap_or(actor.use_dynamic_bsz);
                [
                    on.then(|| {
                        c.forward_max_token_len_per_gpu
                            .map_or(update, |b| ("critic.forward_max_token_len_per_gpu", b))
                    }),
                    on.then_some(update),
                ]
            }
        }
    }

    /// Whether a critic is trained: `critic.enable`, else whether the estimator needs one.
    pub fn critic_enabled(&self) -> bool {
        self.critic
            .enable
            .unwrap_or_else(|| self.algorithm.adv_estimator.needs_critic())
    }

    /// Whether a distillation teacher scores the samples (`distillation.enabled`).
    pub fn teacher_enabled(&self) -> bool {
        self.distillation.enabled
    }

    /// Whether reference log-probs are needed (KL in the loss or in the reward).
    pub fn ref_enabled(&self) -> bool {
        self.actor_rollout_ref.actor.use_kl_loss || self.algorithm.use_kl_in_reward
    }

    /// The engine plugin's name for `role`.
    pub fn engine_strategy(&self, role: EngineRole) -> &str {
        let arr = &self.actor_rollout_ref;
        match role {
            EngineRole::Actor => &arr.actor.strategy,
            EngineRole::Ref | EngineRole::Teacher => arr
                .reference
                .strategy
                .as_deref()
                .unwrap_or(&arr.actor.strategy),
            EngineRole::Critic => &self.critic.strategy,
        }
    }

    /// The key [`Config::engine_strategy`] took the role's strategy from (the reference role
    /// takes the actor's unless it sets its own).
    pub fn strategy_key(&self, role: EngineRole) -> &'static str {
        match role {
            EngineRole::Ref | EngineRole::Teacher
                if self.actor_rollout_ref.reference.strategy.is_some() =>
            {
                "actor_rollout_ref.ref.strategy"
            }
            EngineRole::Actor | EngineRole::Ref | EngineRole::Teacher => {
                "actor_rollout_ref.actor.strategy"
            }
            EngineRole::Critic => "critic.strategy",
        }
    }

    /// The longest response generated: `actor_rollout_ref.rollout.response_length`, else
    /// `data.max_response_length` (verl's interpolation).
    pub fn response_length(&self) -> usize {
        self.actor_rollout_ref
            .rollout
            .response_length
            .unwrap_or(self.data.max_response_length)
    }

    /// `data.apply_chat_template_kwargs`: extra variables of the chat template; a mapping.
    pub fn chat_template_kwargs(&self) -> Result<serde_json::Map<String, Value>, ConfigError> {
        let key = "data.apply_chat_template_kwargs";
        match &self.data.apply_chat_template_kwargs {
            Value::Object(map) => Ok(map.clone()),
            Value::Null => Ok(serde_json::Map::new()),
            other => Err(ConfigError::Invalid {
                key: key.to_owned(),
                origin: self.origin(key).unwrap_or("built-in defaults").to_owned(),
                message: format!("must be a mapping of template variables, not {other}"),
            }),
        }
    }

    /// `{"path", "random_init", "enable_gradient_checkpointing", "use_remove_padding", "dtype"}`
    /// of the policy model (`~/` expanded).
    pub fn model_json(&self) -> Value {
        let m = &self.actor_rollout_ref.model;
        json!({
            "path": expand_home(&m.path),
            "random_init": m.random_init,
            "enable_gradient_checkpointing": m.enable_gradient_checkpointing,
            "use_remove_padding": m.use_remove_padding,
            "dtype": m.dtype,
        })
    }

    /// An engine's config: the actor section (ref: overlaid with `ref`; critic: the `critic`
    /// section) plus `role` and `model`. `ppo_mini_batch_size` is converted from prompts to
    /// sequences (× `rollout.n`) as verl's workers do; the critic's unset keys take the actor's
    /// values, as verl's config interpolates them.
    pub fn engine_json(&self, role: EngineRole) -> Value {
        let arr = &self.actor_rollout_ref;
        let n = arr.rollout.n;
        let mut out = match role {
            EngineRole::Actor => {
                let mut v = section(&arr.actor);
                v["ppo_mini_batch_size"] = json!(arr.actor.ppo_mini_batch_size * n);
                v["ppo_micro_batch_size_per_gpu"] = json!(per_gpu(
                    arr.actor.ppo_micro_batch_size_per_gpu,
                    arr.actor.ppo_micro_batch_size
                ));
                // Old log-probs are computed with the rollout's micro-batch size in verl.
                v["log_prob_micro_batch_size_per_gpu"] = json!(per_gpu(
                    arr.rollout.log_prob_micro_batch_size_per_gpu,
                    arr.rollout.log_prob_micro_batch_size
                ));
                self.log_prob_budget(&mut v, role);
                v["model"] = self.model_json();
                if self.teacher_enabled() {
                    v["distillation_loss"] = section(&self.distillation.distillation_loss);
                }
                v
            }
            EngineRole::Teacher => {
                // Scored like the reference (its engine settings, micro-batches and strategy),
                // with the teacher's weights.
                let mut v = self.engine_json(EngineRole::Ref);
                v["model"]["path"] = json!(
                    self.distillation
                        .teacher_model
                        .model_path
                        .as_deref()
                        .map(expand_home)
                );
                v["model"]["random_init"] = json!(false);
                v
            }
            EngineRole::Ref => {
                let mut v = section(&arr.actor);
                // The ref's plugin sections are its own, never the actor's.
                if let Value::Object(base) = &mut v {
                    base.retain(|k, _| !arr.actor.sections.contains_key(k));
                }
                if let (Value::Object(base), Value::Object(overlay)) =
                    (&mut v, section(&arr.reference))
                {
                    base.extend(overlay);
                }
                self.inherit_megatron(&mut v);
                v["strategy"] = json!(self.engine_strategy(role));
                v["log_prob_micro_batch_size_per_gpu"] = json!(per_gpu(
                    arr.reference.log_prob_micro_batch_size_per_gpu,
                    arr.reference.log_prob_micro_batch_size
                ));
                self.log_prob_budget(&mut v, role);
                // Never used to update, but kept consistent with the micro-batch sizes it shares.
                v["ppo_mini_batch_size"] = json!(arr.actor.ppo_mini_batch_size * n);
                v["model"] = self.model_json();
                v
            }
            EngineRole::Critic => {
                let c = &self.critic;
                let mut v = section(c);
                v["ppo_mini_batch_size"] = json!(
                    c.ppo_mini_batch_size
                        .unwrap_or(arr.actor.ppo_mini_batch_size)
                        * n
                );
                v["ppo_micro_batch_size_per_gpu"] = json!(per_gpu(
                    c.ppo_micro_batch_size_per_gpu,
                    c.ppo_micro_batch_size
                ));
                v["forward_micro_batch_size_per_gpu"] = json!(per_gpu(
                    c.forward_micro_batch_size_per_gpu,
                    c.forward_micro_batch_size
                ));
                v["ppo_epochs"] = json!(c.ppo_epochs.unwrap_or(arr.actor.ppo_epochs));
                let [forward, update] = self.token_budgets(role);
                v["use_dynamic_bsz"] = json!(update.is_some());
                v["forward_max_token_len_per_gpu"] = json!(forward.map(|(_, b)| b));
                v["loss_agg_mode"] = json!(
                    c.loss_agg_mode
                        .as_deref()
                        .unwrap_or(&arr.actor.loss_agg_mode)
                );
                let actor_model = self.model_json();
                let own = |key: &str| c.model.get(key).filter(|v| !v.is_null()).cloned();
                v["model"] = json!({
                    "path": own("path").and_then(|p| p.as_str().map(expand_home)).map_or_else(|| actor_model["path"].clone(), |p| json!(p)),
                    "random_init": own("random_init").unwrap_or_else(|| actor_model["random_init"].clone()),
                    "enable_gradient_checkpointing": own("enable_gradient_checkpointing").unwrap_or(json!(true)),
                    // verl's critic default (its actor's is true).
                    "use_remove_padding": own("use_remove_padding").unwrap_or(json!(false)),
                    "dtype": own("dtype").unwrap_or_else(|| actor_model["dtype"].clone()),
                });
                v
            }
        };
        out["role"] = json!(role.as_str());
        out["deterministic"] = json!(self.trainer.deterministic);
        out
    }

    /// The reference role's `megatron` keys it does not set itself, from the actor's: verl's
    /// megatron workers build the reference model in the process groups made from
    /// `actor.megatron` (`mpu.initialize_model_parallel(tensor_model_parallel_size=
    /// self.config.actor.megatron.tensor_model_parallel_size, …)` in `megatron_workers.py`), and
    /// `ref/megatron_ref.yaml` interpolates the actor's `seed` and transformer overrides.
    fn inherit_megatron(&self, reference: &mut Value) {
        let Some(Value::Object(actor)) = self.actor_rollout_ref.actor.sections.get("megatron")
        else {
            return;
        };
        let mut merged: serde_json::Map<String, Value> = REF_INHERITS_MEGATRON
            .iter()
            .filter_map(|&key| Some((key.to_owned(), actor.get(key)?.clone())))
            .collect();
        if merged.is_empty() {
            return;
        }
        if let Some(Value::Object(own)) = reference.get("megatron") {
            merged.extend(own.clone());
        }
        reference["megatron"] = Value::Object(merged);
    }

    /// `log_prob_use_dynamic_bsz` and `log_prob_max_token_len_per_gpu` of `role`'s
    /// `compute_log_prob`, resolved (the rollout's for the actor's old log-probs, as in verl).
    fn log_prob_budget(&self, v: &mut Value, role: EngineRole) {
        let [forward, _] = self.token_budgets(role);
        v["log_prob_use_dynamic_bsz"] = json!(forward.is_some());
        v["log_prob_max_token_len_per_gpu"] = json!(forward.map(|(_, b)| b));
    }

    /// The rollout's config: `actor_rollout_ref.rollout` plus `model`, with `prompt_length` and
    /// `response_length` taken from `data` when unset (verl's interpolation).
    pub fn rollout_json(&self) -> Value {
        let rollout = &self.actor_rollout_ref.rollout;
        let mut v = section(rollout);
        v["prompt_length"] = json!(rollout.prompt_length.unwrap_or(self.data.max_prompt_length));
        v["response_length"] = json!(self.response_length());
        v["model"] = self.model_json();
        v["deterministic"] = json!(self.trainer.deterministic);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use verl_algo::AdvEstimator;

    /// verl builds the reference model in the actor's megatron process groups: the ref's unset
    /// parallel sizes are the actor's, its own settings stay, and non-grid keys are its own.
    #[test]
    fn the_reference_takes_the_actors_megatron_grid() {
        let mut c = Config::default();
        c.actor_rollout_ref.actor.sections.insert(
            "megatron".into(),
            json!({"tensor_model_parallel_size": 2, "context_parallel_size": 2, "seed": 7, "param_offload": true}),
        );
        let reference = c.engine_json(EngineRole::Ref);
        assert_eq!(
            reference["megatron"],
            json!({"tensor_model_parallel_size": 2, "context_parallel_size": 2, "seed": 7})
        );
        c.actor_rollout_ref
            .reference
            .sections
            .insert("megatron".into(), json!({"context_parallel_size": 1}));
        let reference = c.engine_json(EngineRole::Ref);
        assert_eq!(
            reference["megatron"],
            json!({"tensor_model_parallel_size": 2, "context_parallel_size": 1, "seed": 7})
        );
        // The actor's section is its own.
        assert_eq!(
            c.engine_json(EngineRole::Actor)["megatron"]["param_offload"],
            true
        );
        // Without an actor section, nothing is added.
        let plain = Config::default().engine_json(EngineRole::Ref);
        assert!(plain.get("megatron").is_none(), "{plain}");
    }

    #[test]
    fn engine_sections_carry_role_and_model() {
        let mut c = Config::default();
        c.actor_rollout_ref.model.path = "/m".into();
        c.actor_rollout_ref.rollout.n = 4;
        c.actor_rollout_ref.actor.ppo_mini_batch_size = 8;
        c.actor_rollout_ref
            .rollout
            .log_prob_micro_batch_size_per_gpu = Some(2);
        c.actor_rollout_ref
            .reference
            .log_prob_micro_batch_size_per_gpu = Some(3);
        let actor = c.engine_json(EngineRole::Actor);
        assert_eq!(actor["role"], "actor");
        assert_eq!(
            actor["model"],
            json!({"path": "/m", "random_init": false, "enable_gradient_checkpointing": true, "use_remove_padding": true, "dtype": "float32"})
        );
        assert_eq!(actor["ppo_mini_batch_size"], 32);
        assert_eq!(actor["log_prob_micro_batch_size_per_gpu"], 2);
        assert_eq!(actor["optim"]["lr"], 1e-6);
        // verl's older global sizes stand in for unset per-GPU ones.
        let mut old_style = c.clone();
        old_style.actor_rollout_ref.actor.ppo_micro_batch_size = Some(4);
        old_style
            .actor_rollout_ref
            .rollout
            .log_prob_micro_batch_size_per_gpu = None;
        old_style
            .actor_rollout_ref
            .rollout
            .log_prob_micro_batch_size = Some(8);
        old_style.critic.forward_micro_batch_size = Some(16);
        let actor = old_style.engine_json(EngineRole::Actor);
        assert_eq!(
            (
                actor["ppo_micro_batch_size_per_gpu"].as_u64(),
                actor["log_prob_micro_batch_size_per_gpu"].as_u64()
            ),
            (Some(4), Some(8))
        );
        let critic = old_style.engine_json(EngineRole::Critic);
        assert_eq!(critic["forward_micro_batch_size_per_gpu"], 16);
        assert_eq!(critic["ppo_micro_batch_size_per_gpu"], Value::Null);
        let reference = c.engine_json(EngineRole::Ref);
        assert_eq!(
            (
                reference["role"].as_str(),
                reference["log_prob_micro_batch_size_per_gpu"].as_i64()
            ),
            (Some("ref"), Some(3))
        );
        assert_eq!(reference["strategy"], "fsdp");
        let critic = c.engine_json(EngineRole::Critic);
        assert_eq!(critic["role"], "critic");
        assert_eq!(critic["model"]["path"], "/m");
        assert_eq!(critic["ppo_mini_batch_size"], 32);
        assert_eq!(critic["optim"]["lr"], 1e-5);
        assert_eq!(critic["loss_agg_mode"], "token-mean");
        c.critic.model["path"] = json!("/critic");
        assert_eq!(
            c.engine_json(EngineRole::Critic)["model"]["path"],
            "/critic"
        );
    }

    #[test]
    fn token_budgets_follow_verl_interpolation() {
        let mut c = Config::default();
        assert_eq!(c.token_budgets(EngineRole::Actor), [None, None]);
        assert_eq!(c.token_budgets(EngineRole::Critic), [None, None]);
        let actor = c.engine_json(EngineRole::Actor);
        assert_eq!(
            (
                &actor["use_dynamic_bsz"],
                &actor["log_prob_use_dynamic_bsz"]
            ),
            (&json!(false), &json!(false))
        );
        // The actor's switch and budget reach the rollout's and the ref's log-probs and the
        // critic, as verl's `${oc.select:actor_rollout_ref.actor.…}` defaults do.
        c.actor_rollout_ref.actor.use_dynamic_bsz = true;
        c.actor_rollout_ref.actor.ppo_max_token_len_per_gpu = 100;
        let actor_budget = Some(("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", 100));
        assert_eq!(
            c.token_budgets(EngineRole::Actor),
            [actor_budget, actor_budget]
        );
        assert_eq!(c.token_budgets(EngineRole::Ref), [actor_budget, None]);
        assert_eq!(
            c.token_budgets(EngineRole::Critic),
            [
                Some(("critic.ppo_max_token_len_per_gpu", 32768)),
                Some(("critic.ppo_max_token_len_per_gpu", 32768))
            ]
        );
        // Each role's own keys win.
        c.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu = Some(200);
        c.actor_rollout_ref.reference.log_prob_use_dynamic_bsz = Some(false);
        c.critic.forward_max_token_len_per_gpu = Some(300);
        assert_eq!(
            c.token_budgets(EngineRole::Actor)[0],
            Some((
                "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
                200
            ))
        );
        assert_eq!(c.token_budgets(EngineRole::Ref), [None, None]);
        assert_eq!(
            c.token_budgets(EngineRole::Critic)[0],
            Some(("critic.forward_max_token_len_per_gpu", 300))
        );
        let actor = c.engine_json(EngineRole::Actor);
        assert_eq!(
            (
                &actor["use_dynamic_bsz"],
                &actor["ppo_max_token_len_per_gpu"],
                &actor["log_prob_use_dynamic_bsz"],
                &actor["log_prob_max_token_len_per_gpu"]
            ),
            (&json!(true), &json!(100), &json!(true), &json!(200))
        );
        let reference = c.engine_json(EngineRole::Ref);
        assert_eq!(reference["log_prob_use_dynamic_bsz"], json!(false));
        let critic = c.engine_json(EngineRole::Critic);
        assert_eq!(
            (
                &critic["use_dynamic_bsz"],
                &critic["forward_max_token_len_per_gpu"]
            ),
            (&json!(true), &json!(300))
        );
        c.critic.use_dynamic_bsz = Some(false);
        assert_eq!(c.token_budgets(EngineRole::Critic), [None, None]);
    }

    #[test]
    fn rollout_section_fills_lengths() {
        let mut c = Config::default();
        c.data.max_prompt_length = 16;
        c.actor_rollout_ref.rollout.response_length = Some(8);
        let r = c.rollout_json();
        assert_eq!(
            (r["prompt_length"].as_u64(), r["response_length"].as_u64()),
            (Some(16), Some(8))
        );
        assert_eq!(r["checkpoint_engine"]["backend"], "naive");
        assert_eq!(r["val_kwargs"]["temperature"], 0.0);
        assert_eq!(r["model"]["dtype"], "float32");
    }

    #[test]
    fn switches() {
        let mut c = Config::default();
        assert!(c.critic_enabled() && !c.ref_enabled());
        c.algorithm.adv_estimator = AdvEstimator::Grpo;
        c.actor_rollout_ref.actor.use_kl_loss = true;
        assert!(!c.critic_enabled() && c.ref_enabled());
        c.critic.enable = Some(true);
        assert!(c.critic_enabled());
    }
}
