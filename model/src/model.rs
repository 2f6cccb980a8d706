//! The Llama/Qwen2 decoder on a `tch::nn::VarStore` whose variable names are the Hugging Face
//! parameter names (`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`, …), so that
//! loading and saving safetensors is a name lookup.

use std::path::Path;

use tch::{Device, Kind, Tensor, nn};

use crate::config::{ModelConfig, RopeScaling};
use crate::error::{ModelError, Result};
use crate::rng::Rng;
use crate::weights;

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

    /// `x·Wᵀ + b`; with `transposed` (this layer's `Wᵀ`, contiguous) as `x·(Wᵀ) + b`.
    fn forward(&self, x: &Tensor, transposed: Option<&Tensor>) -> Tensor {
        match transposed {
            None => x.linear(&self.weight, self.bias.as_ref()),
            Some(wt) => {
                let y = x.matmul(wt);
                match &self.bias {
                    Some(b) => y + b,
                    None => y,
                }
            }
        }
    }

    fn transposed(&self) -> Tensor {
        self.weight.detach().tr().contiguous()
    }
}

/// One decoder layer's projection weights transposed to `[in, out]`, contiguous. For the few
/// rows of a decode step, MKL multiplies `x·W` about twice as fast as `x·Wᵀ` from the stored
/// `[out, in]` layout (measured on 8 rows: 256×8192 0.46 ms vs 1.1 ms, 256×768 20 µs vs 35 µs),
/// which is what `linear` and transformers do.
struct LayerWeights {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
}

impl LayerWeights {
    fn shallow_clone(&self) -> Self {
        Self {
            q: self.q.shallow_clone(),
            k: self.k.shallow_clone(),
            v: self.v.shallow_clone(),
            o: self.o.shallow_clone(),
            gate: self.gate.shallow_clone(),
            up: self.up.shallow_clone(),
            down: self.down.shallow_clone(),
        }
    }
}

/// The whole model's transposed weights, held by a [`KvCache`] for one `generate` call (the
/// weights may change between calls): one extra copy of the weights for that long.
struct DecodeWeights {
    layers: Vec<LayerWeights>,
    /// `None` for a value-head model.
    lm_head: Option<Tensor>,
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
}

/// Rotary embedding tables for one forward pass: `[B, 1, T, head_dim]` each.
struct Rope {
    cos: Tensor,
    /// `[-sin, sin]` over the two halves: `rotate_half(x) * [sin, sin] = roll(x) * [-sin, sin]`.
    signed_sin: Tensor,
}

impl Rope {
    /// transformers' default RoPE: `inv_freq` and the angles in fp32, halves duplicated.
    fn new(inv_freq: &Tensor, positions: &Tensor, kind: Kind) -> Self {
        let freqs = (positions.to_kind(Kind::Float).unsqueeze(-1) * inv_freq).unsqueeze(1);
        let (cos, sin) = (freqs.cos().to_kind(kind), freqs.sin().to_kind(kind));
        Self {
            cos: Tensor::cat(&[&cos, &cos], -1),
            signed_sin: Tensor::cat(&[sin.neg(), sin], -1),
        }
    }

    /// `x * cos + rotate_half(x) * sin` with `rotate_half([a, b]) = [-b, a]`, as transformers,
    /// computed as `x * cos + roll(x, half) * [-sin, sin]`: bit-identical (negation is exact), one
    /// kernel instead of three for the rotation.
    fn apply(&self, x: &Tensor) -> Tensor {
        let half = x.size()[x.dim() - 1] / 2;
        x * &self.cos + x.roll([half], [-1]) * &self.signed_sin
    }
}

/// Pre-allocated key/value buffers, `[B, kv_heads, capacity, head_dim]` per layer, and on CPU
/// the transposed weights the decode steps multiply with.
pub(crate) struct KvCache {
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
    len: i64,
    /// CPU only: cuBLAS has no such penalty for the transposed layout, and GPU memory is scarcer.
    weights: Option<DecodeWeights>,
}

impl KvCache {
    pub(crate) fn new(model: &CausalLM, batch: i64, capacity: i64) -> Self {
        let c = &model.config;
        let shape = [batch, c.num_key_value_heads, capacity, c.head_dim];
        let options = (model.kind(), model.device());
        let layers = c.num_hidden_layers as usize;
        let weights = (model.device() == Device::Cpu).then(|| DecodeWeights {
            layers: model.layers.iter().map(DecoderLayer::transposed).collect(),
            lm_head: model.lm_head().ok().map(|w| w.detach().tr().contiguous()),
        });
        Self {
            keys: (0..layers).map(|_| Tensor::zeros(shape, options)).collect(),
            values: (0..layers).map(|_| Tensor::zeros(shape, options)).collect(),
            len: 0,
            weights,
        }
    }

    fn layer_weights(&self, layer: usize) -> Option<LayerWeights> {
        self.weights
            .as_ref()
            .map(|w| w.layers[layer].shallow_clone())
    }

    /// Duplicates each sequence `n` times in place (`n` samples share one prompt prefill).
    pub(crate) fn repeat_interleave(&mut self, n: i64) {
        for t in self.keys.iter_mut().chain(self.values.iter_mut()) {
            *t = t.repeat_interleave_self_int(n, 0, None);
        }
    }

    /// Appends this step's keys/values of `layer` and returns everything cached so far.
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

struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
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
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: d,
        }
    }

    /// `mask`: `[B, 1, T, S]`, true where a query may attend a key.
    fn forward(
        &self,
        x: &Tensor,
        rope: &Rope,
        mask: &Tensor,
        cache: Option<(&mut KvCache, usize)>,
        weights: Option<&LayerWeights>,
    ) -> Tensor {
        let (b, t, _) = x.size3().expect("hidden states are [B, T, H]");
        let split = |y: Tensor, heads: i64| y.view([b, t, heads, self.head_dim]).transpose(1, 2);
        let q = rope.apply(&split(
            self.q_proj.forward(x, weights.map(|w| &w.q)),
            self.heads,
        ));
        let k = rope.apply(&split(
            self.k_proj.forward(x, weights.map(|w| &w.k)),
            self.kv_heads,
        ));
        let v = split(self.v_proj.forward(x, weights.map(|w| &w.v)), self.kv_heads);
        let (k, v) = match cache {
            Some((cache, layer)) => cache.append(layer, &k, &v),
            None => (k, v),
        };
        // Grouped-query attention: each key/value head serves `heads / kv_heads` query heads.
        let groups = self.heads / self.kv_heads;
        let (k, v) = if groups > 1 {
            (
                k.repeat_interleave_self_int(groups, 1, None),
                v.repeat_interleave_self_int(groups, 1, None),
            )
        } else {
            (k, v)
        };
        let scale = (self.head_dim as f64).powf(-0.5);
        let out =
            Tensor::scaled_dot_product_attention(&q, &k, &v, Some(mask), 0.0, false, scale, false);
        self.o_proj.forward(
            &out.transpose(1, 2)
                .reshape([b, t, self.heads * self.head_dim]),
            weights.map(|w| &w.o),
        )
    }
}

struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    fn new(path: nn::Path, c: &ModelConfig) -> Self {
        let (h, i) = (c.hidden_size, c.intermediate_size);
        Self {
            gate_proj: Linear::new(&path / "gate_proj", h, i, c.mlp_bias),
            up_proj: Linear::new(&path / "up_proj", h, i, c.mlp_bias),
            down_proj: Linear::new(&path / "down_proj", i, h, c.mlp_bias),
        }
    }

    /// SwiGLU: `down(silu(gate(x)) * up(x))`.
    fn forward(&self, x: &Tensor, weights: Option<&LayerWeights>) -> Tensor {
        let gate = self.gate_proj.forward(x, weights.map(|w| &w.gate)).silu();
        let up = self.up_proj.forward(x, weights.map(|w| &w.up));
        self.down_proj
            .forward(&(gate * up), weights.map(|w| &w.down))
    }
}

struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

impl DecoderLayer {
    fn new(path: nn::Path, c: &ModelConfig) -> Self {
        Self {
            input_layernorm: RmsNorm::new(&path / "input_layernorm", c.hidden_size, c.rms_norm_eps),
            self_attn: Attention::new(&path / "self_attn", c),
            post_attention_layernorm: RmsNorm::new(
                &path / "post_attention_layernorm",
                c.hidden_size,
                c.rms_norm_eps,
            ),
            mlp: Mlp::new(&path / "mlp", c),
        }
    }

    fn forward(
        &self,
        x: &Tensor,
        rope: &Rope,
        mask: &Tensor,
        cache: Option<(&mut KvCache, usize)>,
    ) -> Tensor {
        let weights = cache
            .as_ref()
            .and_then(|(c, layer)| c.layer_weights(*layer));
        let x = x + self.self_attn.forward(
            &self.input_layernorm.forward(x),
            rope,
            mask,
            cache,
            weights.as_ref(),
        );
        &x + self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&x), weights.as_ref())
    }

    fn transposed(&self) -> LayerWeights {
        let (a, m) = (&self.self_attn, &self.mlp);
        LayerWeights {
            q: a.q_proj.transposed(),
            k: a.k_proj.transposed(),
            v: a.v_proj.transposed(),
            o: a.o_proj.transposed(),
            gate: m.gate_proj.transposed(),
            up: m.up_proj.transposed(),
            down: m.down_proj.transposed(),
        }
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
    /// The model with all parameters zero (norms one) in the requested dtype; callers fill them.
    fn build(config: ModelConfig, options: &ModelOptions) -> Self {
        let mut vs = nn::VarStore::new(options.device);
        let root = vs.root();
        let model = &root / "model";
        let c = &config;
        let embed_tokens =
            (&model / "embed_tokens").zeros("weight", &[c.vocab_size, c.hidden_size]);
        let layers = (0..c.num_hidden_layers)
            .map(|i| DecoderLayer::new(&model / "layers" / i, c))
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
        Self {
            config,
            vs,
            embed_tokens,
            layers,
            norm,
            head,
            inv_freq,
        }
    }

    /// Random initialisation as transformers does it: weights `N(0, initializer_range)`, biases
    /// zero, norms one. Same config + seed → same weights, on any thread.
    pub fn random(config: ModelConfig, options: &ModelOptions) -> Result<Self> {
        let model = Self::build(config, options);
        model.init_matching(&mut Rng::new(options.seed), |_| true)?;
        Ok(model)
    }

    /// Loads `config.json` and `model.safetensors` (or the shards of
    /// `model.safetensors.index.json`) from a Hugging Face model directory. A value-head model
    /// takes `score.*` from the checkpoint when present and initialises it randomly otherwise.
    pub fn from_pretrained(dir: &Path, options: &ModelOptions) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let model = Self::build(config, options);
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
        Ok(self.run(&input_ids.to_device(self.device()), &mask, None))
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
                .forward(hidden, None)
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

    /// [`Self::logits`] inside a `generate` call, with the cache's transposed LM head on CPU.
    pub(crate) fn decode_logits(&self, hidden: &Tensor, cache: &KvCache) -> Result<Tensor> {
        match cache.weights.as_ref().and_then(|w| w.lm_head.as_ref()) {
            Some(wt) => Ok(hidden.matmul(wt).to_kind(Kind::Float)),
            None => self.logits(hidden),
        }
    }

    /// LM-head logits in fp32 for hidden states of any leading shape.
    pub(crate) fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(hidden
            .linear(self.lm_head()?, None::<&Tensor>)
            .to_kind(Kind::Float))
    }

    /// Validates `[B, T]` int64 token ids within the vocabulary and a matching mask.
    pub(crate) fn check_batch(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Result<()> {
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
            if lo < 0 || hi >= self.config.vocab_size {
                return Err(ModelError::invalid_input(
                    "input_ids",
                    format!(
                        "ids must lie in [0, {}), found {lo}..={hi}",
                        self.config.vocab_size
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Rotary tables and the attention mask for the last `t` tokens of the sequences that
    /// `attention_mask` (`[B, S]`) describes.
    fn context(&self, attention_mask: &Tensor, t: i64) -> (Rope, Tensor) {
        let (b, s) = attention_mask.size2().expect("checked [B, S]");
        let device = self.device();
        let valid = attention_mask.to_kind(Kind::Bool);
        // Real-token positions: padding on either side does not shift them.
        let positions = (valid.cumsum(-1, Kind::Int64) - 1)
            .clamp_min(0)
            .narrow(1, s - t, t);
        let rope = Rope::new(&self.inv_freq, &positions, self.kind());
        // Causal and padding mask, [B, 1, T, S]. The diagonal stays open so that a padding query
        // (whose output is never used) has one key and its softmax stays finite.
        let query = Tensor::arange_start(s - t, s, (Kind::Int64, device)).view([t, 1]);
        let key = Tensor::arange(s, (Kind::Int64, device)).view([1, s]);
        let mask = key
            .le_tensor(&query)
            .logical_and(&valid.view([b, 1, 1, s]))
            .logical_or(&key.eq_tensor(&query));
        (rope, mask)
    }

    fn embed(&self, input_ids: &Tensor) -> Tensor {
        Tensor::embedding(&self.embed_tokens, input_ids, -1, false, false)
    }

    /// Runs the decoder on the last `T = input_ids.size()[1]` tokens of `attention_mask`'s
    /// sequence (all of them without a cache; the new ones after the cached prefix with one).
    pub(crate) fn run(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        mut cache: Option<&mut KvCache>,
    ) -> Tensor {
        let t = input_ids.size()[1];
        let (rope, mask) = self.context(attention_mask, t);
        let mut x = self.embed(input_ids);
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(&x, &rope, &mask, cache.as_deref_mut().map(|c| (c, i)));
        }
        if let Some(cache) = cache {
            cache.len += t;
        }
        self.norm.forward(&x)
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
        self.check_batch(input_ids, attention_mask)?;
        let ids = input_ids.to_device(self.device());
        let (rope, mask) = self.context(&attention_mask.to_device(self.device()), ids.size()[1]);
        let inputs = tch::no_grad(|| {
            let mut inputs = vec![self.embed(&ids)];
            for layer in &self.layers {
                let next = layer.forward(
                    inputs.last().expect("starts with the embedding"),
                    &rope,
                    &mask,
                    None,
                );
                inputs.push(next);
            }
            inputs
        });
        // Backward through the head, then through each layer from its saved input: the gradient of
        // sum(output · g) with respect to the layer's input and parameters is the chain rule's step.
        let last = inputs
            .last()
            .expect("starts with the embedding")
            .detach()
            .set_requires_grad(true);
        let loss = loss_fn(&self.norm.forward(&last))?;
        loss.f_backward()?;
        let mut grad = last.grad();
        for (layer, input) in self.layers.iter().zip(&inputs).rev() {
            if !grad.defined() {
                return Ok(loss.detach()); // the loss does not depend on earlier layers
            }
            let x = input.detach().set_requires_grad(true);
            (layer.forward(&x, &rope, &mask, None) * &grad)
                .sum(Kind::Float)
                .f_backward()?;
            grad = x.grad();
        }
        if grad.defined() {
            (self.embed(&ids) * grad).sum(Kind::Float).f_backward()?;
        }
        Ok(loss.detach())
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
