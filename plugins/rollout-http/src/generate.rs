//! Concurrent generation over a [`Pool`]: one request per prompt (its `n` samples together), all
//! in flight at once within the pool's bound, each answer put in its prompt's slot, so no prompt
//! is lost or answered twice whatever order the servers reply in, and a retried request replaces
//! rather than adds.

use serde_json::Value;
use verl_plugin_api::{Completion, FinishReason, GenerateRequest, SamplingParams};

use crate::{HttpError, Pool};

/// One backend's generation protocol: the request for one prompt, and the samples in its answer.
pub trait Protocol: Sync {
    /// The endpoint, e.g. `/v1/completions`.
    fn path(&self) -> &str;
    /// The body asking for `sampling.n` samples of `prompt`; `seed` is this prompt's own.
    fn body(&self, prompt: &[u32], sampling: &SamplingParams, seed: Option<u64>) -> Value;
    /// The samples of one answer, in any order, each with its index among the `n`.
    fn samples(&self, answer: &Value) -> Result<Vec<Sample>, String>;
}

/// One generated sequence as a server returns it.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Which of the prompt's `n` samples this is.
    pub index: usize,
    pub token_ids: Vec<u32>,
    /// Log-prob of each token of `token_ids`.
    pub logprobs: Vec<f32>,
    pub finish_reason: FinishReason,
}

/// Seed of prompt `index` of a request seeded with `seed`: distinct per prompt (so two equal
/// prompts in one batch get different samples) and within the non-negative `i64` range servers
/// accept. Servers derive the `n` samples' seeds from it (vLLM: `seed + i`).
pub fn prompt_seed(seed: u64, index: usize) -> u64 {
    // splitmix64's finaliser over the pair.
    let mut z = seed
        ^ (index as u64)
            .wrapping_add(1)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) >> 1
}

impl Pool {
    /// Generates `request` with `protocol`; completions come back grouped by prompt, in prompt
    /// order, samples in index order. `seed` seeds the request (per prompt, [`prompt_seed`]).
    pub fn generate(
        &self,
        protocol: &dyn Protocol,
        request: &GenerateRequest,
        seed: Option<u64>,
    ) -> Result<Vec<Completion>, HttpError> {
        if request.prompts.is_empty() {
            return Ok(Vec::new());
        }
        self.check_alive()?;
        let n = request.sampling.n as usize;
        let path = protocol.path();
        let one = |i: usize, prompt: &[u32]| {
            let body = protocol.body(prompt, &request.sampling, seed.map(|s| prompt_seed(s, i)));
            async move {
                let (server, answer) = self.post_any(path, &body).await?;
                let url = format!("{}{path}", self.servers()[server].url());
                let bad =
                    |message: String| HttpError::protocol(&url, format!("prompt {i}: {message}"));
                let mut samples = protocol.samples(&answer).map_err(bad)?;
                samples.sort_by_key(|s| s.index);
                let indices: Vec<usize> = samples.iter().map(|s| s.index).collect();
                if indices != (0..n).collect::<Vec<_>>() {
                    return Err(bad(format!(
                        "asked for {n} sample(s), got sample indices {indices:?}"
                    )));
                }
                Ok(samples)
            }
        };
        let all = self.block_on(futures_util::future::try_join_all(
            request.prompts.iter().enumerate().map(|(i, p)| one(i, p)),
        ))?;
        Ok(all
            .into_iter()
            .enumerate()
            .flat_map(|(i, samples)| {
                samples.into_iter().map(move |s| {
                    Completion::new(i as u32, s.token_ids, s.logprobs, s.finish_reason)
                })
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_seeds_differ_and_fit_in_i64() {
        let seeds: std::collections::HashSet<u64> = (0..1000).map(|i| prompt_seed(7, i)).collect();
        assert_eq!(seeds.len(), 1000);
        assert!(seeds.iter().all(|&s| s <= i64::MAX as u64));
        assert_eq!(prompt_seed(7, 3), prompt_seed(7, 3));
        assert_ne!(prompt_seed(7, 3), prompt_seed(8, 3));
    }
}
