//! The Llama/Qwen2 decoder on a `tch::nn::VarStore` whose variable names are the Hugging Face
//! parameter names (`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`, …), so that
//! loading and saving safetensors is a name lookup.
//!
//! [`CausalLM`]'s methods, by what they do: building, loading and saving here; forward passes
//! (whole, by blocks, tensor-parallel halves, checkpointed backward) in [`forward`]; the scores of
//! a batch's responses (log-probs, entropy, values, top-k) in [`scoring`]; generation in
//! [`crate::generate`].

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use tch::{Device, Kind, Tensor, nn};

use verl_plugin_api::TensorRef;

use crate::config::{ModelConfig, RopeScaling};
use crate::error::{ModelError, Result, write_json};
use crate::interop;
use crate::rng::Rng;
use crate::weights::{self, SINGLE_FILE, write_safetensors};

mod cpu_step;
mod forward;
mod invariant;
mod moe;
mod packed;
mod scoring;

use cpu_step::StepBuffers;
pub use forward::{BlockContext, NOT_SHARING_PROMPTS, TensorParallel};
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
    /// `model`'s decode weights for a `generate` call (CPU only), rebuilt if a parameter they copy has
    /// been written since they were made.
    fn of(model: &CausalLM) -> Option<Self> {
        // Sparse layers and query/key norms have no fused decode form: such models decode with
        // the tensor ops of the training forward, and so does the deterministic mode.
        if model.device() != Device::Cpu
            || model.config.moe.is_some()
            || model.config.qk_norm
            || model.batch_invariant()
        {
            return None;
        }
        let projections = model
            .layers
            .iter()
            .map(DecoderLayer::projections)
            .collect::<Option<Vec<_>>>()?
            .into_iter()
            .flatten();
        let sources: Vec<(usize, i64)> = projections
            .flat_map(Linear::parameters)
            .chain(model.lm_head().ok())
            .map(|t| (t.data_ptr() as usize, t.internal_version()))
            .collect();
        let mut cached = model
            .decode_weights
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if cached.as_ref().is_none_or(|w| w.sources != sources) {
            *cached = None; // free the stale copy before making the new one
            *cached = Some(tch::no_grad(|| Self {
                sources,
                layers: model
                    .layers
                    .iter()
                    .filter_map(DecoderLayer::decode_weights)
                    .collect(),
                lm_head: model.lm_head().ok().map(DecodeLinear::from_embedding),
            }));
        }
        cached.as_ref().map(Self::shallow_clone)
    }

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
    /// [`CausalLM::logits`] inside a `generate` call, through the decode weights on CPU.
    fn logits(
        model: &CausalLM,
        hidden: &Tensor,
        weights: Option<&DecodeWeights>,
    ) -> Result<Tensor> {
        match weights.and_then(|w| w.lm_head.as_ref()) {
            Some(head) => Ok(head.forward(hidden).to_kind(Kind::Float)),
            None => model.logits(hidden),
        }
    }

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
            DecodePath::Kernels | DecodePath::Fused => DecodeWeights::of(model),
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
        let logits = Self::logits(model, &hidden.select(1, width - 1), weights.as_ref())?;
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
            return Ok(buffers.step(model, tokens, cache, weights));
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
        Self::logits(model, &hidden.squeeze_dim(1), self.weights.as_ref())
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

    /// Copies borrowed weights into the same-named parameters: one copy per tensor, straight
    /// from the lender's memory (the views are wrapped, not copied, on the way). Returns the bytes
    /// copied.
    pub fn load_views(&self, views: &[TensorRef<'_>]) -> Result<usize> {
        let wrapped = views
            .iter()
            .map(|view| {
                let name = view.name.as_str();
                let kind = interop::kind_of(view.dtype).ok_or_else(|| ModelError::Tensor {
                    tensor: name.to_owned(),
                    reason: format!("unknown dtype code {}", view.dtype.0),
                })?;
                // `TensorRef::new` checked the length; a peer could still hand a bad one.
                let numel: i64 = view.shape.iter().product();
                if view.shape.iter().any(|&d| d < 0)
                    || numel as usize * kind.elt_size_in_bytes() != view.data.len()
                {
                    return Err(ModelError::Tensor {
                        tensor: name.to_owned(),
                        reason: format!(
                            "shape {:?} does not match {} bytes",
                            view.shape.as_slice(),
                            view.data.len()
                        ),
                    });
                }
                // SAFETY: the blob aliases `view.data`, which outlives this function; the tensor is
                // only read (copied from) and dropped before returning.
                let tensor = unsafe {
                    Tensor::f_from_blob(
                        view.data.as_ptr(),
                        view.shape.as_slice(),
                        &[],
                        kind,
                        Device::Cpu,
                    )
                }?;
                Ok((name.to_owned(), tensor))
            })
            .collect::<Result<Vec<_>>>()?;
        self.load_named_tensors(&wrapped)?;
        Ok(views.iter().map(|v| v.data.len()).sum())
    }

    /// Writes `config.json` and `model.safetensors` (fp32 or the model's dtype, HF names) into
    /// `dir`, creating it, and copies the tokenizer and generation files from `companions_from`.
    /// A value-head model is written as `*ForTokenClassification` with one label, as verl's critic.
    pub fn save_pretrained(&self, dir: &Path, companions_from: Option<&Path>) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
        let mut config = self.config().to_hf_json();
        config["torch_dtype"] = serde_json::json!(dtype_name(self.kind()));
        if self.head() == Head::Value {
            config["architectures"] =
                serde_json::json!([self.config().architecture.value_head_class()]);
            config["num_labels"] = serde_json::json!(1);
        }
        write_json(&dir.join("config.json"), &config)?;
        write_safetensors(&dir.join(SINGLE_FILE), &self.named_tensors())?;
        if let Some(source) = companions_from {
            for name in COMPANION_FILES {
                let from = source.join(name);
                if from.exists() {
                    std::fs::copy(&from, dir.join(name)).map_err(|e| ModelError::io(&from, e))?;
                }
            }
        }
        Ok(())
    }

    /// Every parameter under its Hugging Face name, sorted by name. The tensors share storage with
    /// the model. A tied model has no `lm_head.weight`, exactly like its HF checkpoint.
    pub fn named_tensors(&self) -> Vec<(String, Tensor)> {
        let mut named: Vec<(String, Tensor)> = self.vs.variables().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        named
    }

    /// Sets `requires_grad` on every parameter (off for a reference model that never trains).
    pub fn set_trainable(&mut self, trainable: bool) {
        if trainable {
            self.vs.unfreeze()
        } else {
            self.vs.freeze()
        }
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

    /// `router_aux_loss_coef` when the config puts the load-balancing loss into the training
    /// loss (`output_router_logits`, as transformers' mixture-of-experts models add it).
    pub fn router_aux_loss_coef(&self) -> Option<f64> {
        let moe = self.config.moe.as_ref()?;
        moe.output_router_logits.then_some(moe.router_aux_loss_coef)
    }
}

/// Files besides the weights and config that make a model directory usable, copied when present.
const COMPANION_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
];

fn dtype_name(kind: tch::Kind) -> &'static str {
    match kind {
        tch::Kind::BFloat16 => "bfloat16",
        tch::Kind::Half => "float16",
        _ => "float32",
    }
}

/// Some of a pass's tokens: the columns `start .. start + len` of every row (padded), or slots
/// `[T']` of the packed stream, increasing.
enum Select {
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
struct Tail {
    select: Select,
    context: Context,
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
