//! `verl-core bench plugins`: start-up cost of the plugin system and the overhead of calling a
//! component through the stable ABI, each against a reference measured in the same run.

use std::fmt::Write as _;
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use verl_plugin_host::api::{ComponentKind, Device};
use verl_plugin_host::{CpuDevice, PluginSearch, Registry, detect_platform, process_probe};

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
    let cpu = registry.resolve(ComponentKind::DEVICE, "cpu")?.create_device()?;
    let direct: &dyn Device = &CpuDevice;
    let probe = process_probe();
    let info = compare_calls(200_000, || drop(black_box(direct).info()), || drop(black_box(&cpu).info().unwrap()));
    let detect = compare_calls(2_000, || drop(black_box(direct).detect(&probe)), || drop(black_box(&cpu).detect(&probe).unwrap()));
    for (name, (direct_ns, abi_ns)) in [("Device::info", info), ("Device::detect", detect)] {
        let _ = writeln!(
            out,
            "{name} call: direct {direct_ns:.1} ns, cross-ABI {abi_ns:.1} ns, overhead {:.1} ns, ratio {:.3}x (goal <= 1.05x)",
            abi_ns - direct_ns,
            abi_ns / direct_ns
        );
    }
    Ok(out)
}

/// Best-of-7 nanoseconds per call of `direct` and `through_abi`, interleaved so both see the same
/// machine load.
fn compare_calls(calls: u32, mut direct: impl FnMut(), mut through_abi: impl FnMut()) -> (f64, f64) {
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
