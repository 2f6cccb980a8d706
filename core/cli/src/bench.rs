//! `verl-core bench plugins`: start-up cost of the plugin system and the overhead of calling a
//! component through the stable ABI; `verl-core bench components`: weight sync by reference and
//! the record boundary's cost on real work. Each against a reference measured in the same run.

use std::fmt::Write as _;
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use serde_json::json;
use verl_plugin_host::api::{
    ComponentInit, ComponentKind, Device, GenerateOutput, GenerateRequest, SamplingParams, wire,
};
use verl_plugin_host::{CpuDevice, PluginSearch, Registry, detect_platform, process_probe};

use crate::quickstart::{TinyModel, write_tiny_model};
use verl_trainer::placement::Placement;
use verl_trainer::workers::sync_weights;

/// Discover + vet + ABI-check + load + detect, as `verl-core` does at start-up, timed in-process.
pub fn startup_once(plugin_dirs: &[PathBuf], timeout: Duration) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let search = PluginSearch::standard(plugin_dirs, None)?;
    let mut registry = Registry::with_builtins();
    registry.load_all(&search);
    let (report, _) = detect_platform(&registry, &process_probe(), timeout);
    let elapsed = start.elapsed();
    black_box(report);
    Ok(elapsed)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Runs the benchmark and returns the printed report.
pub fn plugins(exe: &Path, plugin_dirs: &[PathBuf], runs: usize) -> anyhow::Result<String> {
    let mut out = String::new();
    let registry = {
        let mut r = Registry::with_builtins();
        r.load_all(&PluginSearch::standard(plugin_dirs, None)?);
        r
    };
    let loaded = registry
        .plugins()
        .iter()
        .filter(|p| p.status.is_ok())
        .count();
    let _ = writeln!(
        out,
        "plugins loaded: {loaded} (incl. built-ins), devices: {}",
        registry.devices().len()
    );

    // Each run is a fresh process, so dlopen and abi_stable's checks are really paid; the first run
    // warms the page cache and is discarded.
    let mut samples = Vec::with_capacity(runs);
    for i in 0..=runs {
        let mut cmd = Command::new(exe);
        for dir in plugin_dirs {
            cmd.arg("--plugin-dir").arg(dir);
        }
        let output = cmd
            .arg("__startup-probe")
            .output()
            .context("running the start-up probe")?;
        if !output.status.success() {
            bail!(
                "start-up probe failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let nanos: f64 = String::from_utf8_lossy(&output.stdout)
            .trim()
            .parse()
            .context("reading the start-up probe")?;
        if i > 0 {
            samples.push(nanos / 1e6);
        }
    }
    samples.sort_by(f64::total_cmp);
    let _ = writeln!(
        out,
        "startup (discover + check + load + detect), warm, {runs} processes: median {:.2} ms, p90 {:.2} ms, min {:.2} ms (goal < 20 ms)",
        percentile(&samples, 0.5),
        percentile(&samples, 0.9),
        samples[0]
    );

    // The same component called directly as a Rust trait object and through the stable ABI
    // (sabi_trait vtable + panic guard + RResult), interleaved, best of several rounds. `info` is
    // the cheapest call in the interface, so it shows the fixed per-call overhead at its largest;
    // `detect` on the real probe is the call the host actually makes.
    let cpu = registry
        .resolve(ComponentKind::DEVICE, "cpu")?
        .create_device()?;
    let direct: &dyn Device = &CpuDevice;
    let probe = process_probe();
    let info = compare_calls(
        200_000,
        || drop(black_box(direct).info()),
        || drop(black_box(&cpu).info().unwrap()),
    );
    let detect = compare_calls(
        2_000,
        || drop(black_box(direct).detect(&probe)),
        || drop(black_box(&cpu).detect(&probe).unwrap()),
    );
    for (name, (direct_ns, abi_ns)) in [("Device::info", info), ("Device::detect", detect)] {
        let _ = writeln!(
            out,
            "{name} call: direct {direct_ns:.1} ns, cross-ABI {abi_ns:.1} ns, overhead {:.1} ns per call, ratio {:.3}x (records cross as JSON; on real work see `bench components`)",
            abi_ns - direct_ns,
            abi_ns / direct_ns
        );
    }
    Ok(out)
}

/// Best-of-7 nanoseconds per call of `direct` and `through_abi`, interleaved so both see the same
/// machine load.
fn compare_calls(
    calls: u32,
    mut direct: impl FnMut(),
    mut through_abi: impl FnMut(),
) -> (f64, f64) {
    let (mut best_direct, mut best_abi) = (f64::MAX, f64::MAX);
    for _ in 0..7 {
        let t = Instant::now();
        (0..calls).for_each(|_| direct());
        best_direct = best_direct.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        (0..calls).for_each(|_| through_abi());
        best_abi = best_abi.min(t.elapsed().as_secs_f64());
    }
    let per_call = |s: f64| s * 1e9 / f64::from(calls);
    (per_call(best_direct), per_call(best_abi))
}

/// What `bench components` measures on.
pub struct ComponentBench<'a> {
    pub registry: &'a Registry,
    pub placement: &'a Placement,
    pub engine: &'a str,
    pub rollout: &'a str,
    /// A model directory; `None` makes a random Llama of `tiny` in a temporary directory.
    pub model: Option<&'a Path>,
    pub tiny: TinyModel,
    pub runs: usize,
}

/// Weight sync by reference and the cost of the record boundary on real work, each against a
/// reference measured in the same run:
/// - for each weight sync backend, the time of one sync against the time of one `memcpy` of the
///   same bytes ("copy equivalents": 1.0 means the sync costs one copy of the model);
/// - `generate` through the ABI against the time its records take to encode and decode.
pub fn components(bench: &ComponentBench<'_>) -> anyhow::Result<String> {
    let mut out = String::new();
    let scratch = tempfile::tempdir().context("creating a scratch directory")?;
    let model_dir = match bench.model {
        Some(dir) => dir.to_path_buf(),
        None => {
            let dir = scratch.path().join("model");
            std::fs::create_dir_all(&dir)?;
            write_tiny_model(&dir, &bench.tiny)?;
            dir
        }
    };
    let random_init = bench.model.is_none();
    let model = json!({"path": model_dir, "random_init": random_init});
    let mut run = bench.placement.run().clone();
    run.run_dir = scratch.path().to_string_lossy().into_owned();
    let init = |config: serde_json::Value| ComponentInit::new(config, run.clone());

    let mut actor = bench
        .registry
        .resolve_engine(bench.engine, &bench.placement.run().device_type)?
        .create_engine()?;
    actor
        .init(&init(
            json!({"role": "actor", "model": model, "ppo_mini_batch_size": 1}),
        ))
        .context("initialising the engine")?;
    let mut rollout = bench
        .registry
        .resolve(ComponentKind::ROLLOUT, bench.rollout)?
        .create_rollout()?;
    rollout
        .init(&init(json!({"model": model})))
        .context("initialising the rollout")?;

    for backend in ["naive", "disk"] {
        let mut sync = bench
            .registry
            .resolve(ComponentKind::CHECKPOINT, backend)?
            .create_checkpoint()?;
        sync.init(&init(json!({})))
            .with_context(|| format!("initialising weight sync `{backend}`"))?;
        let mut stats = sync_weights(&mut actor, &mut sync, backend, &mut rollout, 0)?;
        let mut times = Vec::with_capacity(bench.runs);
        let mut copies = Vec::with_capacity(bench.runs);
        let mut buffer = vec![0u8; stats.bytes];
        let source = vec![1u8; stats.bytes];
        for version in 1..=bench.runs as u64 {
            let t = Instant::now();
            stats = sync_weights(&mut actor, &mut sync, backend, &mut rollout, version)?;
            times.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            buffer.copy_from_slice(black_box(&source));
            black_box(&buffer);
            copies.push(t.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        copies.sort_by(f64::total_cmp);
        let (sync_ms, copy_ms) = (
            percentile(&times, 0.5) * 1e3,
            percentile(&copies, 0.5) * 1e3,
        );
        let _ = writeln!(
            out,
            "weight sync `{backend}` ({} tensors, {:.1} MB): median {sync_ms:.2} ms per sync, one memcpy of the model {copy_ms:.2} ms: {:.2} copy equivalents",
            stats.tensors,
            stats.bytes as f64 / 1e6,
            sync_ms / copy_ms
        );
    }

    // Generation: the records cross as JSON; compare their codec time with the call they carry.
    let prompts: Vec<Vec<u32>> = (0..32u32)
        .map(|i| (0..24).map(|t| 3 + (i + t) % 10).collect())
        .collect();
    let mut sampling = SamplingParams::default();
    sampling.n = 4;
    sampling.max_new_tokens = 48;
    sampling.seed = Some(1);
    let request = GenerateRequest::new(prompts, sampling);
    let (mut call_s, mut codec_s) = (f64::MAX, f64::MAX);
    for _ in 0..bench.runs.clamp(1, 5) {
        let t = Instant::now();
        let output = rollout.generate(&request).context("generating")?;
        call_s = call_s.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let sent: GenerateRequest = wire::decode("request", &wire::encode(black_box(&request)))?;
        let back: GenerateOutput = wire::decode("output", &wire::encode(black_box(&output)))?;
        codec_s = codec_s.min(t.elapsed().as_secs_f64());
        black_box((sent, back));
    }
    let _ = writeln!(
        out,
        "generate through the ABI (32 prompts x 4 samples x 48 tokens): {:.1} ms, of which record encoding/decoding {:.3} ms: ratio {:.4}x to a call without the boundary (goal <= 1.05x)",
        call_s * 1e3,
        codec_s * 1e3,
        call_s / (call_s - codec_s).max(f64::MIN_POSITIVE)
    );
    let _ = writeln!(
        out,
        "update_actor / compute_log_prob: batches cross by reference (no copy, no encoding); only the metric list is returned"
    );
    Ok(out)
}
