//! The Llama/Qwen2 decoder on a `tch::nn::VarStore` whose variable names are the Hugging Face
//! parameter names (`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`, …), so that
//! loading and saving safetensors is a name lookup.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use tch::{Device, Kind, Tensor, nn};

use crate::config::{ModelConfig, RopeScaling};
use crate::error::{ModelError, Result};
use crate::rng::Rng;
use crate::weights;

mod cpu_step;
mod invariant;
mod moe;
mod packed;

use cpu_step::StepBuffers;
pub use moe::{LoadBalance, RouterOutput, load_balancing_loss};
use moe::{Routing, SparseMoe};
pub use packed::Packing;

/// What sits on top of the final norm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Head {
    /// Next-token logits (the actor / reference / rollout model).
    #[default]
    Lm,
    /// A scalar value per token, `score = Linear(hidden, 1)` as in transformers'
    /// `*ForTokenClassification` with `num_labels = 1` (the critic).
    Value,
}

/// Where and how to build a model.
#[derive(Debug, Clone, Copy)]
pub struct ModelOptions {
    pub device: Device,
    /// Parameter dtype. Log-probs, entropy and losses are always computed in fp32.
    pub kind: Kind,
    pub head: Head,
    /// Seeds the random initialisation (all weights for [`CausalLM::random`], the value head of a
    /// critic loaded from a language-model checkpoint).
    pub seed: u64,
}

impl Default for ModelOptions {
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            kind: Kind::Float,
            head: Head::Lm,
            seed: 0,
        }
    }
}

/// The value head's parameter prefix (transformers' token-classification `score`).
const VALUE_HEAD: &str = "score";

struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    fn new(path: nn::Path, in_dim: i64, out_dim: i64, bias: bool) -> Self {
        Self {
            weight: path.zeros("weight", &[out_dim, in_dim]),
            bias: bias.then(|| path.zeros("bias", &[out_dim])),
        }
    }

    /// `x·Wᵀ + b`.
    fn forward(&self, x: &Tensor) -> Tensor {
        x.linear(&self.weight, self.bias.as_ref())
    }

    /// [`Self::forward`], over fixed row tiles when `invariant` (see [`invariant::rows`]).
    fn apply(&self, x: &Tensor, invariant: bool) -> Tensor {
        if invariant {
            invariant::rows(x, |t| self.forward(t))
        } else {
            self.forward(x)
        }
    }

    /// The parameters a [`DecodeLinear`] copies.
    fn parameters(&self) -> impl Iterator<Item = &Tensor> {
        std::iter::once(&self.weight).chain(&self.bias)
    }
}

/// One or more [`Linear`]s side by side with the weights transposed to `[in, Σ out]`,
/// contiguous. For the few rows of a decode step, MKL multiplies `x·W` about twice as fast as
/// `x·Wᵀ` from the stored `[out, in]` layout (measured on 8 rows: 256×8192 0.25 ms vs 0.55 ms),
/// which is what `linear` and transformers do; and one multiplication for q, k and v (or gate
/// and up) instead of three (two) saves a kernel launch and a pass over the input.
struct DecodeLinear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl DecodeLinear {
    /// The layers' biases are all present or all absent (they share one config flag).
    fn new(layers: &[&Linear]) -> Self {
        let weights: Vec<&Tensor> = layers.iter().map(|l| &l.weight).collect();
        let biases: Option<Vec<&Tensor>> = layers.iter().map(|l| l.bias.as_ref()).collect();
        Self {
            weight: Tensor::cat(&weights, 0).detach().tr().contiguous(),
            bias: biases.map(|b| Tensor::cat(&b, 0).detach()),
        }
    }

    fn from_embedding(weight: &Tensor) -> Self {
        Self {
            weight: weight.detach().tr().contiguous(),
            bias: None,
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let y = x.matmul(&self.weight);
        match &self.bias {
            Some(b) => y + b,
            None => y,
        }
    }

    fn shallow_clone(&self) -> Self {
        Self {
            weight: self.weight.shallow_clone(),
            bias: self.bias.as_ref().map(Tensor::shallow_clone),
        }
    }
}

/// One decoder layer's projections for decoding: q, k and v fused, gate and up fused.
struct LayerWeights {
    qkv: DecodeLinear,
    o: DecodeLinear,
    gate_up: DecodeLinear,
    down: DecodeLinear,
}

impl LayerWeights {
    fn shallow_clone(&self) -> Self {
        Self {
            qkv: self.qkv.shallow_clone(),
            o: self.o.shallow_clone(),
            gate_up: self.gate_up.shallow_clone(),
            down: self.down.shallow_clone(),
        }
    }
}

/// The whole model's decode weights (CPU only: cuBLAS has no such penalty for the stored
/// layout, and GPU memory is scarcer). A model keeps them between `generate` calls — one extra
/// copy of its weights — and rebuilds them when any parameter they copy has been written since
/// (libtorch's per-tensor version counter, which every in-place write bumps: weight sync,
/// optimizer steps, loading).
struct DecodeWeights {
    /// `(data pointer, version)` of every copied parameter when this copy was made.
    sources: Vec<(usize, i64)>,
    layers: Vec<LayerWeights>,
    /// `None` for a value-head model.
    lm_head: Option<DecodeLinear>,
}

impl DecodeWeights {
    fn shallow_clone(&self) -> Self {
        Self {
            sources: self.sources.clone(),
            layers: self
                .layers
                .iter()
                .map(LayerWeights::shallow_clone)
                .collect(),
            lm_head: self.lm_head.as_ref().map(DecodeLinear::shallow_clone),
        }
    }
}

struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    fn new(path: nn::Path, dim: i64, eps: f64) -> Self {
        Self {
            weight: path.ones("weight", &[dim]),
            eps,
        }
    }

    /// As transformers: normalise in fp32, cast back, then scale.
    fn forward(&self, x: &Tensor) -> Tensor {
        let x32 = x.to_kind(Kind::Float);
        let variance = x32.square().mean_dim(-1, true, Kind::Float);
        &self.weight * (x32 * (variance + self.eps).rsqrt()).to_kind(x.kind())
    }

    /// [`Self::forward`], over fixed row tiles when `invariant` (see [`invariant::rows`]).
    fn apply(&self, x: &Tensor, invariant: bool) -> Tensor {
        if invariant {
            invariant::rows(x, |t| self.forward(t))
        } else {
            self.forward(x)
        }
    }
}

/// transformers' default RoPE tables for positions `0..len`, `[len, head_dim]`: `inv_freq` and
/// the angles in fp32, halves duplicated. A forward pass picks its rows by position, so a decode
/// step computes no trigonometry.
struct RopeTable {
    cos: Tensor,
    /// `[-sin, sin]` over the two halves: `rotate_half(x) * [sin, sin] = roll(x) * [-sin, sin]`.
    signed_sin: Tensor,
}

impl RopeTable {
    /// `invariant`: the angles are computed over fixed tiles of positions, so that a position's
    /// values do not depend on the table's length (a vectorised cosine and its scalar tail loop
    /// may round differently).
    fn new(inv_freq: &Tensor, len: i64, kind: Kind, invariant: bool) -> Self {
        let positions = Tensor::arange(len, (Kind::Float, inv_freq.device())).unsqueeze(-1);
        let angles = |p: &Tensor| {
            let freqs = p * inv_freq;
            Tensor::cat(&[freqs.cos(), freqs.sin()], -1)
        };
        let angles = if invariant {
            invariant::rows(&positions, angles)
        } else {
            angles(&positions)
        };
        let half = inv_freq.size()[0];
        let (cos, sin) = (
            angles.narrow(-1, 0, half).to_kind(kind),
            angles.narrow(-1, half, half).to_kind(kind),
        );
        Self {
            cos: Tensor::cat(&[&cos, &cos], -1),
            signed_sin: Tensor::cat(&[sin.neg(), sin], -1),
        }
    }

    /// The tables for `positions` `[B, T]`, shaped `[B, T, 1, head_dim]` to broadcast over the
    /// heads of `[B, T, heads, head_dim]` projections.
    fn at(&self, positions: &Tensor) -> Rope {
        let (b, t) = positions.size2().expect("positions are [B, T]");
        let rows = positions.reshape([-1]);
        let pick = |table: &Tensor| table.index_select(0, &rows).view([b, t, 1, -1]);
        Rope {
            cos: pick(&self.cos),
            signed_sin: pick(&self.signed_sin),
        }
    }
}

/// Rotary embedding tables for one forward pass, `[B, T, 1, head_dim]` each.
struct Rope {
    cos: Tensor,
    signed_sin: Tensor,
}

impl Rope {
    /// The tables of the `select`ed tokens.
    fn select(&self, select: &Select) -> Self {
        Self {
            cos: select.apply(&self.cos),
            signed_sin: select.apply(&self.signed_sin),
        }
    }

    /// `x * cos + rotate_half(x) * sin` with `rotate_half([a, b]) = [-b, a]`, as transformers,
    /// computed as `x * cos + roll(x, half) * [-sin, sin]`: bit-identical (negation is exact), one
    /// kernel instead of three for the rotation. `x`: `[B, T, heads, head_dim]`.
    fn apply(&self, x: &Tensor) -> Tensor {
        let half = x.size()[x.dim() - 1] / 2;
        x * &self.cos + x.roll([half], [-1]) * &self.signed_sin
    }
}

/// Rotary tables, what each query attends and the experts' routing, for one forward pass.
struct Context {
    rope: Rope,
    attend: Attend,
    routing: Routing,
}

/// Which keys each query attends.
enum Attend {
    /// `[B, 1, T, S]`: boolean (true where a query may attend a key) or additive (0 or -inf).
    Mask(Tensor),
    /// A packed batch (`B = 1`): each run of queries attends causally within its sequence's
    /// keys (see [`packed::Segment`]), laid out in padded grids (see [`packed::attend`]).
    Segments(packed::Grids),
    /// The deterministic mode: each sequence's queries over its own real keys, in fixed tiles
    /// (see [`invariant::attention`]).
    Spans(Vec<invariant::Span>),
}

impl Context {
    /// Whether the pass runs the batch-invariant kernels.
    fn invariant(&self) -> bool {
        matches!(self.attend, Attend::Spans(_))
    }
}

/// The state of one `generate` call: key/value buffers `[B, kv_heads, capacity, head_dim]` per
/// layer (one head's positions contiguous, so attention streams them; with positions outermost,
/// a head's keys lay 1 KB apart and reading them was latency-bound), an additive mask over all
/// `capacity` positions, each row's next position and the RoPE table.
struct KvCache {
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
    len: i64,
    /// `[B, 1, 1, capacity]`: -inf at prompt padding, 0 elsewhere (generated tokens are real).
    mask: Tensor,
    /// `[B, 1]`: the position of each row's next token.
    next_positions: Tensor,
    rope: RopeTable,
}

impl KvCache {
    fn new(model: &CausalLM, batch: i64, capacity: i64) -> Self {
        let c = &model.config;
        let shape = [batch, c.num_key_value_heads, capacity, c.head_dim];
        let options = (model.kind(), model.device());
        let layers = c.num_hidden_layers as usize;
        // Only the filled prefix is ever read, so the buffers need no initialisation.
        Self {
            keys: (0..layers).map(|_| Tensor::empty(shape, options)).collect(),
            values: (0..layers).map(|_| Tensor::empty(shape, options)).collect(),
            len: 0,
            mask: Tensor::zeros([batch, 1, 1, capacity], options),
            next_positions: Tensor::zeros([batch, 1], (Kind::Int64, model.device())),
            rope: RopeTable::new(
                &model.inv_freq,
                capacity,
                model.kind(),
                model.batch_invariant(),
            ),
        }
    }

    /// Duplicates each sequence `n` times in place (`n` samples share one prompt prefill).
    fn repeat_interleave(&mut self, n: i64) {
        for t in self
            .keys
            .iter_mut()
            .chain(self.values.iter_mut())
            .chain([&mut self.mask, &mut self.next_positions])
        {
            *t = t.repeat_interleave_self_int(n, 0, None);
        }
    }

    /// Appends keys/values `[B, kv_heads, T, head_dim]` of `layer` and returns everything cached
    /// so far, `[B, kv_heads, S, head_dim]`.
    fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> (Tensor, Tensor) {
        let new = k.size()[2];
        let end = self.len + new;
        self.keys[layer].narrow(2, self.len, new).copy_(k);
        self.values[layer].narrow(2, self.len, new).copy_(v);
        (
            self.keys[layer].narrow(2, 0, end),
            self.values[layer].narrow(2, 0, end),
        )
    }
}

/// How a decoder runs its steps. `generate` uses the fastest the model allows; the tests run
/// every path on CPU against the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(
    not(test),
    expect(dead_code, reason = "only the tests choose a slower path")
)]
pub(crate) enum DecodePath {
    /// fp32 on CPU: the [`cpu_step`] kernels. Otherwise as `Fused`.
    Kernels,
    /// Tensor ops with the fused, transposed [`DecodeWeights`] on CPU. Otherwise as `Tensors`.
    Fused,
    /// Tensor ops on the parameters themselves: what a GPU model runs.
    Tensors,
}

/// One `generate` call's decoding state: the KV cache, the decode weights and, for an fp32
/// model on CPU, the buffers of the [`cpu_step`] kernels.
pub(crate) struct Decoder<'m> {
    model: &'m CausalLM,
    cache: KvCache,
    weights: Option<DecodeWeights>,
    /// Whether steps run through [`cpu_step`] (created with the buffers at the first step).
    cpu_kernels: bool,
    buffers: Option<StepBuffers>,
    /// The experts of the tokens the last prefill or step ran, `[rows, tokens, sparse layers,
    /// k]` int64 on CPU (`None` for a dense model).
    routing: Option<Tensor>,
}

impl<'m> Decoder<'m> {
    /// Runs left-padded prompts `input_ids` `[B, W]` (`attention_mask` 0 at padding) into a cache
    /// with room for `capacity` positions; returns the decoder and the next-token logits `[B,
    /// vocab]` in fp32.
    pub(crate) fn prefill(
        model: &'m CausalLM,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        capacity: i64,
        path: DecodePath,
    ) -> Result<(Self, Tensor)> {
        let (batch, width) = input_ids.size2().expect("prompts are [B, W]");
        let weights = match path {
            DecodePath::Kernels | DecodePath::Fused => model.decode_weights(),
            DecodePath::Tensors => None,
        };
        let mut cache = KvCache::new(model, batch, capacity);
        let context = model.context(attention_mask, width);
        let hidden = model.run(input_ids, &context, Some(&mut cache), weights.as_ref());
        let padding = attention_mask.eq(0).view([-1, 1, 1, width]);
        let _ = cache
            .mask
            .narrow(3, 0, width)
            .masked_fill_(&padding, f64::NEG_INFINITY);
        cache.next_positions = attention_mask.sum_dim_intlist(-1, true, Kind::Int64);
        let logits = model.decode_logits(&hidden.select(1, width - 1), weights.as_ref())?;
        let routing = model.routed_experts(&context, batch, width);
        let decoder = Self {
            model,
            routing,
            cache,
            cpu_kernels: path == DecodePath::Kernels
                && weights.is_some()
                && model.kind() == Kind::Float,
            weights,
            buffers: None,
        };
        Ok((decoder, logits))
    }

    /// Duplicates each sequence `n` times (`n` samples share one prompt prefill). Before the first
    /// step only.
    pub(crate) fn repeat_interleave(&mut self, n: i64) {
        self.cache.repeat_interleave(n);
        if let Some(routing) = &mut self.routing {
            *routing = routing.repeat_interleave_self_int(n, 0, None);
        }
    }

    /// The experts of the tokens the last prefill or step ran (see [`Self::routing`]).
    pub(crate) fn routing(&self) -> Option<&Tensor> {
        self.routing.as_ref()
    }

    /// Feeds each row's next token; returns the next-token logits `[rows, vocab]` in fp32,
    /// valid until the next step.
    pub(crate) fn step(&mut self, tokens: &[i64]) -> Result<Tensor> {
        let (model, cache) = (self.model, &mut self.cache);
        if let (true, Some(weights)) = (self.cpu_kernels, &self.weights) {
            let buffers = self
                .buffers
                .get_or_insert_with(|| StepBuffers::new(model, cache));
            return Ok(model.cpu_decode_step(tokens, cache, weights, buffers));
        }
        let tokens = Tensor::from_slice(tokens).to_device(model.device());
        // Every generated token is real: its rotary row is the row's next position and its mask
        // the cached prefix's.
        let mask = cache.mask.narrow(3, 0, cache.len + 1);
        let attend = if model.batch_invariant() {
            // One query per row, at its next position, over its real cached keys and itself.
            let real = mask.reshape([mask.size()[0], -1]).eq(0);
            Attend::Spans(invariant::Span::per_row(
                &real,
                &Tensor::from_slice(&[cache.len]),
                &cache.next_positions,
            ))
        } else {
            Attend::Mask(mask)
        };
        let context = Context {
            rope: cache.rope.at(&cache.next_positions),
            attend,
            routing: Routing::default(),
        };
        let rows = tokens.size()[0];
        let hidden = model.run(
            &tokens.view([-1, 1]),
            &context,
            Some(cache),
            self.weights.as_ref(),
        );
        cache.next_positions += 1;
        self.routing = model.routed_experts(&context, rows, 1);
        model.decode_logits(&hidden.squeeze_dim(1), self.weights.as_ref())
    }
}

struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    /// Qwen3's per-head RMS norms of queries and keys, before the rotation.
    qk_norm: Option<(RmsNorm, RmsNorm)>,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
}

impl Attention {
    fn new(path: nn::Path, c: &ModelConfig) -> Self {
        let (h, d) = (c.hidden_size, c.head_dim);
        Self {
            q_proj: Linear::new(&path / "q_proj", h, c.num_attention_heads * d, c.qkv_bias),
            k_proj: Linear::new(&path / "k_proj", h, c.num_key_value_heads * d, c.qkv_bias),
            v_proj: Linear::new(&path / "v_proj", h, c.num_key_value_heads * d, c.qkv_bias),
            o_proj: Linear::new(&path / "o_proj", c.num_attention_heads * d, h, c.o_bias),
            qk_norm: c.qk_norm.then(|| {
                (
                    RmsNorm::new(&path / "q_norm", d, c.rms_norm_eps),
                    RmsNorm::new(&path / "k_norm", d, c.rms_norm_eps),
                )
            }),
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: d,
        }
    }

    fn forward(
        &self,
        x: &Tensor,
        context: &Context,
        cache: Option<(&mut KvCache, usize)>,
        weights: Option<&LayerWeights>,
    ) -> Tensor {
        let out = self.attend(x, context, cache, weights);
        match weights {
            Some(w) => w.o.forward(&out),
            None => self.o_proj.apply(&out, context.invariant()),
        }
    }

    /// The attention's output `[B, T, heads × head_dim]` before the output projection.
    fn attend(
        &self,
        x: &Tensor,
        context: &Context,
        cache: Option<(&mut KvCache, usize)>,
        weights: Option<&LayerWeights>,
    ) -> Tensor {
        let (q, k, v) = self.project(x, context, cache, weights);
        self.attention(&q, k, v, context)
    }

    /// Queries `[B, T, heads, head_dim]` and the keys and values `[B, kv_heads, S, head_dim]`
    /// they attend (with a cache, everything cached so far), rotated.
    fn project(
        &self,
        x: &Tensor,
        context: &Context,
        cache: Option<(&mut KvCache, usize)>,
        weights: Option<&LayerWeights>,
    ) -> (Tensor, Tensor, Tensor) {
        let (b, t, _) = x.size3().expect("hidden states are [B, T, H]");
        let (h, kv, d) = (self.heads, self.kv_heads, self.head_dim);
        let rope = &context.rope;
        // Projections as [B, T, heads, head_dim].
        let (q, k, v) = match weights {
            Some(w) => {
                let qkv = w.qkv.forward(x).view([b, t, h + 2 * kv, d]);
                // One rotation for the queries and keys together.
                let qk = rope.apply(&qkv.narrow(2, 0, h + kv));
                (
                    qk.narrow(2, 0, h),
                    qk.narrow(2, h, kv),
                    qkv.narrow(2, h + kv, kv),
                )
            }
            None => {
                let (k, v) = self.keys_values(x, context);
                (self.queries(x, context), k, v)
            }
        };
        let (k, v) = (k.transpose(1, 2), v.transpose(1, 2));
        let (k, v) = match cache {
            Some((cache, layer)) => cache.append(layer, &k, &v),
            None => (k, v),
        };
        (q, k, v)
    }

    /// The rotated queries `[B, T, heads, head_dim]` of `x` `[B, T, hidden]` (normed).
    fn queries(&self, x: &Tensor, context: &Context) -> Tensor {
        let inv = context.invariant();
        let q = self.heads(self.q_proj.apply(x, inv), self.heads);
        let q = match &self.qk_norm {
            Some((q_norm, _)) => q_norm.apply(&q, inv),
            None => q,
        };
        context.rope.apply(&q)
    }

    /// The rotated keys and the values `[B, T, kv_heads, head_dim]` of `x` `[B, T, hidden]`.
    fn keys_values(&self, x: &Tensor, context: &Context) -> (Tensor, Tensor) {
        let inv = context.invariant();
        let k = self.heads(self.k_proj.apply(x, inv), self.kv_heads);
        let k = match &self.qk_norm {
            Some((_, k_norm)) => k_norm.apply(&k, inv),
            None => k,
        };
        let v = self.heads(self.v_proj.apply(x, inv), self.kv_heads);
        (context.rope.apply(&k), v)
    }

    /// A projection `[B, T, n × head_dim]` as `[B, T, n, head_dim]`.
    fn heads(&self, y: Tensor, n: i64) -> Tensor {
        let (b, t, _) = y.size3().expect("projections are [B, T, features]");
        y.view([b, t, n, self.head_dim])
    }

    /// [`Self::forward`] for the tail's tokens only (`x`: every token's normed hidden states,
    /// whose keys and values the tail's queries attend), `[B, T', hidden]`.
    fn forward_tail(&self, x: &Tensor, context: &Context, tail: &Tail) -> Tensor {
        let q = self.queries(&tail.select.apply(x), &tail.context);
        let (k, v) = self.keys_values(x, context);
        let out = self.attention(&q, k.transpose(1, 2), v.transpose(1, 2), &tail.context);
        self.o_proj.forward(&out)
    }

    /// Scaled dot-product attention of `q` over `k`, `v` under the context's mask, `[B, T,
    /// heads × head_dim]`.
    fn attention(&self, q: &Tensor, k: Tensor, v: Tensor, context: &Context) -> Tensor {
        let (b, t) = (q.size()[0], q.size()[1]);
        let (h, kv, d) = (self.heads, self.kv_heads, self.head_dim);
        let scale = scale_of(d);
        // Grouped-query attention: each key/value head serves `heads / kv_heads` query heads.
        let groups = h / kv;
        let shared = |t: Tensor| {
            if groups > 1 {
                t.repeat_interleave_self_int(groups, 1, None)
            } else {
                t
            }
        };
        let out = match &context.attend {
            Attend::Mask(mask) => Tensor::scaled_dot_product_attention(
                &q.transpose(1, 2),
                &shared(k),
                &shared(v),
                Some(mask),
                0.0,
                false,
                scale,
                false,
            )
            .transpose(1, 2),
            // The grids share the key/value heads among their query heads themselves.
            Attend::Segments(grids) => {
                packed::attend(&q.transpose(1, 2), &k, &v, grids, scale).transpose(1, 2)
            }
            Attend::Spans(spans) => invariant::attention(q, &shared(k), &shared(v), spans, scale),
        };
        out.reshape([b, t, h * d])
    }
}

/// Scaled dot-product attention's scale for heads of `head_dim`: `1/√d`.
fn scale_of(head_dim: i64) -> f64 {
    (head_dim as f64).powf(-0.5)
}

struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    fn new(path: nn::Path, c: &ModelConfig) -> Self {
        Self::sized(path, c.hidden_size, c.intermediate_size, c.mlp_bias)
    }

    /// A SwiGLU MLP `hidden → intermediate → hidden` (also one expert of a sparse MLP).
    fn sized(path: nn::Path, hidden: i64, intermediate: i64, bias: bool) -> Self {
        let (h, i) = (hidden, intermediate);
        Self {
            gate_proj: Linear::new(&path / "gate_proj", h, i, bias),
            up_proj: Linear::new(&path / "up_proj", h, i, bias),
            down_proj: Linear::new(&path / "down_proj", i, h, bias),
        }
    }

    /// SwiGLU: `down(silu(gate(x)) * up(x))`.
    fn forward(&self, x: &Tensor, weights: Option<&LayerWeights>) -> Tensor {
        match weights {
            Some(w) => {
                let gate_up = w.gate_up.forward(x);
                let i = gate_up.size()[gate_up.dim() - 1] / 2;
                w.down
                    .forward(&(gate_up.narrow(-1, 0, i).silu() * gate_up.narrow(-1, i, i)))
            }
            None => self.down_proj.forward(&self.inner(x)),
        }
    }

    /// [`Self::forward`] without decode weights, over fixed row tiles when `invariant`.
    fn apply(&self, x: &Tensor, invariant: bool) -> Tensor {
        if invariant {
            invariant::rows(x, |t| self.forward(t, None))
        } else {
            self.forward(x, None)
        }
    }

    /// `silu(gate(x)) * up(x)`: the down projection's input.
    fn inner(&self, x: &Tensor) -> Tensor {
        self.gate_proj.forward(x).silu() * self.up_proj.forward(x)
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

/// A layer's MLP: dense, or a mixture of experts.
enum Ffn {
    Dense(Mlp),
    Sparse(SparseMoe),
}

struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Ffn,
}

impl DecoderLayer {
    /// Layer `index`; a sparse one is the `sparse_ordinal`-th of the model's sparse layers.
    fn new(path: nn::Path, c: &ModelConfig, index: i64, sparse_ordinal: usize) -> Self {
        Self {
            input_layernorm: RmsNorm::new(&path / "input_layernorm", c.hidden_size, c.rms_norm_eps),
            self_attn: Attention::new(&path / "self_attn", c),
            post_attention_layernorm: RmsNorm::new(
                &path / "post_attention_layernorm",
                c.hidden_size,
                c.rms_norm_eps,
            ),
            mlp: match &c.moe {
                Some(moe) if moe.is_sparse(index) => {
                    Ffn::Sparse(SparseMoe::new(&path / "mlp", c, moe, sparse_ordinal))
                }
                _ => Ffn::Dense(Mlp::new(&path / "mlp", c)),
            },
        }
    }

    fn forward(
        &self,
        x: &Tensor,
        context: &Context,
        cache: Option<(&mut KvCache, usize)>,
        weights: Option<&LayerWeights>,
    ) -> Tensor {
        let inv = context.invariant();
        let x = x + self.self_attn.forward(
            &self.input_layernorm.apply(x, inv),
            context,
            cache,
            weights,
        );
        let normed = self.post_attention_layernorm.apply(&x, inv);
        &x + match &self.mlp {
            Ffn::Dense(mlp) if inv => mlp.apply(&normed, true),
            Ffn::Dense(mlp) => mlp.forward(&normed, weights),
            Ffn::Sparse(moe) => moe.forward(&normed, &context.routing, inv),
        }
    }

    /// [`Self::forward`] at the tail's tokens only, `[B, T', hidden]` (a dense layer, outside
    /// the deterministic mode: see [`BlockContext::score_predictors_only`]).
    fn forward_tail(&self, x: &Tensor, context: &Context, tail: &Tail) -> Tensor {
        let mlp = self.dense_mlp().expect("a tail runs on a dense layer");
        let normed = self.input_layernorm.forward(x);
        let x = tail.select.apply(x) + self.self_attn.forward_tail(&normed, context, tail);
        &x + mlp.forward(&self.post_attention_layernorm.forward(&x), None)
    }

    /// The dense MLP (`None` for a sparse layer).
    fn dense_mlp(&self) -> Option<&Mlp> {
        match &self.mlp {
            Ffn::Dense(mlp) => Some(mlp),
            Ffn::Sparse(_) => None,
        }
    }

    /// The projections the decode weights copy (dense layers only).
    fn projections(&self) -> Option<[&Linear; 7]> {
        let (a, m) = (&self.self_attn, self.dense_mlp()?);
        Some([
            &a.q_proj,
            &a.k_proj,
            &a.v_proj,
            &a.o_proj,
            &m.gate_proj,
            &m.up_proj,
            &m.down_proj,
        ])
    }

    fn decode_weights(&self) -> Option<LayerWeights> {
        let (a, m) = (&self.self_attn, self.dense_mlp()?);
        Some(LayerWeights {
            qkv: DecodeLinear::new(&[&a.q_proj, &a.k_proj, &a.v_proj]),
            o: DecodeLinear::new(&[&a.o_proj]),
            gate_up: DecodeLinear::new(&[&m.gate_proj, &m.up_proj]),
            down: DecodeLinear::new(&[&m.down_proj]),
        })
    }
}

enum OutputHead {
    /// `None`: tied to the input embedding.
    Lm(Option<Tensor>),
    Value(Linear),
}

/// A decoder-only transformer of the Llama/Qwen2 family with an LM head or a value head.
pub struct CausalLM {
    config: ModelConfig,
    vs: nn::VarStore,
    embed_tokens: Tensor,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    head: OutputHead,
    inv_freq: Tensor,
    /// Built by the first `generate` on CPU; see [`DecodeWeights`].
    decode_weights: Mutex<Option<DecodeWeights>>,
    /// The deterministic mode (see [`Self::set_batch_invariant`]).
    invariant: AtomicBool,
}

impl std::fmt::Debug for CausalLM {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CausalLM")
            .field("config", &self.config)
            .field("device", &self.vs.device())
            .finish()
    }
}

impl CausalLM {
    /// The model with all parameters zero (norms one) in the requested dtype, for callers that
    /// fill them (a tensor-parallel engine builds its shard this way, with the shard's sizes in
    /// `config`). Refused before allocating when the parameters exceed host memory.
    pub fn zeroed(config: ModelConfig, options: &ModelOptions) -> Result<Self> {
        Self::build(config, options)
    }

    /// The model with all parameters zero (norms one) in the requested dtype; callers fill them.
    /// Refused before allocating when the parameters (created in fp32) exceed host memory.
    fn build(config: ModelConfig, options: &ModelOptions) -> Result<Self> {
        if options.device == Device::Cpu {
            let c = &config;
            crate::memory::check(
                || {
                    format!(
                        "a model of {} parameters (hidden_size {}, intermediate_size {}, {} layers, vocab_size {})",
                        c.parameter_count(),
                        c.hidden_size,
                        c.intermediate_size,
                        c.num_hidden_layers,
                        c.vocab_size
                    )
                },
                c.parameter_count() * 4,
            )?;
        }
        let mut vs = nn::VarStore::new(options.device);
        let root = vs.root();
        let model = &root / "model";
        let c = &config;
        let embed_tokens =
            (&model / "embed_tokens").zeros("weight", &[c.vocab_size, c.hidden_size]);
        let mut sparse = 0;
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                let layer = DecoderLayer::new(&model / "layers" / i, c, i, sparse);
                sparse += usize::from(matches!(layer.mlp, Ffn::Sparse(_)));
                layer
            })
            .collect();
        let norm = RmsNorm::new(&model / "norm", c.hidden_size, c.rms_norm_eps);
        let head = match options.head {
            Head::Lm if c.tie_word_embeddings => OutputHead::Lm(None),
            Head::Lm => OutputHead::Lm(Some(
                (&root / "lm_head").zeros("weight", &[c.vocab_size, c.hidden_size]),
            )),
            Head::Value => {
                OutputHead::Value(Linear::new(&root / VALUE_HEAD, c.hidden_size, 1, true))
            }
        };
        let inv_freq = inv_freq(c, options.device);
        // Before loading, so that a bf16 model never holds an fp32 copy of its weights.
        vs.set_kind(options.kind);
        Ok(Self {
            config,
            vs,
            embed_tokens,
            layers,
            norm,
            head,
            inv_freq,
            decode_weights: Mutex::new(None),
            invariant: AtomicBool::new(false),
        })
    }

    /// Random initialisation as transformers does it: weights `N(0, initializer_range)`, biases
    /// zero, norms one. Same config + seed → same weights, on any thread.
    pub fn random(config: ModelConfig, options: &ModelOptions) -> Result<Self> {
        let model = Self::build(config, options)?;
        model.init_matching(&mut Rng::new(options.seed), |_| true)?;
        Ok(model)
    }

    /// Loads `config.json` and `model.safetensors` (or the shards of
    /// `model.safetensors.index.json`) from a Hugging Face model directory. A value-head model
    /// takes `score.*` from the checkpoint when present and initialises it randomly otherwise.
    pub fn from_pretrained(dir: &Path, options: &ModelOptions) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let model = Self::build(config, options)?;
        let absent = weights::load_into(dir, &model.named_tensors(), is_value_head)?;
        model.init_matching(&mut Rng::new(options.seed), |name| {
            absent.iter().any(|a| a == name)
        })?;
        Ok(model)
    }

    /// Fills the selected parameters, in name order so that the result depends only on the seed.
    fn init_matching(&self, rng: &mut Rng, selected: impl Fn(&str) -> bool) -> Result<()> {
        let std = self.config.initializer_range;
        for (name, tensor) in self.named_tensors().iter().filter(|(n, _)| selected(n)) {
            let source = if name.ends_with("norm.weight") {
                tensor.ones_like()
            } else if name.ends_with(".bias") {
                tensor.zeros_like()
            } else {
                let values: Vec<f32> = (0..tensor.numel())
                    .map(|_| (rng.normal() * std) as f32)
                    .collect();
                Tensor::from_slice(&values).view(tensor.size().as_slice())
            };
            weights::assign(tensor, &source)?;
        }
        Ok(())
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The deterministic mode (verl's `trainer.deterministic`): when on, every forward pass and
    /// `generate` call built afterwards runs batch-invariant kernels, so a sequence's logits,
    /// log-probs and greedy tokens are bit-identical whatever else is in its batch, however it
    /// is padded or packed, and a KV-cache decode step equals the full forward pass at that
    /// position (see the `invariant` module). Off (the default): libtorch's fastest kernels.
    pub fn set_batch_invariant(&self, on: bool) {
        self.invariant.store(on, Ordering::Relaxed);
    }

    /// Whether the deterministic mode is on.
    pub fn batch_invariant(&self) -> bool {
        self.invariant.load(Ordering::Relaxed)
    }

    pub fn device(&self) -> Device {
        self.vs.device()
    }

    /// The parameter dtype.
    pub fn kind(&self) -> Kind {
        self.embed_tokens.kind()
    }

    pub fn head(&self) -> Head {
        match self.head {
            OutputHead::Lm(_) => Head::Lm,
            OutputHead::Value(_) => Head::Value,
        }
    }

    /// Sets `requires_grad` on every parameter (off for a reference model that never trains).
    pub fn set_trainable(&mut self, trainable: bool) {
        if trainable {
            self.vs.unfreeze()
        } else {
            self.vs.freeze()
        }
    }

    /// Every parameter under its Hugging Face name, sorted by name. The tensors share storage with
    /// the model. A tied model has no `lm_head.weight`, exactly like its HF checkpoint.
    pub fn named_tensors(&self) -> Vec<(String, Tensor)> {
        let mut named: Vec<(String, Tensor)> = self.vs.variables().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        named
    }

    /// Overwrites every parameter from a directory of safetensors files (`model.safetensors`, or
    /// the shards of `model.safetensors.index.json`): a weight update handed over on disk.
    pub fn load_weights_dir(&self, dir: &Path) -> Result<()> {
        weights::load_into(dir, &self.named_tensors(), |_| false).map(drop)
    }

    /// Overwrites parameters from named tensors (weight sync from a trainer). Names must exist in
    /// this model with the same shapes; a subset is fine.
    pub fn load_named_tensors(&self, tensors: &[(String, Tensor)]) -> Result<()> {
        weights::copy_named(&self.vs.variables(), tensors)
    }

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
    pub(crate) fn values_from_hidden(&self, hidden: &Tensor) -> Result<Tensor> {
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

    /// [`Self::logits`] inside a `generate` call, through the decode weights on CPU.
    fn decode_logits(&self, hidden: &Tensor, weights: Option<&DecodeWeights>) -> Result<Tensor> {
        match weights.and_then(|w| w.lm_head.as_ref()) {
            Some(head) => Ok(head.forward(hidden).to_kind(Kind::Float)),
            None => self.logits(hidden),
        }
    }

    /// The decode weights for a `generate` call (CPU only), rebuilt if a parameter they copy has
    /// been written since they were made.
    fn decode_weights(&self) -> Option<DecodeWeights> {
        // Sparse layers and query/key norms have no fused decode form: such models decode with
        // the tensor ops of the training forward, and so does the deterministic mode.
        if self.device() != Device::Cpu
            || self.config.moe.is_some()
            || self.config.qk_norm
            || self.batch_invariant()
        {
            return None;
        }
        let projections = self
            .layers
            .iter()
            .map(DecoderLayer::projections)
            .collect::<Option<Vec<_>>>()?
            .into_iter()
            .flatten();
        let sources: Vec<(usize, i64)> = projections
            .flat_map(Linear::parameters)
            .chain(self.lm_head().ok())
            .map(|t| (t.data_ptr() as usize, t.internal_version()))
            .collect();
        let mut cached = self
            .decode_weights
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if cached.as_ref().is_none_or(|w| w.sources != sources) {
            *cached = None; // free the stale copy before making the new one
            *cached = Some(tch::no_grad(|| DecodeWeights {
                sources,
                layers: self
                    .layers
                    .iter()
                    .filter_map(DecoderLayer::decode_weights)
                    .collect(),
                lm_head: self.lm_head().ok().map(DecodeLinear::from_embedding),
            }));
        }
        cached.as_ref().map(DecodeWeights::shallow_clone)
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
    pub(crate) fn row_wise(&self, x: &Tensor, f: impl Fn(&Tensor) -> Tensor) -> Tensor {
        if self.batch_invariant() {
            invariant::rows(x, f)
        } else {
            f(x)
        }
    }

    /// Validates `[B, T]` int64 token ids within the vocabulary and a matching mask.
    pub(crate) fn check_batch(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Result<()> {
        check_batch(input_ids, attention_mask, self.config.vocab_size)
    }

    /// Rotary tables and the attention mask for the last `t` tokens of the sequences that
    /// `attention_mask` (`[B, S]`) describes.
    fn context(&self, attention_mask: &Tensor, t: i64) -> Context {
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
    fn routed_experts(&self, context: &Context, batch: i64, tokens: i64) -> Option<Tensor> {
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

    /// Whether passes over this model can share prompts among rows
    /// ([`Self::prompt_sharing_block_context`]): a dense model outside the deterministic mode.
    pub fn shares_prompts(&self) -> bool {
        self.sparse_layers() == 0 && !self.batch_invariant()
    }

    /// The number of sparse (mixture-of-experts) layers.
    pub fn sparse_layers(&self) -> i64 {
        self.layers
            .iter()
            .filter(|l| matches!(l.mlp, Ffn::Sparse(_)))
            .count() as i64
    }

    fn embed(&self, input_ids: &Tensor) -> Tensor {
        Tensor::embedding(&self.embed_tokens, input_ids, -1, false, false)
    }

    /// Runs the decoder on `input_ids` `[B, T]` and returns the final hidden states. With a
    /// cache, the tokens follow the cached prefix and their keys/values are appended.
    fn run(
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
    fn layer_in(&self, layer: usize, x: &Tensor, context: &BlockContext) -> Tensor {
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

    /// `router_aux_loss_coef` when the config puts the load-balancing loss into the training
    /// loss (`output_router_logits`, as transformers' mixture-of-experts models add it).
    pub fn router_aux_loss_coef(&self) -> Option<f64> {
        let moe = self.config.moe.as_ref()?;
        moe.output_router_logits.then_some(moe.router_aux_loss_coef)
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

/// Why a model does not share prompts among rows (see [`CausalLM::shares_prompts`]).
pub const NOT_SHARING_PROMPTS: &str = "prompts are not shared by a mixture-of-experts model (its routing and load-balancing loss cover every row's tokens) nor in the deterministic mode (trainer.deterministic), whose kernels tile each row whole";

/// What the blocks of one forward pass share: the batch's token ids, rotary tables and attention
/// mask (see [`CausalLM::block_context`]).
pub struct BlockContext {
    context: Context,
    input_ids: Tensor,
    /// The batch's `[B, S]` ids, whose response tokens the head scores.
    pub(crate) batch_ids: Tensor,
    pub(crate) layout: Layout,
    /// Set by [`Self::score_predictors_only`]: the last layer's tokens.
    pub(crate) tail: Option<Tail>,
}

/// Some of a pass's tokens: the columns `start .. start + len` of every row (padded), or slots
/// `[T']` of the packed stream, increasing.
pub(crate) enum Select {
    Columns { start: i64, len: i64 },
    Slots(Tensor),
}

impl Select {
    /// The selected tokens of `x` `[B, T, ..]` (dimension 1).
    fn apply(&self, x: &Tensor) -> Tensor {
        match self {
            Self::Columns { start, len } => x.narrow(1, *start, *len),
            Self::Slots(slots) => x.index_select(1, slots),
        }
    }
}

/// The tokens the last decoder layer computes, and their rotary tables and mask over all the
/// pass's keys (see [`BlockContext::score_predictors_only`]).
pub(crate) struct Tail {
    select: Select,
    context: Context,
}

/// How a batch's rows are laid out for the blocks.
pub(crate) enum Layout {
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
                crate::logprobs::check_response_len(seq, response_len)?;
                let (start, len) = (seq - response_len - 1, response_len);
                (
                    Select::Columns { start, len },
                    Attend::Mask(attend.narrow(2, start, len)),
                )
            }
            (Layout::Packed(packing), Attend::Segments(_)) => {
                crate::logprobs::check_packed_response_len(packing, response_len)?;
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

/// RoPE frequencies `[head_dim / 2]` in fp32, computed as transformers computes them.
fn inv_freq(c: &ModelConfig, device: Device) -> Tensor {
    let half =
        Tensor::arange_start_step(0, c.head_dim, 2, (Kind::Int64, device)).to_kind(Kind::Float);
    let inv_freq = Tensor::pow_scalar(c.rope_theta, &(half / c.head_dim as f64)).reciprocal();
    match c.rope_scaling {
        None => inv_freq,
        Some(RopeScaling::Linear { factor }) => inv_freq / factor,
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => {
            let context = original_max_position_embeddings as f64;
            let wavelen = inv_freq.reciprocal() * std::f64::consts::TAU;
            // Wavelengths longer than the original context are stretched by `factor`, shorter
            // than context / high_freq_factor kept, and the band between blended.
            let long = wavelen.gt(context / low_freq_factor);
            let scaled = (&inv_freq / factor).where_self(&long, &inv_freq);
            let smooth = (wavelen.reciprocal() * context - low_freq_factor)
                / (high_freq_factor - low_freq_factor);
            let blended = (smooth.neg() + 1.0) * &scaled / factor + &smooth * &scaled;
            let medium = wavelen
                .ge(context / high_freq_factor)
                .logical_and(&long.logical_not());
            blended.where_self(&medium, &scaled)
        }
    }
}

fn is_value_head(name: &str) -> bool {
    name.strip_prefix(VALUE_HEAD)
        .is_some_and(|rest| rest.starts_with('.'))
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
