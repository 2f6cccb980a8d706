//! Nothing accepted is ignored (`config check`, and `run` stopping before anything is made), and
//! the quickstart never writes into paths the user points elsewhere.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

use crate::helpers::*;

/// The release binary in `cwd` with only `env` set (plus PATH), as `verl_core` runs it.
fn verl_core_in(cwd: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(&release().binary)
        .current_dir(cwd)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("VERL_PLUGIN_DEFAULT_DIR", "")
        .envs(env.iter().copied())
        .args(args)
        .output()
        .expect("running verl-core")
}

/// Every file and directory under `dir`, relative.
fn tree(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            found.push(path.strip_prefix(dir).unwrap().display().to_string());
            if path.is_dir() {
                stack.push(path);
            }
        }
    }
    found.sort();
    found
}

fn fsdp_plugins() -> tempfile::TempDir {
    bundled_plugins(&["verl_plugin_fsdp"])
}

/// `config check` lists each key set that nothing acts on, with its value and origin: errors for
/// what would change training (the fsdp engine's own `model_dtype` among them, as the engine
/// declares), warnings for infrastructure; `trainer.strict_config=false` makes them warnings.
#[test]
fn config_check_lists_what_is_not_acted_on() {
    let plugins = fsdp_plugins();
    let dir = plugins.path().to_str().unwrap();
    let overrides = [
        "trainer.n_gpus_per_node=8",
        "actor_rollout_ref.model.lora_rank=32",
        "++actor_rollout_ref.actor.fsdp_config.model_dtype=bf16",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "+ray_kwargs.ray_init.num_cpus=4",
        "actor_rollout_ref.actor.optim.lr=3e-6",
    ];
    let check = |extra: &[&str]| {
        let mut args = vec!["--plugin-dir", dir, "config", "check", "--json"];
        args.extend(overrides);
        args.extend(extra);
        verl_core(&args, &[])
    };
    let out = check(&[]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report = stdout_json(&out);
    let by_key = |key: &str| -> Value {
        report["findings"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["key"] == key)
            .cloned()
            .unwrap_or_else(|| panic!("no finding for {key} in {report:#}"))
    };
    assert_eq!(
        (report["errors"].as_u64(), report["warnings"].as_u64()),
        (Some(3), Some(2))
    );
    let dtype = by_key("actor_rollout_ref.actor.fsdp_config.model_dtype");
    assert_eq!(dtype["severity"], "error");
    assert_eq!(dtype["value"], "bf16");
    assert_eq!(
        dtype["origin"],
        "command-line override `++actor_rollout_ref.actor.fsdp_config.model_dtype=bf16`"
    );
    assert_eq!(by_key("trainer.n_gpus_per_node")["severity"], "error");
    assert_eq!(
        by_key("actor_rollout_ref.model.lora_rank")["severity"],
        "error"
    );
    assert_eq!(
        by_key("ray_kwargs.ray_init.num_cpus")["severity"],
        "warning"
    );
    assert_eq!(
        by_key("actor_rollout_ref.rollout.gpu_memory_utilization")["severity"],
        "warning"
    );

    let out = check(&["trainer.strict_config=false"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report = stdout_json(&out);
    assert_eq!(
        (report["errors"].as_u64(), report["warnings"].as_u64()),
        (Some(0), Some(5))
    );

    // Text: one line per finding, naming key, value and origin.
    let out = verl_core(&["config", "check", "reward_model.enable=True"], &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text.starts_with(
            "error: config key `reward_model.enable`=true (from command-line override `reward_model.enable=True`) is not supported yet"
        ),
        "{text}"
    );
}

/// `run` with a key that would change training stops before anything is made: no quickstart
/// data, no model, no run directory.
#[test]
fn run_stops_on_an_unsupported_key_before_anything_is_made() {
    let cwd = tempfile::tempdir().unwrap();
    let home = tempfile::tempdir().unwrap();
    let home_dir = home.path().to_str().unwrap();
    let out = verl_core_in(
        cwd.path(),
        &[
            "run",
            "actor_rollout_ref.model.lora_rank=32",
            "actor_rollout_ref.model.enable_activation_offload=true",
        ],
        &[("HOME", home_dir)],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    for wanted in [
        "config key `actor_rollout_ref.model.lora_rank`=32 (from command-line override `actor_rollout_ref.model.lora_rank=32`) is not supported yet",
        "config key `actor_rollout_ref.model.enable_activation_offload`=true",
        "trainer.strict_config=false",
    ] {
        assert!(
            stderr.contains(wanted),
            "`{wanted}` missing from:\n{stderr}"
        );
    }
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(tree(cwd.path()), Vec::<String>::new());
    assert_eq!(tree(home.path()), Vec::<String>::new());
}

/// A value `run` refuses (here a zero batch, and prompts that do not split over the ranks) stops
/// it before the quickstart makes its data, model or warm-up; `config check` reports the same
/// error without running anything.
#[test]
fn run_stops_on_a_bad_value_before_anything_is_made() {
    for bad in ["data.train_batch_size=0", "algorithm.adv_estimator=gdpo"] {
        let cwd = tempfile::tempdir().unwrap();
        let home = tempfile::tempdir().unwrap();
        let home_dir = home.path().to_str().unwrap();
        let out = verl_core_in(cwd.path(), &["run", bad], &[("HOME", home_dir)]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{bad}: {stderr}");
        let key = bad.split('=').next().unwrap();
        assert!(
            stderr.contains(key),
            "{bad}: the error names no key:\n{stderr}"
        );
        assert!(!stderr.contains("sft"), "{bad}: the warm-up ran:\n{stderr}");
        assert_eq!(tree(cwd.path()), Vec::<String>::new(), "{bad}");
        assert_eq!(tree(home.path()), Vec::<String>::new(), "{bad}");

        let check = verl_core_in(
            cwd.path(),
            &["config", "check", "--json", bad],
            &[("HOME", home_dir)],
        );
        assert_eq!(check.status.code(), Some(1), "{bad}");
        let report = stdout_json(&check);
        let invalid = report["invalid"].as_str().unwrap_or_default();
        assert!(invalid.contains(key), "{bad}: {report}");
        assert!(report["errors"].as_u64() >= Some(1), "{report}");
        assert_eq!(tree(cwd.path()), Vec::<String>::new(), "{bad}");
    }
}

/// verl's GSM8K quickstart overrides on `verl-core run` (the embedded quickstart): the data and
/// model they name are not the quickstart's to make, so the run stops, naming the key, and nothing
/// is written — not in $HOME, not in the working directory. Existing files there stay as they were.
#[test]
fn the_quickstart_never_writes_into_user_paths() {
    let cwd = tempfile::tempdir().unwrap();
    let home = tempfile::tempdir().unwrap();
    let home_dir = home.path().to_str().unwrap();
    let train = format!("data.train_files={home_dir}/data/gsm8k/train.parquet");
    let val = format!("data.val_files={home_dir}/data/gsm8k/test.parquet");
    let args = [
        "run",
        train.as_str(),
        val.as_str(),
        "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct",
    ];
    let out = verl_core_in(cwd.path(), &args, &[("HOME", home_dir)]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("data.train_files:") && stderr.contains("writes only inside its directory"),
        "{stderr}"
    );
    assert_eq!(tree(home.path()), Vec::<String>::new());
    assert_eq!(tree(cwd.path()), Vec::<String>::new());

    // The user's data exists: used as given, but the model id is no local directory.
    let data = home.path().join("data/gsm8k");
    std::fs::create_dir_all(&data).unwrap();
    for name in ["train.parquet", "test.parquet"] {
        std::fs::write(data.join(name), format!("the user's {name}")).unwrap();
    }
    let before = tree(home.path());
    let out = verl_core_in(cwd.path(), &args, &[("HOME", home_dir)]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(
            "actor_rollout_ref.model.path: Qwen/Qwen2.5-0.5B-Instruct is not a directory here"
        ),
        "{stderr}"
    );
    assert_eq!(tree(home.path()), before);
    for name in ["train.parquet", "test.parquet"] {
        assert_eq!(
            std::fs::read_to_string(data.join(name)).unwrap(),
            format!("the user's {name}")
        );
    }
    assert_eq!(tree(cwd.path()), Vec::<String>::new());
}
