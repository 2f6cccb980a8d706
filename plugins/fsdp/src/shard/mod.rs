//! ZeRO-3 / FSDP2 sharding of a [`CausalLM`] over a process group.
//!
//! Each rank holds `1/N` of every block's parameters (flat, padded to a multiple of `N`; see
//! [`layout`]), of their gradients and of their AdamW moments. A block — the embedding, each
//! decoder layer, the final norm with the head — is all-gathered just before it runs and freed
//! right after, in the forward pass and again in the backward pass: the backward pass recomputes
//! each block from its saved input (FSDP with activation checkpointing, verl's
//! `enable_gradient_checkpointing`), backpropagates the incoming gradient through it, and
//! reduce-scatters (sums) the block's parameter gradients into the shards. Losses are expected to
//! be normalised by global counts, so the sum over ranks is the full batch's gradient.
//!
//! A tied LM head is the embedding: the final block gathers the embedding block again and its
//! gradient is added to the embedding's shard. Grad-norm clipping is global (an all-reduce of the
//! squared norms), and the AdamW update of a flat shard is elementwise, hence exactly the update
//! the unsharded optimizer makes to those elements; ranks agree on skipping a non-finite update.
//!
//! Every method that communicates must be called in the same order on every rank, and
//! [`ShardedModel::forward`] / [`ShardedModel::forward_backward`] as many times on each (with
//! each rank's own rows).

pub mod layout;

pub mod checkpoint;
pub mod strategy;

use std::path::Path;

use tch::{Device, Kind, Tensor};
use verl_actor::{AdamW, AdamWConfig};
use verl_distributed::{DistError, ProcessGroup, ReduceOp};
use verl_model::{BlockContext, CausalLM, Head, ModelError};

use layout::BlockLayout;

/// A failure of a sharded model.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    #[error(transparent)]
    Dist(#[from] DistError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("{op}: libtorch: {source}")]
    Torch {
        op: &'static str,
        source: tch::TchError,
    },
    #[error("{op}: the model was sharded without an optimizer (a reference model does not train)")]
    NotTrainable { op: &'static str },
    #[error("{}: {reason}", path.display())]
    Checkpoint {
        path: std::path::PathBuf,
        reason: String,
    },
}

pub type Result<T, E = ShardError> = std::result::Result<T, E>;

fn torch(op: &'static str) -> impl FnOnce(tch::TchError) -> ShardError {
    move |source| ShardError::Torch { op, source }
}

/// How a model is sharded.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ShardOptions {
    /// AdamW for the shards; `None` for a model that never trains (the reference policy).
    pub optimizer: Option<AdamWConfig>,
    /// verl's `fsdp_config.param_offload`: parameter and gradient shards live on the host and
    /// are copied to the compute device for each gather (the AdamW update then runs on the
    /// host). On a CPU model the copies are no-ops, but the same code runs.
    pub param_offload: bool,
    /// verl's `fsdp_config.optimizer_offload`: the AdamW moments live on the host and visit the
    /// parameters' device for each update.
    pub optimizer_offload: bool,
}

/// Bytes this rank holds between steps, and the most a gathered stage adds on top.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardMemory {
    pub parameters: u64,
    pub gradients: u64,
    pub optimizer: u64,
    /// The largest stage's gathered parameters plus their full gradients (during a backward
    /// pass both exist at once), freed after the stage.
    pub peak_gathered: u64,
}

impl ShardMemory {
    /// Parameters, gradients and optimizer state held between steps.
    pub fn persistent(&self) -> u64 {
        self.parameters + self.gradients + self.optimizer
    }
}

/// One block: its layout, the model's own parameter tensors (sharing storage with the model's
/// layers: while the block is gathered their data is the gathered buffer, otherwise empty), and
/// this rank's shard of parameters and gradients.
struct Block {
    layout: BlockLayout,
    handles: Vec<Tensor>,
    shard: Tensor,
    grad: Option<Tensor>,
}

/// What runs between one gather and the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Embed,
    Layer(usize),
    /// The final norm and the head.
    Final,
}

/// A model sharded over a process group (see the module documentation).
pub struct ShardedModel {
    model: CausalLM,
    blocks: Vec<Block>,
    /// The head is the embedding (`tie_word_embeddings`).
    tied: bool,
    rank: u32,
    world: u32,
    /// Where the model computes.
    compute: Device,
    /// Where the parameter and gradient shards live (the host under `param_offload`).
    home: Device,
    options: ShardOptions,
    optimizer: Option<AdamW>,
}

impl std::fmt::Debug for ShardedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedModel")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("blocks", &self.blocks.len())
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl ShardedModel {
    /// Shards a full model: rank 0's parameters are broadcast (FSDP's `sync_module_states`), each
    /// rank keeps its shard of every block, and the model's own parameter storage is freed.
    /// Collective.
    pub fn new(model: CausalLM, group: &mut ProcessGroup, options: ShardOptions) -> Result<Self> {
        let named = model.named_tensors();
        let layers = model.config().num_hidden_layers as usize;
        let tied = model.head() == Head::Lm && !named.iter().any(|(n, _)| n == "lm_head.weight");
        let compute = model.device();
        let home = if options.param_offload {
            Device::Cpu
        } else {
            compute
        };
        let (rank, world) = (group.rank(), group.world_size());
        let trainable = options.optimizer.is_some();
        let mut handles: Vec<Vec<Tensor>> = (0..layers + 2).map(|_| Vec::new()).collect();
        for (name, tensor) in &named {
            handles[layout::block_of(name, layers)].push(tensor.shallow_clone());
        }
        let mut blocks = Vec::with_capacity(layers + 2);
        for (layout, handles) in layout::layouts(&named, layers).into_iter().zip(handles) {
            let len = layout.shard_len(world);
            let (shard, grad) = tch::no_grad(|| -> Result<_> {
                let mut flat = layout.flatten(&handles, world, &handles[0]).detach();
                group.broadcast(&mut flat, 0)?;
                let shard = flat
                    .narrow(0, i64::from(rank) * len, len)
                    .to_device(home)
                    .copy();
                let grad = trainable.then(|| shard.zeros_like());
                Ok((shard, grad))
            })?;
            blocks.push(Block {
                layout,
                handles,
                shard,
                grad,
            });
        }
        let optimizer = options.optimizer.map(|config| {
            let params = blocks
                .iter()
                .map(|b| (b.layout.name.clone(), b.shard.shallow_clone()))
                .collect();
            let mut optimizer = AdamW::new(params, config);
            if options.optimizer_offload {
                optimizer.moments_to(Device::Cpu);
            }
            optimizer
        });
        let mut sharded = Self {
            model,
            blocks,
            tied,
            rank,
            world,
            compute,
            home,
            options,
            optimizer,
        };
        for block in 0..sharded.blocks.len() {
            sharded.release(block);
        }
        Ok(sharded)
    }

    pub fn rank(&self) -> u32 {
        self.rank
    }

    pub fn world_size(&self) -> u32 {
        self.world
    }

    pub fn options(&self) -> &ShardOptions {
        &self.options
    }

    /// The block layouts (the same on every rank).
    pub fn layouts(&self) -> impl Iterator<Item = &BlockLayout> {
        self.blocks.iter().map(|b| &b.layout)
    }

    /// The model (its parameters are empty outside the closures this type runs).
    pub fn model(&self) -> &CausalLM {
        &self.model
    }

    /// Each block's layout with this rank's parameter shard and gradient shard (`None`
    /// without an optimizer).
    pub fn shards(&self) -> impl Iterator<Item = (&BlockLayout, &Tensor, Option<&Tensor>)> {
        self.blocks
            .iter()
            .map(|b| (&b.layout, &b.shard, b.grad.as_ref()))
    }

    /// Where the parameter shards and the optimizer moments live.
    pub fn placement(&self) -> (Device, Device) {
        let moments = if self.options.optimizer_offload {
            Device::Cpu
        } else {
            self.home
        };
        (self.home, moments)
    }

    /// What this rank holds, counted from the tensors themselves.
    pub fn memory(&self) -> ShardMemory {
        let bytes = |t: &Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
        let elt = self.model.kind().elt_size_in_bytes() as u64;
        let gathered = |stage: Stage| -> u64 {
            self.stage_blocks(stage)
                .iter()
                .map(|&b| {
                    let block = &self.blocks[b].layout;
                    // Gathered (padded) parameters, plus full gradients when training.
                    let params = (block.shard_len(self.world) * i64::from(self.world)) as u64;
                    let grads = if self.optimizer.is_some() {
                        block.numel as u64
                    } else {
                        0
                    };
                    (params + grads) * elt
                })
                .sum()
        };
        let stages = [Stage::Embed, Stage::Final]
            .into_iter()
            .chain((0..self.layers()).map(Stage::Layer));
        ShardMemory {
            parameters: self.blocks.iter().map(|b| bytes(&b.shard)).sum(),
            gradients: self.blocks.iter().flat_map(|b| &b.grad).map(bytes).sum(),
            optimizer: self
                .optimizer
                .as_ref()
                .map_or(0, |o| o.state_tensors().iter().map(|(_, t)| bytes(t)).sum()),
            peak_gathered: stages.map(gathered).max().unwrap_or(0),
        }
    }

    fn layers(&self) -> usize {
        self.blocks.len() - 2
    }

    /// The blocks a stage needs gathered.
    fn stage_blocks(&self, stage: Stage) -> Vec<usize> {
        match stage {
            Stage::Embed => vec![0],
            Stage::Layer(i) => vec![1 + i],
            Stage::Final if self.tied => vec![self.blocks.len() - 1, 0],
            Stage::Final => vec![self.blocks.len() - 1],
        }
    }

    /// All-gathers a block into the model's parameters. Collective.
    fn gather(&mut self, group: &mut ProcessGroup, block: usize) -> Result<()> {
        let world = self.world;
        let compute = self.compute;
        let block = &mut self.blocks[block];
        let len = block.layout.shard_len(world);
        let shard = block.shard.to_device(compute);
        let mut full = Tensor::empty([len * i64::from(world)], (shard.kind(), compute));
        group.all_gather_into(&mut full, &shard)?;
        for (slot, handle) in block.layout.params.iter().zip(&mut block.handles) {
            handle
                .f_set_data(
                    &full
                        .narrow(0, slot.offset, slot.numel)
                        .view(&slot.shape[..]),
                )
                .map_err(torch("gather"))?;
        }
        Ok(())
    }

    /// Frees a block's gathered parameters.
    fn release(&mut self, block: usize) {
        let empty = Tensor::empty([0], (self.model.kind(), self.compute));
        for handle in &mut self.blocks[block].handles {
            handle.set_data(&empty);
        }
    }

    /// Runs `f` on the model with a stage's blocks gathered, and frees them whatever `f`
    /// returns. `f` receives the model and the stage's parameter tensors, block by block.
    fn with_stage<T>(
        &mut self,
        group: &mut ProcessGroup,
        stage: Stage,
        f: impl FnOnce(&CausalLM, Vec<&Tensor>) -> Result<T>,
    ) -> Result<T> {
        let blocks = self.stage_blocks(stage);
        let mut gathered = Ok(());
        for &b in &blocks {
            gathered = self.gather(group, b);
            if gathered.is_err() {
                break;
            }
        }
        let outcome = gathered.and_then(|()| {
            let params = blocks
                .iter()
                .flat_map(|&b| &self.blocks[b].handles)
                .collect();
            f(&self.model, params)
        });
        for &b in &blocks {
            self.release(b);
        }
        outcome
    }

    /// Forward pass without gradients: the final hidden states `[B, T, hidden]` go to `head`,
    /// which runs with the head's block gathered (log-probs, values). Collective.
    pub fn forward<T>(
        &mut self,
        group: &mut ProcessGroup,
        context: &BlockContext,
        head: impl FnOnce(&CausalLM, &Tensor) -> verl_model::Result<T>,
    ) -> Result<T> {
        tch::no_grad(|| {
            let mut x = self.with_stage(group, Stage::Embed, |model, _| {
                Ok(model.embed_block(context))
            })?;
            for layer in 0..self.layers() {
                x = self.with_stage(group, Stage::Layer(layer), |model, _| {
                    Ok(model.layer_block(layer, &x, context)?)
                })?;
            }
            self.with_stage(group, Stage::Final, |model, _| {
                Ok(head(model, &model.norm_block(&x))?)
            })
        })
    }

    /// Forward and backward of one micro-batch: `loss_fn` maps the final hidden states to a
    /// scalar loss (with the head's block gathered); the parameter gradients are summed over
    /// ranks into this rank's gradient shards, adding to what earlier micro-batches left there.
    /// Returns the loss, detached. Collective.
    pub fn forward_backward(
        &mut self,
        group: &mut ProcessGroup,
        context: &BlockContext,
        loss_fn: impl FnOnce(&CausalLM, &Tensor) -> verl_model::Result<Tensor>,
    ) -> Result<Tensor> {
        self.forward_backward_aux(group, context, None, loss_fn)
            .map(|(loss, _)| loss)
    }

    /// As [`ShardedModel::forward_backward`], adding `aux_weight` × `router_aux_loss_coef` × the
    /// pass's load-balancing loss to the loss when the model's config asks for it
    /// ([`CausalLM::router_aux_loss_coef`]); returns the loss and the load-balancing loss added.
    /// Each layer's share (`LoadBalance::layer_term`) joins that layer's recomputation in the
    /// backward pass, with the expert counts of the whole forward pass. Collective.
    pub fn forward_backward_aux(
        &mut self,
        group: &mut ProcessGroup,
        context: &BlockContext,
        aux_weight: Option<f64>,
        loss_fn: impl FnOnce(&CausalLM, &Tensor) -> verl_model::Result<Tensor>,
    ) -> Result<(Tensor, Option<f64>)> {
        const OP: &str = "backward";
        if self.optimizer.is_none() {
            return Err(ShardError::NotTrainable { op: OP });
        }
        // Forward, keeping each layer's input (and the last layer's output).
        let mut inputs = Vec::with_capacity(self.layers() + 1);
        let embedded = tch::no_grad(|| {
            self.with_stage(group, Stage::Embed, |model, _| {
                Ok(model.embed_block(context))
            })
        })?;
        inputs.push(embedded);
        for layer in 0..self.layers() {
            let x = inputs.last().expect("starts with the embedding");
            let next = tch::no_grad(|| {
                self.with_stage(group, Stage::Layer(layer), |model, _| {
                    Ok(model.layer_block(layer, x, context)?)
                })
            })?;
            inputs.push(next);
        }
        let balance = match aux_weight.zip(self.model.router_aux_loss_coef()) {
            Some((weight, coef)) => Some((weight * coef, self.model.load_balance_in(context)?)),
            None => None,
        };
        // Backward, stage by stage from the head: each stage's gradient with respect to its
        // input is the next stage's incoming gradient.
        let last = inputs
            .pop()
            .expect("starts with the embedding")
            .detach()
            .set_requires_grad(true);
        let (loss, mut grads) = self.with_stage(group, Stage::Final, |model, params| {
            let loss = loss_fn(model, &model.norm_block(&last))?;
            let wrt: Vec<&Tensor> = std::iter::once(&last).chain(params).collect();
            let grads = Tensor::f_run_backward(&[&loss], &wrt, false, false).map_err(torch(OP))?;
            Ok((loss.detach(), grads))
        })?;
        let mut incoming = grads.remove(0);
        self.reduce_scatter_grads(group, Stage::Final, &grads)?;
        for layer in (0..self.layers()).rev() {
            let x = inputs
                .pop()
                .expect("one input per layer")
                .set_requires_grad(true);
            let g = defined_or_zeros(incoming, &x);
            let mut grads = self.with_stage(group, Stage::Layer(layer), |model, params| {
                let out = model.layer_block(layer, &x, context)?;
                let wrt: Vec<&Tensor> = std::iter::once(&x).chain(params).collect();
                // The gradient of sum(out · g) is the chain rule's step through the layer.
                let mut objective = (out * &g).sum(Kind::Float);
                if let Some((weight, balance)) = &balance {
                    for logits in context.take_router_logits() {
                        objective += balance.layer_term(&logits) * *weight;
                    }
                }
                Tensor::f_run_backward(&[objective], &wrt, false, false).map_err(torch(OP))
            })?;
            incoming = grads.remove(0);
            self.reduce_scatter_grads(group, Stage::Layer(layer), &grads)?;
        }
        let g = defined_or_zeros(incoming, &last);
        let grads = self.with_stage(group, Stage::Embed, |model, params| {
            let out = model.embed_block(context);
            Tensor::f_run_backward(&[(out * &g).sum(Kind::Float)], &params, false, false)
                .map_err(torch(OP))
        })?;
        self.reduce_scatter_grads(group, Stage::Embed, &grads)?;
        Ok((loss, balance.map(|(_, b)| b.value)))
    }

    /// Sums a stage's full parameter gradients over ranks into the blocks' gradient shards.
    /// Collective.
    fn reduce_scatter_grads(
        &mut self,
        group: &mut ProcessGroup,
        stage: Stage,
        grads: &[Tensor],
    ) -> Result<()> {
        let world = self.world;
        let mut rest = grads;
        for b in self.stage_blocks(stage) {
            let block = &mut self.blocks[b];
            let (mine, others) = rest.split_at(block.layout.params.len());
            rest = others;
            let like = Tensor::empty([0], (self.model.kind(), self.compute));
            let flat = tch::no_grad(|| block.layout.flatten(mine, world, &like));
            let mut part = like.new_empty(
                [block.layout.shard_len(world)],
                (like.kind(), like.device()),
            );
            group.reduce_scatter(&mut part, &flat, ReduceOp::Sum)?;
            let grad = block
                .grad
                .as_mut()
                .expect("a trainable model has gradient shards");
            let _ = tch::no_grad(|| grad.g_add_(&part.to_device(self.home)));
        }
        Ok(())
    }

    /// Zeroes the gradient shards (before the first micro-batch of an update).
    pub fn zero_grad(&mut self) {
        for grad in self.blocks.iter_mut().flat_map(|b| &mut b.grad) {
            let _ = grad.zero_();
        }
    }

    /// Scales the gradients so that their global L2 norm — over every rank's shards — is at
    /// most `max_norm` (torch's `clip_grad_norm_`, as FSDP computes it: an all-reduce of the
    /// squared norms) and returns the norm before clipping. A non-finite norm is returned as is
    /// and nothing is scaled (verl then skips the update). Collective.
    pub fn clip_grad_norm_global(
        &mut self,
        group: &mut ProcessGroup,
        max_norm: f64,
    ) -> Result<f64> {
        if self.optimizer.is_none() {
            return Err(ShardError::NotTrainable {
                op: "clip_grad_norm",
            });
        }
        let squares: f64 = self
            .blocks
            .iter()
            .flat_map(|b| &b.grad)
            .map(|g| {
                g.to_kind(Kind::Double)
                    .square()
                    .sum(Kind::Double)
                    .double_value(&[])
            })
            .sum();
        // On the compute device: NCCL reduces device tensors only.
        let mut total = Tensor::from_slice(&[squares]).to_device(self.compute);
        group.all_reduce(&mut total, ReduceOp::Sum)?;
        let total = total.double_value(&[0]).sqrt();
        if total.is_finite() {
            let coef = (max_norm / (total + 1e-6)).min(1.0);
            tch::no_grad(|| {
                for grad in self.blocks.iter_mut().flat_map(|b| &mut b.grad) {
                    let _ = grad.g_mul_scalar_(coef);
                }
            });
        }
        Ok(total)
    }

    /// One AdamW update of every shard with learning rate `lr`, unless it would leave a value
    /// non-finite on any rank: then no rank changes anything and `false` is returned.
    /// Collective.
    pub fn step(&mut self, group: &mut ProcessGroup, lr: f64) -> Result<bool> {
        let grads: Vec<Tensor> = self
            .blocks
            .iter()
            .flat_map(|b| &b.grad)
            .map(Tensor::shallow_clone)
            .collect();
        let offload = self.options.optimizer_offload;
        let optimizer = self
            .optimizer
            .as_mut()
            .ok_or(ShardError::NotTrainable { op: "step" })?;
        if offload {
            optimizer.moments_to(self.home);
        }
        let compute = self.compute;
        let applied = optimizer.step_with_grads(lr, &grads, |finite| -> Result<bool> {
            let mut all = Tensor::from_slice(&[i64::from(finite)]).to_device(compute);
            group.all_reduce(&mut all, ReduceOp::Min)?;
            Ok(all.int64_value(&[0]) == 1)
        });
        if offload {
            optimizer.moments_to(Device::Cpu);
        }
        applied
    }

    /// Updates applied so far (0 without an optimizer).
    pub fn steps(&self) -> u64 {
        self.optimizer.as_ref().map_or(0, AdamW::steps)
    }

    /// Every parameter, whole, on every rank (the rollout's weights), under the model's names and
    /// in its order. Collective.
    pub fn gather_full_weights(
        &mut self,
        group: &mut ProcessGroup,
    ) -> Result<Vec<(String, Tensor)>> {
        let mut named = Vec::new();
        for b in 0..self.blocks.len() {
            self.gather(group, b)?;
            let block = &self.blocks[b];
            named.extend(
                block
                    .layout
                    .params
                    .iter()
                    .zip(&block.handles)
                    .map(|(slot, t)| (slot.name.clone(), t.detach().copy())),
            );
            self.release(b);
        }
        named.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(named)
    }

    /// Writes the whole model as a Hugging Face directory on rank 0 (`save_pretrained`, with
    /// the tokenizer files from `companions_from`); the other ranks take part in the gathers and
    /// keep nothing. Collective.
    pub fn export_hf(
        &mut self,
        group: &mut ProcessGroup,
        dir: &Path,
        companions_from: Option<&Path>,
    ) -> Result<()> {
        let mut gathered = Ok(());
        for b in 0..self.blocks.len() {
            gathered = self.gather(group, b);
            if gathered.is_err() || self.rank != 0 {
                self.release(b);
            }
            if gathered.is_err() {
                break;
            }
        }
        let written = gathered.and_then(|()| {
            if self.rank == 0 {
                Ok(self.model.save_pretrained(dir, companions_from)?)
            } else {
                Ok(())
            }
        });
        for b in 0..self.blocks.len() {
            self.release(b);
        }
        written
    }
}

/// An undefined gradient (the loss does not reach this stage) as zeros shaped like `like`.
fn defined_or_zeros(grad: Tensor, like: &Tensor) -> Tensor {
    if grad.defined() {
        grad
    } else {
        like.zeros_like()
    }
}
