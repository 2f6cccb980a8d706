//! Building the binary and plugins once per test run, plugin directories with safe permissions,
//! and running `verl-core` with a controlled environment.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, OnceLock};

use serde_json::Value;
use tempfile::TempDir;
use verl_testkit::FakeRoot;

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ is inside the workspace")
        .to_path_buf()
}

pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
}

/// Cargo for the builds a test starts (fixture plugins, the vendor example), without the lint
/// pass CI runs the workspace's own build under (scripts/test.sh: clippy-driver as
/// RUSTC_WORKSPACE_WRAPPER): those crates are built as a plugin author would build them.
pub fn cargo() -> Command {
    let mut cargo = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cargo
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env_remove("CLIPPY_ARGS");
    cargo
}

fn run_cargo(mut cmd: Command, what: &str) {
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("running cargo for {what}: {e}"));
    assert!(status.success(), "cargo failed building {what}");
}

pub fn dylib_name(lib: &str) -> String {
    format!(
        "{}{lib}{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    )
}

/// The release `verl-core` binary and the workspace's plugin libraries, built once (a no-op when the
/// README's build command already built them), or, with `VERL_RELEASE_DIR`, the ones its caller
/// built there (`scripts/test.sh` builds them in the background while other stages run).
pub struct Release {
    pub binary: PathBuf,
    pub dir: PathBuf,
}

pub fn release() -> &'static Release {
    static RELEASE: OnceLock<Release> = OnceLock::new();
    RELEASE.get_or_init(|| {
        if let Some(dir) = std::env::var_os("VERL_RELEASE_DIR").map(PathBuf::from) {
            let binary = dir.join("verl-core");
            assert!(
                binary.is_file(),
                "VERL_RELEASE_DIR={}: no verl-core binary there",
                dir.display()
            );
            return Release { binary, dir };
        }
        let mut cmd = cargo();
        cmd.current_dir(workspace_root())
            .args(["build", "--release", "-p", "verl-core"]);
        for plugin in [
            "rocm",
            "ascend",
            "fsdp",
            "megatron",
            "native",
            "trackers",
            "vllm",
            "sglang",
            "reward-http",
        ] {
            cmd.args(["-p", &format!("verl-plugin-{plugin}")]);
        }
        run_cargo(cmd, "the release binary and plugins");
        let dir = target_dir().join("release");
        Release {
            binary: dir.join("verl-core"),
            dir,
        }
    })
}

pub fn bundled_plugin(lib: &str) -> PathBuf {
    release().dir.join(dylib_name(lib))
}

/// Fixture builds share one target dir (their own, so they never wait on the outer cargo's lock)
/// and run one at a time because a feature change rebuilds the same crate.
static FIXTURE_BUILD: Mutex<()> = Mutex::new(());

/// Another release of plugin-api, as a copy of this one.
#[derive(Clone, Copy)]
pub struct Api<'a> {
    pub version: &'a str,
    /// Whether records gained fields in it (see [`grow`]).
    pub grown: bool,
}

impl<'a> Api<'a> {
    pub fn at(version: &'a str) -> Self {
        Self {
            version,
            grown: false,
        }
    }
    pub fn grown(version: &'a str) -> Self {
        Self {
            version,
            grown: true,
        }
    }
    fn key(&self) -> String {
        format!("{}{}", self.version, if self.grown { "-grown" } else { "" })
    }
}

/// Builds `tests/fixtures/test-plugin` with `features` (against a copy of plugin-api at `api`
/// when given) and returns the library's path.
pub fn fixture_plugin(features: &[&str], api: Option<Api<'_>>) -> PathBuf {
    let _guard = FIXTURE_BUILD.lock().unwrap_or_else(|e| e.into_inner());
    let key = format!(
        "{}-{}",
        api.map_or("current".to_owned(), |a| a.key()),
        if features.is_empty() {
            "default".into()
        } else {
            features.join("+")
        }
    );
    let out = target_dir()
        .join("fixture-plugins")
        .join(dylib_name(&format!("verl_test_plugin_{key}")));
    let fixture = workspace_root().join("tests/fixtures/test-plugin");
    let manifest = match api {
        None => fixture.join("Cargo.toml"),
        Some(api) => versioned_fixture(&fixture, "test-plugin", api),
    };
    let mut cmd = cargo();
    cmd.args(["build", "--quiet", "--manifest-path"])
        .arg(&manifest)
        .env("CARGO_TARGET_DIR", target_dir().join("fixture-build"));
    if !features.is_empty() {
        cmd.args(["--features", &features.join(",")]);
    }
    run_cargo(cmd, &format!("the test plugin ({key})"));
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    std::fs::copy(
        target_dir()
            .join("fixture-build/debug")
            .join(dylib_name("verl_test_plugin")),
        &out,
    )
    .unwrap();
    out
}

/// The plugin API version this workspace is at (the tests that build other releases depend on it).
pub const API_VERSION: &str = "2.4.0";

/// A copy of plugin-api at `api`, and a copy of the fixture crate `name` (from `fixture`) that
/// depends on it: what a plugin or host built against another release of the API looks like.
fn versioned_fixture(fixture: &Path, name: &str, api: Api<'_>) -> PathBuf {
    let base = target_dir().join("fixture-api").join(api.key());
    let api_dir = base.join("plugin-api");
    copy_dir(
        &workspace_root().join("plugin-api/src"),
        &api_dir.join("src"),
    );
    if api.grown {
        grow(&api_dir.join("src/components.rs"));
    }
    let real = std::fs::read_to_string(workspace_root().join("plugin-api/Cargo.toml")).unwrap();
    assert!(
        real.contains(&format!("version = \"{API_VERSION}\"")),
        "update API_VERSION and the version tests: plugin-api's version changed"
    );
    std::fs::write(
        api_dir.join("Cargo.toml"),
        format!(
            "[package]\nname = \"verl-plugin-api\"\nversion = \"{}\"\nedition = \"2024\"\n\n[dependencies]\n\
             abi_stable = \"0.11.3\"\nserde = {{ version = \"1\", features = [\"derive\"] }}\nserde_json = \"1\"\n\
             serde_path_to_error = \"0.1\"\nstrsim = \"0.11\"\n",
            api.version
        ),
    )
    .unwrap();
    let copy = base.join(name);
    copy_dir(&fixture.join("src"), &copy.join("src"));
    let manifest = std::fs::read_to_string(fixture.join("Cargo.toml"))
        .unwrap()
        .replace("../../../plugin-api", "../plugin-api");
    std::fs::write(copy.join("Cargo.toml"), manifest).unwrap();
    copy.join("Cargo.toml")
}

/// Appends fields to records, as a later 2.x release would: `RunContext::numa_node`,
/// `SamplingParams::min_p` (host → plugin) and `Completion::prompt_logprobs` (plugin → host).
/// Each edit must apply exactly once, so a reshaped plugin-api fails here, by name.
fn grow(components: &Path) {
    let mut text = std::fs::read_to_string(components).unwrap();
    let edits = [
        (
            "    pub seed: u64,\n}",
            "    pub seed: u64,\n    pub numa_node: Option<u32>,\n}",
        ),
        (
            "            seed: 0,\n        }",
            "            seed: 0,\n            numa_node: None,\n        }",
        ),
        (
            "    pub seed: Option<u64>,\n}",
            "    pub seed: Option<u64>,\n    pub min_p: f32,\n}",
        ),
        (
            "            seed: None,\n        }",
            "            seed: None,\n            min_p: 0.0,\n        }",
        ),
        (
            "    pub routed_experts: Option<RoutedExperts>,\n}",
            "    pub routed_experts: Option<RoutedExperts>,\n    pub prompt_logprobs: Vec<f32>,\n}",
        ),
        (
            "            routed_experts: None,\n        }",
            "            routed_experts: None,\n            prompt_logprobs: Vec::new(),\n        }",
        ),
    ];
    for (anchor, grown) in edits {
        assert_eq!(
            text.matches(anchor).count(),
            1,
            "growing plugin-api: `{anchor}` must occur once in components.rs"
        );
        text = text.replace(anchor, grown);
    }
    std::fs::write(components, text).unwrap();
}

/// `tests/fixtures/grown-host` built against a grown copy of plugin-api at `version`; returns the
/// binary.
pub fn grown_host(version: &str) -> PathBuf {
    let _guard = FIXTURE_BUILD.lock().unwrap_or_else(|e| e.into_inner());
    let fixture = workspace_root().join("tests/fixtures/grown-host");
    // Its manifest points at `../plugin-api`, where the copy puts the grown API.
    let copy = versioned_fixture(&fixture, "grown-host", Api::grown(version));
    let build = target_dir().join("fixture-build");
    let mut cmd = cargo();
    cmd.args(["build", "--quiet", "--manifest-path"])
        .arg(&copy)
        .env("CARGO_TARGET_DIR", &build);
    run_cargo(cmd, "the grown host");
    build.join("debug/verl-grown-host")
}

pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let dest = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &dest);
        } else {
            std::fs::copy(entry.path(), dest).unwrap();
        }
    }
}

/// A fresh plugin directory (mode 755) holding copies of `plugins` (mode 644), named as given.
/// A plugin directory holding copies of these bundled plugins (crate library names).
pub fn bundled_plugins(libs: &[&str]) -> TempDir {
    let sources: Vec<(String, PathBuf)> = libs
        .iter()
        .map(|lib| (dylib_name(lib), bundled_plugin(lib)))
        .collect();
    let plugins: Vec<(&str, &Path)> = sources
        .iter()
        .map(|(name, path)| (name.as_str(), path.as_path()))
        .collect();
    plugin_dir(&plugins)
}

pub fn plugin_dir(plugins: &[(&str, &Path)]) -> TempDir {
    let dir = tempfile::Builder::new()
        .prefix("verl-plugins-")
        .tempdir()
        .unwrap();
    set_mode(dir.path(), 0o755);
    for (name, source) in plugins {
        let dest = dir.path().join(name);
        std::fs::copy(source, &dest)
            .unwrap_or_else(|e| panic!("copying {}: {e}", source.display()));
        set_mode(&dest, 0o644);
    }
    dir
}

pub fn set_mode(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// The release binary with only `env` set (plus PATH), so the machine's own variables never leak
/// into a test.
pub fn verl_core_command(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(&release().binary);
    // No default plugin directory: an installed target/release/plugins must not leak into tests.
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("VERL_PLUGIN_DEFAULT_DIR", "")
        .args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// Runs [`verl_core_command`].
pub fn verl_core(args: &[&str], env: &[(&str, &str)]) -> Output {
    verl_core_command(args, env)
        .output()
        .expect("running verl-core")
}

/// Runs [`verl_core`] on the fake machine `root`: its fake environment only, with the device probes
/// pointed at it (`VERL_PROBE_ROOT`), plus `extra`.
pub fn verl_core_on(root: &FakeRoot, args: &[&str], extra: &[(&str, &str)]) -> Output {
    let root_path = root.path().to_str().unwrap().to_owned();
    let mut env: Vec<(&str, &str)> = root
        .fake_env()
        .vars()
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    env.push(("VERL_PROBE_ROOT", &root_path));
    env.extend(extra);
    verl_core(args, &env)
}

pub fn stdout_json(output: &Output) -> Value {
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}):\n{}\nstderr:\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

/// The `plugins` entry whose path ends with `file_name`.
pub fn plugin_entry<'a>(list: &'a Value, file_name: &str) -> &'a Value {
    list["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| {
            p["path"]
                .as_str()
                .is_some_and(|path| path.ends_with(file_name))
        })
        .unwrap_or_else(|| panic!("no plugin {file_name} in {list:#}"))
}

pub fn device<'a>(platform: &'a Value, name: &str) -> &'a Value {
    platform["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == name)
        .unwrap_or_else(|| panic!("no device {name} in {platform:#}"))
}

/// `run --config examples/quickstart.yaml …`: the quickstart task shrunk to seconds (256 training
/// prompts, 5 SFT steps, 8 prompts × 4 samples per step, validation every 2 steps,
/// constant learning rate so that a run extended on resume schedules like an uninterrupted one),
/// then `overrides`, on the data and model the quickstart makes in `work`, writing to `run_dir`.
pub fn quickstart_run_args(
    work: &Path,
    run_dir: &Path,
    steps: u64,
    save_freq: u64,
    overrides: &[&str],
) -> Vec<String> {
    let quickstart = workspace_root().join("examples/quickstart.yaml");
    let mut args = vec![
        "run".to_string(),
        "--config".to_string(),
        quickstart.display().to_string(),
    ];
    args.extend(
        [
            "quickstart.task.train_size=256",
            "sft.steps=5",
            "sft.batch_size=32",
            "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.n=4",
            "trainer.test_freq=2",
            "actor_rollout_ref.actor.optim.lr_scheduler_type=constant",
        ]
        .iter()
        .chain(overrides)
        .map(|o| o.to_string()),
    );
    let work = work.display();
    args.extend([
        format!("quickstart.dir={work}"),
        format!("data.train_files=[{work}/data/train.parquet]"),
        format!("data.val_files=[{work}/data/test.parquet]"),
        format!("actor_rollout_ref.model.path={work}/model-sft"),
        format!("trainer.default_local_dir={}", run_dir.display()),
        format!("trainer.total_training_steps={steps}"),
        format!("trainer.save_freq={save_freq}"),
    ]);
    args
}

/// Each step's metrics from a run's `metrics.jsonl`, which must hold every step once and in
/// order. Timing and throughput vary from run to run and are left out.
pub fn step_metrics(run_dir: &Path) -> BTreeMap<u64, BTreeMap<String, Value>> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    let mut by_step: BTreeMap<u64, BTreeMap<String, Value>> = BTreeMap::new();
    for line in text.lines() {
        let record: Value = serde_json::from_str(line).unwrap();
        let Some(data) = record["data"].as_object() else {
            continue;
        };
        let step = record["step"].as_u64().unwrap();
        assert!(
            by_step
                .last_key_value()
                .is_none_or(|(last, _)| *last < step),
            "step {step} after step {:?} in {}:\n{text}",
            by_step.last_key_value().map(|(s, _)| s),
            run_dir.display()
        );
        let kept = data
            .iter()
            // Time measurements, and the batch's split over the ranks (differs by world size).
            .filter(|(k, _)| {
                ![
                    "timing_s/",
                    "timing_per_token_ms/",
                    "perf/",
                    "global_seqlen/",
                    // How far the fully-async rollouter was ahead, and the trainer's wait.
                    "fully_async/monitor/",
                    "fully_async/total_wait_time",
                ]
                .iter()
                .any(|prefix| k.starts_with(prefix))
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        by_step.insert(step, kept);
    }
    by_step
}
