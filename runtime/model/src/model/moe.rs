//! The mixture-of-experts MLP of Qwen2-MoE / Qwen3-MoE as transformers implements it
//! (`Qwen2MoeSparseMoeBlock`, `load_balancing_loss_func`), and router replay: a forward pass that
//! takes each token's experts from a recording (the rollout's, verl's `routed_experts`) instead of
//! the router's own top-k.

use std::cell::RefCell;

use tch::{Kind, Tensor, nn};

use super::{Linear, Mlp};
use crate::config::{ModelConfig, MoeConfig};
use crate::error::{ModelError, Result};

/// Routing of one forward pass, shared by its sparse layers through the pass's context.
#[derive(Default)]
pub(crate) struct Routing {
    /// Experts to use instead of the router's top-k: `[N, k]` per sparse layer (`N` = the pass's
    /// tokens, flattened).
    replay: Option<Vec<Tensor>>,
    /// What each sparse layer did, by its ordinal (a layer run twice, as activation checkpointing
    /// does, overwrites its entry).
    trace: RefCell<Vec<Option<LayerRouting>>>,
}

/// One sparse layer's routing of a pass's `N` tokens.
pub(crate) struct LayerRouting {
    /// The router's logits `[N, experts]` (in the graph: the aux loss differentiates them).
    pub(crate) logits: Tensor,
    /// The experts used, `[N, k]` int64.
    pub(crate) experts: Tensor,
}

impl Routing {
    /// Replays `experts` `[N, sparse layers, k]` (int64) instead of routing.
    pub(crate) fn replaying(experts: &Tensor) -> Self {
        let layers = experts.size()[1];
        Self {
            replay: Some((0..layers).map(|l| experts.select(1, l)).collect()),
            trace: RefCell::default(),
        }
    }

    /// The recorded routing, one entry per sparse layer in order.
    pub(crate) fn take(&self) -> Vec<LayerRouting> {
        self.trace.take().into_iter().flatten().collect()
    }

    fn record(&self, ordinal: usize, routing: LayerRouting) {
        let mut trace = self.trace.borrow_mut();
        if trace.len() <= ordinal {
            trace.resize_with(ordinal + 1, || None);
        }
        trace[ordinal] = Some(routing);
    }
}

/// Routing recorded by [`crate::CausalLM::forward_routed`]: everything the load-balancing loss
/// and router replay need.
pub struct RouterOutput {
    /// Each sparse layer's router logits `[B·T, experts]`, in the autograd graph.
    pub logits: Vec<Tensor>,
    /// The experts each token used, `[B, T, sparse layers, k]` int64 — verl's `routed_experts`.
    pub experts: Tensor,
}

impl RouterOutput {
    /// Joins the layers' routing of a `[batch, tokens]` pass.
    pub(crate) fn from_layers(layers: Vec<LayerRouting>, batch: i64, tokens: i64) -> Self {
        let experts: Vec<Tensor> = layers
            .iter()
            .map(|l| l.experts.view([batch, tokens, 1, -1]))
            .collect();
        Self {
            experts: if experts.is_empty() {
                Tensor::zeros([batch, tokens, 0, 0], (Kind::Int64, tch::Device::Cpu))
            } else {
                Tensor::cat(&experts, 2)
            },
            logits: layers.into_iter().map(|l| l.logits).collect(),
        }
    }
}

/// transformers' `load_balancing_loss_func` (Switch Transformer eq. 4–6) over the sparse layers'
/// router `logits` (`[N, experts]` each): `experts · Σ_e f_e · P_e`, with `f_e` the fraction of
/// top-`k` assignments to expert `e` and `P_e` its mean routing probability, over all layers'
/// tokens; `attention_mask` (`[N]` flattened as the logits' rows) leaves padding out. fp32 scalar,
/// in the logits' graph.
pub fn load_balancing_loss(
    logits: &[Tensor],
    num_experts: i64,
    top_k: i64,
    attention_mask: Option<&Tensor>,
) -> Result<Tensor> {
    let balance = LoadBalance::new(logits, num_experts, top_k, attention_mask)?;
    Ok(logits
        .iter()
        .map(|layer| balance.layer_term(layer))
        .reduce(|a, b| a + b)
        .expect("LoadBalance::new refuses no layers"))
}

/// [`load_balancing_loss`] taken one layer at a time, for a backward pass that recomputes and
/// differentiates each layer on its own (activation checkpointing). The loss is
/// `Σ_e (E·c_e/rows²) · Σ_layers Σ_tokens m·p_e` (`c_e` the masked top-k assignments to `e` over
/// all layers, `rows` the masked tokens × layers): the counts carry no gradient, so with them
/// fixed from the whole pass it is a sum over layers of [`LoadBalance::layer_term`], each with
/// the loss's exact gradient with respect to its layer's logits.
pub struct LoadBalance {
    /// `E·f_e/rows²` per expert.
    weights: Tensor,
    /// The loss of the pass.
    pub value: f64,
    /// The real tokens `[N]` (fp32), `None`: all.
    mask: Option<Tensor>,
}

impl LoadBalance {
    /// From every sparse layer's router logits of a pass (no graph needed) and its token mask.
    pub fn new(
        logits: &[Tensor],
        num_experts: i64,
        top_k: i64,
        attention_mask: Option<&Tensor>,
    ) -> Result<Self> {
        let Some(first) = logits.first() else {
            return Err(ModelError::invalid_input(
                "router logits",
                "the model has no sparse layer",
            ));
        };
        let options = (Kind::Float, first.device());
        let mask = attention_mask.map(|m| {
            m.reshape([-1])
                .to_kind(Kind::Float)
                .to_device(first.device())
        });
        let weights = tch::no_grad(|| {
            let mut counts = Tensor::zeros([num_experts], options);
            let mut rows = 0.0;
            for layer in logits {
                let (_, selected) = layer.topk(top_k, -1, true, true);
                let weight = match &mask {
                    Some(m) => m.shallow_clone(),
                    None => Tensor::ones([layer.size()[0]], options),
                };
                rows += weight.sum(Kind::Float).double_value(&[]);
                counts = counts.scatter_add(
                    0,
                    &selected.reshape([-1]),
                    &weight.repeat_interleave_self_int(top_k, 0, None),
                );
            }
            counts * (num_experts as f64 / (rows * rows).max(1.0))
        });
        let mut balance = Self {
            weights,
            value: 0.0,
            mask,
        };
        balance.value = tch::no_grad(|| {
            logits
                .iter()
                .map(|layer| balance.layer_term(layer).double_value(&[]))
                .sum()
        });
        Ok(balance)
    }

    /// One layer's share of the loss, in the graph of its `logits` `[N, experts]`.
    pub fn layer_term(&self, logits: &Tensor) -> Tensor {
        let probs = logits.softmax(-1, Kind::Float);
        let probs = match &self.mask {
            Some(m) => probs * m.unsqueeze(-1),
            None => probs,
        };
        (probs.sum_dim_intlist(0, false, Kind::Float) * &self.weights).sum(Kind::Float)
    }
}

/// The sparse MLP: `Σ_top-k w_e · expert_e(x)` (+ the gated shared expert).
pub(super) struct SparseMoe {
    /// The router (`mlp.gate`): `[experts, hidden]`, no bias.
    gate: Linear,
    experts: Vec<Mlp>,
    /// The shared expert and its gate (`mlp.shared_expert`, `mlp.shared_expert_gate`).
    shared: Option<(Mlp, Linear)>,
    top_k: i64,
    norm_topk_prob: bool,
    /// This layer's position among the model's sparse layers.
    ordinal: usize,
}

impl SparseMoe {
    pub(super) fn new(path: nn::Path, c: &ModelConfig, moe: &MoeConfig, ordinal: usize) -> Self {
        let h = c.hidden_size;
        let experts = &path / "experts";
        Self {
            gate: Linear::new(&path / "gate", h, moe.num_experts, false),
            experts: (0..moe.num_experts)
                .map(|e| Mlp::sized(&experts / e, h, moe.moe_intermediate_size, false))
                .collect(),
            shared: moe.shared_expert_intermediate_size.map(|size| {
                (
                    Mlp::sized(&path / "shared_expert", h, size, false),
                    Linear::new(&path / "shared_expert_gate", h, 1, false),
                )
            }),
            top_k: moe.num_experts_per_tok,
            norm_topk_prob: moe.norm_topk_prob,
            ordinal,
        }
    }

    /// `x` `[B, T, hidden]` → `[B, T, hidden]`, routing recorded in (or replayed from) `routing`.
    /// `invariant`: the router and every expert run over fixed row tiles, so a token's result
    /// does not depend on how many tokens its experts serve in this batch.
    pub(super) fn forward(&self, x: &Tensor, routing: &Routing, invariant: bool) -> Tensor {
        let size = x.size();
        let hidden = x.reshape([-1, size[size.len() - 1]]);
        let logits = self.gate.apply(&hidden, invariant);
        let probs = logits.softmax(-1, Kind::Float);
        // Replay keeps the recorded experts; their weights still come from this pass's router, so
        // the router trains (verl's router replay does the same).
        let experts = match routing.replay.as_ref().and_then(|r| r.get(self.ordinal)) {
            Some(recorded) => recorded.to_device(x.device()),
            None => probs.topk(self.top_k, -1, true, true).1,
        };
        let mut weights = probs.gather(-1, &experts, false);
        if self.norm_topk_prob {
            weights = &weights / weights.sum_dim_intlist(-1, true, Kind::Float);
        }
        let weights = weights.to_kind(x.kind());
        // As transformers: expert by expert, each over the tokens routed to it, accumulated with
        // index_add in expert order.
        let mut out = hidden.zeros_like();
        for (e, expert) in self.experts.iter().enumerate() {
            let chosen = experts.eq(e as i64);
            let tokens = chosen.any_dim(-1, false).nonzero().squeeze_dim(-1);
            if tokens.numel() == 0 {
                continue;
            }
            // Each expert appears at most once in a token's top-k: the masked sum is its weight.
            let weight = (&weights * chosen.to_kind(weights.kind()))
                .sum_dim_intlist(-1, true, weights.kind())
                .index_select(0, &tokens);
            let y = expert.apply(&hidden.index_select(0, &tokens), invariant) * weight;
            let _ = out.index_add_(0, &tokens, &y);
        }
        let out = match &self.shared {
            Some((shared, gate)) => {
                let mix = |t: &Tensor| gate.forward(t).sigmoid() * shared.forward(t, None);
                out + if invariant {
                    super::invariant::rows(&hidden, mix)
                } else {
                    mix(&hidden)
                }
            }
            None => out,
        };
        routing.record(self.ordinal, LayerRouting { logits, experts });
        out.view(size.as_slice())
    }
}
