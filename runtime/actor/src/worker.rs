//! verl's actor and critic semantics, shared by every engine strategy: the config with verl's keys
//! and defaults ([`ActorConfig`]), the batch layout ([`Rows`]), `compute_log_prob` /
//! `compute_values`, and the update loop — epochs × mini-batches (one optimizer step each) ×
//! micro-batches (gradient accumulation) — with verl's losses and metric names. A strategy (`fsdp`:
//! one rank holds the whole model; `megatron`: tensor/sequence/context parallel shards) supplies
//! only what differs: its forward and backward, its optimizer, its checkpoint files and its weights
//! ([`Strategy`]).
//!
//! Micro-batches hold a fixed number of rows (`ppo_micro_batch_size_per_gpu`, …), or, with verl's
//! `use_dynamic_bsz`, a token budget (`ppo_max_token_len_per_gpu`, …): verl's
//! `rearrange_micro_batches` (Karmarkar–Karp over a FLOP estimate, [`verl_seqlen_balancing`]),
//! with per-row outputs put back in the input order.
//!
//! Loss scaling follows verl's global-batch normalisation (its engine workers' `global_batch_info`):
//! every micro-batch's loss is aggregated with the mini-batch's token count (token-mean) or
//! sequence count (seq-mean modes) as the denominator, so the accumulated gradient equals the
//! mini-batch's loss gradient however the rows are grouped into micro-batches — fixed or by
//! tokens. (verl's legacy `dp_actor` instead scales each micro-batch's own mean by its share of
//! the mini-batch's rows, which differs from the mini-batch's token mean when micro-batches hold
//! different token counts.) Metrics are averaged as verl's `reduce_metrics` does (mean of the collected
//! values), with the loss values (`pg_loss`, `kl_loss`, `loss`, `vf_loss`) collected per mini-batch
//! (the sum of its micro-batches' contributions, i.e. the mini-batch loss) and the rest per
//! micro-batch.
//! `actor/entropy` comes from `update_actor` only when `entropy_coeff != 0`, as in verl, whose
//! trainer otherwise reports it from `compute_log_prob`'s `entropys`.
//!
//! Data parallelism: a strategy whose ranks each hold a slice of the batch sums across them
//! ([`Strategy::all_reduce`], [`Strategy::reduce_gradients`]) the mini-batch's token and
//! sequence counts (so each rank's loss is its share of the global loss: local sum / global
//! count), the gradients (before clipping: the grad-norm is global), the loss values and the
//! metrics (means over every rank's collected values). Every rank then reports the same metrics
//! and takes the same skip decisions.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};
use verl_model::interop::from_tch;
use verl_model::{
    DistillScores, ModelError, ResponseScores, Result, Rng, ScoreOutputs, TopkLogProbs,
};
use verl_plugin_api::{Batch, Metric, TensorRef, keys};
use verl_seqlen_balancing::{BalanceError, inverse_permutation, micro_batch_count, micro_batches};

use crate::distill::{DistillObjective, DistillSettings, TEACHER_IDS, TEACHER_LOGPROBS, topk_kl};
use crate::losses::{
    AggScale, PolicyBatch, agg_loss, kl_penalty, masked_mean, policy_loss, value_loss,
};
use crate::{
    ActorError, ActorSettings, LrSchedule, Meta, MicroBatching, Role, RouterReplayMode, Rows,
};

/// What an engine strategy supplies: how its (possibly sharded) model computes and learns.
/// Everything else — verl's losses, loss scaling, mini/micro-batching, metrics, the schedule,
/// checkpoint bookkeeping — is [`ActorWorker`]'s.
pub trait Strategy {
    fn device(&self) -> Device;
    /// Per-token log-probs (and the `outputs` asked for) of the response tokens of `rows`, at
    /// `temperature`. Called under `no_grad`.
    fn scores(
        &self,
        rows: &Rows,
        temperature: f64,
        outputs: ScoreOutputs,
    ) -> Result<ResponseScores>;
    /// As [`Strategy::scores`], and the experts each token of `rows` was routed through,
    /// `[B, P+R, sparse layers, k]` int64 (router replay R2 records them here). A strategy that
    /// cannot record routing keeps this default.
    fn scores_routed(
        &self,
        _rows: &Rows,
        _temperature: f64,
        _outputs: ScoreOutputs,
    ) -> Result<(ResponseScores, Tensor)> {
        Err(ModelError::invalid_input(
            "router_replay.mode",
            "R2 needs an engine strategy that records each token's experts; this one does not",
        ))
    }
    /// Per-token values of the response tokens (value-head models). Called under `no_grad`.
    fn values(&self, rows: &Rows) -> Result<Tensor>;
    /// A distillation teacher's top-`k` tokens and log-probs at each response position,
    /// `[B, R, k]` (see [`CausalLM::response_topk_in`](verl_model::CausalLM::response_topk_in)).
    /// Called under `no_grad`. Strategies that hold the whole vocabulary implement it.
    fn topk(&self, _rows: &Rows, _temperature: f64, _k: i64) -> Result<TopkLogProbs> {
        Err(unsupported_distillation("top-k log-probs"))
    }
    /// [`Strategy::backward_scores_aux`] where the loss also sees the student's log-probs of `ids`
    /// (`[B, R, k]`, the teacher's top-k tokens), from the same log-softmax.
    fn backward_distill_scores(
        &self,
        _rows: &Rows,
        _temperature: f64,
        _outputs: ScoreOutputs,
        _aux_weight: f64,
        _ids: &Tensor,
        _loss: &mut dyn FnMut(&DistillScores) -> Result<Tensor>,
    ) -> Result<Option<f64>> {
        Err(unsupported_distillation("top-k distillation losses"))
    }
    /// Forward and backward of one micro-batch through the policy: `loss` maps the response scores
    /// to the scalar loss, whose gradient is accumulated into the parameters.
    fn backward_scores(
        &self,
        rows: &Rows,
        temperature: f64,
        outputs: ScoreOutputs,
        loss: &mut dyn FnMut(&ResponseScores) -> Result<Tensor>,
    ) -> Result<()>;
    /// As [`Strategy::backward_scores`], adding `aux_weight` × the model's load-balancing loss
    /// × `router_aux_loss_coef` to the loss when the model's config asks for it
    /// (`output_router_logits`, as transformers adds it to a mixture-of-experts model's loss);
    /// returns that loss's value, `None` when none was added. A strategy that cannot keeps this
    /// default, which adds none.
    fn backward_scores_aux(
        &self,
        rows: &Rows,
        temperature: f64,
        outputs: ScoreOutputs,
        _aux_weight: f64,
        loss: &mut dyn FnMut(&ResponseScores) -> Result<Tensor>,
    ) -> Result<Option<f64>> {
        self.backward_scores(rows, temperature, outputs, loss)
            .map(|()| None)
    }
    /// As [`Strategy::backward_scores`], through the value head.
    fn backward_values(
        &self,
        rows: &Rows,
        loss: &mut dyn FnMut(&Tensor) -> Result<Tensor>,
    ) -> Result<()>;
    fn zero_grad(&mut self);
    /// Clips the global gradient norm to `max_norm`; returns the norm before clipping.
    fn clip_grad_norm(&mut self, max_norm: f64) -> f64;
    /// Applies one optimizer update, unless it would leave a weight (or optimizer state)
    /// non-finite: then nothing changes and `false` is returned.
    fn step(&mut self, lr: f64) -> bool;
    /// Writes weights and optimizer state under `dir`, with the worker's schedule and generator.
    fn save(&self, dir: &Path, schedule: &LrSchedule, rng: &Rng) -> Result<()>;
    /// Restores what [`Strategy::save`] wrote; returns the schedule and generator.
    fn load(&mut self, dir: &Path) -> Result<(LrSchedule, Rng)>;
    /// The full weights as views (see `verl_plugin_api::Engine::weights`).
    fn weights(&mut self) -> Result<Vec<TensorRef<'_>>>;
    fn export_hf(&self, dir: &Path) -> Result<()>;
    /// Reduces `values` in place over the data-parallel ranks (every rank calls it at the same
    /// point).
    fn all_reduce(&mut self, values: &mut [f64], op: Reduction) -> Result<()>;
    /// What a rank's token budget (`use_dynamic_bsz`) is multiplied by: verl's Megatron worker
    /// multiplies it by the context-parallel size, each rank holding that share of every
    /// sequence.
    fn token_budget_scale(&self) -> usize {
        1
    }
    /// Makes each rank's gradients the sum of every rank's accumulated gradients (of what it
    /// holds), before they are clipped.
    fn reduce_gradients(&mut self) -> Result<()>;
}

fn unsupported_distillation(what: &str) -> ModelError {
    ModelError::invalid_input(
        "distillation",
        format!("this engine strategy does not compute {what} (fsdp with one shard does)"),
    )
}

/// A reduction over the data-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduction {
    Sum,
    Max,
}

/// What a trainable role carries besides its strategy.
struct Training {
    schedule: LrSchedule,
    /// Shuffles mini-batches; saved with the checkpoint so a resumed run shuffles identically.
    rng: Rng,
    /// `update_*` calls so far: verl steps the LR scheduler once per call, not per optimizer step.
    updates: u64,
}

/// The worker's own part of a checkpoint, next to the strategy's files.
#[derive(Serialize, Deserialize)]
struct EngineState {
    role: Role,
    global_step: u64,
    updates: u64,
}

const ENGINE_STATE_FILE: &str = "engine_state.json";

/// The metric (`actor/…`, `critic/…`) counting the optimizer updates of one `update_*` call that
/// were not applied because the loss, the gradient norm or the updated weights were not finite;
/// verl-core's trainer stops on it or skips the step (`trainer.nan_policy`).
pub const SKIPPED_UPDATES: &str = "skipped_updates";

/// Collected metric values, averaged at the end.
#[derive(Default)]
struct Metrics(BTreeMap<&'static str, Vec<f64>>);

impl Metrics {
    fn push(&mut self, key: &'static str, value: f64) {
        self.0.entry(key).or_default().push(value);
    }

    /// The mean of each key's values over every rank: `reduce` sums each key's (sum, count)
    /// across ranks.
    fn into_means(self, reduce: impl FnOnce(&mut [f64]) -> Result<()>) -> Result<Vec<Metric>> {
        let mut totals: Vec<f64> = self
            .0
            .values()
            .flat_map(|v| [v.iter().sum::<f64>(), v.len() as f64])
            .collect();
        reduce(&mut totals)?;
        Ok(self
            .0
            .into_keys()
            .zip(totals.chunks_exact(2))
            .map(|(k, total)| Metric::new(k, total[0] / total[1]))
            .collect())
    }
}

fn scalar(t: &Tensor) -> f64 {
    t.double_value(&[])
}

/// One micro-batch's forward and backward; returns its contributions to the mini-batch's loss
/// values.
type MicroStep<'a, S> = dyn FnMut(&S, &Rows, &AggScale, &mut Metrics) -> Result<Vec<(&'static str, f64)>, ActorError>
    + 'a;

/// A call's rows cut into micro-batches.
struct MicroBatches {
    batches: Vec<Rows>,
    /// With a token budget (whose micro-batches regroup the rows): where each input row sits in
    /// the micro-batches' concatenated outputs (verl's `restore_dynamic_batch`).
    order: Option<Tensor>,
}

impl MicroBatches {
    /// The micro-batches' per-row outputs as one tensor in the input's row order.
    fn restore(&self, outputs: &[Tensor]) -> Tensor {
        let all = Tensor::cat(outputs, 0);
        match &self.order {
            Some(order) => all.index_select(0, order),
            None => all,
        }
    }
}

/// An engine role (actor, ref or critic) on a strategy.
pub struct ActorWorker<S> {
    settings: ActorSettings,
    strategy: S,
    /// `None` for the reference policy, which never learns.
    training: Option<Training>,
}

impl<S: Strategy> ActorWorker<S> {
    /// `seed` seeds mini-batch shuffling (the run seed).
    pub fn new(settings: ActorSettings, strategy: S, seed: u64) -> Self {
        let training = settings.role.trains().then(|| Training {
            schedule: settings.schedule,
            rng: Rng::stream(seed, 1),
            updates: 0,
        });
        Self {
            settings,
            strategy,
            training,
        }
    }

    pub fn settings(&self) -> &ActorSettings {
        &self.settings
    }

    pub fn strategy(&self) -> &S {
        &self.strategy
    }

    fn require_role(&self, op: &str, roles: &[Role]) -> Result<(), ActorError> {
        if roles.contains(&self.settings.role) {
            Ok(())
        } else {
            Err(ActorError::Unsupported(format!(
                "a `{}` engine does not support `{op}`",
                self.settings.role.as_str()
            )))
        }
    }

    /// `wanted` of `batch` on the strategy's device, laid out as the settings ask.
    fn rows(&self, batch: &Batch, wanted: &[&'static str]) -> Result<Rows, ActorError> {
        Rows::load(batch, wanted, self.strategy.device(), self.settings.layout)
    }

    pub fn compute_log_prob(&mut self, batch: &Batch) -> Result<Batch, ActorError> {
        self.require_role("compute_log_prob", &[Role::Actor, Role::Ref, Role::Teacher])?;
        let meta = Meta::of(batch)?;
        let replay = self.settings.router_replay;
        let mut wanted = vec![keys::INPUT_IDS, keys::ATTENTION_MASK, keys::RESPONSES];
        // R3: the old log-probs come from the rollout's routing, as the update's will.
        if replay == RouterReplayMode::R3 {
            wanted.push(keys::ROUTED_EXPERTS);
        }
        let rows = self.rows(batch, &wanted)?;
        let micro = self.micro_batches(&rows, self.settings.forward_micro_batch)?;
        let outputs = meta.outputs();
        let (mut log_probs, mut entropys, mut sum_pi_squared) =
            (Vec::new(), Vec::new(), Vec::new());
        let (mut experts, mut topk_ids, mut topk_log_probs) = (Vec::new(), Vec::new(), Vec::new());
        tch::no_grad(|| -> Result<(), ActorError> {
            for rows in &micro.batches {
                let (t, e) = (meta.temperature, outputs);
                let scores = if replay != RouterReplayMode::Disabled {
                    let (scores, routed) = self.strategy.scores_routed(rows, t, e)?;
                    experts.push(routed);
                    scores
                } else {
                    self.strategy.scores(rows, t, e)?
                };
                log_probs.push(scores.log_probs);
                entropys.extend(scores.entropy);
                sum_pi_squared.extend(scores.sum_pi_squared);
                if let Some(k) = meta.distill_topk {
                    let top = self.strategy.topk(rows, meta.temperature, k)?;
                    topk_ids.push(top.ids);
                    topk_log_probs.push(top.log_probs);
                }
            }
            Ok(())
        })?;
        let mut out = Batch::default();
        if meta.distill_topk.is_some() {
            out.insert(
                TEACHER_IDS,
                from_tch(TEACHER_IDS, &micro.restore(&topk_ids))?,
            );
            out.insert(
                TEACHER_LOGPROBS,
                from_tch(TEACHER_LOGPROBS, &micro.restore(&topk_log_probs))?,
            );
        }
        for (key, wanted, parts) in [
            (keys::LOG_PROBS, true, &log_probs),
            (keys::ENTROPYS, outputs.entropy, &entropys),
            (
                keys::SUM_PI_SQUARED,
                outputs.sum_pi_squared,
                &sum_pi_squared,
            ),
        ] {
            if wanted {
                out.insert(key, from_tch(key, &micro.restore(parts))?);
            }
        }
        // The experts this forward used: R2's recording, for the update to replay (R3's are
        // the replayed ones, returned so the caller can check them).
        if !experts.is_empty() {
            out.insert(
                keys::ROUTED_EXPERTS,
                from_tch(keys::ROUTED_EXPERTS, &micro.restore(&experts))?,
            );
        }
        Ok(out)
    }

    pub fn compute_values(&mut self, batch: &Batch) -> Result<Batch, ActorError> {
        self.require_role("compute_values", &[Role::Critic])?;
        let rows = self.rows(
            batch,
            &[keys::INPUT_IDS, keys::ATTENTION_MASK, keys::RESPONSES],
        )?;
        let micro = self.micro_batches(&rows, self.settings.forward_micro_batch)?;
        let values = tch::no_grad(|| -> Result<Vec<Tensor>, ActorError> {
            micro
                .batches
                .iter()
                .map(|m| Ok(self.strategy.values(m)?))
                .collect()
        })?;
        let mut out = Batch::default();
        out.insert(
            keys::VALUES,
            from_tch(keys::VALUES, &micro.restore(&values))?,
        );
        Ok(out)
    }

    pub fn update_actor(&mut self, batch: &Batch) -> Result<Vec<Metric>, ActorError> {
        self.require_role("update_actor", &[Role::Actor])?;
        let meta = Meta::of(batch)?;
        // verl's on-policy shortcut (`dp_actor.update_policy`: `on_policy = len(mini_batches) == 1
        // and ppo_epochs == 1` → `old_log_prob = log_prob.detach()`): the policy being updated is
        // the one the old log-probs describe, so they are the update's own forward, detached
        // (the ratio is exactly 1), and the batch's `old_log_probs` are neither needed nor read.
        let rows = batch.require(keys::INPUT_IDS)?.shape.first().copied();
        let on_policy =
            self.settings.epochs == 1 && rows.is_some_and(|r| r <= self.settings.mini_batch as i64);
        let mut wanted = vec![
            keys::INPUT_IDS,
            keys::ATTENTION_MASK,
            keys::RESPONSES,
            keys::RESPONSE_MASK,
            keys::ADVANTAGES,
        ];
        if !on_policy {
            wanted.insert(4, keys::OLD_LOG_PROBS);
        }
        if self.settings.kl_loss.is_some() {
            wanted.push(keys::REF_LOG_PROB);
        }
        if batch.get(ROLLOUT_IS_WEIGHTS).is_some() {
            wanted.push(ROLLOUT_IS_WEIGHTS);
        }
        match self.settings.distillation.map(|d| d.objective) {
            Some(DistillObjective::Topk { .. }) => wanted.extend([TEACHER_IDS, TEACHER_LOGPROBS]),
            Some(DistillObjective::Estimator(_)) => wanted.push(TEACHER_LOGPROBS),
            None => {}
        }
        // R2 replays what `compute_log_prob` recorded, R3 the rollout's routing.
        if self.settings.router_replay != RouterReplayMode::Disabled {
            wanted.push(keys::ROUTED_EXPERTS);
        }
        let rows = self.rows(batch, &wanted)?;
        let settings = self.settings.clone();
        self.update("actor", rows, &mut |strategy, micro, scale, metrics| {
            actor_micro_step(
                &settings,
                strategy,
                micro,
                scale,
                meta.temperature,
                OwnOld {
                    on_policy,
                    // The trainer skipped its old-log-prob pass: `actor/entropy` comes from here.
                    entropy: on_policy && meta.calculate_entropy,
                },
                metrics,
            )
        })
    }

    pub fn update_critic(&mut self, batch: &Batch) -> Result<Vec<Metric>, ActorError> {
        self.require_role("update_critic", &[Role::Critic])?;
        let wanted = [
            keys::INPUT_IDS,
            keys::ATTENTION_MASK,
            keys::RESPONSES,
            keys::RESPONSE_MASK,
            keys::VALUES,
            keys::RETURNS,
        ];
        let rows = self.rows(batch, &wanted)?;
        let (cliprange, agg_mode) = (self.settings.cliprange_value, self.settings.loss_agg_mode);
        self.update("critic", rows, &mut |strategy, micro, scale, metrics| {
            let response_mask = micro.get(keys::RESPONSE_MASK);
            let mut loss_value = 0.0;
            strategy.backward_values(micro, &mut |vpreds| {
                let (loss, clipfrac) = value_loss(
                    vpreds,
                    micro.get(keys::RETURNS),
                    micro.get(keys::VALUES),
                    response_mask,
                    cliprange,
                    agg_mode,
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

    /// verl's update loop, shared by the actor and the critic: `micro_step` runs forward and
    /// backward of one micro-batch under the mini-batch's loss normalisation and records the
    /// micro-batch's metrics; it returns the micro-batch's contribution to the mini-batch loss
    /// values (keyed like the metrics), which are recorded once per mini-batch.
    fn update(
        &mut self,
        prefix: &'static str,
        rows: Rows,
        micro_step: &mut MicroStep<'_, S>,
    ) -> Result<Vec<Metric>, ActorError> {
        let s = self.settings.clone();
        let lr = {
            let training = self.training("update")?;
            training.schedule.lr_at(training.updates)
        };
        let mut metrics = Metrics::default();
        let mut skipped = 0u32;
        for _ in 0..s.epochs {
            let order = if s.shuffle {
                let training = self.training.as_mut().expect("checked above");
                rows.select(&permutation(
                    &mut training.rng,
                    rows.rows(),
                    self.strategy.device(),
                ))
            } else {
                rows.narrow(0, rows.rows())
            };
            for mini in order.chunks(Some(s.mini_batch)) {
                self.strategy.zero_grad();
                let mask = mini.get(keys::RESPONSE_MASK);
                // The global batch's counts: each rank's loss is its share of the global loss.
                let mut counts = [
                    scalar(&mask.sum(Kind::Float)),
                    scalar(
                        &mask
                            .sum_dim_intlist(-1, false, Kind::Float)
                            .gt(0.0)
                            .sum(Kind::Float),
                    ),
                ];
                self.strategy.all_reduce(&mut counts, Reduction::Sum)?;
                let [tokens, seqs] = counts;
                let scale = AggScale {
                    batch_num_tokens: Some(tokens.max(1.0)),
                    global_batch_size: Some(seqs.max(1.0)),
                    loss_scale_factor: s.loss_scale_factor,
                    ..AggScale::default()
                };
                let micro_batches = self.micro_batches(&mini, s.micro_batch)?;
                let mut losses: BTreeMap<&'static str, f64> = BTreeMap::new();
                for micro in &micro_batches.batches {
                    for (key, value) in micro_step(&self.strategy, micro, &scale, &mut metrics)? {
                        *losses.entry(key).or_default() += value;
                    }
                }
                // The global mini-batch's loss values: the sum of every rank's share.
                let mut values: Vec<f64> = losses.values().copied().collect();
                self.strategy.all_reduce(&mut values, Reduction::Sum)?;
                let finite_loss = values.iter().all(|v| v.is_finite());
                losses
                    .into_keys()
                    .zip(values)
                    .for_each(|(k, v)| metrics.push(k, v));
                self.strategy.reduce_gradients()?;
                let grad_norm = self.strategy.clip_grad_norm(s.clip_grad);
                // As verl, a non-finite gradient skips the update instead of corrupting the
                // weights; so do a non-finite loss and an update the strategy refuses because
                // its result would be non-finite. The trainer reads the count.
                if !(finite_loss && grad_norm.is_finite() && self.strategy.step(lr)) {
                    skipped += 1;
                }
                self.strategy.zero_grad();
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
        self.training.as_mut().expect("checked above").updates += 1;
        let mut out =
            metrics.into_means(|totals| self.strategy.all_reduce(totals, Reduction::Sum))?;
        out.push(Metric::new(format!("{prefix}/lr"), lr));
        out.push(Metric::new(
            format!("{prefix}/{SKIPPED_UPDATES}"),
            f64::from(skipped),
        ));
        Ok(out)
    }

    /// `rows` cut into micro-batches as `batching` says. With a token budget these are verl's
    /// `rearrange_micro_batches` (`verl_seqlen_balancing::micro_batches`), as many on every
    /// data-parallel rank (the most any rank needs: verl's `same_micro_num_in_dp`, which a
    /// sharded model relies on to gather its blocks in step).
    fn micro_batches(
        &mut self,
        rows: &Rows,
        batching: MicroBatching,
    ) -> Result<MicroBatches, ActorError> {
        let (max_token_len, key) = match batching {
            MicroBatching::Rows(size) => {
                return Ok(MicroBatches {
                    batches: rows.chunks(size).collect(),
                    order: None,
                });
            }
            MicroBatching::Tokens { max_token_len, key } => (max_token_len, key),
        };
        let mask = rows.get(keys::ATTENTION_MASK);
        let seqlens: Vec<u64> = Vec::<i64>::try_from(
            mask.sum_dim_intlist(-1, false, Kind::Int64)
                .to_device(Device::Cpu),
        )?
        .into_iter()
        .map(|n| n.max(0) as u64)
        .collect();
        let budget = (max_token_len * self.strategy.token_budget_scale()) as u64;
        let config_error = |e: BalanceError| ActorError::Config {
            key: key.to_owned(),
            reason: e.to_string(),
        };
        let local =
            micro_batch_count(&seqlens, mask.size()[1] as u64, budget).map_err(config_error)?;
        let mut count = [local as f64];
        self.strategy.all_reduce(&mut count, Reduction::Max)?;
        let partitions = micro_batches(&seqlens, count[0] as usize)
            .map_err(|e| ActorError::Batch(format!("`{key}` micro-batches: {e}")))?;
        let device = self.strategy.device();
        let index = |rows: &[usize]| {
            let rows: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
            Tensor::from_slice(&rows).to_device(device)
        };
        let order = partitions.concat();
        Ok(MicroBatches {
            batches: partitions.iter().map(|p| rows.select(&index(p))).collect(),
            order: Some(index(&inverse_permutation(&order))),
        })
    }

    fn training(&self, op: &str) -> Result<&Training, ActorError> {
        self.training.as_ref().ok_or_else(|| {
            ActorError::Unsupported(format!("a `ref` engine has no training state to `{op}`"))
        })
    }

    /// The strategy's weights and optimizer state plus the schedule, generator and step
    /// counters, so that the next update after `load_checkpoint` is bit-identical.
    pub fn save_checkpoint(&mut self, dir: &Path, global_step: u64) -> Result<(), ActorError> {
        let training = self.training("save_checkpoint")?;
        self.strategy.save(dir, &training.schedule, &training.rng)?;
        let state = EngineState {
            role: self.settings.role,
            global_step,
            updates: training.updates,
        };
        let path = dir.join(ENGINE_STATE_FILE);
        let text = serde_json::to_string_pretty(&state).expect("plain struct");
        std::fs::write(&path, text).map_err(|e| checkpoint_error(&path, e))
    }

    pub fn load_checkpoint(&mut self, dir: &Path) -> Result<u64, ActorError> {
        self.training("load_checkpoint")?;
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
        let (schedule, rng) = self.strategy.load(dir)?;
        let training = self.training.as_mut().expect("checked above");
        training.schedule = schedule;
        training.rng = rng;
        training.updates = state.updates;
        Ok(state.global_step)
    }

    pub fn weights(&mut self) -> Result<Vec<TensorRef<'_>>, ActorError> {
        Ok(self.strategy.weights()?)
    }

    pub fn export_hf(&self, dir: &Path) -> Result<(), ActorError> {
        Ok(self.strategy.export_hf(dir)?)
    }
}

/// verl's batch key for the rollout-correction IS weights the trainer sends (decoupled mode):
/// they multiply the per-token policy loss.
const ROLLOUT_IS_WEIGHTS: &str = "rollout_is_weights";

/// An update's use of its own forward: `on_policy`, verl's shortcut (the old log-probs are the
/// forward's own, detached); `entropy`, report `actor/entropy` of it (the trainer ran no
/// old-log-prob pass to report it from).
#[derive(Debug, Clone, Copy)]
struct OwnOld {
    on_policy: bool,
    entropy: bool,
}

fn actor_micro_step<S: Strategy>(
    s: &ActorSettings,
    strategy: &S,
    micro: &Rows,
    scale: &AggScale,
    temperature: f64,
    own: OwnOld,
    metrics: &mut Metrics,
) -> Result<Vec<(&'static str, f64)>, ActorError> {
    let on_policy = own.on_policy;
    let mut losses = Vec::new();
    // As verl: entropy only when it is in the loss (then also reported); otherwise the trainer
    // reports `actor/entropy` from `compute_log_prob`'s `entropys`, and the [batch, response,
    // vocab] entropy tensors are never built here.
    let outputs = ScoreOutputs {
        entropy: s.entropy_coeff != 0.0 || own.entropy,
        sum_pi_squared: false,
    };
    // The micro-batch's share of the mini-batch (by response tokens, like token-mean): the
    // mini-batch's load-balancing term is the token-weighted mean of its micro-batches' losses.
    let aux_weight = scalar(&micro.get(keys::RESPONSE_MASK).sum(Kind::Float))
        / scale.batch_num_tokens.unwrap_or(1.0).max(1.0);
    let aux = match s.distillation {
        Some(
            d @ DistillSettings {
                objective: DistillObjective::Topk { kl, .. },
                ..
            },
        ) => strategy.backward_distill_scores(
            micro,
            temperature,
            outputs,
            aux_weight,
            micro.get(TEACHER_IDS),
            &mut |scores| {
                let top = topk_kl(&scores.topk_log_probs, micro.get(TEACHER_LOGPROBS), &kl);
                let mask = micro.get(keys::RESPONSE_MASK);
                metrics.push(
                    "distillation/student_mass",
                    scalar(&masked_mean(&top.student_mass, mask)),
                );
                metrics.push(
                    "distillation/teacher_mass",
                    scalar(&masked_mean(&top.teacher_mass, mask)),
                );
                actor_loss(
                    s,
                    micro,
                    scale,
                    &scores.scores,
                    Some((&d, top.loss)),
                    on_policy,
                    metrics,
                    &mut losses,
                )
            },
        )?,
        Some(
            d @ DistillSettings {
                objective: DistillObjective::Estimator(penalty),
                ..
            },
        ) => strategy.backward_scores_aux(
            micro,
            temperature,
            outputs,
            aux_weight,
            &mut |scores| {
                let per_token = kl_penalty(&scores.log_probs, micro.get(TEACHER_LOGPROBS), penalty);
                actor_loss(
                    s,
                    micro,
                    scale,
                    scores,
                    Some((&d, per_token)),
                    on_policy,
                    metrics,
                    &mut losses,
                )
            },
        )?,
        None => strategy.backward_scores_aux(
            micro,
            temperature,
            outputs,
            aux_weight,
            &mut |scores| {
                actor_loss(
                    s,
                    micro,
                    scale,
                    scores,
                    None,
                    on_policy,
                    metrics,
                    &mut losses,
                )
            },
        )?,
    };
    if let Some(aux) = aux {
        metrics.push("actor/moe_aux_loss", aux);
    }
    if let Some((coef, _)) = s.kl_loss {
        metrics.push("actor/kl_coef", coef);
    }
    Ok(losses)
}

/// The policy loss's inputs for `micro` with `advantages`; the old log-probs are `own_old` (the
/// on-policy shortcut's detached log-probs) when given, else the batch's.
fn policy_batch<'a>(
    micro: &'a Rows,
    scores: &'a ResponseScores,
    advantages: &'a Tensor,
    own_old: Option<&'a Tensor>,
) -> PolicyBatch<'a> {
    PolicyBatch {
        old_log_prob: own_old.unwrap_or_else(|| micro.get(keys::OLD_LOG_PROBS)),
        log_prob: &scores.log_probs,
        advantages,
        response_mask: micro.get(keys::RESPONSE_MASK),
        rollout_is_weights: micro.try_get(ROLLOUT_IS_WEIGHTS),
    }
}

/// The actor's loss on one micro-batch's scores: verl's policy loss, entropy bonus and KL loss,
/// and with `distill` (the settings and the per-token distillation loss `[B, R]`) verl's
/// `distillation_ppo_loss` combination. `on_policy`: the old log-probs are these scores' own,
/// detached (verl's on-policy shortcut).
#[allow(clippy::too_many_arguments)]
fn actor_loss(
    s: &ActorSettings,
    micro: &Rows,
    scale: &AggScale,
    scores: &ResponseScores,
    distill: Option<(&DistillSettings, Tensor)>,
    on_policy: bool,
    metrics: &mut Metrics,
    losses: &mut Vec<(&'static str, f64)>,
) -> Result<Tensor> {
    let response_mask = micro.get(keys::RESPONSE_MASK);
    let own_old = on_policy.then(|| scores.log_probs.detach());
    let mut terms = Vec::new();
    // verl skips the task's policy loss when distilling without task rewards.
    if distill.as_ref().is_none_or(|(d, _)| d.use_task_rewards) {
        let pg = policy_loss(
            s.loss_mode,
            policy_batch(micro, scores, micro.get(keys::ADVANTAGES), own_old.as_ref()),
            &s.clip,
            &s.loss_options,
            s.loss_agg_mode,
            scale,
        )?;
        for &(key, value) in &pg.metrics {
            metrics.push(key, value);
        }
        losses.push(("actor/pg_loss", scalar(&pg.pg_loss)));
        terms.push(pg.pg_loss);
    }
    if let Some((d, per_token)) = distill {
        let per_token = match d.loss_max_clamp {
            Some(c) => per_token.clamp(-c, c),
            None => per_token,
        };
        let loss = match &d.policy_gradient {
            // The negated loss is the advantage (on-policy distillation as a reward).
            Some(clip) => {
                let advantages = -per_token.detach();
                crate::losses::policy_loss_vanilla(
                    policy_batch(micro, scores, &advantages, own_old.as_ref()),
                    clip,
                    s.loss_agg_mode,
                    scale,
                )?
                .pg_loss
            }
            None => agg_loss(&per_token, response_mask, s.loss_agg_mode, scale),
        };
        metrics.push(
            "distillation/token_loss",
            scalar(&masked_mean(&per_token.detach(), response_mask)),
        );
        losses.push(("distillation/loss", scalar(&loss)));
        // verl weights the distillation loss only when it is added to the task's loss.
        let coef = if d.use_task_rewards { d.coef } else { 1.0 };
        terms.push(loss * coef);
    }
    if let Some(entropy) = &scores.entropy {
        // The micro-batch's own mean entropy, as verl reports it.
        let own = agg_loss(
            &entropy.detach(),
            response_mask,
            s.loss_agg_mode,
            &AggScale::default(),
        );
        metrics.push("actor/entropy", scalar(&own));
        // Asked for the metric alone (an on-policy update), it stays out of the graph.
        if s.entropy_coeff != 0.0 {
            terms.push(agg_loss(entropy, response_mask, s.loss_agg_mode, scale) * -s.entropy_coeff);
        }
    }
    if let Some((coef, penalty)) = s.kl_loss {
        let kl = kl_penalty(&scores.log_probs, micro.get(keys::REF_LOG_PROB), penalty);
        let kl_loss = agg_loss(&kl, response_mask, s.loss_agg_mode, scale);
        losses.push(("actor/kl_loss", scalar(&kl_loss)));
        terms.push(kl_loss * coef);
    }
    // The loss backpropagated, summed over the mini-batch (verl's engine workers' `loss`).
    let loss = Tensor::stack(&terms, 0).sum(Kind::Float);
    losses.push(("actor/loss", scalar(&loss)));
    Ok(loss)
}

fn checkpoint_error(path: &Path, reason: impl ToString) -> ActorError {
    ActorError::Checkpoint {
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
