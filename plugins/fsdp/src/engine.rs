//! The engine's compute: a model (policy, reference or critic), its optimizer and schedule, and
//! verl's update loop — epochs × mini-batches (one optimizer step each) × micro-batches (gradient
//! accumulation).
//!
//! Loss scaling follows verl's global-batch normalisation: every micro-batch's loss is aggregated
//! with the mini-batch's token count (token-mean) or sequence count (seq-mean modes) as the
//! denominator, so the accumulated gradient equals the mini-batch's loss gradient whatever the
//! micro-batch size. Metrics are averaged as verl's `reduce_metrics` does (mean of the collected
//! values), with the loss values (`pg_loss`, `kl_loss`, `vf_loss`) collected per mini-batch (the sum
//! of its micro-batches' contributions, i.e. the mini-batch loss) and the rest per micro-batch.
//! `actor/entropy` comes from `update_actor` only when `entropy_coeff != 0`, as in verl, whose
//! trainer otherwise reports it from `compute_log_prob`'s `entropys`.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};
use verl_model::interop::{LentTensors, from_tch};
use verl_model::losses::{
    AggScale, PolicyBatch, agg_loss, kl_penalty, masked_mean, policy_loss, value_loss,
};
use verl_model::{
    AdamW, CausalLM, Head, LrSchedule, Rng, load_training_state, parse_device, save_training_state,
};
use verl_plugin_api::{Batch, ComponentInit, Metric, TensorRef, keys};

use crate::batch::{Meta, Rows};
use crate::config::{EngineConfig, Role, Settings};
use crate::error::EngineError;

/// What a trainable role carries besides the model.
struct Trainer {
    optimizer: AdamW,
    schedule: LrSchedule,
    /// Shuffles mini-batches; saved with the checkpoint so a resumed run shuffles identically.
    rng: Rng,
    /// `update_*` calls so far: verl steps the LR scheduler once per call, not per optimizer step.
    updates: u64,
}

/// The engine's own part of a checkpoint, next to verl-model's training state.
#[derive(Serialize, Deserialize)]
struct EngineState {
    role: Role,
    global_step: u64,
    updates: u64,
}

const ENGINE_STATE_FILE: &str = "engine_state.json";

/// Collected metric values, averaged at the end.
#[derive(Default)]
struct Metrics(BTreeMap<&'static str, Vec<f64>>);

impl Metrics {
    fn push(&mut self, key: &'static str, value: f64) {
        self.0.entry(key).or_default().push(value);
    }

    fn into_means(self) -> Vec<Metric> {
        self.0
            .into_iter()
            .map(|(k, v)| Metric::new(k, v.iter().sum::<f64>() / v.len() as f64))
            .collect()
    }
}

fn scalar(t: &Tensor) -> f64 {
    t.double_value(&[])
}

pub struct Worker {
    settings: Settings,
    model: CausalLM,
    trainer: Option<Trainer>,
    /// The weights last lent to a weight sync.
    lent: LentTensors,
}

impl Worker {
    pub fn new(init: &ComponentInit) -> Result<Self, EngineError> {
        let run = &init.run;
        if run.world_size > 1 {
            return Err(EngineError::Unsupported(format!(
                "the fsdp engine runs on a single rank for now; world_size {} (rank {}) is not yet supported",
                run.world_size, run.rank
            )));
        }
        let config = init.config::<EngineConfig>("fsdp")?;
        let settings = if init.section_path.is_empty() {
            config.validate()?
        } else {
            config.validate_section(&init.section_path, &init.origins_json())?
        };
        let device = parse_device(&run.device)?;
        let head = if settings.role == Role::Critic {
            Head::Value
        } else {
            Head::Lm
        };
        let mut model = settings.model.load(device, head, run.seed)?;
        let trainer = if settings.role == Role::Ref {
            model.set_trainable(false);
            None
        } else {
            Some(Trainer {
                optimizer: AdamW::for_model(&model, settings.optimizer),
                schedule: settings.schedule,
                rng: Rng::stream(run.seed, 1),
                updates: 0,
            })
        };
        Ok(Self {
            settings,
            model,
            trainer,
            lent: LentTensors::default(),
        })
    }

    fn device(&self) -> Device {
        self.model.device()
    }

    fn require_role(&self, op: &str, roles: &[Role]) -> Result<(), EngineError> {
        if roles.contains(&self.settings.role) {
            Ok(())
        } else {
            Err(EngineError::Unsupported(format!(
                "a `{}` engine does not support `{op}`",
                self.settings.role.as_str()
            )))
        }
    }

    pub fn compute_log_prob(&mut self, batch: &Batch) -> Result<Batch, EngineError> {
        self.require_role("compute_log_prob", &[Role::Actor, Role::Ref])?;
        let meta = Meta::of(batch)?;
        let rows = Rows::load(
            batch,
            &[keys::INPUT_IDS, keys::ATTENTION_MASK, keys::RESPONSES],
            self.device(),
        )?;
        let (mut log_probs, mut entropys) = (Vec::new(), Vec::new());
        tch::no_grad(|| -> Result<(), EngineError> {
            for micro in rows.chunks(self.settings.forward_micro_batch) {
                let scores = self.model.response_scores(
                    micro.get(keys::INPUT_IDS),
                    micro.get(keys::ATTENTION_MASK),
                    rows.response_len,
                    meta.temperature,
                    meta.calculate_entropy,
                )?;
                log_probs.push(scores.log_probs);
                entropys.extend(scores.entropy);
            }
            Ok(())
        })?;
        let mut out = Batch::default();
        out.insert(
            keys::LOG_PROBS,
            from_tch(keys::LOG_PROBS, &Tensor::cat(&log_probs, 0))?,
        );
        if meta.calculate_entropy {
            out.insert(
                keys::ENTROPYS,
                from_tch(keys::ENTROPYS, &Tensor::cat(&entropys, 0))?,
            );
        }
        Ok(out)
    }

    pub fn compute_values(&mut self, batch: &Batch) -> Result<Batch, EngineError> {
        self.require_role("compute_values", &[Role::Critic])?;
        let rows = Rows::load(
            batch,
            &[keys::INPUT_IDS, keys::ATTENTION_MASK, keys::RESPONSES],
            self.device(),
        )?;
        let values = tch::no_grad(|| -> Result<Vec<Tensor>, EngineError> {
            rows.chunks(self.settings.forward_micro_batch)
                .map(|m| {
                    Ok(self.model.response_values(
                        m.get(keys::INPUT_IDS),
                        m.get(keys::ATTENTION_MASK),
                        rows.response_len,
                    )?)
                })
                .collect()
        })?;
        let mut out = Batch::default();
        out.insert(
            keys::VALUES,
            from_tch(keys::VALUES, &Tensor::cat(&values, 0))?,
        );
        Ok(out)
    }

    /// verl's update loop, shared by the actor and the critic: `micro_step` runs forward and
    /// backward of one micro-batch under the mini-batch's loss normalisation and records the
    /// micro-batch's metrics; it returns the micro-batch's contribution to the mini-batch loss
    /// values (keyed like the metrics), which are recorded once per mini-batch.
    fn update(
        &mut self,
        prefix: &'static str,
        rows: Rows,
        micro_step: impl FnMut(
            &Net<'_>,
            &Rows,
            &AggScale,
            &mut Metrics,
        ) -> Result<Vec<(&'static str, f64)>, EngineError>,
    ) -> Result<Vec<Metric>, EngineError> {
        let net = Net {
            settings: &self.settings,
            model: &self.model,
        };
        let trainer = self
            .trainer
            .as_mut()
            .expect("trainable roles have a trainer");
        net.update(trainer, prefix, rows, micro_step)
    }

    pub fn update_actor(&mut self, batch: &Batch) -> Result<Vec<Metric>, EngineError> {
        self.require_role("update_actor", &[Role::Actor])?;
        let meta = Meta::of(batch)?;
        let mut wanted = vec![
            keys::INPUT_IDS,
            keys::ATTENTION_MASK,
            keys::RESPONSES,
            keys::RESPONSE_MASK,
            keys::OLD_LOG_PROBS,
            keys::ADVANTAGES,
        ];
        if self.settings.kl_loss.is_some() {
            wanted.push(keys::REF_LOG_PROB);
        }
        let rows = Rows::load(batch, &wanted, self.device())?;
        self.update("actor", rows, |this, micro, scale, metrics| {
            this.actor_micro_step(micro, scale, meta.temperature, metrics)
        })
    }

    pub fn update_critic(&mut self, batch: &Batch) -> Result<Vec<Metric>, EngineError> {
        self.require_role("update_critic", &[Role::Critic])?;
        let wanted = [
            keys::INPUT_IDS,
            keys::ATTENTION_MASK,
            keys::RESPONSES,
            keys::RESPONSE_MASK,
            keys::VALUES,
            keys::RETURNS,
        ];
        let rows = Rows::load(batch, &wanted, self.device())?;
        self.update("critic", rows, |this, micro, scale, metrics| {
            let s = &this.settings;
            let response_mask = micro.get(keys::RESPONSE_MASK);
            let mut loss_value = 0.0;
            this.backward(micro, |hidden| {
                let vpreds = this.model.response_values_from_hidden(
                    hidden,
                    micro.get(keys::ATTENTION_MASK),
                    micro.response_len,
                )?;
                let (loss, clipfrac) = value_loss(
                    &vpreds,
                    micro.get(keys::RETURNS),
                    micro.get(keys::VALUES),
                    response_mask,
                    s.cliprange_value,
                    s.loss_agg_mode,
                    scale,
                );
                metrics.push("critic/vf_clipfrac", clipfrac);
                metrics.push(
                    "critic/vpred_mean",
                    scalar(&masked_mean(&vpreds.detach(), response_mask)),
                );
                loss_value = scalar(&loss);
                Ok(loss)
            })?;
            Ok(vec![("critic/vf_loss", loss_value)])
        })
    }

    fn trainer(&self, op: &str) -> Result<&Trainer, EngineError> {
        self.trainer.as_ref().ok_or_else(|| {
            EngineError::Unsupported(format!("a `ref` engine has no training state to `{op}`"))
        })
    }

    /// Weights, optimizer moments, schedule and RNG (verl-model's training state) plus the
    /// engine's step counters, so that the next update after `load_checkpoint` is bit-identical.
    pub fn save_checkpoint(&mut self, dir: &Path, global_step: u64) -> Result<(), EngineError> {
        let trainer = self.trainer("save_checkpoint")?;
        save_training_state(
            dir,
            &self.model,
            &trainer.optimizer,
            &trainer.schedule,
            &trainer.rng,
        )?;
        let state = EngineState {
            role: self.settings.role,
            global_step,
            updates: trainer.updates,
        };
        let path = dir.join(ENGINE_STATE_FILE);
        let text = serde_json::to_string_pretty(&state).expect("plain struct");
        std::fs::write(&path, text).map_err(|e| checkpoint_error(&path, e))
    }

    pub fn load_checkpoint(&mut self, dir: &Path) -> Result<u64, EngineError> {
        self.trainer("load_checkpoint")?;
        let path = dir.join(ENGINE_STATE_FILE);
        let text = std::fs::read_to_string(&path).map_err(|e| checkpoint_error(&path, e))?;
        let state: EngineState =
            serde_json::from_str(&text).map_err(|e| checkpoint_error(&path, e))?;
        if state.role != self.settings.role {
            return Err(checkpoint_error(
                &path,
                format!(
                    "was saved by a `{}` engine, this one is `{}`",
                    state.role.as_str(),
                    self.settings.role.as_str()
                ),
            ));
        }
        let trainer = self.trainer.as_mut().expect("checked above");
        let saved = load_training_state(dir, &self.model, &mut trainer.optimizer)?;
        trainer.schedule = saved.schedule;
        trainer.rng = saved.rng;
        trainer.updates = state.updates;
        Ok(state.global_step)
    }

    /// The parameters as views, in place for contiguous host tensors.
    pub fn weights(&mut self) -> Result<Vec<TensorRef<'_>>, EngineError> {
        self.lent.lend(self.model.named_tensors())?;
        Ok(self.lent.views()?)
    }

    pub fn export_hf(&self, dir: &Path) -> Result<(), EngineError> {
        Ok(self
            .model
            .save_pretrained(dir, Some(&self.settings.model.path))?)
    }
}

/// What an update step reads (settings and model), borrowed apart from the trainer it mutates.
struct Net<'a> {
    settings: &'a Settings,
    model: &'a CausalLM,
}

impl Net<'_> {
    /// Forward and backward of one micro-batch; `loss_fn` maps final hidden states to the scalar
    /// loss (with activation checkpointing when the model config asks for it).
    fn backward(
        &self,
        rows: &Rows,
        loss_fn: impl FnOnce(&Tensor) -> verl_model::Result<Tensor>,
    ) -> Result<(), EngineError> {
        let (ids, mask) = (rows.get(keys::INPUT_IDS), rows.get(keys::ATTENTION_MASK));
        if self.settings.model.enable_gradient_checkpointing {
            // The returned (detached) loss is not needed: `loss_fn` records its values.
            let _ = self.model.backward_checkpointed(ids, mask, loss_fn)?;
        } else {
            loss_fn(&self.model.hidden_states(ids, mask)?)?.f_backward()?;
        }
        Ok(())
    }

    fn update(
        &self,
        trainer: &mut Trainer,
        prefix: &'static str,
        rows: Rows,
        mut micro_step: impl FnMut(
            &Self,
            &Rows,
            &AggScale,
            &mut Metrics,
        ) -> Result<Vec<(&'static str, f64)>, EngineError>,
    ) -> Result<Vec<Metric>, EngineError> {
        let s = self.settings;
        let lr = trainer.schedule.lr_at(trainer.updates);
        let mut metrics = Metrics::default();
        for _ in 0..s.epochs {
            let order = if s.shuffle {
                rows.select(&permutation(
                    &mut trainer.rng,
                    rows.rows(),
                    self.model.device(),
                ))
            } else {
                rows.narrow(0, rows.rows())
            };
            for mini in order.chunks(Some(s.mini_batch)) {
                trainer.optimizer.zero_grad();
                let mask = mini.get(keys::RESPONSE_MASK);
                let tokens = scalar(&mask.sum(Kind::Float));
                let seqs = scalar(
                    &mask
                        .sum_dim_intlist(-1, false, Kind::Float)
                        .gt(0.0)
                        .sum(Kind::Float),
                );
                let scale = AggScale {
                    batch_num_tokens: Some(tokens.max(1.0)),
                    global_batch_size: Some(seqs.max(1.0)),
                    loss_scale_factor: s.loss_scale_factor,
                    ..AggScale::default()
                };
                let mut losses: BTreeMap<&'static str, f64> = BTreeMap::new();
                for micro in mini.chunks(s.micro_batch) {
                    for (key, value) in micro_step(self, &micro, &scale, &mut metrics)? {
                        *losses.entry(key).or_default() += value;
                    }
                }
                losses.into_iter().for_each(|(k, v)| metrics.push(k, v));
                let grad_norm = trainer.optimizer.clip_grad_norm(s.clip_grad);
                // As verl: a non-finite gradient skips the step instead of corrupting the weights.
                if grad_norm.is_finite() {
                    trainer.optimizer.step(lr);
                }
                trainer.optimizer.zero_grad();
                metrics.push(
                    if prefix == "actor" {
                        "actor/grad_norm"
                    } else {
                        "critic/grad_norm"
                    },
                    grad_norm,
                );
            }
        }
        trainer.updates += 1;
        let mut out = metrics.into_means();
        out.push(Metric::new(format!("{prefix}/lr"), lr));
        Ok(out)
    }

    fn actor_micro_step(
        &self,
        micro: &Rows,
        scale: &AggScale,
        temperature: f64,
        metrics: &mut Metrics,
    ) -> Result<Vec<(&'static str, f64)>, EngineError> {
        let s = self.settings;
        let response_mask = micro.get(keys::RESPONSE_MASK);
        let mut losses = Vec::new();
        self.backward(micro, |hidden| {
            // As verl: entropy only when it is in the loss (then also reported); otherwise the
            // trainer reports `actor/entropy` from `compute_log_prob`'s `entropys`, and the
            // [batch, response, vocab] entropy tensors are never built here.
            let with_entropy = s.entropy_coeff != 0.0;
            let scores = self.model.response_scores_from_hidden(
                hidden,
                micro.get(keys::INPUT_IDS),
                micro.get(keys::ATTENTION_MASK),
                micro.response_len,
                temperature,
                with_entropy,
            )?;
            let pg = policy_loss(
                s.loss_mode,
                PolicyBatch {
                    old_log_prob: micro.get(keys::OLD_LOG_PROBS),
                    log_prob: &scores.log_probs,
                    advantages: micro.get(keys::ADVANTAGES),
                    response_mask,
                },
                &s.clip,
                s.loss_agg_mode,
                scale,
            )?;
            metrics.push("actor/pg_clipfrac", pg.pg_clipfrac);
            metrics.push("actor/ppo_kl", pg.ppo_kl);
            metrics.push("actor/pg_clipfrac_lower", pg.pg_clipfrac_lower);
            losses.push(("actor/pg_loss", scalar(&pg.pg_loss)));
            let mut terms = vec![pg.pg_loss];
            if let Some(entropy) = &scores.entropy {
                // The micro-batch's own mean entropy, as verl reports it.
                let own = agg_loss(
                    &entropy.detach(),
                    response_mask,
                    s.loss_agg_mode,
                    &AggScale::default(),
                );
                metrics.push("actor/entropy", scalar(&own));
                terms.push(
                    agg_loss(entropy, response_mask, s.loss_agg_mode, scale) * -s.entropy_coeff,
                );
            }
            if let Some((coef, penalty)) = s.kl_loss {
                let kl = kl_penalty(&scores.log_probs, micro.get(keys::REF_LOG_PROB), penalty);
                let kl_loss = agg_loss(&kl, response_mask, s.loss_agg_mode, scale);
                losses.push(("actor/kl_loss", scalar(&kl_loss)));
                terms.push(kl_loss * coef);
            }
            Ok(Tensor::stack(&terms, 0).sum(Kind::Float))
        })?;
        if let Some((coef, _)) = s.kl_loss {
            metrics.push("actor/kl_coef", coef);
        }
        Ok(losses)
    }
}

fn checkpoint_error(path: &Path, reason: impl ToString) -> EngineError {
    EngineError::Checkpoint {
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

/// A seeded Fisher–Yates permutation of `0..n` (our own RNG, so it is checkpointed with the engine).
fn permutation(rng: &mut Rng, n: i64, device: Device) -> Tensor {
    let mut order: Vec<i64> = (0..n).collect();
    for i in (1..order.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    Tensor::from_slice(&order).to_device(device)
}
