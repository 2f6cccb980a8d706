//! The engine suite: log-probs against transformers' reference, a deterministic update, an
//! update after save → load equal bit for bit to one without, and clean errors for what the
//! engine does not do.

use std::path::Path;

use serde_json::{Value, json};
use verl_plugin_api::{
    Batch, ComponentInit, EngineCapabilities, Metric, NamedTensor, RunContext, Tensor, keys,
};
use verl_plugin_host::EngineHandle;

use super::fixture::{self, Expected, layout};
use super::{Outcome, Suite, call, ensure, expect_unsupported, merge, no_panic, tempdir};

pub const CHECKS: &[&str] = &[
    "init",
    "log_probs_match_reference",
    "update_deterministic",
    "save_load_update_bit_identical",
    "unsupported_methods",
    "object_exchange",
];

const TOLERANCE: f32 = 1e-5;

struct Ctx {
    suite_component: verl_plugin_host::Component,
    config: Value,
}

impl Ctx {
    fn engine(&self) -> Result<EngineHandle, String> {
        let mut engine = self
            .suite_component
            .create_engine()
            .map_err(|e| e.to_string())?;
        let mut run = RunContext::default();
        run.seed = 7;
        call(
            "init",
            engine.init(&ComponentInit::new(self.config.clone(), run)),
        )?;
        Ok(engine)
    }
}

fn weights(engine: &mut EngineHandle) -> Result<Vec<NamedTensor>, String> {
    Ok(call("weights", engine.weights())?
        .iter()
        .map(|t| t.to_named())
        .collect())
}

fn log_probs(engine: &mut EngineHandle, batch: &Batch) -> Result<Tensor, String> {
    let out = call("compute_log_prob", engine.compute_log_prob(batch))?;
    out.get(keys::LOG_PROBS)
        .cloned()
        .ok_or_else(|| format!("compute_log_prob returned no `{}`", keys::LOG_PROBS))
}

/// A PPO batch on the fixture sequences: old = ref = the engine's own log-probs (ratio 1 at the
/// first step), fixed per-sequence advantages.
fn ppo_batch(engine: &mut EngineHandle, expected: &Expected) -> Result<Batch, String> {
    let seqs: Vec<Vec<i64>> = expected.sequences.iter().map(|s| s.ids.clone()).collect();
    let (mut batch, _) = layout(&seqs);
    let old = log_probs(engine, &batch)?;
    let shape = old.shape.to_vec();
    let (b, r) = (shape[0] as usize, shape[1] as usize);
    let adv: Vec<f32> = (0..b)
        .flat_map(|i| std::iter::repeat_n([1.0f32, -0.5, 0.25, -1.0][i % 4], r))
        .collect();
    batch.insert(
        keys::ADVANTAGES,
        Tensor::from_slice(&shape, &adv).map_err(|e| e.to_string())?,
    );
    batch.insert(keys::REF_LOG_PROB, old.clone());
    batch.insert(keys::OLD_LOG_PROBS, old);
    Ok(batch)
}

fn update(engine: &mut EngineHandle, batch: &Batch) -> Result<Vec<Metric>, String> {
    call("update_actor", engine.update_actor(batch))
}

fn rstr(p: &Path) -> &str {
    p.to_str().unwrap_or_default()
}

pub fn run(suite: &mut Suite) {
    let caps: EngineCapabilities = suite.component.capabilities();
    let Some((fixture, expected)) = fixture::load(
        suite,
        suite.options.fixture.clone(),
        fixture::ENGINE_FIXTURE[0],
        CHECKS,
    ) else {
        return;
    };
    if !caps.supports_role("actor") {
        for check in CHECKS {
            suite.skip(
                check,
                format!(
                    "the engine declares roles {:?}; the suite drives an `actor`",
                    caps.roles
                ),
            );
        }
        return;
    }
    let mut config = json!({
        "role": "actor",
        "model": {"path": fixture},
        "optim": {"lr": 1e-3},
        "ppo_mini_batch_size": expected.sequences.len(),
    });
    merge(&mut config, &suite.options.engine_config);
    let ctx = Ctx {
        suite_component: suite.component.clone(),
        config,
    };

    let mut first: Option<EngineHandle> = None;
    let initialised = suite.check("init", || {
        first = Some(ctx.engine()?);
        Ok(Outcome::Pass)
    });
    if !initialised {
        for check in &CHECKS[1..] {
            suite.skip(check, "needs `init`, which failed");
        }
        return;
    }
    let mut engine = first.expect("init passed");

    suite.check("log_probs_match_reference", || {
        let seqs: Vec<Vec<i64>> = expected.sequences.iter().map(|s| s.ids.clone()).collect();
        let (mut batch, lens) = layout(&seqs);
        for temperature in [1.0, expected.temperature] {
            batch.meta_json = json!({"temperature": temperature}).to_string().into();
            let lp = log_probs(&mut engine, &batch)?;
            let width = *lp.shape.get(1).ok_or("log_probs is not [B, R]")? as usize;
            let values = lp.to_vec::<f32>().map_err(|e| e.to_string())?;
            ensure(values.len() == width * seqs.len(), || {
                format!("log_probs has shape {:?} for {} sequences", lp.shape.as_slice(), seqs.len())
            })?;
            for (i, seq) in expected.sequences.iter().enumerate() {
                let reference = if temperature == 1.0 { &seq.logprobs } else { &seq.logprobs_temperature };
                let n = reference.len();
                let got = &values[i * width..i * width + lens[i]];
                let diff = got
                    .iter()
                    .zip(&reference[n - lens[i]..])
                    .map(|(a, b)| (a - *b as f32).abs())
                    .fold(0.0f32, f32::max);
                ensure(diff <= TOLERANCE, || {
                    format!("row {i} at temperature {temperature}: max |Δ| {diff:.3e} > {TOLERANCE:e} from transformers")
                })?;
            }
        }
        Ok(Outcome::Pass)
    });

    suite.check("update_deterministic", || {
        let mut a = ctx.engine()?;
        let mut b = ctx.engine()?;
        let batch = ppo_batch(&mut a, &expected)?;
        let before = weights(&mut a)?;
        let ma = update(&mut a, &batch)?;
        let mb = update(&mut b, &batch)?;
        let (wa, wb) = (weights(&mut a)?, weights(&mut b)?);
        ensure(wa != before, || {
            "update_actor did not change the weights".into()
        })?;
        ensure(wa == wb, || {
            "two engines with the same config, seed and batch end with different weights".into()
        })?;
        ensure(ma == mb, || {
            format!("the same update reported different metrics: {ma:?} vs {mb:?}")
        })?;
        Ok(Outcome::Pass)
    });

    suite.check("save_load_update_bit_identical", || {
        let dir = tempdir()?;
        let mut straight = ctx.engine()?;
        let batch = ppo_batch(&mut straight, &expected)?;
        update(&mut straight, &batch)?;
        let want = update(&mut straight, &batch)?;
        let mut first = ctx.engine()?;
        update(&mut first, &batch)?;
        call(
            "save_checkpoint",
            first.save_checkpoint(rstr(dir.path()), 1),
        )?;
        let mut resumed = ctx.engine()?;
        let step = call("load_checkpoint", resumed.load_checkpoint(rstr(dir.path())))?;
        ensure(step == 1, || {
            format!("load_checkpoint returned global step {step}, saved as 1")
        })?;
        let got = update(&mut resumed, &batch)?;
        ensure(weights(&mut resumed)? == weights(&mut straight)?, || {
            "update → save → load → update ends with other weights than update → update".into()
        })?;
        ensure(got == want, || {
            format!("metrics after resuming differ: {got:?} vs {want:?}")
        })?;
        Ok(Outcome::Pass)
    });

    suite.check("unsupported_methods", || {
        // An engine without the critic role must say UNSUPPORTED; one with it may refuse an
        // actor's call any way but a panic.
        let batch = ppo_batch(&mut engine, &expected)?;
        let values = engine.compute_values(&batch);
        let critic = engine.update_critic(&batch);
        if caps.supports_role("critic") {
            no_panic("compute_values on an actor", values)?;
            no_panic("update_critic on an actor", critic)?;
        } else {
            expect_unsupported("compute_values", values)?;
            expect_unsupported("update_critic", critic)?;
        }
        // Before init and on an empty batch, every method fails cleanly.
        let mut fresh = ctx
            .suite_component
            .create_engine()
            .map_err(|e| e.to_string())?;
        let empty = Batch::default();
        let dir = tempdir()?;
        no_panic(
            "compute_log_prob before init",
            fresh.compute_log_prob(&empty),
        )?;
        no_panic("compute_values before init", fresh.compute_values(&empty))?;
        no_panic("update_actor before init", fresh.update_actor(&empty))?;
        no_panic("update_critic before init", fresh.update_critic(&empty))?;
        no_panic(
            "save_checkpoint before init",
            fresh.save_checkpoint(rstr(dir.path()), 0),
        )?;
        no_panic(
            "load_checkpoint before init",
            fresh.load_checkpoint(rstr(dir.path())),
        )?;
        no_panic("weights before init", fresh.weights().map(|w| w.len()))?;
        no_panic("export_hf before init", fresh.export_hf(rstr(dir.path())))?;
        no_panic(
            "compute_log_prob of an empty batch",
            engine.compute_log_prob(&empty),
        )?;
        no_panic(
            "update_actor of an empty batch",
            engine.update_actor(&empty),
        )?;
        no_panic(
            "load_checkpoint of an empty directory",
            engine.load_checkpoint(rstr(dir.path())),
        )?;
        Ok(Outcome::Pass)
    });

    suite.check("object_exchange", || {
        // On one rank the exchange hands back this rank's bytes; an engine that does not declare
        // it says UNSUPPORTED.
        let bytes = b"rank 0 \x00\xff".to_vec();
        let gathered = engine.all_gather_object(&bytes);
        if !caps.object_exchange {
            return expect_unsupported("all_gather_object", gathered).map(|()| Outcome::Pass);
        }
        let gathered = call("all_gather_object", gathered)?;
        ensure(gathered == [bytes.clone()], || {
            format!("all_gather_object on one rank returned {gathered:?}, not [{bytes:?}]")
        })?;
        let empty = call("all_gather_object", engine.all_gather_object(&[]))?;
        ensure(empty == [Vec::<u8>::new()], || {
            format!("all_gather_object of no bytes returned {empty:?}")
        })?;
        Ok(Outcome::Pass)
    });
}
