//! Concurrent generation over a [`Pool`]: one request per prompt (its `n` samples together), all
//! in flight at once within the pool's bound, each answer put in its prompt's slot, so no prompt
//! is lost or answered twice whatever order the servers reply in, and a retried request replaces
//! rather than adds.

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use serde_json::Value;
use verl_plugin_api::{Completion, FinishReason, GenerateRequest, SamplingParams};

use crate::{HttpError, Pool, Restore};

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
    ///
    /// A started server that dies, before or during the call, is started again (within
    /// `max_restarts`), given back the rollout's weights by `restore`, and sent again exactly the
    /// requests that had not completed: each prompt's request is its slot, filled once by the
    /// answer to that request, so no prompt is answered twice or lost.
    pub fn generate(
        &mut self,
        protocol: &dyn Protocol,
        request: &GenerateRequest,
        seed: Option<u64>,
        restore: &Restore<'_>,
    ) -> Result<Vec<Completion>, HttpError> {
        self.generate_seeded(
            protocol,
            request,
            |i| seed.map(|s| prompt_seed(s, i)),
            restore,
        )
    }

    /// [`Pool::generate`] with prompt `i` seeded `seed_of(i)` (e.g. the request's per-prompt
    /// seeds).
    pub fn generate_seeded(
        &mut self,
        protocol: &dyn Protocol,
        request: &GenerateRequest,
        seed_of: impl Fn(usize) -> Option<u64>,
        restore: &Restore<'_>,
    ) -> Result<Vec<Completion>, HttpError> {
        if request.prompts.is_empty() {
            return Ok(Vec::new());
        }
        self.recover(restore)?;
        let mut slots: Vec<Option<Vec<Sample>>> = vec![None; request.prompts.len()];
        while let Some(failure) =
            self.block_on(self.round(protocol, request, &seed_of, &mut slots))?
        {
            let dead = self.dead_after_failure();
            if dead.is_empty() {
                return Err(failure);
            }
            for i in dead {
                self.restart(i, "during a generation")?;
                restore(self, i)?;
            }
            eprintln!(
                "{}: sending again the {} of {} requests that had not completed",
                self.backend(),
                slots.iter().filter(|s| s.is_none()).count(),
                slots.len()
            );
        }
        Ok(slots
            .into_iter()
            .enumerate()
            .flat_map(|(i, samples)| {
                samples.unwrap_or_default().into_iter().map(move |s| {
                    Completion::new(i as u32, s.token_ids, s.logprobs, s.finish_reason)
                })
            })
            .collect())
    }

    /// Sends the request of every empty slot, all concurrently, and fills each slot with its
    /// answer. A connection failure (a server that died or does not answer) lets the others
    /// finish and is returned as `Ok(Some(_))` when this pool started a server, which may have
    /// died; any other error ends the round at once.
    async fn round(
        &self,
        protocol: &dyn Protocol,
        request: &GenerateRequest,
        seed_of: &dyn Fn(usize) -> Option<u64>,
        slots: &mut [Option<Vec<Sample>>],
    ) -> Result<Option<HttpError>, HttpError> {
        let n = request.sampling.n as usize;
        let path = protocol.path();
        let one = |i: usize| {
            let body = protocol.body(&request.prompts[i], &request.sampling, seed_of(i));
            async move {
                let answer = async {
                    let (server, answer) = self.post_any(path, &body).await?;
                    let url = format!("{}{path}", self.servers()[server].url());
                    let bad = |message: String| {
                        HttpError::protocol(&url, format!("prompt {i}: {message}"))
                    };
                    let mut samples = protocol.samples(&answer).map_err(bad)?;
                    samples.sort_by_key(|s| s.index);
                    let indices: Vec<usize> = samples.iter().map(|s| s.index).collect();
                    if indices != (0..n).collect::<Vec<_>>() {
                        return Err(bad(format!(
                            "asked for {n} sample(s), got sample indices {indices:?}"
                        )));
                    }
                    Ok(samples)
                };
                (i, answer.await)
            }
        };
        let mut pending: FuturesUnordered<_> = (0..slots.len())
            .filter(|&i| slots[i].is_none())
            .map(one)
            .collect();
        let started = self.servers().iter().any(|s| s.process().is_some());
        let mut failure = None;
        while let Some((i, answer)) = pending.next().await {
            match answer {
                Ok(samples) => slots[i] = Some(samples),
                Err(e @ (HttpError::Died { .. } | HttpError::Unreachable { .. })) if started => {
                    failure.get_or_insert(e);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(failure)
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
