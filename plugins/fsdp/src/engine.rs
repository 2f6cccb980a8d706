//! The `fsdp` strategy on one rank: the whole model and its AdamW optimizer in this process, or,
//! when `fsdp_config` asks for offloading, the sharded model ([`crate::shard`]). verl's
//! actor/critic semantics around it are the shared [`verl_torch_runtime::actor::ActorWorker`].

use std::path::Path;

use tch::{Device, Tensor};
use verl_plugin_api::{ComponentInit, TensorRef, keys};
use verl_torch_runtime::actor::{ActorConfig, ActorError, ActorWorker, Role, Rows, Strategy};
use verl_torch_runtime::interop::LentTensors;
use verl_torch_runtime::{
    AdamW, CausalLM, Head, LrSchedule, ModelSpec, ResponseScores, Rng, load_training_state,
    parse_device, save_training_state,
};

use crate::config::FsdpConfig;
use crate::placement::Placement;
use crate::shard::strategy::ShardedStrategy;

/// The model, its optimizer (none for the reference policy) and the weights last lent.
pub struct LocalModel {
    model: CausalLM,
    spec: ModelSpec,
    optimizer: Option<AdamW>,
    lent: LentTensors,
}

/// The engine of one role: verl's semantics on the local or the sharded model.
pub type Worker = ActorWorker<Placement>;

pub fn new_worker(init: &ComponentInit) -> Result<Worker, ActorError> {
    let run = &init.run;
    if run.world_size > 1 {
        return Err(ActorError::Unsupported(format!(
            "the fsdp engine runs on a single rank for now; world_size {} (rank {}) is not yet supported",
            run.world_size, run.rank
        )));
    }
    let settings = init.config::<ActorConfig>("fsdp")?.validate()?;
    // Checked for unknown keys and types; only offloading changes where the model lives.
    let fsdp = FsdpConfig::of(init, settings.role)?;
    let device = parse_device(&run.device)?;
    let head = if settings.role == Role::Critic {
        Head::Value
    } else {
        Head::Lm
    };
    let mut model = settings.model.load(device, head, run.seed)?;
    let optimizer = if settings.role == Role::Ref {
        model.set_trainable(false);
        None
    } else {
        Some(settings.optimizer)
    };
    let spec = settings.model.clone();
    let strategy = match fsdp.shard_options(optimizer) {
        Some(options) => Placement::Sharded(ShardedStrategy::for_run(model, run, options, spec)?),
        None => Placement::Local(LocalModel {
            optimizer: optimizer.map(|config| AdamW::for_model(&model, config)),
            model,
            spec,
            lent: LentTensors::default(),
        }),
    };
    Ok(ActorWorker::new(settings, strategy, run.seed))
}

impl LocalModel {
    fn optimizer(&mut self) -> &mut AdamW {
        self.optimizer
            .as_mut()
            .expect("the worker only trains roles that have an optimizer")
    }

    /// Forward and backward of one micro-batch; `loss_fn` maps final hidden states to the scalar
    /// loss (with activation checkpointing when the model config asks for it).
    fn backward(
        &self,
        rows: &Rows,
        loss_fn: impl FnOnce(&Tensor) -> verl_torch_runtime::Result<Tensor>,
    ) -> verl_torch_runtime::Result<()> {
        let (ids, mask) = (rows.get(keys::INPUT_IDS), rows.get(keys::ATTENTION_MASK));
        if self.spec.enable_gradient_checkpointing {
            // The returned (detached) loss is not needed: `loss_fn` records its values.
            let _ = self.model.backward_checkpointed(ids, mask, loss_fn)?;
        } else {
            loss_fn(&self.model.hidden_states(ids, mask)?)?.f_backward()?;
        }
        Ok(())
    }
}

impl Strategy for LocalModel {
    fn device(&self) -> Device {
        self.model.device()
    }

    fn scores(
        &self,
        rows: &Rows,
        temperature: f64,
        with_entropy: bool,
    ) -> verl_torch_runtime::Result<ResponseScores> {
        self.model.response_scores(
            rows.get(keys::INPUT_IDS),
            rows.get(keys::ATTENTION_MASK),
            rows.response_len,
            temperature,
            with_entropy,
        )
    }

    fn values(&self, rows: &Rows) -> verl_torch_runtime::Result<Tensor> {
        self.model.response_values(
            rows.get(keys::INPUT_IDS),
            rows.get(keys::ATTENTION_MASK),
            rows.response_len,
        )
    }

    fn backward_scores(
        &self,
        rows: &Rows,
        temperature: f64,
        with_entropy: bool,
        loss: &mut dyn FnMut(&ResponseScores) -> verl_torch_runtime::Result<Tensor>,
    ) -> verl_torch_runtime::Result<()> {
        self.backward(rows, |hidden| {
            let scores = self.model.response_scores_from_hidden(
                hidden,
                rows.get(keys::INPUT_IDS),
                rows.get(keys::ATTENTION_MASK),
                rows.response_len,
                temperature,
                with_entropy,
            )?;
            loss(&scores)
        })
    }

    fn backward_values(
        &self,
        rows: &Rows,
        loss: &mut dyn FnMut(&Tensor) -> verl_torch_runtime::Result<Tensor>,
    ) -> verl_torch_runtime::Result<()> {
        self.backward(rows, |hidden| {
            let values = self.model.response_values_from_hidden(
                hidden,
                rows.get(keys::ATTENTION_MASK),
                rows.response_len,
            )?;
            loss(&values)
        })
    }

    fn zero_grad(&mut self) {
        self.optimizer().zero_grad();
    }

    fn clip_grad_norm(&mut self, max_norm: f64) -> f64 {
        self.optimizer().clip_grad_norm(max_norm)
    }

    fn step(&mut self, lr: f64) -> bool {
        self.optimizer().step(lr)
    }

    /// verl-torch-runtime's training state: weights, optimizer moments, schedule and generator.
    fn save(&self, dir: &Path, schedule: &LrSchedule, rng: &Rng) -> verl_torch_runtime::Result<()> {
        let optimizer = self
            .optimizer
            .as_ref()
            .expect("the worker only saves roles that have an optimizer");
        save_training_state(dir, &self.model, optimizer, schedule, rng)
    }

    fn load(&mut self, dir: &Path) -> verl_torch_runtime::Result<(LrSchedule, Rng)> {
        let optimizer = self
            .optimizer
            .as_mut()
            .expect("the worker only loads roles that have an optimizer");
        let saved = load_training_state(dir, &self.model, optimizer)?;
        Ok((saved.schedule, saved.rng))
    }

    /// The parameters as views, in place for contiguous host tensors.
    fn weights(&mut self) -> verl_torch_runtime::Result<Vec<TensorRef<'_>>> {
        self.lent.lend(self.model.named_tensors())?;
        self.lent.views()
    }

    fn export_hf(&self, dir: &Path) -> verl_torch_runtime::Result<()> {
        self.model.save_pretrained(dir, Some(&self.spec.path))
    }
}
