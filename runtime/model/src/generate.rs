//! Batched generation with a KV cache: prompts of different lengths are left-padded into one
//! batch, prefilled once, then decoded one token per step for all sequences together.

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::error::{ModelError, Result};
use crate::interop;
use crate::kernels;
use crate::model::{CausalLM, DecodePath, Decoder};
use crate::rng::Rng;

/// How to pick tokens. verl's rollout defaults: `n = 1, temperature = 1, top_p = 1, top_k = -1`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Samples per prompt.
    pub n: usize,
    pub max_new_tokens: usize,
    /// 0 selects greedy decoding (verl's `do_sample = false`).
    pub temperature: f64,
    /// Nucleus sampling: keep the most likely tokens whose probabilities sum to at least `top_p`.
    pub top_p: f64,
    /// Keep only the `top_k` most likely tokens; ≤ 0 keeps all.
    pub top_k: i64,
    /// Token ids that end a sequence besides the EOS ids (kept in the response, like EOS).
    pub stop_token_ids: Vec<i64>,
    /// Do not stop on the model's EOS ids (only on `stop_token_ids` and the length limit).
    pub ignore_eos: bool,
    pub seed: u64,
    /// One seed per prompt (empty: `seed` seeds the request): sample `k` of prompt `i` draws
    /// from stream `k` of `prompt_seeds[i]`, so a prompt's samples do not depend on the other
    /// prompts of the batch (a batch sharded over ranks samples what one rank would).
    pub prompt_seeds: Vec<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            n: 1,
            max_new_tokens: 16,
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            seed: 0,
            prompt_seeds: Vec::new(),
        }
    }
}

/// Why a sequence ended, with the names vLLM and SGLang report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// An EOS or stop token was generated (and is the last response token).
    Stop,
    /// `max_new_tokens` was reached.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
        }
    }
}

/// One generated sequence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    /// Index of the prompt this sample continues.
    pub prompt_index: usize,
    pub response_ids: Vec<i64>,
    /// Log-probability of each response token under the distribution it was drawn from before
    /// top-k/top-p filtering: `log_softmax(logits / temperature)` when sampling (what the trainer
    /// recomputes as old log-probs), `log_softmax(logits)` when greedy.
    pub logprobs: Vec<f32>,
    pub finish_reason: FinishReason,
    /// Mixture-of-experts models: the experts each token the model ran used (verl's
    /// `routed_experts`), `[prompt + response − 1 tokens][sparse layers][k]` flattened — every
    /// prompt token and every response token but the last, which is never fed back. Empty for a
    /// dense model.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub routed_experts: Vec<i64>,
}

impl SamplingParams {
    /// The generator of each of `rows` sampled rows (prompt by prompt, `n` each).
    fn row_rngs(&self, rows: usize) -> Vec<Rng> {
        (0..rows)
            .map(|r| match self.prompt_seeds.get(r / self.n) {
                Some(&seed) => Rng::stream(seed, (r % self.n) as u64),
                None => Rng::stream(self.seed, r as u64),
            })
            .collect()
    }

    fn validate(&self, vocab_size: i64, prompts: usize) -> Result<()> {
        let bad = |what: &str, reason: String| Err(ModelError::invalid_input(what, reason));
        if self.n == 0 {
            return bad("n", "must be at least 1".into());
        }
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad(
                "temperature",
                format!("must be ≥ 0, got {}", self.temperature),
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", format!("must lie in (0, 1], got {}", self.top_p));
        }
        if !self.prompt_seeds.is_empty() && self.prompt_seeds.len() != prompts {
            return bad(
                "prompt_seeds",
                format!(
                    "{} seeds for {prompts} prompts (one per prompt, or none)",
                    self.prompt_seeds.len()
                ),
            );
        }
        if let Some(id) = self
            .stop_token_ids
            .iter()
            .find(|&&id| id < 0 || id >= vocab_size)
        {
            return bad(
                "stop_token_ids",
                format!("{id} is outside the vocabulary [0, {vocab_size})"),
            );
        }
        Ok(())
    }
}

impl CausalLM {
    /// Continues every prompt `params.n` times. Results come prompt by prompt, the samples of a
    /// prompt together (verl's `repeat_interleave` order). Same inputs and seed → same outputs.
    pub fn generate(
        &self,
        prompts: &[Vec<i64>],
        params: &SamplingParams,
        eos_token_ids: &[i64],
    ) -> Result<Vec<Completion>> {
        self.lm_head()?;
        let vocab = self.config().vocab_size;
        params.validate(vocab, prompts.len())?;
        for (i, prompt) in prompts.iter().enumerate() {
            if prompt.is_empty() || prompt.iter().any(|&id| id < 0 || id >= vocab) {
                return Err(ModelError::invalid_input(
                    &format!("prompts[{i}]"),
                    format!("must be non-empty with ids in [0, {vocab})"),
                ));
            }
        }
        self.check_size(prompts, params)?;
        if prompts.is_empty() || params.max_new_tokens == 0 {
            return Ok(prompts
                .iter()
                .enumerate()
                .flat_map(|(i, _)| (0..params.n).map(move |_| Completion::empty(i)))
                .collect());
        }
        let mut stops: Vec<i64> = params.stop_token_ids.clone();
        if !params.ignore_eos {
            stops.extend_from_slice(eos_token_ids);
        }
        tch::no_grad(|| self.decode(prompts, params, &stops, DecodePath::Kernels))
    }

    /// Refuses a request before anything is allocated for it when prompt and new tokens exceed
    /// the model's context, or when its KV cache and working set (an estimate) exceed the memory
    /// available: on CPU all of it, on an accelerator the host-side part (the device's own
    /// allocator reports the rest).
    fn check_size(&self, prompts: &[Vec<i64>], params: &SamplingParams) -> Result<()> {
        let c = self.config();
        let width = prompts.iter().map(Vec::len).max().unwrap_or(0) as u128;
        let new_tokens = params.max_new_tokens as u128;
        let positions = width + new_tokens;
        let context = c.context_length();
        if positions > context as u128 {
            return Err(ModelError::invalid_input(
                "max_new_tokens",
                format!(
                    "the longest prompt ({width} tokens) + max_new_tokens {new_tokens} = {positions} positions, more than the model's context of {context} (max_position_embeddings)"
                ),
            ));
        }
        let rows = prompts.len() as u128 * params.n as u128;
        let f32_bytes = 4u128;
        let elt = self.kind().elt_size_in_bytes() as u128;
        let int = |v: i64| v as u128;
        // Per row: the response and its log-probs, the row's RNG and bookkeeping.
        let host = rows * (new_tokens * 12 + 64);
        let kv = 2 * int(c.num_hidden_layers) * int(c.num_key_value_heads) * int(c.head_dim);
        let step_width = 3 * int(c.hidden_size)
            + int(c.num_attention_heads + 2 * c.num_key_value_heads) * int(c.head_dim)
            + int(c.num_attention_heads) * int(c.head_dim)
            + 3 * int(c.intermediate_size);
        let per_row = positions * (kv + 1) * elt + (2 * int(c.vocab_size) + step_width) * f32_bytes;
        // The prefill's activations and attention scores, for the prompts before the samples
        // share them.
        let prefill = prompts.len() as u128
            * width
            * ((4 * int(c.hidden_size) + 2 * int(c.intermediate_size)) * elt
                + int(c.num_attention_heads) * width * f32_bytes);
        let needed = host
            + if self.device() == tch::Device::Cpu {
                rows * per_row + prefill
            } else {
                0
            };
        crate::memory::check(
            || {
                format!(
                    "generating {} prompts × n {} samples × {positions} positions (KV cache, logits, responses)",
                    prompts.len(),
                    params.n
                )
            },
            needed,
        )
    }

    fn decode(
        &self,
        prompts: &[Vec<i64>],
        params: &SamplingParams,
        stops: &[i64],
        path: DecodePath,
    ) -> Result<Vec<Completion>> {
        let device = self.device();
        let n = params.n as i64;
        let batch = prompts.len() as i64;
        let width = prompts.iter().map(Vec::len).max().unwrap_or(0) as i64;
        // Left padding puts every prompt's last token in the last column.
        let mut ids = vec![0i64; (batch * width) as usize];
        let mut mask = vec![0i64; (batch * width) as usize];
        for (row, prompt) in prompts.iter().enumerate() {
            let start = row * width as usize + width as usize - prompt.len();
            ids[start..start + prompt.len()].copy_from_slice(prompt);
            mask[start..start + prompt.len()].fill(1);
        }
        let ids = Tensor::from_slice(&ids)
            .view([batch, width])
            .to_device(device);
        let mask = Tensor::from_slice(&mask)
            .view([batch, width])
            .to_device(device);

        let capacity = width + params.max_new_tokens as i64;
        let (mut decoder, mut logits) = Decoder::prefill(self, &ids, &mask, capacity, path)?;
        if n > 1 {
            // Prefill once per prompt, then give each sample its own copy of the cache.
            decoder.repeat_interleave(n);
            logits = logits.repeat_interleave_self_int(n, 0, None);
        }
        let rows = (batch * n) as usize;
        let mut rngs = params.row_rngs(rows);
        let mut out: Vec<Completion> = (0..rows).map(|r| Completion::empty(r / params.n)).collect();
        let mut done = vec![false; rows];
        // Each row's prompt tokens' experts (left padding dropped), then one token's per step.
        if let Some(routing) = decoder.routing() {
            for (r, completion) in out.iter_mut().enumerate() {
                let len = prompts[r / params.n].len() as i64;
                completion.routed_experts =
                    flat_i64(&routing.get(r as i64).narrow(0, width - len, len))?;
            }
        }

        for step in 0..params.max_new_tokens {
            let (tokens, mut logprobs) = pick(&logits, params, &mut rngs)?;
            if self.batch_invariant() {
                // The engine's log-softmax over the same row tiles: bit-identical log-probs.
                let scaled = if params.temperature == 0.0 {
                    logits.shallow_clone()
                } else {
                    &logits / params.temperature
                };
                let picked = Tensor::from_slice(&tokens).to_device(device);
                logprobs = Vec::try_from(&self.log_probs_in_rows(&scaled, &picked))?;
            }
            for (r, completion) in out.iter_mut().enumerate() {
                if done[r] {
                    continue;
                }
                completion.response_ids.push(tokens[r]);
                completion.logprobs.push(logprobs[r]);
                if stops.contains(&tokens[r]) {
                    completion.finish_reason = FinishReason::Stop;
                    done[r] = true;
                }
            }
            if done.iter().all(|&d| d) || step + 1 == params.max_new_tokens {
                break;
            }
            // Finished rows keep decoding with the rest of the batch; their tokens are dropped.
            logits = decoder.step(&tokens)?;
            if let Some(routing) = decoder.routing() {
                for (r, completion) in out.iter_mut().enumerate().filter(|(r, _)| !done[*r]) {
                    completion
                        .routed_experts
                        .extend(flat_i64(&routing.get(r as i64))?);
                }
            }
        }
        Ok(out)
    }
}

impl Completion {
    /// No tokens yet; `Length` until a stop token is seen.
    fn empty(prompt_index: usize) -> Self {
        Self {
            prompt_index,
            response_ids: Vec::new(),
            logprobs: Vec::new(),
            finish_reason: FinishReason::Length,
            routed_experts: Vec::new(),
        }
    }
}

/// The values of an int64 tensor, flattened.
fn flat_i64(t: &Tensor) -> Result<Vec<i64>> {
    Vec::<i64>::try_from(&t.reshape([-1])).map_err(|e| ModelError::Torch(e.to_string()))
}

/// Chooses one token per row from fp32 `logits [rows, V]`; returns the tokens and their
/// log-probabilities (see [`Completion::logprobs`]).
fn pick(
    logits: &Tensor,
    params: &SamplingParams,
    rngs: &mut [Rng],
) -> Result<(Vec<i64>, Vec<f32>)> {
    let greedy = params.temperature == 0.0;
    let vocab = logits.size().last().copied().unwrap_or(0);
    let filtered = params.top_p < 1.0 || (params.top_k > 0 && params.top_k < vocab);
    // On CPU, greedy picks and unfiltered sampling (verl's RL default) read the logits in place:
    // no sort of the vocabulary, one pass of vectorised exponentials per row.
    if let Some(rows) = host_rows(logits).filter(|_| greedy || !filtered) {
        let mut scratch = vec![0f32; vocab as usize];
        return Ok(rows
            .zip(rngs)
            .map(|(row, rng)| {
                let (token, logprob) = if greedy {
                    kernels::greedy(row, &mut scratch)
                } else {
                    let u = rng.uniform() as f32;
                    kernels::sample(row, params.temperature as f32, u, &mut scratch)
                };
                (token as i64, logprob)
            })
            .unzip());
    }
    if greedy {
        let tokens = logits.argmax(-1, false);
        let logprobs = crate::log_probs_from_logits(logits, &tokens);
        return Ok((Vec::try_from(&tokens)?, Vec::try_from(&logprobs)?));
    }
    let (tokens, logprobs) = sample(logits, params, rngs);
    Ok((Vec::try_from(&tokens)?, Vec::try_from(&logprobs)?))
}

/// The rows of a CPU fp32 `[rows, V]` tensor read in place, when it is one (contiguous).
fn host_rows(logits: &Tensor) -> Option<std::slice::ChunksExact<'_, f32>> {
    let (_, vocab) = logits.size2().ok()?;
    // SAFETY: checked to be host fp32; nothing writes to `logits` while the caller reads it.
    let all = interop::is_host_f32(logits).then(|| unsafe { interop::floats(logits) })?;
    Some(all.chunks_exact(vocab as usize))
}

/// Temperature, top-k and top-p sampling in tensor ops, in order of decreasing probability: the
/// tokens `[rows]` and their log-probabilities.
fn sample(logits: &Tensor, params: &SamplingParams, rngs: &mut [Rng]) -> (Tensor, Tensor) {
    let scaled = logits / params.temperature;
    let (probs, order) = scaled.softmax(-1, Kind::Float).sort_stable(true, -1, true);
    let vocab = probs.size()[1];
    // Filter in sorted order, as transformers' and vLLM's warpers: drop ranks ≥ top_k and tokens
    // whose more likely predecessors already hold top_p of the mass. The most likely token always
    // survives.
    let rank = Tensor::arange(vocab, (Kind::Int64, probs.device())).unsqueeze(0);
    let mut keep = rank.lt(if params.top_k > 0 {
        params.top_k
    } else {
        vocab
    });
    if params.top_p < 1.0 {
        keep = keep.logical_and(&(probs.cumsum(-1, Kind::Float) - &probs).lt(params.top_p));
    }
    let cdf = (probs * keep.to_kind(Kind::Float)).cumsum(-1, Kind::Float);
    // Inverse-CDF sampling with each row's own uniform draw, scaled to the kept mass.
    let uniforms: Vec<f32> = rngs.iter_mut().map(|r| r.uniform() as f32).collect();
    let target = Tensor::from_slice(&uniforms)
        .to_device(cdf.device())
        .unsqueeze(1)
        * cdf.narrow(1, vocab - 1, 1);
    let last_kept = keep.sum_dim_intlist(-1, true, Kind::Int64) - 1;
    let rank = cdf
        .le_tensor(&target)
        .sum_dim_intlist(-1, true, Kind::Int64)
        .minimum(&last_kept);
    let tokens = order.gather(-1, &rank, false).squeeze_dim(-1);
    let logprobs = crate::log_probs_from_logits(&scaled, &tokens);
    (tokens, logprobs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ModelConfig, ModelOptions};

    /// The three decode paths give the same completions: grouped-query attention (tiny-llama),
    /// q/k/v biases and tied embeddings (tiny-qwen2), llama3 RoPE scaling, prompts of different
    /// lengths (left padding), greedy, n > 1 sampling with and without top-p.
    #[test]
    fn decode_paths_agree() {
        let prompts = vec![vec![5, 9, 14, 3, 22, 7, 301], vec![11], vec![40, 2, 8]];
        let greedy = SamplingParams {
            max_new_tokens: 24,
            temperature: 0.0,
            ignore_eos: true,
            ..SamplingParams::default()
        };
        let sampled = SamplingParams {
            n: 3,
            temperature: 0.8,
            seed: 4,
            ..greedy.clone()
        };
        let nucleus = SamplingParams {
            top_p: 0.9,
            ..sampled.clone()
        };
        for name in ["tiny-llama", "tiny-qwen2", "tiny-llama-rope-llama3"] {
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("fixtures")
                .join(name);
            // The llama3-RoPE fixture is a config without weights.
            let model = CausalLM::from_pretrained(&dir, &ModelOptions::default()).or_else(|_| {
                CausalLM::random(ModelConfig::from_dir(&dir)?, &ModelOptions::default())
            });
            let model = model.unwrap();
            for params in [&greedy, &sampled, &nucleus] {
                let run = |path| tch::no_grad(|| model.decode(&prompts, params, &[], path));
                let reference = run(DecodePath::Tensors).unwrap();
                assert_eq!(reference.len(), prompts.len() * params.n);
                for path in [DecodePath::Fused, DecodePath::Kernels] {
                    for (got, want) in run(path).unwrap().iter().zip(&reference) {
                        assert_eq!(got.response_ids, want.response_ids, "{name} {path:?}");
                        for (a, b) in got.logprobs.iter().zip(&want.logprobs) {
                            assert!((a - b).abs() < 1e-5, "{name} {path:?}: {a} vs {b}");
                        }
                    }
                }
            }
        }
    }

    /// With a seed per prompt, a prompt's samples are the same alone or in a batch, at any
    /// position: what a batch sharded over ranks relies on.
    #[test]
    fn prompt_seeds_make_samples_independent_of_the_batch() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-llama");
        let model = CausalLM::from_pretrained(&dir, &ModelOptions::default()).unwrap();
        let prompts = vec![vec![5, 9, 14, 3], vec![11, 40], vec![40, 2, 8]];
        let params = |seeds: &[u64]| SamplingParams {
            n: 2,
            max_new_tokens: 12,
            temperature: 1.0,
            ignore_eos: true,
            prompt_seeds: seeds.to_vec(),
            ..SamplingParams::default()
        };
        let ids = |out: Vec<Completion>| -> Vec<Vec<i64>> {
            out.into_iter().map(|c| c.response_ids).collect()
        };
        let whole = ids(model.generate(&prompts, &params(&[7, 8, 9]), &[]).unwrap());
        let tail = ids(model
            .generate(&prompts[1..], &params(&[8, 9]), &[])
            .unwrap());
        assert_eq!(whole[2..], tail[..]);
        let alone = ids(model.generate(&prompts[..1], &params(&[7]), &[]).unwrap());
        assert_eq!(whole[..2], alone[..]);
        // Another seed for prompt 0 changes its samples only.
        let reseeded = ids(model.generate(&prompts, &params(&[70, 8, 9]), &[]).unwrap());
        assert_ne!(whole[..2], reseeded[..2]);
        assert_eq!(whole[2..], reseeded[2..]);
        let error = model
            .generate(&prompts, &params(&[1, 2]), &[])
            .unwrap_err()
            .to_string();
        assert!(error.contains("2 seeds for 3 prompts"), "{error}");
    }

    /// Oversized requests are refused before anything is allocated, naming the parameter, the
    /// size and the limit.
    #[test]
    fn oversized_requests_are_refused_before_allocating() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-llama");
        let model = CausalLM::from_pretrained(&dir, &ModelOptions::default()).unwrap();
        let context = model.config().context_length();
        let prompts = vec![vec![5, 9, 14], vec![11]];
        let params = |n, max_new_tokens| SamplingParams {
            n,
            max_new_tokens,
            temperature: 0.0,
            ..SamplingParams::default()
        };
        let error = |p: &SamplingParams| model.generate(&prompts, p, &[]).unwrap_err().to_string();

        let long = error(&params(1, 1_000_000_000));
        assert!(long.contains("\"max_new_tokens\""), "{long}");
        assert!(long.contains("1000000003 positions"), "{long}");
        assert!(long.contains(&format!("context of {context}")), "{long}");
        // Exactly the context fits.
        let fits = params(1, context as usize - 3);
        assert_eq!(
            model.generate(&prompts, &fits, &[]).unwrap()[0]
                .response_ids
                .len(),
            fits.max_new_tokens
        );

        let many = error(&params(1_000_000_000, 8));
        assert!(
            many.contains("2 prompts × n 1000000000 samples × 11 positions"),
            "{many}"
        );
        assert!(many.contains("of memory available"), "{many}");
    }

    /// The parameter count the memory check uses is exact, and a model too large for memory is
    /// refused before its parameters are allocated.
    #[test]
    fn oversized_models_are_refused_before_allocating() {
        for name in ["tiny-llama", "tiny-qwen2"] {
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("fixtures")
                .join(name);
            let model = CausalLM::from_pretrained(&dir, &ModelOptions::default()).unwrap();
            let numel: i64 = model
                .named_tensors()
                .iter()
                .map(|(_, t)| t.numel() as i64)
                .sum();
            assert_eq!(model.config().parameter_count(), numel as u128, "{name}");
        }
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-llama");
        let mut config = ModelConfig::from_dir(&dir).unwrap();
        config.hidden_size = 1 << 30;
        config.intermediate_size = 1 << 30;
        let error = CausalLM::random(config, &ModelOptions::default())
            .unwrap_err()
            .to_string();
        assert!(error.contains("hidden_size 1073741824"), "{error}");
        assert!(error.contains("of memory available"), "{error}");
    }

    /// Empirical token frequencies of `pick` over many rows sharing one distribution. `in_place`
    /// gives it contiguous CPU logits (read in place when it can), else a broadcast view (always
    /// tensor ops).
    fn frequencies(probs: &[f64], params: &SamplingParams, in_place: bool) -> Vec<f64> {
        let rows = 20_000;
        let logits: Vec<f32> = probs.iter().map(|p| p.ln() as f32).collect();
        let logits = Tensor::from_slice(&logits)
            .unsqueeze(0)
            .expand([rows, probs.len() as i64], false);
        let logits = if in_place {
            logits.contiguous()
        } else {
            logits
        };
        let mut rngs: Vec<Rng> = (0..rows as u64)
            .map(|r| Rng::stream(params.seed, r))
            .collect();
        let (tokens, logprobs) = pick(&logits, params, &mut rngs).unwrap();
        let (tokens, logprobs) = (Tensor::from_slice(&tokens), Tensor::from_slice(&logprobs));
        // Reported log-probs are those of the unfiltered, tempered distribution: p^(1/T) / Σ p^(1/T).
        let tilted: Vec<f64> = probs
            .iter()
            .map(|p| p.powf(1.0 / params.temperature))
            .collect();
        let z: f64 = tilted.iter().sum();
        let log_tilted: Vec<f32> = tilted.iter().map(|t| (t / z).ln() as f32).collect();
        let expected = Tensor::from_slice(&log_tilted).gather(0, &tokens, false);
        assert!(f64::try_from((logprobs - expected).abs().max()).unwrap() < 1e-6);
        let counts =
            Vec::<i64>::try_from(tokens.bincount::<Tensor>(None, probs.len() as i64)).unwrap();
        counts.iter().map(|&c| c as f64 / rows as f64).collect()
    }

    fn assert_close(got: &[f64], want: &[f64]) {
        assert!(
            got.iter().zip(want).all(|(g, w)| (g - w).abs() < 0.015),
            "{got:?} vs {want:?}"
        );
    }

    /// Both samplers: tensor ops (sorted order, every filter) and in place (vocabulary order,
    /// unfiltered only; filtered requests fall back to tensor ops).
    #[test]
    fn top_k_and_top_p_renormalise_the_kept_tokens() {
        let probs = [0.5, 0.3, 0.15, 0.05];
        let base = SamplingParams {
            temperature: 1.0,
            seed: 9,
            ..Default::default()
        };
        // top_k = 2 keeps {0.5, 0.3} → 0.625, 0.375.
        let top2 = vec![0.625, 0.375, 0.0, 0.0];
        // top_p = 0.9 keeps three tokens: mass 0.95.
        let top3 = vec![0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0];
        // Temperature 0.5 squares the probabilities before renormalising.
        let squared: Vec<f64> = probs.iter().map(|p| p * p / 0.365).collect();
        let cases = [
            (base.clone(), probs.to_vec()),
            (
                SamplingParams {
                    top_k: 2,
                    ..base.clone()
                },
                top2.clone(),
            ),
            // top_p = 0.7: the third token's predecessors hold 0.8 ≥ 0.7, so it goes.
            (
                SamplingParams {
                    top_p: 0.7,
                    ..base.clone()
                },
                top2,
            ),
            (
                SamplingParams {
                    top_p: 0.9,
                    ..base.clone()
                },
                top3,
            ),
            (
                SamplingParams {
                    temperature: 0.5,
                    ..base.clone()
                },
                squared,
            ),
            // top_k at or beyond the vocabulary filters nothing.
            (SamplingParams { top_k: 4, ..base }, probs.to_vec()),
        ];
        for in_place in [false, true] {
            for (params, want) in &cases {
                assert_close(&frequencies(&probs, params, in_place), want);
            }
        }
    }
}
