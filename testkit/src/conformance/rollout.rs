//! The rollout suite: greedy decoding against transformers' reference, the sampling parameters
//! (`n`, stop ids, length limit, seed), weight updates, and clean errors for what the rollout
//! does not do.

use serde_json::json;
use verl_plugin_api::{
    ComponentInit, ErrorKind, FinishReason, GenerateOutput, GenerateRequest, Handover, NamedTensor,
    PluginError, RolloutCapabilities, RunContext, SamplingParams, WeightSource, WeightSourceKind,
};
use verl_plugin_host::RolloutHandle;

use super::fixture::{self, perturbed, read_safetensors_dir, write_safetensors};
use super::{
    Outcome, Suite, call, ensure, expect_unsupported, merge, no_panic, ok_or_unsupported, tempdir,
};

pub const CHECKS: &[&str] = &[
    "init",
    "greedy_matches_reference",
    "n_samples",
    "stop_token_ids",
    "max_new_tokens",
    "seeded_reproducibility",
    "weight_update_changes_output",
    "sleep_and_wake_keep_the_weights",
    "unsupported_methods",
];

const TOLERANCE: f32 = 1e-5;

fn greedy(max_new_tokens: u32) -> SamplingParams {
    let mut s = SamplingParams::default();
    s.greedy = true;
    s.max_new_tokens = max_new_tokens;
    s
}

fn sampled(n: u32, seed: Option<u64>) -> SamplingParams {
    let mut s = SamplingParams::default();
    s.n = n;
    s.temperature = 1.0;
    s.max_new_tokens = 12;
    s.seed = seed;
    s
}

fn generate(
    rollout: &mut RolloutHandle,
    prompts: &[Vec<u32>],
    sampling: SamplingParams,
) -> Result<GenerateOutput, String> {
    call(
        "generate",
        rollout.generate(&GenerateRequest::new(prompts.to_vec(), sampling)),
    )
}

fn ids(out: &GenerateOutput) -> Vec<Vec<u32>> {
    out.completions
        .iter()
        .map(|c| c.response_ids.clone())
        .collect()
}

pub fn run(suite: &mut Suite) {
    let caps: RolloutCapabilities = suite.component.capabilities();
    let Some((fixture, expected)) = fixture::load(
        suite,
        suite.options.rollout_fixture.clone(),
        fixture::ROLLOUT_FIXTURE[0],
        CHECKS,
    ) else {
        return;
    };
    let mut config = json!({"name": suite.component.name, "model": {"path": fixture}});
    merge(&mut config, &suite.options.rollout_config);
    let component = suite.component.clone();
    let fresh_component = suite.component.clone();
    let new_rollout = move || -> Result<RolloutHandle, String> {
        let mut rollout = component.create_rollout().map_err(|e| e.to_string())?;
        let mut run = RunContext::default();
        run.seed = 11;
        call(
            "init",
            rollout.init(&ComponentInit::new(config.clone(), run)),
        )?;
        Ok(rollout)
    };

    let mut first = None;
    if !suite.check("init", || {
        first = Some(new_rollout()?);
        Ok(Outcome::Pass)
    }) {
        for check in &CHECKS[1..] {
            suite.skip(check, "needs `init`, which failed");
        }
        return;
    }
    let mut rollout = first.expect("init passed");
    let prompts: Vec<Vec<u32>> = expected
        .greedy
        .iter()
        .map(|g| g.prompt_ids.clone())
        .collect();
    let longest = expected
        .greedy
        .iter()
        .map(|g| g.response_ids.len())
        .max()
        .unwrap_or(8) as u32;

    // Whether a completion matches transformers' greedy continuation of prompt `i`: the same
    // tokens up to where either stopped (an EOS ends it early), log-probs within the tolerance.
    let matches_reference = |out: &GenerateOutput| -> Result<(), String> {
        ensure(out.completions.len() == expected.greedy.len(), || {
            format!(
                "{} prompts gave {} completions",
                expected.greedy.len(),
                out.completions.len()
            )
        })?;
        for (i, (c, g)) in out.completions.iter().zip(&expected.greedy).enumerate() {
            let n = c.response_ids.len().min(g.response_ids.len());
            ensure(c.prompt_index as usize == i, || {
                format!("completion {i} has prompt_index {}", c.prompt_index)
            })?;
            ensure(n > 0 && c.response_ids[..n] == g.response_ids[..n], || {
                format!(
                    "prompt {i}: greedy tokens {:?}, transformers {:?}",
                    c.response_ids, g.response_ids
                )
            })?;
            let stopped = c
                .response_ids
                .last()
                .is_some_and(|id| expected.eos_token_ids.contains(id));
            ensure(
                c.response_ids.len() == g.response_ids.len() || stopped,
                || {
                    format!(
                        "prompt {i}: {} tokens without EOS, transformers generated {}",
                        c.response_ids.len(),
                        g.response_ids.len()
                    )
                },
            )?;
            if caps.logprobs {
                ensure(c.logprobs.len() == c.response_ids.len(), || {
                    format!(
                        "prompt {i}: {} log-probs for {} tokens (the rollout declares log-probs)",
                        c.logprobs.len(),
                        c.response_ids.len()
                    )
                })?;
                let diff = c
                    .logprobs
                    .iter()
                    .zip(&g.logprobs)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                ensure(diff <= TOLERANCE, || {
                    format!("prompt {i}: log-prob max |Δ| {diff:.3e} > {TOLERANCE:e}")
                })?;
            }
        }
        Ok(())
    };

    suite.check("greedy_matches_reference", || {
        matches_reference(&generate(&mut rollout, &prompts, greedy(longest))?)?;
        Ok(Outcome::Pass)
    });

    suite.check("n_samples", || {
        let out = generate(&mut rollout, &prompts[..2], sampled(3, Some(1)))?;
        let order: Vec<u32> = out.completions.iter().map(|c| c.prompt_index).collect();
        ensure(order == [0, 0, 0, 1, 1, 1], || {
            format!("n=3 on 2 prompts: prompt indices {order:?}, want [0, 0, 0, 1, 1, 1] (grouped by prompt)")
        })?;
        Ok(Outcome::Pass)
    });

    suite.check("stop_token_ids", || {
        let g = &expected.greedy[0];
        let stop = *g
            .response_ids
            .get(2)
            .ok_or("the fixture's first greedy response is too short")?;
        let first = g.response_ids.iter().position(|&t| t == stop).unwrap_or(2);
        let mut s = greedy(longest);
        s.stop_token_ids = vec![stop];
        let out = generate(&mut rollout, std::slice::from_ref(&g.prompt_ids), s)?;
        let c = out.completions.first().ok_or("no completion")?;
        ensure(c.response_ids == g.response_ids[..=first], || {
            format!(
                "stop id {stop}: response {:?}, want {:?}",
                c.response_ids,
                &g.response_ids[..=first]
            )
        })?;
        ensure(c.finish_reason == FinishReason::Stop, || {
            format!(
                "a response ended by a stop id has finish reason `{}`",
                c.finish_reason.as_str()
            )
        })?;
        Ok(Outcome::Pass)
    });

    suite.check("max_new_tokens", || {
        for limit in [1, 3] {
            let out = generate(&mut rollout, &prompts, greedy(limit))?;
            for (i, c) in out.completions.iter().enumerate() {
                let stopped = c.response_ids.last().is_some_and(|id| expected.eos_token_ids.contains(id));
                ensure(c.response_ids.len() <= limit as usize, || {
                    format!("max_new_tokens {limit}: prompt {i} got {} tokens", c.response_ids.len())
                })?;
                if !stopped {
                    ensure(c.response_ids.len() == limit as usize && c.finish_reason == FinishReason::Length, || {
                        format!("max_new_tokens {limit}: prompt {i} got {} tokens, finish `{}` (want {limit}, `length`)", c.response_ids.len(), c.finish_reason.as_str())
                    })?;
                }
            }
        }
        Ok(Outcome::Pass)
    });

    suite.check("seeded_reproducibility", || {
        let a = generate(&mut rollout, &prompts, sampled(3, Some(1)))?;
        let b = generate(&mut rollout, &prompts, sampled(3, Some(1)))?;
        ensure(ids(&a) == ids(&b), || {
            "two requests with seed 1 sampled different tokens".into()
        })?;
        let c = generate(&mut rollout, &prompts, sampled(3, Some(2)))?;
        ensure(ids(&a) != ids(&c), || {
            "seeds 1 and 2 sampled the same tokens".into()
        })?;
        Ok(Outcome::Pass)
    });

    suite.check("weight_update_changes_output", || {
        let kinds: Vec<WeightSourceKind> = [WeightSourceKind::Memory, WeightSourceKind::File]
            .into_iter()
            .filter(|k| caps.accepts(*k))
            .collect();
        if kinds.is_empty() {
            return Ok(Outcome::Skipped(format!(
                "the rollout declares weight sources {:?}; the suite sends memory or file",
                caps.weight_sources
            )));
        }
        let (original, _) = read_safetensors_dir(&fixture)?;
        let noisy = perturbed(&original, 0.5);
        let dir = tempdir()?;
        let send = |rollout: &mut RolloutHandle, kind: WeightSourceKind, tensors: &[NamedTensor], version: u64| -> Result<(), PluginError> {
            let views: Vec<_> = tensors.iter().map(NamedTensor::as_ref).collect();
            match kind {
                WeightSourceKind::Memory => rollout.update_weights(&WeightSource::memory(version, &views)),
                _ => {
                    let sub = dir.path().join(format!("step_{version}"));
                    std::fs::create_dir_all(&sub).map_err(|e| PluginError::other(e.to_string()))?;
                    write_safetensors(&sub, tensors).map_err(PluginError::other)?;
                    let json = WeightSource::encode_handover(&Handover::file(sub.to_string_lossy()));
                    rollout.update_weights(&WeightSource::from_handover(version, &[], &json))
                }
            }
        };
        // A rollout whose configuration picks its source (a server rollout takes memory only in
        // its collective mode) refuses the others as unsupported: the first it takes is tested.
        let mut kind = kinds[0];
        for (i, &k) in kinds.iter().enumerate() {
            kind = k;
            match send(&mut rollout, k, &noisy, 5) {
                Ok(()) => break,
                Err(e) if e.kind == ErrorKind::UNSUPPORTED && i + 1 < kinds.len() => {}
                Err(e) => return Err(format!("update_weights ({}): {} error: {e}", k.as_str(), e.kind.as_str())),
            }
        }
        let send = |rollout: &mut RolloutHandle, tensors: &[NamedTensor], version: u64| {
            call("update_weights", send(rollout, kind, tensors, version))
        };
        let changed = generate(&mut rollout, &prompts, greedy(longest))?;
        ensure(matches_reference(&changed).is_err(), || {
            format!("after update_weights ({}) with perturbed weights, greedy output still equals the reference", kind.as_str())
        })?;
        ensure(changed.weight_version == Some(5), || {
            format!("output after an update to version 5 reports weight_version {:?}", changed.weight_version)
        })?;
        send(&mut rollout, &original, 6)?;
        let back = generate(&mut rollout, &prompts, greedy(longest))?;
        matches_reference(&back).map_err(|e| format!("after updating back to the fixture's weights: {e}"))?;
        Ok(Outcome::Pass)
    });

    suite.check("sleep_and_wake_keep_the_weights", || {
        if !caps.sleep_wake {
            return Ok(Outcome::Skipped(
                "the rollout declares no sleep/wake-up".into(),
            ));
        }
        call("sleep", rollout.sleep(1))?;
        call("wake_up", rollout.wake_up())?;
        let out = generate(&mut rollout, &prompts, greedy(longest))?;
        matches_reference(&out).map_err(|e| format!("after sleep(1) and wake_up: {e}"))?;
        Ok(Outcome::Pass)
    });

    suite.check("unsupported_methods", || {
        if !caps.sleep_wake {
            ok_or_unsupported("sleep (sleep_wake not declared)", rollout.sleep(1))?;
            ok_or_unsupported("wake_up (sleep_wake not declared)", rollout.wake_up())?;
        }
        let collective = WeightSource::encode_handover(&Handover::collective(json!({})));
        let file = WeightSource::encode_handover(&Handover::file("/nonexistent/verl-certify"));
        for (kind, json) in [
            (WeightSourceKind::Collective, &collective),
            (WeightSourceKind::File, &file),
        ] {
            let r = rollout.update_weights(&WeightSource::from_handover(9, &[], json));
            if caps.accepts(kind) {
                no_panic(
                    &format!("update_weights from a {} source", kind.as_str()),
                    r,
                )?;
            } else {
                expect_unsupported(
                    &format!(
                        "update_weights from a {} source (not declared)",
                        kind.as_str()
                    ),
                    r,
                )?;
            }
        }
        let mut fresh = fresh_component
            .create_rollout()
            .map_err(|e| e.to_string())?;
        no_panic(
            "generate before init",
            fresh.generate(&GenerateRequest::new(prompts.clone(), greedy(2))),
        )?;
        no_panic(
            "generate of no prompts",
            rollout.generate(&GenerateRequest::new(vec![], greedy(2))),
        )?;
        no_panic(
            "generate of an empty prompt",
            rollout.generate(&GenerateRequest::new(vec![vec![]], greedy(2))),
        )?;
        Ok(Outcome::Pass)
    });
}
