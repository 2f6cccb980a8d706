//! Conformance suites, one per component kind, runnable against any plugin file: what
//! `verl-core plugins certify FILE` runs. Each suite drives a component through the host's typed
//! handles (the same calls the trainer makes) and reports one [`Check`] per property:
//!
//! | kind | checks |
//! |---|---|
//! | device | `info`, `no_hardware`, `detects_declared_hardware`, `visible_devices_filter`, `odd_environment` |
//! | engine | `init`, `log_probs_match_reference`, `update_deterministic`, `save_load_update_bit_identical`, `unsupported_methods`, `object_exchange` |
//! | rollout | `init`, `greedy_matches_reference`, `n_samples`, `stop_token_ids`, `max_new_tokens`, `seeded_reproducibility`, `weight_update_changes_output`, `sleep_and_wake_keep_the_weights`, `unsupported_methods` |
//! | checkpoint | `init`, `handover_as_declared`, `round_trip`, `next_version`, `finalize_releases` |
//! | tracker | `init`, `log_steps`, `log_table`, `finish`, `nothing_lost` |
//! | reward | `init`, `one_score_per_item`, `deterministic`, `order_follows_items`, `empty_batch`, `undeclared_source_refused` |
//!
//! Every check runs panic-guarded (a failed assertion or a panic is a failure naming it) and
//! time-bounded: a plugin call that does not return within [`Options::check_timeout`] fails the
//! check, and the component's remaining checks are reported as skipped. A check is skipped only
//! with a stated reason.
//!
//! **What a device declares.** A device suite must know what hardware to fake. It looks the device
//! up in [`Options::device_layouts`] by component name, then by its [`DeviceInfo`](verl_plugin_api::DeviceInfo) vendor (and
//! `device_type` "cpu"); the defaults are FakeRoot's machines: `nvidia` ([`FakeRoot::nvidia_gpus`]),
//! `amd` ([`FakeRoot::rocm_gpus`]), `huawei` ([`FakeRoot::ascend_npus`]), `intel`
//! ([`FakeRoot::intel_gpus`], discrete) and `cpu` ([`FakeRoot::cpus`]). A vendor with another
//! family adds its layout ([`Options::device_layout`]); without one the hardware checks are skipped
//! with that reason. On a layout of `n` devices, detection must report exactly `n`; each declared
//! visible-devices variable set to `"1,3"` (and `"0"`) on four devices must leave 2 (and 1).
//!
//! **Reference fixtures.** Engine and rollout suites need a model directory with an
//! `expected.json` computed by transformers: [`Options::fixture`] for engines (default
//! [`locate_fixture`], `runtime/model/fixtures/tiny-llama` of the verl-core repo, made by
//! `make_fixtures.py`) and [`Options::rollout_fixture`] for rollouts (default
//! [`locate_rollout_fixture`], `plugins/vllm/fixtures/tiny-qwen2-hd32`: head size 32, which vLLM's
//! CPU attention needs, so every bundled rollout serves it). Without one, their numeric checks are
//! skipped with that reason. Engines are initialised with verl's actor
//! section (`role`, `model.path`, `optim.lr`, `ppo_mini_batch_size`), rollouts with verl's rollout
//! section plus `model.path` — the keys the trainer sends; [`Options::engine_config`] and
//! [`Options::rollout_config`] merge extra keys in.

mod checkpoint;
mod device;
mod engine;
mod fixture;
mod reward;
mod rollout;
mod tracker;

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde::Serialize;
use verl_plugin_api::{ComponentKind, ErrorKind, PluginError};
use verl_plugin_host::{Component, LoadError, Registry, vet::AllowList};

use crate::FakeRoot;

pub use fixture::{layout, layout_split, locate_fixture, locate_rollout_fixture};

/// A fake machine with `n` devices of one family.
pub type DeviceLayout = fn(u32) -> FakeRoot;

/// What the suites run with.
#[derive(Debug, Clone)]
pub struct Options {
    /// The engine suite's model fixture directory (weights, config, tokenizer, `expected.json`).
    pub fixture: Option<PathBuf>,
    /// The rollout suite's: a model every rollout under test serves.
    pub rollout_fixture: Option<PathBuf>,
    /// Limit of one check; a check that overruns fails and stops its component's suite.
    pub check_timeout: Duration,
    /// Steps the tracker suite logs.
    pub tracker_steps: u64,
    /// Fake machines by device component name or vendor (see the module docs).
    pub device_layouts: BTreeMap<String, DeviceLayout>,
    /// Merged into the engine's init config.
    pub engine_config: serde_json::Value,
    /// Merged into the rollout's init config.
    pub rollout_config: serde_json::Value,
    /// A reward component's init config: the `custom_reward_function` section (`path`, `name`,
    /// `reward_kwargs`), e.g. a reward server's URL for the `http` reward.
    pub reward_config: serde_json::Value,
}

impl Default for Options {
    fn default() -> Self {
        let layouts: [(&str, DeviceLayout); 5] = [
            ("nvidia", |n| {
                FakeRoot::new().nvidia_gpus(n, "NVIDIA H100 80GB HBM3")
            }),
            ("amd", |n| FakeRoot::new().rocm_gpus(n)),
            ("huawei", |n| FakeRoot::new().ascend_npus(n)),
            ("intel", |n| FakeRoot::new().intel_gpus(n, false)),
            ("cpu", |n| {
                FakeRoot::new().cpus(&format!("0-{}", n.max(1) - 1), "GenuineIntel", "Xeon")
            }),
        ];
        Self {
            fixture: locate_fixture(),
            rollout_fixture: locate_rollout_fixture(),
            check_timeout: Duration::from_secs(120),
            tracker_steps: 50,
            device_layouts: layouts
                .into_iter()
                .map(|(k, f)| (k.to_owned(), f))
                .collect(),
            engine_config: serde_json::Value::Null,
            rollout_config: serde_json::Value::Null,
            reward_config: serde_json::json!({"path": null, "name": "compute_score", "reward_kwargs": {}}),
        }
    }
}

impl Options {
    /// Adds (or replaces) the fake machine for a device name or vendor.
    pub fn device_layout(mut self, name_or_vendor: &str, layout: DeviceLayout) -> Self {
        self.device_layouts
            .insert(name_or_vendor.to_owned(), layout);
        self
    }

    /// One model fixture for the engine and rollout suites.
    pub fn fixture(mut self, dir: Option<PathBuf>) -> Self {
        self.rollout_fixture.clone_from(&dir);
        self.fixture = dir;
        self
    }

    /// The `custom_reward_function` section reward components are initialised with.
    pub fn reward_config(mut self, section: serde_json::Value) -> Self {
        self.reward_config = section;
        self
    }
}

/// How a check ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Pass,
    Fail(String),
    Skipped(String),
}

impl Outcome {
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Pass => "pass",
            Self::Fail(_) => "FAIL",
            Self::Skipped(_) => "skip",
        }
    }
    pub fn reason(&self) -> &str {
        match self {
            Self::Pass => "",
            Self::Fail(r) | Self::Skipped(r) => r,
        }
    }
    pub fn is_fail(&self) -> bool {
        matches!(self, Self::Fail(_))
    }
}

impl Serialize for Outcome {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(match self {
            Self::Pass => "pass",
            Self::Fail(_) => "fail",
            Self::Skipped(_) => "skip",
        })
    }
}

/// One property of one component.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub kind: String,
    pub component: String,
    pub name: String,
    #[serde(rename = "status")]
    pub outcome: Outcome,
    /// Why it failed or was skipped; empty on a pass.
    pub reason: String,
    pub seconds: f64,
}

/// Every check of every component a plugin registers. As JSON (`plugins certify --json`):
/// `{"plugin", "version", "path", "certified", "passed", "failed", "skipped",
/// "checks": [{"kind", "component", "name", "status": "pass"|"fail"|"skip", "reason", "seconds"}]}`.
#[derive(Debug, Clone)]
pub struct Report {
    pub plugin: String,
    pub version: String,
    pub path: String,
    pub checks: Vec<Check>,
}

impl Serialize for Report {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Json<'a> {
            plugin: &'a str,
            version: &'a str,
            path: &'a str,
            certified: bool,
            passed: usize,
            failed: usize,
            skipped: usize,
            checks: &'a [Check],
        }
        let (passed, failed, skipped) = self.counts();
        Json {
            plugin: &self.plugin,
            version: &self.version,
            path: &self.path,
            certified: failed == 0,
            passed,
            failed,
            skipped,
            checks: &self.checks,
        }
        .serialize(s)
    }
}

impl Report {
    pub fn passed(&self) -> bool {
        !self.checks.iter().any(|c| c.outcome.is_fail())
    }

    pub fn failures(&self) -> impl Iterator<Item = &Check> {
        self.checks.iter().filter(|c| c.outcome.is_fail())
    }

    /// The check `kind`/`component`/`name`, if it ran.
    pub fn check(&self, kind: &str, component: &str, name: &str) -> Option<&Check> {
        self.checks
            .iter()
            .find(|c| c.kind == kind && c.component == component && c.name == name)
    }

    /// Counts of passed, failed and skipped checks.
    pub fn counts(&self) -> (usize, usize, usize) {
        let count = |f: fn(&Outcome) -> bool| self.checks.iter().filter(|c| f(&c.outcome)).count();
        (
            count(|o| *o == Outcome::Pass),
            count(Outcome::is_fail),
            count(|o| matches!(o, Outcome::Skipped(_))),
        )
    }

    /// The pass/fail table `verl-core plugins certify` prints.
    pub fn table(&self) -> String {
        let mut out = format!("{} {} ({})\n", self.plugin, self.version, self.path);
        let width = self
            .checks
            .iter()
            .map(|c| c.kind.len() + c.component.len() + c.name.len() + 2)
            .max()
            .unwrap_or(0);
        for c in &self.checks {
            let id = format!("{} {} {}", c.kind, c.component, c.name);
            let reason = if c.reason.is_empty() {
                String::new()
            } else {
                format!("  {}", c.reason.replace('\n', " "))
            };
            out.push_str(&format!(
                "  {:<4}  {id:<width$}  {:>6.2}s{reason}\n",
                c.outcome.as_str(),
                c.seconds
            ));
        }
        let (pass, fail, skip) = self.counts();
        out.push_str(&format!(
            "{}: {pass} passed, {fail} failed, {skip} skipped\n",
            if fail == 0 {
                "certified"
            } else {
                "NOT certified"
            }
        ));
        out
    }
}

/// Vets and loads `path` as the CLI would (with the host's built-in devices next to it, without
/// registering them for certification) and certifies every component it registers.
pub fn certify_file(
    path: &Path,
    allow_list: Option<&AllowList>,
    options: &Options,
) -> Result<Report, LoadError> {
    let mut registry = Registry::default();
    let record = registry.load_file(path, allow_list).clone();
    record.status.clone()?;
    Ok(Report {
        plugin: record.name.clone(),
        version: record.version.clone(),
        path: record.origin.describe(),
        checks: certify_components(&record.components, options),
    })
}

/// Certifies the components built into this process (the host's devices and whatever crates
/// linked in registered with `inventory`).
pub fn certify_builtins(options: &Options) -> Report {
    let registry = Registry::with_builtins();
    let components: Vec<Component> = registry
        .plugins()
        .iter()
        .flat_map(|p| p.components.iter().cloned())
        .collect();
    Report {
        plugin: "<built-in>".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        path: "<built-in>".into(),
        checks: certify_components(&components, options),
    }
}

/// Runs the suite of each component's kind, one component at a time.
pub fn certify_components(components: &[Component], options: &Options) -> Vec<Check> {
    let mut checks = Vec::new();
    for component in components {
        let (names, body): (&[&str], Body) = match component.kind {
            ComponentKind::DEVICE => (device::CHECKS, Box::new(device::run)),
            ComponentKind::ENGINE => (engine::CHECKS, Box::new(engine::run)),
            ComponentKind::ROLLOUT => (rollout::CHECKS, Box::new(rollout::run)),
            ComponentKind::CHECKPOINT => (checkpoint::CHECKS, Box::new(checkpoint::run)),
            ComponentKind::TRACKER => (tracker::CHECKS, Box::new(tracker::run)),
            ComponentKind::REWARD => (reward::CHECKS, Box::new(reward::run)),
            _ => continue,
        };
        checks.extend(run_suite(component, names, body, options));
    }
    checks
}

type Body = Box<dyn FnOnce(&mut Suite) + Send>;

enum Event {
    Started(&'static str),
    Done(&'static str, Outcome, f64),
}

/// What a suite body sees: its component, the options, and [`Suite::check`].
pub(crate) struct Suite {
    pub component: Component,
    pub options: Options,
    tx: mpsc::Sender<Event>,
}

/// The result of one check body: `Err` is a failure with its reason; `Ok(Outcome::Skipped(..))`
/// a skip.
pub(crate) type Verdict = Result<Outcome, String>;

impl Suite {
    /// Runs one check, panic-guarded; the runner times it.
    pub fn check(&mut self, name: &'static str, body: impl FnOnce() -> Verdict) -> bool {
        let _ = self.tx.send(Event::Started(name));
        let start = Instant::now();
        let outcome = match catch_unwind(AssertUnwindSafe(body)) {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(reason)) => Outcome::Fail(reason),
            Err(payload) => Outcome::Fail(format!("panicked: {}", panic_text(&*payload))),
        };
        let passed = outcome == Outcome::Pass;
        let _ = self
            .tx
            .send(Event::Done(name, outcome, start.elapsed().as_secs_f64()));
        passed
    }

    /// Reports `name` skipped without running anything.
    pub fn skip(&mut self, name: &'static str, reason: impl Into<String>) {
        let reason = reason.into();
        self.check(name, || Ok(Outcome::Skipped(reason)));
    }
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".to_owned())
}

fn run_suite(component: &Component, names: &[&str], body: Body, options: &Options) -> Vec<Check> {
    let (tx, rx) = mpsc::channel();
    let mut suite = Suite {
        component: component.clone(),
        options: options.clone(),
        tx,
    };
    let spawned = std::thread::Builder::new()
        .name(format!("certify-{}", component.name))
        .spawn(move || body(&mut suite));
    let kind = component.kind.to_string();
    let make = |name: &str, outcome: Outcome, seconds: f64| Check {
        kind: kind.clone(),
        component: component.name.clone(),
        name: name.to_owned(),
        reason: outcome.reason().to_owned(),
        outcome,
        seconds,
    };
    let mut done: Vec<Check> = Vec::new();
    if let Err(e) = spawned {
        return vec![make(
            "suite",
            Outcome::Fail(format!("cannot start: {e}")),
            0.0,
        )];
    }
    let mut running: Option<(&'static str, Instant)> = None;
    let mut stopped: Option<String> = None;
    loop {
        let wait = running.map_or(options.check_timeout, |(_, t)| {
            options.check_timeout.saturating_sub(t.elapsed())
        });
        match rx.recv_timeout(wait) {
            Ok(Event::Started(name)) => running = Some((name, Instant::now())),
            Ok(Event::Done(name, outcome, seconds)) => {
                running = None;
                done.push(make(name, outcome, seconds));
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                // The suite thread is left behind: a hung plugin call cannot be cancelled.
                let name = running.map_or("suite", |(n, _)| n);
                done.push(make(
                    name,
                    Outcome::Fail(format!(
                        "did not finish within {:?} (hung?)",
                        options.check_timeout
                    )),
                    options.check_timeout.as_secs_f64(),
                ));
                stopped = Some(format!("not run: `{name}` did not finish"));
                break;
            }
        }
    }
    let reason = stopped.unwrap_or_else(|| "not run: the suite stopped early".to_owned());
    for name in names {
        if !done.iter().any(|c| c.name == *name) {
            done.push(make(name, Outcome::Skipped(reason.clone()), 0.0));
        }
    }
    done
}

// ----- helpers shared by the suites -----

/// A failure naming the call, for `?` in check bodies.
pub(crate) fn call<T>(what: &str, r: Result<T, PluginError>) -> Result<T, String> {
    r.map_err(|e| format!("{what}: {} error: {e}", e.kind.as_str()))
}

/// `Err` naming `what` unless `r` is an error of kind UNSUPPORTED (a panic or a success fail).
pub(crate) fn expect_unsupported<T>(what: &str, r: Result<T, PluginError>) -> Result<(), String> {
    match r {
        Err(e) if e.kind == ErrorKind::UNSUPPORTED => Ok(()),
        Err(e) => Err(format!(
            "{what} returned a {} error, expected UNSUPPORTED: {e}",
            e.kind.as_str()
        )),
        Ok(_) => Err(format!("{what} succeeded, expected UNSUPPORTED")),
    }
}

/// For a method the component does not declare: it may work (the trainer never calls it) or
/// return UNSUPPORTED; a panic or any other error fails.
pub(crate) fn ok_or_unsupported<T>(what: &str, r: Result<T, PluginError>) -> Result<(), String> {
    match r {
        Ok(_) => Ok(()),
        other => expect_unsupported(what, other),
    }
}

/// `Err` naming `what` if `r` is a panic.
pub(crate) fn no_panic<T>(what: &str, r: Result<T, PluginError>) -> Result<(), String> {
    match r {
        Err(e) if e.kind == ErrorKind::PANIC => Err(format!("{what} panicked: {e}")),
        _ => Ok(()),
    }
}

pub(crate) fn ensure(cond: bool, reason: impl FnOnce() -> String) -> Result<(), String> {
    if cond { Ok(()) } else { Err(reason()) }
}

/// Deep-merges `extra` into `base` (objects by key, anything else replaced; null merges nothing).
pub(crate) fn merge(base: &mut serde_json::Value, extra: &serde_json::Value) {
    use serde_json::Value;
    match (base, extra) {
        (_, Value::Null) => {}
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                merge(a.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (slot, v) => *slot = v.clone(),
    }
}

pub(crate) fn tempdir() -> Result<tempfile::TempDir, String> {
    tempfile::Builder::new()
        .prefix("verl-certify-")
        .tempdir()
        .map_err(|e| format!("creating a temporary directory: {e}"))
}

#[cfg(test)]
mod tests {
    use verl_plugin_api::{
        Detection, Device, DeviceInfo, PluginBuilder, ProbeContext, visible_devices,
    };

    use super::*;

    /// An NVIDIA-style device: counts `/dev/nvidiaN`, honours CUDA_VISIBLE_DEVICES; `bug` breaks it.
    struct Gpu(&'static str);
    impl Device for Gpu {
        fn info(&self) -> DeviceInfo {
            DeviceInfo::new(self.0, "nvidia", "cuda", "nccl")
                .visible_devices_env(["CUDA_VISIBLE_DEVICES"])
        }
        fn detect(&self, probe: &ProbeContext) -> Result<Detection, PluginError> {
            let physical = probe
                .list_dir("/dev")
                .iter()
                .filter(|n| {
                    n.strip_prefix("nvidia")
                        .is_some_and(|d| d.parse::<u32>().is_ok())
                })
                .count() as u32;
            let filter = probe.var("CUDA_VISIBLE_DEVICES");
            match self.0 {
                "hangs" if physical == 2 => loop {
                    std::thread::sleep(Duration::from_secs(60));
                },
                "panics" if filter.is_some() => panic!("cannot parse {filter:?}"),
                "unfiltered" => Ok(Detection::available(physical, "all")),
                _ => Ok(Detection::available(
                    visible_devices(physical, filter).len() as u32,
                    "gpus",
                )),
            }
        }
    }

    fn certify(name: &'static str, timeout: Duration) -> Vec<Check> {
        let mut registry = Registry::default();
        registry.add_builtin(PluginBuilder::new("t", "0.1.0", "test").device(
            name,
            1,
            "d",
            move || Gpu(name),
        ));
        let options = Options {
            check_timeout: timeout,
            ..Options::default()
        };
        certify_components(&registry.plugins()[0].components, &options)
    }

    fn outcome<'a>(checks: &'a [Check], name: &str) -> &'a Outcome {
        &checks
            .iter()
            .find(|c| c.name == name)
            .unwrap_or_else(|| panic!("no check {name}: {checks:?}"))
            .outcome
    }

    #[test]
    fn a_conforming_device_passes_every_check() {
        let checks = certify("good", Duration::from_secs(30));
        assert_eq!(checks.len(), device::CHECKS.len());
        assert!(
            checks.iter().all(|c| c.outcome == Outcome::Pass),
            "{checks:#?}"
        );
    }

    #[test]
    fn failures_and_panics_are_named() {
        let checks = certify("unfiltered", Duration::from_secs(30));
        assert!(
            outcome(&checks, "visible_devices_filter").is_fail(),
            "{checks:#?}"
        );
        assert_eq!(
            *outcome(&checks, "detects_declared_hardware"),
            Outcome::Pass
        );
        let checks = certify("panics", Duration::from_secs(30));
        let Outcome::Fail(reason) = outcome(&checks, "visible_devices_filter") else {
            panic!("{checks:#?}")
        };
        assert!(
            reason.contains("panic") && reason.contains("cannot parse"),
            "{reason}"
        );
        assert!(outcome(&checks, "odd_environment").is_fail(), "{checks:#?}");
    }

    #[test]
    fn a_hung_check_fails_and_the_rest_are_skipped() {
        let checks = certify("hangs", Duration::from_millis(500));
        let Outcome::Fail(reason) = outcome(&checks, "detects_declared_hardware") else {
            panic!("{checks:#?}")
        };
        assert!(reason.contains("did not finish"), "{reason}");
        let Outcome::Skipped(reason) = outcome(&checks, "odd_environment") else {
            panic!("{checks:#?}")
        };
        assert!(reason.contains("detects_declared_hardware"), "{reason}");
        assert_eq!(checks.len(), device::CHECKS.len());
    }

    struct Lossy(std::path::PathBuf);
    impl verl_plugin_api::Tracker for Lossy {
        fn init(&mut self, init: &verl_plugin_api::ComponentInit) -> Result<(), PluginError> {
            self.0 = Path::new(&init.run.run_dir).join("metrics.txt");
            Ok(())
        }
        fn log(
            &mut self,
            step: u64,
            metrics: &[verl_plugin_api::Metric],
        ) -> Result<(), PluginError> {
            use std::io::Write;
            if step % 2 == 1 {
                let mut f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&self.0)?;
                for m in metrics {
                    writeln!(f, "{step} {} {}", m.key, m.value)?;
                }
            }
            Ok(())
        }
        fn finish(&mut self, _: i32) -> Result<(), PluginError> {
            Ok(())
        }
    }

    struct Misdeclared;
    impl verl_plugin_api::CheckpointEngine for Misdeclared {
        fn init(&mut self, _: &verl_plugin_api::ComponentInit) -> Result<(), PluginError> {
            Ok(())
        }
        fn send_weights(
            &mut self,
            _: &verl_plugin_api::WeightSource<'_>,
        ) -> Result<verl_plugin_api::Handover, PluginError> {
            Ok(verl_plugin_api::Handover::file("/nonexistent/verl-certify"))
        }
    }

    struct NoModel;
    impl verl_plugin_api::Engine for NoModel {
        fn capabilities() -> verl_plugin_api::EngineCapabilities {
            verl_plugin_api::EngineCapabilities::default().roles(["actor"])
        }
        fn init(&mut self, _: &verl_plugin_api::ComponentInit) -> Result<(), PluginError> {
            Ok(())
        }
    }

    #[test]
    fn lost_metrics_misdeclared_handovers_and_missing_fixtures_are_reported() {
        let mut registry = Registry::default();
        registry.add_builtin(
            PluginBuilder::new("t", "0.1.0", "test")
                .tracker("lossy", 1, "drops even steps", || Lossy(Default::default()))
                .checkpoint("misdeclared", 1, "says memory, hands a file", || {
                    Misdeclared
                })
                .engine("nomodel", 1, "no fixture given", || NoModel),
        );
        let options = Options {
            fixture: None,
            tracker_steps: 10,
            ..Options::default()
        };
        let checks = certify_components(&registry.plugins()[0].components, &options);
        let get = |component: &str, name: &str| {
            checks
                .iter()
                .find(|c| c.component == component && c.name == name)
                .unwrap_or_else(|| panic!("{component} {name}: {checks:#?}"))
        };
        assert_eq!(get("lossy", "log_steps").outcome, Outcome::Pass);
        let lost = &get("lossy", "nothing_lost").outcome;
        assert!(
            lost.is_fail() && lost.reason().contains("5 of 10"),
            "{lost:?}"
        );
        let declared = &get("misdeclared", "handover_as_declared").outcome;
        assert!(
            declared.is_fail() && declared.reason().contains("`file`"),
            "{declared:?}"
        );
        assert!(get("misdeclared", "round_trip").outcome.is_fail());
        for name in engine::CHECKS {
            let Outcome::Skipped(reason) = &get("nomodel", name).outcome else {
                panic!("{checks:#?}")
            };
            assert!(reason.contains("--fixture"), "{reason}");
        }
    }

    #[test]
    fn report_table_and_json() {
        let report = Report {
            plugin: "t".into(),
            version: "1".into(),
            path: "p".into(),
            checks: certify("unfiltered", Duration::from_secs(30)),
        };
        assert!(!report.passed());
        let table = report.table();
        assert!(
            table.contains("FAIL  device unfiltered visible_devices_filter"),
            "{table}"
        );
        assert!(table.contains("NOT certified"), "{table}");
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["checks"][3]["status"], "fail", "{json:#}");
        assert_eq!(json["checks"][0]["name"], "info");
        assert_eq!(
            (json["certified"].clone(), json["failed"].clone()),
            (false.into(), 1.into())
        );
    }
}
