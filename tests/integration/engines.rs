//! Device-aware engine resolution through the released binary: `strategy=megatron` runs the
//! engine that declares it serves `megatron` on the selected platform's device type (verl's
//! MindSpeed route on Ascend), else the `megatron` engine where it runs, else a clear error. The
//! Ascend machine is a fake root (`/dev/davinci*`); MindSpeed is the test plugin's stand-in.

use std::process::Output;

use verl_testkit::FakeRoot;

use crate::helpers::*;

fn machine() -> FakeRoot {
    FakeRoot::new().cpus("0-7", "GenuineIntel", "Intel Xeon")
}

/// `verl-core ARGS` on `root` with the bundled ascend and megatron plugins, plus the MindSpeed
/// stand-in when `mindspeed`.
fn on(root: &FakeRoot, mindspeed: bool, args: &[&str]) -> Output {
    let megatron = bundled_plugin("verl_plugin_megatron");
    let ascend = bundled_plugin("verl_plugin_ascend");
    let stand_in = fixture_plugin(&["mindspeed"], None);
    let mut libs = vec![
        ("libverl_plugin_megatron.so", megatron.as_path()),
        ("libverl_plugin_ascend.so", ascend.as_path()),
    ];
    if mindspeed {
        libs.push(("libmindspeed.so", stand_in.as_path()));
    }
    let dir = plugin_dir(&libs);
    let mut full = vec!["--plugin-dir", dir.path().to_str().unwrap()];
    full.extend(args);
    verl_core_on(root, &full, &[])
}

/// `plugins list --json`'s route of `strategy`: (device type, engine or error).
fn route(root: &FakeRoot, mindspeed: bool, strategy: &str) -> (String, Result<String, String>) {
    let out = on(root, mindspeed, &["plugins", "list", "--json"]);
    let list = stdout_json(&out);
    let routes = list["engines"]
        .as_array()
        .unwrap_or_else(|| panic!("{list:#}"));
    let r = routes
        .iter()
        .find(|r| r["strategy"] == strategy)
        .unwrap_or_else(|| panic!("no route for {strategy}: {routes:#?}"));
    let target = match (r["engine"].as_str(), r["error"].as_str()) {
        (Some(engine), _) => Ok(engine.to_owned()),
        (_, Some(error)) => Err(error.to_owned()),
        _ => panic!("{r:#}"),
    };
    (r["device_type"].as_str().unwrap().to_owned(), target)
}

#[test]
fn plugins_list_shows_what_megatron_resolves_to() {
    let ascend = machine().ascend_npus(8);
    assert_eq!(
        route(&ascend, true, "megatron"),
        ("npu".to_owned(), Ok("mindspeed".to_owned()))
    );
    assert_eq!(
        route(&machine(), true, "megatron"),
        ("cpu".to_owned(), Ok("megatron".to_owned()))
    );
    let (device, missing) = route(&ascend, false, "megatron");
    assert_eq!(device, "npu");
    let error = missing.unwrap_err();
    assert!(
        error.contains("strategy `megatron` has no engine for `npu` devices: engine `megatron` runs on [cpu, cuda]")
            && error.contains("`mindspeed`"),
        "{error}"
    );
    // The table says the same.
    let out = on(&ascend, true, &["plugins", "list"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("Engines on `npu` (strategy -> engine):")
            && text.contains("megatron   -> mindspeed (test-fixture)"),
        "{text}"
    );
}

/// `score` with verl's override on the fake Ascend machine reaches the MindSpeed stand-in with the
/// reference role's `megatron` section (inherited from the actor's); without it, the message
/// names the key, the device type and what would serve it.
#[test]
fn score_with_strategy_megatron_runs_mindspeed_on_ascend() {
    let model = workspace_root().join("runtime/model/fixtures/tiny-llama");
    let input = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        input.path(),
        "{\"prompt_ids\": [1, 2], \"response_ids\": [3, 4]}\n",
    )
    .unwrap();
    let args = [
        "score",
        "--model",
        model.to_str().unwrap(),
        "--input",
        input.path().to_str().unwrap(),
        "actor_rollout_ref.actor.strategy=megatron",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
    ];
    let ascend = machine().ascend_npus(8);
    let out = on(&ascend, true, &args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(
            "initialising engine `mindspeed`: mindspeed stand-in: role \"ref\" on npu:0 with megatron {\"tensor_model_parallel_size\":2}"
        ),
        "{stderr}"
    );

    let out = on(&ascend, false, &args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(
            "error: actor_rollout_ref.actor.strategy=megatron: strategy `megatron` has no engine for `npu` devices"
        ),
        "{stderr}"
    );
}
