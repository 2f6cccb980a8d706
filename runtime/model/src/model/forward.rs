//! The model's forward passes: whole ([`CausalLM::hidden_states`]) or a block at a time over a
//! [`BlockContext`] (padded or packed rows, a shard of the vocabulary or of the sequence), the
//! tensor-parallel halves of a layer ([`TensorParallel`]), and the backward pass with activation
//! checkpointing.

use tch::{Device, Kind, Tensor};

use super::moe::{LoadBalance, RouterOutput, Routing, load_balancing_loss};
use super::packed::{self, Packing};
use super::{
    Attend, CausalLM, Context, DecodeWeights, DecoderLayer, KvCache, Linear, OutputHead, RopeTable,
    Select, Tail, invariant,
};
use crate::error::{ModelError, Result};

impl CausalLM {
    /// Final hidden states `[B, T, hidden]` of a batch. `attention_mask` (`[B, T]`, 1 = token,
    /// 0 = padding) may pad on either side: positions count only real tokens, so a sequence gets
    /// the same values wherever its padding is.
    pub fn hidden_states(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
        self.check_batch(input_ids, attention_mask)?;
        let mask = attention_mask.to_device(self.device());
        let context = self.context(&mask, mask.size()[1]);
        Ok(self.run(&input_ids.to_device(self.device()), &context, None, None))
    }

    /// Next-token logits `[B, T, vocab]` in fp32.
    pub fn forward(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
        self.logits(&self.hidden_states(input_ids, attention_mask)?)
    }

    /// Per-token values `[B, T]` in fp32 from a value-head model.
    pub fn values(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
        self.values_from_hidden(&self.hidden_states(input_ids, attention_mask)?)
    }

    /// Value-head outputs in fp32 for hidden states `[.., hidden]` → `[..]`.
    pub(super) fn values_from_hidden(&self, hidden: &Tensor) -> Result<Tensor> {
        match &self.head {
            OutputHead::Value(score) => Ok(score
                .apply(hidden, self.batch_invariant())
                .squeeze_dim(-1)
                .to_kind(Kind::Float)),
            OutputHead::Lm(_) => Err(ModelError::invalid_input(
                "head",
                "values need a model built with Head::Value",
            )),
        }
    }

    /// The LM head's weight (the input embedding when tied).
    pub(crate) fn lm_head(&self) -> Result<&Tensor> {
        match &self.head {
            OutputHead::Lm(Some(weight)) => Ok(weight),
            OutputHead::Lm(None) => Ok(&self.embed_tokens),
            OutputHead::Value(_) => Err(ModelError::invalid_input(
                "head",
                "logits need a model built with Head::Lm",
            )),
        }
    }

    /// LM-head logits in fp32 for hidden states of any leading shape.
    pub(crate) fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let head = self.lm_head()?;
        let logits = if self.batch_invariant() {
            invariant::rows(hidden, |t| t.linear(head, None::<&Tensor>))
        } else {
            hidden.linear(head, None::<&Tensor>)
        };
        Ok(logits.to_kind(Kind::Float))
    }

    /// `f` applied to the rows of `x`, over fixed row tiles in the deterministic mode.
    pub(super) fn row_wise(&self, x: &Tensor, f: impl Fn(&Tensor) -> Tensor) -> Tensor {
        if self.batch_invariant() {
            invariant::rows(x, f)
        } else {
            f(x)
        }
    }

    /// Validates `[B, T]` int64 token ids within the vocabulary and a matching mask.
    pub(super) fn check_batch(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Result<()> {
        check_batch(input_ids, attention_mask, self.config.vocab_size)
    }

    /// Rotary tables and the attention mask for the last `t` tokens of the sequences that
    /// `attention_mask` (`[B, S]`) describes.
    pub(super) fn context(&self, attention_mask: &Tensor, t: i64) -> Context {
        let s = attention_mask.size()[1];
        let queries = Tensor::arange_start(s - t, s, (Kind::Int64, self.device()));
        self.context_at(attention_mask, &queries)
    }

    /// Rotary tables and the attention mask for the tokens at `queries` (`[T]` indices) of the
    /// sequences `attention_mask` (`[B, S]`) describes, attending all `S` positions.
    fn context_at(&self, attention_mask: &Tensor, queries: &Tensor) -> Context {
        let (b, s) = attention_mask.size2().expect("checked [B, S]");
        let device = self.device();
        let t = queries.size()[0];
        let valid = attention_mask.to_kind(Kind::Bool);
        // Real-token positions: padding on either side does not shift them.
        let positions = (valid.cumsum(-1, Kind::Int64) - 1)
            .clamp_min(0)
            .index_select(1, queries);
        let rope =
            RopeTable::new(&self.inv_freq, s, self.kind(), self.batch_invariant()).at(&positions);
        // Causal and padding mask, [B, 1, T, S]. The diagonal stays open so that a padding query
        // (whose output is never used) has one key and its softmax stays finite.
        let query = queries.view([t, 1]);
        let key = Tensor::arange(s, (Kind::Int64, device)).view([1, s]);
        let attend = if self.batch_invariant() {
            Attend::Spans(invariant::Span::per_row(&valid, queries, &positions))
        } else {
            let mask = key
                .le_tensor(&query)
                .logical_and(&valid.view([b, 1, 1, s]))
                .logical_or(&key.eq_tensor(&query));
            Attend::Mask(mask)
        };
        Context {
            rope,
            attend,
            routing: Routing::default(),
        }
    }

    /// The experts a pass over `[batch, tokens]` used, `[batch, tokens, sparse layers, k]` int64
    /// on CPU; `None` for a dense model.
    pub(super) fn routed_experts(
        &self,
        context: &Context,
        batch: i64,
        tokens: i64,
    ) -> Option<Tensor> {
        self.config.moe.as_ref()?;
        let routing = RouterOutput::from_layers(context.routing.take(), batch, tokens);
        Some(routing.experts.to_device(Device::Cpu))
    }

    /// Next-token logits `[B, T, vocab]` in fp32 and the routing of every token: each sparse
    /// layer's router logits and the experts used. With `replay` (`[B, T, sparse layers, k]`
    /// int64, e.g. a rollout's [`crate::Completion::routed_experts`] laid out like `input_ids`),
    /// the tokens use those experts instead of the router's top-k, weighted by this pass's router
    /// probabilities at them (router replay).
    pub fn forward_routed(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        replay: Option<&Tensor>,
    ) -> Result<(Tensor, RouterOutput)> {
        let mut block = self.block_context(input_ids, attention_mask)?;
        if let Some(experts) = replay {
            block.replay_experts(self, experts)?;
        }
        let logits = self.logits(&self.hidden_states_in(&block))?;
        let (b, t) = input_ids.size2().expect("checked [B, T]");
        Ok((logits, block.take_routing(b, t)))
    }

    pub(super) fn embed(&self, input_ids: &Tensor) -> Tensor {
        Tensor::embedding(&self.embed_tokens, input_ids, -1, false, false)
    }

    /// Runs the decoder on `input_ids` `[B, T]` and returns the final hidden states. With a
    /// cache, the tokens follow the cached prefix and their keys/values are appended.
    pub(super) fn run(
        &self,
        input_ids: &Tensor,
        context: &Context,
        mut cache: Option<&mut KvCache>,
        weights: Option<&DecodeWeights>,
    ) -> Tensor {
        let mut x = self.embed(input_ids);
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(
                &x,
                context,
                cache.as_deref_mut().map(|c| (c, i)),
                weights.map(|w| &w.layers[i]),
            );
        }
        if let Some(cache) = cache {
            cache.len += input_ids.size()[1];
        }
        self.norm.apply(&x, context.invariant())
    }

    /// Checks a batch and prepares what every block of one forward pass shares, for running the
    /// model a block at a time: [`Self::embed_block`], [`Self::layer_block`] for each layer,
    /// [`Self::norm_block`] — together exactly [`Self::hidden_states`]. A sharded engine gathers
    /// each block's parameters just before it runs and frees them after.
    pub fn block_context(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
    ) -> Result<BlockContext> {
        self.check_batch(input_ids, attention_mask)?;
        let mask = attention_mask.to_device(self.device());
        let input_ids = input_ids.to_device(self.device());
        Ok(BlockContext {
            context: self.context(&mask, mask.size()[1]),
            batch_ids: input_ids.shallow_clone(),
            input_ids,
            layout: Layout::Padded(mask),
            tail: None,
        })
    }

    /// The token embeddings `[B, T, hidden]` of the context's batch.
    pub fn embed_block(&self, context: &BlockContext) -> Tensor {
        self.embed(&context.input_ids)
    }

    /// Decoder layer `layer` applied to hidden states `x` `[B, T, hidden]` (the last layer after
    /// [`BlockContext::score_predictors_only`]: at the predictors only).
    pub fn layer_block(&self, layer: usize, x: &Tensor, context: &BlockContext) -> Result<Tensor> {
        self.layer(layer)?;
        Ok(self.layer_in(layer, x, context))
    }

    /// [`Self::layer_block`] for a layer that exists.
    pub(super) fn layer_in(&self, layer: usize, x: &Tensor, context: &BlockContext) -> Tensor {
        let block = &self.layers[layer];
        match &context.tail {
            Some(tail) if layer + 1 == self.layers.len() => {
                block.forward_tail(x, &context.context, tail)
            }
            _ => block.forward(x, &context.context, None, None),
        }
    }

    fn layer(&self, layer: usize) -> Result<&DecoderLayer> {
        self.layers.get(layer).ok_or_else(|| {
            ModelError::invalid_input(
                "layer",
                format!(
                    "the model has {} layers, not {}",
                    self.layers.len(),
                    layer + 1
                ),
            )
        })
    }

    /// [`Self::block_context`] for a model holding a shard of the vocabulary (tensor
    /// parallelism, whose engine embeds the tokens itself): the ids are checked against
    /// `vocab_size`, the whole vocabulary's.
    pub fn block_context_for_vocab(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        vocab_size: i64,
    ) -> Result<BlockContext> {
        check_batch(input_ids, attention_mask, vocab_size)?;
        let mask = attention_mask.to_device(self.device());
        let input_ids = input_ids.to_device(self.device());
        Ok(BlockContext {
            context: self.context(&mask, mask.size()[1]),
            batch_ids: input_ids.shallow_clone(),
            input_ids,
            layout: Layout::Padded(mask),
            tail: None,
        })
    }

    /// [`Self::block_context_for_vocab`] for the tokens at `tokens` (`[T]` int64, increasing
    /// indices into the sequence) of the batch: rotary tables at their positions and the mask
    /// of what each may attend among all the sequence's tokens (context parallelism: a rank's
    /// queries attend every rank's keys, see [`TensorParallel::keys_values`]).
    pub fn block_context_for_tokens(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        vocab_size: i64,
        tokens: &Tensor,
    ) -> Result<BlockContext> {
        check_batch(input_ids, attention_mask, vocab_size)?;
        let device = self.device();
        let tokens = tokens.to_device(device);
        let (input_ids, mask) = (
            input_ids.to_device(device),
            attention_mask.to_device(device),
        );
        Ok(BlockContext {
            context: self.context_at(&mask, &tokens),
            input_ids: input_ids.index_select(1, &tokens),
            batch_ids: input_ids,
            layout: Layout::Padded(mask),
            tail: None,
        })
    }

    /// [`Self::block_context`] for a packed batch (verl's `use_remove_padding`): the real tokens
    /// of every row of `input_ids` (`[B, S]`, `attention_mask` 1 at real tokens) as one sequence
    /// `[1, N]`, positions restarting at each row, attention confined to each row. The blocks
    /// then run on `[1, N, hidden]`; [`Self::response_scores_in`] returns the `[B, R]` layout.
    pub fn packed_block_context(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        response_len: i64,
    ) -> Result<BlockContext> {
        self.check_batch(input_ids, attention_mask)?;
        let packing = Packing::new(&attention_mask.to_device(self.device()), response_len, 1)?;
        self.packed_block_context_for(input_ids, packing, self.config.vocab_size, None)
    }

    /// [`Self::packed_block_context`] with each prompt packed once, the rows repeating it
    /// attending its slots (verl's `use_prefix_grouper`, see [`Packing::sharing_prompts`]).
    /// Not for a model with sparse layers (their routing and load-balancing loss count every
    /// row's tokens) nor in the deterministic mode (whose kernels tile each row whole): see
    /// [`Self::shares_prompts`].
    pub fn prompt_sharing_block_context(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        response_len: i64,
    ) -> Result<BlockContext> {
        if !self.shares_prompts() {
            return Err(ModelError::invalid_input(
                "use_prefix_grouper",
                NOT_SHARING_PROMPTS,
            ));
        }
        self.check_batch(input_ids, attention_mask)?;
        let mask = attention_mask.to_device(self.device());
        let packing = Packing::sharing_prompts(input_ids, &mask, response_len)?;
        self.packed_block_context_for(input_ids, packing, self.config.vocab_size, None)
    }

    /// [`Self::packed_block_context`] with the packing given (rows aligned as a parallel engine
    /// needs), for ids within `vocab_size` (the whole vocabulary's, for a shard of it), for the
    /// stream's `tokens` only (`[T]` int64, increasing slots; `None`: all): rotary tables at
    /// their positions, and each run of consecutive slots of a row attending that row's keys
    /// among the whole stream's (context parallelism: see [`TensorParallel::keys_values`]).
    pub fn packed_block_context_for(
        &self,
        input_ids: &Tensor,
        packing: Packing,
        vocab_size: i64,
        tokens: Option<&Tensor>,
    ) -> Result<BlockContext> {
        let shape = packing.padded_shape();
        check_batch(input_ids, &input_ids.zeros_like(), vocab_size)?;
        if input_ids.size() != shape {
            return Err(ModelError::invalid_input(
                "input_ids",
                format!(
                    "shape {:?} differs from the packing's batch {shape:?}",
                    input_ids.size()
                ),
            ));
        }
        let device = self.device();
        let tokens = tokens.map(|t| t.to_device(device));
        let slots = match &tokens {
            Some(t) => Some(
                Vec::<i64>::try_from(&t.to_device(Device::Cpu))
                    .map_err(|e| ModelError::Torch(e.to_string()))?,
            ),
            None => None,
        };
        let batch_ids = input_ids.to_device(device);
        let packed = packing.pack_ids(&batch_ids);
        let rope = RopeTable::new(
            &self.inv_freq,
            packing.max_len().max(1),
            self.kind(),
            self.batch_invariant(),
        )
        .at(&packing.positions(tokens.as_ref()));
        let segments = packing.segments(slots.as_deref());
        let attend = if self.batch_invariant() {
            Attend::Spans(
                segments
                    .iter()
                    .map(|segment| invariant::Span::of_segment(segment, device))
                    .collect(),
            )
        } else {
            Attend::Segments(packed::Grids::new(&segments, device))
        };
        Ok(BlockContext {
            context: Context {
                rope,
                attend,
                routing: Routing::default(),
            },
            input_ids: match &tokens {
                Some(t) => packed.index_select(1, t),
                None => packed,
            },
            batch_ids,
            layout: Layout::Packed(packing),
            tail: None,
        })
    }

    /// Final hidden states of the context's tokens, `[B, T, hidden]` (packed: `[1, T, hidden]`);
    /// of the response predictors only after [`BlockContext::score_predictors_only`].
    pub fn hidden_states_in(&self, context: &BlockContext) -> Tensor {
        let mut x = self.embed_block(context);
        for layer in 0..self.layers.len() {
            x = self.layer_in(layer, &x, context);
        }
        self.norm_block(&x)
    }

    /// The attention half of decoder layer `layer` on a tensor-parallel shard of the model:
    /// `x + tp.exit(o(attention(tp.enter(norm(x))))) + o.bias`, with this shard's heads.
    /// `x` may be a slice of the sequence (sequence parallelism) as long as `tp.enter` returns
    /// the context's whole sequence.
    pub fn attention_block(
        &self,
        layer: usize,
        x: &Tensor,
        context: &BlockContext,
        tp: &dyn TensorParallel,
    ) -> Result<Tensor> {
        let block = self.layer(layer)?;
        let attn = &block.self_attn;
        let input = tp.enter(&block.input_layernorm.forward(x))?;
        let (q, k, v) = attn.project(&input, &context.context, None, None);
        let (k, v) = tp.keys_values(k, v)?;
        let out = attn.attention(&q, k, v, &context.context);
        Ok(x + row_parallel(&attn.o_proj, &out, tp)?)
    }

    /// The MLP half of decoder layer `layer` on a tensor-parallel shard of the model (see
    /// [`Self::attention_block`]): `x + tp.exit(down(silu(gate(h)) · up(h))) + down.bias` with
    /// `h = tp.enter(norm(x))`. Together the two halves are [`Self::layer_block`] when `tp` is
    /// the identity.
    pub fn mlp_block(&self, layer: usize, x: &Tensor, tp: &dyn TensorParallel) -> Result<Tensor> {
        let block = self.layer(layer)?;
        let mlp = block.dense_mlp().ok_or_else(|| {
            ModelError::invalid_input(
                "layer",
                format!(
                    "layer {layer} is a mixture of experts, which tensor parallelism does not shard"
                ),
            )
        })?;
        let input = tp.enter(&block.post_attention_layernorm.forward(x))?;
        Ok(x + row_parallel(&mlp.down_proj, &mlp.inner(&input), tp)?)
    }

    /// The final norm: its output is the model's final hidden states.
    pub fn norm_block(&self, x: &Tensor) -> Tensor {
        self.norm.apply(x, self.batch_invariant())
    }

    /// Forward and backward with activation checkpointing: the forward pass keeps only each
    /// layer's input, and the backward pass recomputes one layer at a time, so activation memory
    /// is one layer's instead of all layers'. `loss_fn` maps the final hidden states `[B, T,
    /// hidden]` to a scalar loss (see [`Self::response_scores_from_hidden`]). Gradients accumulate
    /// into the parameters as `loss.backward()` would after [`Self::hidden_states`]; the cost is
    /// one extra forward pass. Returns the loss, detached.
    pub fn backward_checkpointed(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        loss_fn: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        self.backward_checkpointed_in(&self.block_context(input_ids, attention_mask)?, loss_fn)
    }

    /// [`Self::backward_checkpointed`] on a prepared context (padded or packed).
    pub fn backward_checkpointed_in(
        &self,
        block: &BlockContext,
        loss_fn: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        self.backward_checkpointed_aux_in(block, None, loss_fn)
            .map(|(loss, _)| loss)
    }

    /// The load-balancing loss of the pass just run over `block` (its recorded router logits,
    /// in the pass's graph), over its real tokens.
    pub fn load_balancing_loss_in(&self, block: &BlockContext) -> Result<Tensor> {
        let (e, k) = self.experts()?;
        load_balancing_loss(
            &block.take_router_logits(),
            e,
            k,
            block.token_mask().as_ref(),
        )
    }

    /// [`Self::load_balancing_loss_in`] split by layer, for a backward pass that recomputes one
    /// layer at a time.
    pub fn load_balance_in(&self, block: &BlockContext) -> Result<LoadBalance> {
        let (e, k) = self.experts()?;
        LoadBalance::new(
            &block.take_router_logits(),
            e,
            k,
            block.token_mask().as_ref(),
        )
    }

    /// Experts per sparse layer and per token.
    fn experts(&self) -> Result<(i64, i64)> {
        let moe = self.config.moe.as_ref().ok_or_else(|| {
            ModelError::invalid_input("router logits", "the model has no sparse layer")
        })?;
        Ok((moe.num_experts, moe.num_experts_per_tok))
    }

    /// [`Self::backward_checkpointed_in`], adding `aux_weight` × [`Self::router_aux_loss_coef`] ×
    /// the pass's load-balancing loss to the loss when the config asks for it; returns the loss
    /// and the load-balancing loss added (each layer's share joins that layer's recomputation).
    pub fn backward_checkpointed_aux_in(
        &self,
        block: &BlockContext,
        aux_weight: Option<f64>,
        loss_fn: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<(Tensor, Option<f64>)> {
        let (ids, context) = (&block.input_ids, &block.context);
        let inputs = tch::no_grad(|| {
            let mut inputs = vec![self.embed(ids)];
            for layer in 0..self.layers.len() {
                let next = self.layer_in(
                    layer,
                    inputs.last().expect("starts with the embedding"),
                    block,
                );
                inputs.push(next);
            }
            inputs
        });
        let balance = match aux_weight.zip(self.router_aux_loss_coef()) {
            Some((weight, coef)) => Some((weight * coef, self.load_balance_in(block)?)),
            None => None,
        };
        // Backward through the head, then through each layer from its saved input: the gradient of
        // sum(output · g) with respect to the layer's input and parameters is the chain rule's step.
        let last = inputs
            .last()
            .expect("starts with the embedding")
            .detach()
            .set_requires_grad(true);
        let loss = loss_fn(&self.norm.apply(&last, context.invariant()))?;
        loss.f_backward()?;
        let mut grad = last.grad();
        let aux = balance.as_ref().map(|(_, b)| b.value);
        for (layer, input) in inputs.iter().enumerate().take(self.layers.len()).rev() {
            if !grad.defined() && balance.is_none() {
                return Ok((loss.detach(), aux)); // the loss does not depend on earlier layers
            }
            let x = input.detach().set_requires_grad(true);
            let out = self.layer_in(layer, &x, block);
            let mut objective = if grad.defined() {
                (out * &grad).sum(Kind::Float)
            } else {
                out.sum(Kind::Float) * 0.0
            };
            if let Some((weight, balance)) = &balance {
                for logits in block.take_router_logits() {
                    objective += balance.layer_term(&logits) * *weight;
                }
            }
            objective.f_backward()?;
            grad = x.grad();
        }
        if grad.defined() {
            (self.embed(ids) * grad).sum(Kind::Float).f_backward()?;
        }
        Ok((loss.detach(), aux))
    }
}

/// A row-parallel projection: `tp.exit` of `x·Wᵀ` (partial sums over the shards of the input
/// features), then the bias, which only the whole sum gets.
fn row_parallel(linear: &Linear, x: &Tensor, tp: &dyn TensorParallel) -> Result<Tensor> {
    let y = tp.exit(&x.linear(&linear.weight, None::<&Tensor>))?;
    Ok(match &linear.bias {
        Some(bias) => y + bias,
        None => y,
    })
}

/// How a tensor-parallel engine joins a model holding its shard of every projection — q/k/v and
/// gate/up split by output features (column-parallel), o and down by input features
/// (row-parallel) — to the others: Megatron-LM's conjugate operators around each sub-layer.
/// [`CausalLM::attention_block`] and [`CausalLM::mlp_block`] call them.
pub trait TensorParallel {
    /// The normed input of a column-parallel group (Megatron's `f`: identity forward, gradient
    /// all-reduced; with sequence parallelism the all-gather along the sequence).
    fn enter(&self, x: &Tensor) -> Result<Tensor>;
    /// The partial output of a row-parallel projection, before its bias (Megatron's `g`:
    /// all-reduce; with sequence parallelism the reduce-scatter along the sequence).
    fn exit(&self, y: &Tensor) -> Result<Tensor>;
    /// The rotated keys and values `[B, kv_heads, T, head_dim]` of this rank's tokens → those
    /// its queries attend (context parallelism: every rank's, in sequence order). By default
    /// the same.
    fn keys_values(&self, k: Tensor, v: Tensor) -> Result<(Tensor, Tensor)> {
        Ok((k, v))
    }
}

/// Why a model does not share prompts among rows (see [`CausalLM::shares_prompts`]).
pub const NOT_SHARING_PROMPTS: &str = "prompts are not shared by a mixture-of-experts model (its routing and load-balancing loss cover every row's tokens) nor in the deterministic mode (trainer.deterministic), whose kernels tile each row whole";

/// What the blocks of one forward pass share: the batch's token ids, rotary tables and attention
/// mask (see [`CausalLM::block_context`]).
pub struct BlockContext {
    context: Context,
    input_ids: Tensor,
    /// The batch's `[B, S]` ids, whose response tokens the head scores.
    pub(super) batch_ids: Tensor,
    pub(super) layout: Layout,
    /// Set by [`Self::score_predictors_only`]: the last layer's tokens.
    pub(super) tail: Option<Tail>,
}

/// How a batch's rows are laid out for the blocks.
pub(super) enum Layout {
    /// `[B, S]` rows, with the attention mask.
    Padded(Tensor),
    /// One packed stream.
    Packed(Packing),
}

impl BlockContext {
    /// Makes the passes over this context compute the last decoder layer at the response tokens'
    /// predictors only: their queries, output projection, MLP and final norm. The final hidden
    /// states are then the predictors' alone — padded `[B, R, hidden]` (the last `R + 1`
    /// columns but the last), packed `[1, n, hidden]` (the packing's predictors) — and the
    /// `response_*_in` functions take them as they are. Every token's keys and values are still
    /// computed, so the predictors attend exactly what they did; the other tokens' last-layer
    /// outputs fed nothing but the discarded logits. For a prompt of `P` tokens and a response of
    /// `R`, this saves about `P / (P + R)` of the last layer's work, forward and backward.
    ///
    /// Returns whether it applies: not to a context of part of the batch's tokens (context
    /// parallelism), a sparse last layer (its routing covers every token: router replay, the
    /// load-balancing loss), or the deterministic mode (whose kernels tile every token).
    pub fn score_predictors_only(&mut self, model: &CausalLM, response_len: i64) -> Result<bool> {
        let last_dense = model.layers.last().is_some_and(|l| l.dense_mlp().is_some());
        if !last_dense || model.batch_invariant() {
            return Ok(false);
        }
        let device = self.input_ids.device();
        let (select, attend) = match (&self.layout, &self.context.attend) {
            (Layout::Padded(mask), Attend::Mask(attend)) => {
                let seq = mask.size()[1];
                if self.input_ids.size()[1] != seq {
                    return Ok(false);
                }
                super::scoring::check_response_len(seq, response_len)?;
                let (start, len) = (seq - response_len - 1, response_len);
                (
                    Select::Columns { start, len },
                    Attend::Mask(attend.narrow(2, start, len)),
                )
            }
            (Layout::Packed(packing), Attend::Segments(_)) => {
                super::scoring::check_packed_response_len(packing, response_len)?;
                if self.input_ids.size()[1] != packing.len() || packing.predictors().numel() == 0 {
                    return Ok(false);
                }
                (
                    Select::Slots(packing.predictors().to_device(device)),
                    Attend::Segments(packed::Grids::new(&packing.predictor_segments(), device)),
                )
            }
            _ => return Ok(false),
        };
        self.tail = Some(Tail {
            context: Context {
                rope: self.context.rope.select(&select),
                attend,
                routing: Routing::default(),
            },
            select,
        });
        Ok(true)
    }

    /// Router replay for this pass: the tokens use `experts` (`[B, T, sparse layers, k]` int64,
    /// laid out like the padded batch's ids; packed, each real token takes its own entry) instead
    /// of the router's top-k.
    pub fn replay_experts(&mut self, model: &CausalLM, experts: &Tensor) -> Result<()> {
        let Some(moe) = &model.config.moe else {
            return Err(ModelError::invalid_input(
                "routed_experts",
                "the model has no experts to replay",
            ));
        };
        let ids = match &self.layout {
            Layout::Padded(_) => self.input_ids.size(),
            Layout::Packed(packing) => {
                if self.input_ids.size()[1] != packing.len() {
                    return Err(ModelError::invalid_input(
                        "routed_experts",
                        "router replay of part of a packed stream (context parallelism) is not built",
                    ));
                }
                packing.padded_shape().to_vec()
            }
        };
        let want = [
            ids[0],
            ids[1],
            model.sparse_layers(),
            moe.num_experts_per_tok,
        ];
        if experts.size() != want || experts.kind() != Kind::Int64 {
            return Err(ModelError::invalid_input(
                "routed_experts",
                format!(
                    "must be int64 {want:?} (batch, tokens, sparse layers, top-k), got {:?} {:?}",
                    experts.kind(),
                    experts.size()
                ),
            ));
        }
        if experts.numel() > 0 {
            let (lo, hi) = (
                experts.min().int64_value(&[]),
                experts.max().int64_value(&[]),
            );
            if lo < 0 || hi >= moe.num_experts {
                return Err(ModelError::invalid_input(
                    "routed_experts",
                    format!(
                        "experts must lie in [0, {}), found {lo}..={hi}",
                        moe.num_experts
                    ),
                ));
            }
        }
        let flat = experts
            .reshape([ids[0] * ids[1], want[2], want[3]])
            .to_device(self.input_ids.device());
        let flat = match &self.layout {
            Layout::Padded(_) => flat,
            Layout::Packed(packing) => packing.pack_tokens(&flat),
        };
        self.context.routing = Routing::replaying(&flat);
        Ok(())
    }

    /// The routing recorded by the last pass over this context (`[batch, tokens]` of its ids).
    pub fn take_routing(&self, batch: i64, tokens: i64) -> RouterOutput {
        RouterOutput::from_layers(self.context.routing.take(), batch, tokens)
    }

    /// The token ids of the context's tokens `[B, T]` (for an engine that embeds them itself;
    /// packed: `[1, T]`).
    pub fn input_ids(&self) -> &Tensor {
        &self.input_ids
    }

    /// The experts each token of the padded batch used in the last pass over this context,
    /// `[B, T, sparse layers, k]` int64 (router replay R2 records them).
    pub fn take_routed_experts(&self) -> Result<Tensor> {
        let (batch, tokens) = self.input_ids.size2()?;
        let experts = self.take_routing(batch, tokens).experts;
        match &self.layout {
            Layout::Padded(_) => Ok(experts),
            Layout::Packed(packing) => {
                let [rows, seq] = packing.padded_shape();
                let size = experts.size();
                let stream = experts.reshape([tokens, size[2], size[3]]);
                let padded = if tokens == packing.len() {
                    packing.unpack_tokens(&stream)
                } else {
                    None
                };
                padded
                    .map(|p| p.view([rows, seq, size[2], size[3]]))
                    .ok_or_else(|| {
                        ModelError::invalid_input(
                            "routed_experts",
                            "recording the routing of an aligned or partial packed stream is not built",
                        )
                    })
            }
        }
    }

    /// Each sparse layer's router logits `[N, experts]` recorded since the last take, in layer
    /// order (`N`: the context's tokens, flattened).
    pub fn take_router_logits(&self) -> Vec<Tensor> {
        self.context
            .routing
            .take()
            .into_iter()
            .map(|l| l.logits)
            .collect()
    }

    /// Which of the context's `N` tokens are real, flattened like the router logits; `None` when
    /// all are (a packed stream).
    pub fn token_mask(&self) -> Option<Tensor> {
        match &self.layout {
            Layout::Padded(mask) => Some(mask.reshape([-1])),
            Layout::Packed(_) => None,
        }
    }

    /// The packing of a packed batch's context.
    pub fn packing(&self) -> Option<&Packing> {
        match &self.layout {
            Layout::Packed(packing) => Some(packing),
            Layout::Padded(_) => None,
        }
    }
}

/// `[B, T]` int64 token ids within `[0, vocab_size)` and a matching mask.
fn check_batch(input_ids: &Tensor, attention_mask: &Tensor, vocab_size: i64) -> Result<()> {
    let size = input_ids.size();
    if size.len() != 2 || input_ids.kind() != Kind::Int64 {
        return Err(ModelError::invalid_input(
            "input_ids",
            format!(
                "must be an int64 [batch, seq] tensor, got {:?} {size:?}",
                input_ids.kind()
            ),
        ));
    }
    if attention_mask.size() != size {
        return Err(ModelError::invalid_input(
            "attention_mask",
            format!(
                "shape {:?} differs from input_ids {size:?}",
                attention_mask.size()
            ),
        ));
    }
    if input_ids.numel() > 0 {
        let (lo, hi) = (
            input_ids.min().int64_value(&[]),
            input_ids.max().int64_value(&[]),
        );
        if lo < 0 || hi >= vocab_size {
            return Err(ModelError::invalid_input(
                "input_ids",
                format!("ids must lie in [0, {vocab_size}), found {lo}..={hi}"),
            ));
        }
    }
    Ok(())
}
