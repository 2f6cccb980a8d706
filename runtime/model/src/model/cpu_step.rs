//! The decode step of an fp32 model on CPU. The four projections of a layer and the LM head go to
//! MKL through libtorch (`mm_out` into buffers allocated once per `generate` call); everything
//! between them — RMSNorm, RoPE, the KV-cache append, attention of one query over the cache,
//! SwiGLU's product, biases and residuals — runs as plain loops over those buffers.
//!
//! Why: at decode sizes (`[rows, hidden]` with a handful of rows) the cost of a libtorch call,
//! not its arithmetic, dominated. The tensor-op step makes about 50 calls per layer; between the
//! weight-streaming matrix products their code and data are cold, so each cost 5–10 µs (an
//! RMSNorm of 8 × 256 values took 25–55 µs, attention of one query over 100 cached keys 80–120
//! µs). This step makes six calls per layer. The results agree with the tensor-op step to fp32
//! rounding (checked by the tests below and by the transformers parity fixtures).

use tch::{Kind, Tensor};

use super::{CausalLM, DecodeLinear, DecodeWeights, KvCache, RmsNorm};
use crate::interop::{floats, floats_mut};
use crate::kernels::{self, add};

/// Work buffers of one `generate` call's decode steps, fp32 and contiguous, reused by every step
/// and layer. Tensors, so that the matrix products write into them.
pub(super) struct StepBuffers {
    /// The residual stream, `[rows, hidden]`.
    x: Tensor,
    /// Normalised `x`, the input of the next projection.
    normed: Tensor,
    /// `[rows, (heads + 2·kv_heads)·head_dim]`.
    qkv: Tensor,
    /// Attention output, `[rows, heads·head_dim]`.
    attn: Tensor,
    /// Output of the o and down projections, `[rows, hidden]`.
    proj: Tensor,
    /// `[rows, 2·intermediate]`.
    gate_up: Tensor,
    /// `silu(gate)·up`, `[rows, intermediate]`.
    act: Tensor,
    /// `[rows, vocab]`.
    logits: Tensor,
    /// Each row's next position, advanced here (the cache's `next_positions` tensor serves the
    /// tensor-op step and stays at the prefill's values on this path).
    positions: Vec<i64>,
    /// Each row's first cached position that is not prompt padding: attention starts there,
    /// as the positions before it (masked, `e^-inf = 0`) add exactly nothing.
    first_real: Vec<usize>,
    /// Attention scores of one head, `[capacity]`.
    scores: Vec<f32>,
}

impl StepBuffers {
    /// Buffers for `cache`'s rows, starting at its next positions.
    pub(super) fn new(model: &CausalLM, cache: &KvCache) -> Self {
        let c = &model.config;
        let rows = cache.next_positions.size()[0];
        let buffer = |width: i64| Tensor::zeros([rows, width], (Kind::Float, model.device()));
        let heads = c.num_attention_heads + 2 * c.num_key_value_heads;
        Self {
            x: buffer(c.hidden_size),
            normed: buffer(c.hidden_size),
            qkv: buffer(heads * c.head_dim),
            attn: buffer(c.num_attention_heads * c.head_dim),
            proj: buffer(c.hidden_size),
            gate_up: buffer(2 * c.intermediate_size),
            act: buffer(c.intermediate_size),
            logits: buffer(c.vocab_size),
            positions: Vec::<i64>::try_from(cache.next_positions.reshape([-1]))
                .expect("int64 positions"),
            first_real: first_real(cache),
            scores: vec![0.0; cache.keys[0].size()[2] as usize],
        }
    }

    /// One decode step of `model` for `tokens` (one per row); returns the logits `[rows,
    /// vocab]`, a view of a buffer that the next step overwrites.
    pub(super) fn step(
        &mut self,
        model: &CausalLM,
        tokens: &[i64],
        cache: &mut KvCache,
        weights: &DecodeWeights,
    ) -> Tensor {
        let c = &model.config;
        let (hidden, head_dim) = (c.hidden_size as usize, c.head_dim as usize);
        // SAFETY (every `floats` below): the buffers, cache and weights are distinct contiguous
        // fp32 CPU tensors, and each slice ends before libtorch touches its tensor again.
        unsafe {
            let embed = floats(&model.embed_tokens);
            for (row, &token) in floats_mut(&mut self.x).chunks_exact_mut(hidden).zip(tokens) {
                row.copy_from_slice(&embed[token as usize * hidden..][..hidden]);
            }
        }
        let geometry = Geometry {
            heads: c.num_attention_heads as usize,
            kv_heads: c.num_key_value_heads as usize,
            head_dim,
            capacity: cache.keys[0].size()[2] as usize,
            len: cache.len as usize,
        };
        for ((layer, w), i) in model.layers.iter().zip(&weights.layers).zip(0..) {
            normalize(&layer.input_layernorm, &self.x, &mut self.normed);
            project(&w.qkv, &self.normed, &mut self.qkv);
            unsafe {
                let qkv = floats_mut(&mut self.qkv);
                rotate(qkv, &geometry, &self.positions, &cache.rope);
                attend(
                    qkv,
                    (
                        floats_mut(&mut cache.keys[i]),
                        floats_mut(&mut cache.values[i]),
                    ),
                    (floats(&cache.mask), &self.first_real),
                    &geometry,
                    &mut self.scores,
                    floats_mut(&mut self.attn),
                );
            }
            project(&w.o, &self.attn, &mut self.proj);
            unsafe { add(floats_mut(&mut self.x), floats(&self.proj)) };
            normalize(&layer.post_attention_layernorm, &self.x, &mut self.normed);
            project(&w.gate_up, &self.normed, &mut self.gate_up);
            let intermediate = c.intermediate_size as usize;
            unsafe {
                kernels::silu_mul(
                    floats(&self.gate_up),
                    intermediate,
                    floats_mut(&mut self.act),
                )
            };
            project(&w.down, &self.act, &mut self.proj);
            unsafe { add(floats_mut(&mut self.x), floats(&self.proj)) };
        }
        normalize(&model.norm, &self.x, &mut self.normed);
        let head = weights
            .lm_head
            .as_ref()
            .expect("generate checks for an LM head");
        project(head, &self.normed, &mut self.logits);
        cache.len += 1;
        for p in &mut self.positions {
            *p += 1;
        }
        self.logits.shallow_clone()
    }
}

/// Each row's first position whose mask is not -inf among those cached so far (`len` if none:
/// the step's own token is then the first).
fn first_real(cache: &KvCache) -> Vec<usize> {
    let capacity = cache.mask.size()[3] as usize;
    let len = cache.len as usize;
    // SAFETY: the mask is a contiguous fp32 CPU tensor, only read here.
    let mask = unsafe { floats(&cache.mask) };
    mask.chunks_exact(capacity)
        .map(|row| {
            row[..len]
                .iter()
                .position(|&m| m != f32::NEG_INFINITY)
                .unwrap_or(len)
        })
        .collect()
}

/// Attention shapes and the number of cached positions before this step.
struct Geometry {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    capacity: usize,
    len: usize,
}

/// `out = norm(x)` for `[rows, hidden]` buffers.
fn normalize(norm: &RmsNorm, x: &Tensor, out: &mut Tensor) {
    // SAFETY: distinct contiguous fp32 tensors, no other slice alive.
    unsafe {
        kernels::rms_norm(
            floats(x),
            floats(&norm.weight),
            norm.eps as f32,
            floats_mut(out),
        )
    };
}

/// `out = input · W (+ b)` through MKL.
fn project(linear: &DecodeLinear, input: &Tensor, out: &mut Tensor) {
    let _ = input.mm_out(out, &linear.weight);
    if let Some(bias) = &linear.bias {
        // SAFETY: distinct contiguous fp32 tensors, no other slice alive.
        let (out, bias) = unsafe { (floats_mut(out), floats(bias)) };
        for row in out.chunks_exact_mut(bias.len()) {
            add(row, bias);
        }
    }
}

/// RoPE on the query and key heads of every row of `qkv`, each row at its own position.
fn rotate(qkv: &mut [f32], g: &Geometry, positions: &[i64], table: &super::RopeTable) {
    let d = g.head_dim;
    let half = d / 2;
    // SAFETY: the tables are contiguous fp32 and only read.
    let (cos, signed_sin) = unsafe { (floats(&table.cos), floats(&table.signed_sin)) };
    let width = qkv.len() / positions.len();
    let mut original = vec![0f32; d];
    for (row, &position) in qkv.chunks_exact_mut(width).zip(positions) {
        let at = position as usize * d;
        let (cos, sin) = (&cos[at..at + d], &signed_sin[at..at + d]);
        for head in row[..(g.heads + g.kv_heads) * d].chunks_exact_mut(d) {
            original.copy_from_slice(head);
            // x·cos + roll(x, half)·[-sin, sin], as the tensor step computes it, a half at a time.
            let (low, high) = original.split_at(half);
            let (out_low, out_high) = head.split_at_mut(half);
            for i in 0..half {
                out_low[i] = low[i] * cos[i] + high[i] * sin[i];
                out_high[i] = high[i] * cos[half + i] + low[i] * sin[half + i];
            }
        }
    }
}

/// Appends every row's new key and value to the cache at position `len`, then attends its query
/// heads over positions `first_real[row]..=len` (additive mask: -inf at prompt padding).
fn attend(
    qkv: &[f32],
    (keys, values): (&mut [f32], &mut [f32]),
    (mask, first_real): (&[f32], &[usize]),
    g: &Geometry,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let (d, len) = (g.head_dim, g.len);
    let width = (g.heads + 2 * g.kv_heads) * d;
    let groups = g.heads / g.kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    let scores = &mut scores[..=len];
    for ((r, row), &first) in qkv.chunks_exact(width).enumerate().zip(first_real) {
        let mask = &mask[r * g.capacity..][first..=len];
        for kv_head in 0..g.kv_heads {
            // This head's positions of this row: `[capacity, d]`, contiguous.
            let start = (r * g.kv_heads + kv_head) * g.capacity * d;
            let keys = &mut keys[start..][..(len + 1) * d];
            let values = &mut values[start..][..(len + 1) * d];
            let new = (g.heads + kv_head) * d;
            keys[len * d..].copy_from_slice(&row[new..][..d]);
            values[len * d..].copy_from_slice(&row[new + g.kv_heads * d..][..d]);
            let attended = (&keys[first * d..], &values[first * d..]);
            for head in kv_head * groups..(kv_head + 1) * groups {
                let q = &row[head * d..][..d];
                let head_out = &mut out[(r * g.heads + head) * d..][..d];
                kernels::attend_head(q, attended, mask, scale, scores, head_out);
            }
        }
    }
}
