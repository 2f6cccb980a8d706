//! `verl-core plugins certify`: the bundled plugins, the built-in components and the vendor
//! example pass their kinds' conformance suites; a deliberately broken plugin fails by name.

use serde_json::Value;

use crate::helpers::*;

fn fixture_arg() -> String {
    workspace_root()
        .join("runtime/model/fixtures/tiny-llama")
        .to_string_lossy()
        .into_owned()
}

/// Runs `plugins certify --json` on `args` with the default fixtures (the checkout's, found from
/// the test's directory: tiny-llama for engines, the head-size-32 Qwen2 every bundled rollout
/// serves for rollouts); returns the exit status and the report.
fn certify(args: &[&str], env: &[(&str, &str)]) -> (bool, Value) {
    let mut all = vec!["plugins", "certify", "--json"];
    all.extend_from_slice(args);
    let out = verl_core(&all, env);
    let report = stdout_json(&out);
    (out.status.success(), report)
}

/// `(kind component name, status, reason)` of every check.
fn checks(report: &Value) -> Vec<(String, String, String)> {
    report["checks"]
        .as_array()
        .unwrap_or_else(|| panic!("no checks in {report:#}"))
        .iter()
        .map(|c| {
            (
                format!(
                    "{} {} {}",
                    c["kind"].as_str().unwrap(),
                    c["component"].as_str().unwrap(),
                    c["name"].as_str().unwrap()
                ),
                c["status"].as_str().unwrap().to_owned(),
                c["reason"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn status<'a>(checks: &'a [(String, String, String)], id: &str) -> &'a str {
    checks
        .iter()
        .find(|c| c.0 == id)
        .map(|c| c.1.as_str())
        .unwrap_or_else(|| panic!("no check `{id}` in {checks:#?}"))
}

/// Certifies a bundled plugin; every check passes except the listed skips.
fn assert_certifies(
    lib: &str,
    env: &[(&str, &str)],
    skips: &[&str],
) -> Vec<(String, String, String)> {
    let dir = plugin_dir(&[(&dylib_name(lib), &bundled_plugin(lib))]);
    let file = dir.path().join(dylib_name(lib));
    let (ok, report) = certify(&[file.to_str().unwrap()], env);
    let checks = checks(&report);
    assert!(ok, "{lib} does not certify: {checks:#?}");
    assert_eq!(report["certified"], true);
    for (id, status, reason) in &checks {
        let skipped = skips.contains(&id.as_str());
        let want = if skipped { "skip" } else { "pass" };
        assert_eq!(status, want, "{lib}: {id}: {reason}");
    }
    checks
}

#[test]
fn device_plugins_certify() {
    let rocm = assert_certifies("verl_plugin_rocm", &[], &[]);
    assert_eq!(status(&rocm, "device rocm visible_devices_filter"), "pass");
    assert_certifies("verl_plugin_ascend", &[], &[]);
}

#[test]
fn engine_and_rollout_plugins_certify_against_the_default_fixtures() {
    let fsdp = assert_certifies("verl_plugin_fsdp", &[], &[]);
    assert_eq!(fsdp.len(), 6, "{fsdp:#?}");
    // Plugin API 2.1: the trainer's object exchange between ranks.
    assert_eq!(status(&fsdp, "engine fsdp object_exchange"), "pass");
    // In-process generation: nothing to put to sleep.
    let native = assert_certifies(
        "verl_plugin_native",
        &[],
        &["rollout native sleep_and_wake_keep_the_weights"],
    );
    assert_eq!(
        status(&native, "rollout native weight_update_changes_output"),
        "pass"
    );
}

/// Offline: TensorBoard and wandb (offline mode) write files; MLflow and Trackio get a closed
/// port, so their metrics go to the spill file, which is what `nothing_lost` finds.
#[test]
fn tracker_plugin_certifies_offline() {
    let closed = "http://127.0.0.1:9";
    let checks = assert_certifies(
        "verl_plugin_trackers",
        &[
            ("MLFLOW_TRACKING_URI", closed),
            ("TRACKIO_SERVER_URL", closed),
        ],
        &[],
    );
    assert_eq!(status(&checks, "tracker tensorboard nothing_lost"), "pass");
}

#[test]
fn builtin_components_certify() {
    let (ok, report) = certify(&["--builtin"], &[]);
    let checks = checks(&report);
    assert!(ok, "{checks:#?}");
    for id in [
        "device cpu detects_declared_hardware",
        "device cuda visible_devices_filter",
        "tracker file nothing_lost",
        "checkpoint naive round_trip",
        "checkpoint disk round_trip",
        "checkpoint disk finalize_releases",
        "reward rule one_score_per_item",
        "reward rule deterministic",
        "reward rule undeclared_source_refused",
    ] {
        assert_eq!(status(&checks, id), "pass", "{id}");
    }
    // Console output goes to stderr: nothing to read back.
    assert_eq!(status(&checks, "tracker console nothing_lost"), "skip");
}

#[test]
fn a_broken_plugin_fails_with_the_named_checks() {
    let lib = fixture_plugin(&["broken-conformance"], None);
    let dir = plugin_dir(&[("libbroken.so", &lib)]);
    let file = dir.path().join("libbroken.so");
    let (ok, report) = certify(&[file.to_str().unwrap()], &[]);
    assert!(!ok, "a broken plugin must not certify: {report:#}");
    assert_eq!(report["certified"], false);
    let checks = checks(&report);
    for id in [
        "device broken detects_declared_hardware",
        "device broken visible_devices_filter",
        "rollout broken seeded_reproducibility",
        "rollout broken unsupported_methods",
    ] {
        assert_eq!(status(&checks, id), "fail", "{id}: {checks:#?}");
    }
    assert_eq!(status(&checks, "device broken no_hardware"), "pass");
    let panicked = checks
        .iter()
        .find(|c| c.0 == "rollout broken unsupported_methods")
        .unwrap();
    assert!(
        panicked.2.contains("panic") && panicked.2.contains("sleep"),
        "{panicked:?}"
    );

    // The text table names each failing check, and the exit status is non-zero.
    let out = verl_core(
        &[
            "plugins",
            "certify",
            "--fixture",
            &fixture_arg(),
            file.to_str().unwrap(),
        ],
        &[],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success());
    assert!(
        text.contains("FAIL  device broken visible_devices_filter"),
        "{text}"
    );
    assert!(text.contains("NOT certified"), "{text}");
}

#[test]
fn a_file_that_does_not_load_is_an_error() {
    let out = verl_core(&["plugins", "certify", "/nonexistent/libnothing.so"], &[]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("libnothing.so"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
