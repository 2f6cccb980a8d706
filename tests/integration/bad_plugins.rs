//! The bad-plugin corpus: every broken or unsafe plugin gives a clear error naming its file, and
//! never stops the good plugins next to it from loading.

use std::time::{Duration, Instant};

use crate::helpers::*;

const ROCM: &str = "libverl_plugin_rocm.so";
const ASCEND: &str = "libverl_plugin_ascend.so";

fn assert_loaded(list: &serde_json::Value, file: &str) {
    let entry = plugin_entry(list, file);
    assert_eq!(entry["status"], "loaded", "{entry:#}");
}

fn assert_rejected(list: &serde_json::Value, file: &str, needles: &[&str]) {
    let entry = plugin_entry(list, file);
    assert_eq!(entry["status"], "rejected", "{entry:#}");
    let error = entry["error"].as_str().unwrap();
    assert!(error.contains(file), "error should name the file: {error}");
    for needle in needles {
        assert!(
            error.contains(needle),
            "error should mention `{needle}`: {error}"
        );
    }
}

#[test]
fn broken_libraries_are_rejected_with_reasons_and_the_rest_load() {
    let rocm = bundled_plugin("verl_plugin_rocm");
    let scratch = tempfile::tempdir().unwrap();
    // Deterministic noise: an xorshift stream.
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let noise: Vec<u8> = (0..64 * 1024)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    let random = scratch.path().join("random");
    std::fs::write(&random, noise).unwrap();
    let truncated = scratch.path().join("truncated");
    let bytes = std::fs::read(&rocm).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() / 3]).unwrap();
    let no_root = fixture_plugin(&["no-root-module"], None);
    let major = fixture_plugin(&[], Some(Api::at("3.0.0")));
    let old_major = fixture_plugin(&[], Some(Api::at("1.4.0")));
    let minor = fixture_plugin(&[], Some(Api::grown("2.5.0")));
    let panics_registering = fixture_plugin(&["panic-register"], None);

    let dir = plugin_dir(&[
        (ROCM, &rocm),
        (ASCEND, &bundled_plugin("verl_plugin_ascend")),
        ("librandom.so", &random),
        ("libtruncated.so", &truncated),
        ("libnoroot.so", &no_root),
        ("libmajor.so", &major),
        ("liboldmajor.so", &old_major),
        ("libminor.so", &minor),
        ("libpanicreg.so", &panics_registering),
    ]);
    std::fs::write(dir.path().join("README.md"), "plugins live here\n").unwrap();
    std::fs::write(dir.path().join("libverl_plugin_rocm.so.sha256"), "x\n").unwrap();

    let out = verl_core(
        &[
            "plugins",
            "list",
            "--json",
            "--plugin-dir",
            dir.path().to_str().unwrap(),
        ],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let list = stdout_json(&out);
    assert_loaded(&list, ROCM);
    assert_loaded(&list, ASCEND);
    assert_rejected(&list, "librandom.so", &["not a loadable verl-core plugin"]);
    assert_rejected(&list, "libtruncated.so", &["truncated or corrupt library"]);
    assert_rejected(&list, "libnoroot.so", &["not a loadable verl-core plugin"]);
    assert_rejected(&list, "libmajor.so", &["3.0.0", API_VERSION, "major"]);
    assert_rejected(&list, "liboldmajor.so", &["1.4.0", API_VERSION, "major"]);
    // A newer minor whose records grew is still refused: it may rely on methods this core lacks.
    assert_rejected(&list, "libminor.so", &["2.5.0", API_VERSION, "newer"]);
    assert_rejected(
        &list,
        "libpanicreg.so",
        &["registration", "fixture registration exploded"],
    );
    // Non-plugin files are skipped quietly: not listed, not warned about.
    let listed = list["plugins"].to_string();
    assert!(
        !listed.contains("README") && !listed.contains(".sha256"),
        "{listed}"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("README"), "{stderr}");
    // The good plugins' devices still take part in detection.
    for name in ["rocm", "ascend", "cpu", "cuda"] {
        device(&list["platform"], name);
    }
    assert_eq!(list["platform"]["selected"], "cpu");
}

/// A host one minor release ahead, whose `RunContext`, `SamplingParams` and `Completion` gained
/// fields, loads a plugin built against this release and exchanges records with it both ways: the
/// plugin ignores the fields it does not know, the host reads the plugin's output with defaults.
#[test]
fn a_plugin_loads_into_a_host_whose_records_grew() {
    let plugin = fixture_plugin(&["echo-rollout"], None);
    let host = grown_host("2.5.0");
    let out = std::process::Command::new(&host)
        .arg(&plugin)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (report["host_api"].as_str(), report["plugin_api"].as_str()),
        (Some("2.5.0"), Some(API_VERSION))
    );
    let completions = report["completions"].as_array().unwrap();
    // Two prompts, n = 2; each reports [n, max_new_tokens, rank, world_size, seed].
    let prompts: Vec<u64> = completions
        .iter()
        .map(|c| c["prompt_index"].as_u64().unwrap())
        .collect();
    assert_eq!(prompts, [0, 0, 1, 1]);
    for c in completions {
        assert_eq!(c["ids"], serde_json::json!([2, 7, 2, 4, 9]));
        assert_eq!(c["prompt_logprobs"], serde_json::json!([]));
    }
}

#[test]
fn a_plugin_built_against_an_older_minor_loads() {
    // A plugin labelled 2.0.0 (built separately, from this source) loads into the 2.2 core.
    let same = fixture_plugin(&[], Some(Api::at("2.0.0")));
    let dir = plugin_dir(&[("libsame.so", &same)]);
    let out = verl_core(
        &[
            "plugins",
            "check",
            "--json",
            dir.path().join("libsame.so").to_str().unwrap(),
        ],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_loaded(&stdout_json(&out), "libsame.so");
}

#[test]
fn panicking_and_hanging_detection_fail_alone() {
    let dir = plugin_dir(&[
        ("libpanicky.so", &fixture_plugin(&["panic-detect"], None)),
        ("libhangs.so", &fixture_plugin(&["hang-detect"], None)),
        (ROCM, &bundled_plugin("verl_plugin_rocm")),
    ]);
    let start = Instant::now();
    let out = verl_core(
        &[
            "platform",
            "--json",
            "--detect-timeout-ms",
            "500",
            "--plugin-dir",
            dir.path().to_str().unwrap(),
        ],
        &[],
    );
    let elapsed = start.elapsed();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        elapsed < Duration::from_secs(10),
        "a hung detection must not hang the host ({elapsed:?})"
    );
    let platform = stdout_json(&out);
    assert_eq!(platform["selected"], "cpu");
    let panicky = device(&platform, "panicky");
    assert_eq!(panicky["available"], false);
    assert!(
        panicky["error"]
            .as_str()
            .unwrap()
            .contains("panicked in detect: fixture detection exploded"),
        "{panicky:#}"
    );
    let hangs = device(&platform, "hangs");
    assert_eq!(hangs["available"], false);
    assert!(
        hangs["error"]
            .as_str()
            .unwrap()
            .contains("did not finish within 500ms"),
        "{hangs:#}"
    );
    assert!(device(&platform, "rocm")["error"].is_null());
}

#[test]
fn same_name_and_priority_is_a_conflict_naming_both_files() {
    let clone = fixture_plugin(&["rocm-clone"], None);
    let dir = plugin_dir(&[
        (ROCM, &bundled_plugin("verl_plugin_rocm")),
        ("librocm_clone.so", &clone),
        (ASCEND, &bundled_plugin("verl_plugin_ascend")),
    ]);
    let out = verl_core(
        &[
            "plugins",
            "list",
            "--json",
            "--plugin-dir",
            dir.path().to_str().unwrap(),
        ],
        &[],
    );
    let list = stdout_json(&out);
    assert_loaded(&list, ASCEND);
    let conflicts = list["conflicts"].as_array().unwrap();
    assert_eq!(conflicts.len(), 1, "{list:#}");
    let error = conflicts[0]["error"].as_str().unwrap();
    assert!(
        error.contains(ROCM) && error.contains("librocm_clone.so") && error.contains("priority 90"),
        "{error}"
    );
    for file in [ROCM, "librocm_clone.so"] {
        assert_eq!(
            plugin_entry(&list, file)["components"][0]["status"],
            "conflict"
        );
    }
    let rocm_device = device(&list["platform"], "rocm");
    assert!(
        rocm_device["error"]
            .as_str()
            .unwrap()
            .contains("librocm_clone.so"),
        "{rocm_device:#}"
    );
    assert_eq!(list["platform"]["selected"], "cpu");
    // `plugins check` reports the conflict with the bundled plugin only when both are loaded.
    let out = verl_core(
        &[
            "plugins",
            "check",
            dir.path().join("librocm_clone.so").to_str().unwrap(),
        ],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn a_second_copy_of_a_plugin_is_ignored_in_favour_of_the_first_found() {
    let rocm = bundled_plugin("verl_plugin_rocm");
    let first = plugin_dir(&[(ROCM, &rocm)]);
    // A later file of the same name is not opened at all: were it, this one would be rejected as
    // no loadable plugin.
    let second = plugin_dir(&[("librocm_copy.so", &rocm)]);
    std::fs::write(second.path().join(ROCM), b"not even a library").unwrap();
    let out = verl_core(
        &[
            "plugins",
            "list",
            "--json",
            "--plugin-dir",
            first.path().to_str().unwrap(),
            "--plugin-dir",
            second.path().to_str().unwrap(),
        ],
        &[],
    );
    let list = stdout_json(&out);
    assert!(list["conflicts"].as_array().unwrap().is_empty(), "{list:#}");
    let entries: Vec<&serde_json::Value> = list["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["path"].as_str().unwrap().ends_with(ROCM))
        .collect();
    assert_eq!(entries.len(), 2);
    assert_eq!(entries[0]["status"], "loaded");
    assert!(
        entries[0]["path"]
            .as_str()
            .unwrap()
            .starts_with(first.path().to_str().unwrap())
    );
    assert_eq!(entries[1]["status"], "rejected");
    let error = entries[1]["error"].as_str().unwrap();
    assert!(
        error.contains("not opened")
            && error.contains("already loaded from")
            && error.contains(first.path().to_str().unwrap()),
        "{error}"
    );
    // A copy under another file name can only be recognised by the name it declares, once opened.
    assert_rejected(
        &list,
        "librocm_copy.so",
        &["plugin `rocm` is already loaded from", "was opened"],
    );
}

#[test]
fn writable_plugins_and_directories_are_refused_before_loading() {
    let rocm = bundled_plugin("verl_plugin_rocm");
    let ascend = bundled_plugin("verl_plugin_ascend");
    let safe = plugin_dir(&[(ROCM, &rocm), (ASCEND, &ascend)]);
    set_mode(&safe.path().join(ASCEND), 0o666);
    let open_dir = plugin_dir(&[("libverl_plugin_other.so", &ascend)]);
    set_mode(open_dir.path(), 0o777);
    let out = verl_core(
        &[
            "plugins",
            "list",
            "--json",
            "--plugin-dir",
            safe.path().to_str().unwrap(),
            "--plugin-dir",
            open_dir.path().to_str().unwrap(),
        ],
        &[],
    );
    let list = stdout_json(&out);
    assert_loaded(&list, ROCM);
    assert_rejected(
        &list,
        ASCEND,
        &["writable by group or others", "file", "666"],
    );
    assert_rejected(
        &list,
        "libverl_plugin_other.so",
        &["writable by group or others", "directory", "777"],
    );
    let out = verl_core(
        &[
            "plugins",
            "check",
            safe.path().join(ASCEND).to_str().unwrap(),
        ],
        &[],
    );
    assert!(!out.status.success());
    // The developers' escape hatch is explicit and loads with a warning naming the broken rule.
    let out = verl_core(
        &[
            "plugins",
            "list",
            "--json",
            "--plugin-dir",
            safe.path().to_str().unwrap(),
        ],
        &[("VERL_PLUGIN_INSECURE_PERMISSIONS", "1")],
    );
    assert_loaded(&stdout_json(&out), ASCEND);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("writable by group or others")
            && stderr.contains("loaded anyway: VERL_PLUGIN_INSECURE_PERMISSIONS=1"),
        "{stderr}"
    );
}

/// The uid this test process runs as (the owner of a file it creates).
fn own_uid() -> u32 {
    use std::os::unix::fs::MetadataExt;
    tempfile::tempfile().unwrap().metadata().unwrap().uid()
}

const STRANGER: u32 = 12345;

#[test]
fn files_and_directories_of_another_uid_are_refused() {
    let rocm = bundled_plugin("verl_plugin_rocm");
    let ascend = bundled_plugin("verl_plugin_ascend");
    if own_uid() != 0 {
        // Only root can give files away; the host's unit tests check the rule for any uid.
        eprintln!("not root: plugin files owned by another uid cannot be made here");
        return;
    }
    let mine = plugin_dir(&[(ROCM, &rocm), ("libforeign.so", &ascend)]);
    std::os::unix::fs::chown(mine.path().join("libforeign.so"), Some(STRANGER), None).unwrap();
    // A root-owned plugin in a directory that another uid owns (and so may rename or replace).
    let theirs = plugin_dir(&[(ASCEND, &ascend)]);
    std::os::unix::fs::chown(theirs.path(), Some(STRANGER), None).unwrap();
    let out = verl_core(
        &[
            "plugins",
            "list",
            "--json",
            "--plugin-dir",
            mine.path().to_str().unwrap(),
            "--plugin-dir",
            theirs.path().to_str().unwrap(),
        ],
        &[],
    );
    let list = stdout_json(&out);
    assert_loaded(&list, ROCM);
    assert_rejected(
        &list,
        "libforeign.so",
        &["refused before loading: file", "owned by uid 12345"],
    );
    assert_rejected(
        &list,
        ASCEND,
        &[
            &format!(
                "directory {} is owned by uid 12345",
                theirs.path().display()
            ),
            "neither root nor you (uid 0)",
        ],
    );
    let out = verl_core(
        &[
            "plugins",
            "check",
            mine.path().join("libforeign.so").to_str().unwrap(),
        ],
        &[],
    );
    assert!(!out.status.success());
}

#[test]
fn links_and_directories_that_others_may_write_are_refused() {
    let rocm = bundled_plugin("verl_plugin_rocm");
    let ascend = bundled_plugin("verl_plugin_ascend");
    let top = tempfile::tempdir().unwrap();
    set_mode(top.path(), 0o755);
    let mkdir = |rel: &str, mode: u32| {
        let dir = top.path().join(rel);
        std::fs::create_dir_all(&dir).unwrap();
        set_mode(&dir, mode);
        dir
    };
    // A link in a directory anyone may write, pointing at a safe plugin: the link could be
    // replaced at any moment, so the safe target does not help. Sticky or not.
    let safe = mkdir("safe", 0o755);
    std::fs::copy(&rocm, safe.join(ROCM)).unwrap();
    set_mode(&safe.join(ROCM), 0o644);
    let open = mkdir("open", 0o777);
    std::os::unix::fs::symlink(safe.join(ROCM), open.join("liblinked.so")).unwrap();
    let sticky = mkdir("sticky", 0o1777);
    std::os::unix::fs::symlink(safe.join(ROCM), sticky.join("libsticky.so")).unwrap();
    // A safe plugin directory under an ancestor that anyone may write, without and with the
    // sticky bit (the sticky one, like /tmp, is accepted).
    let under_open = mkdir("shared/plugins", 0o755);
    set_mode(&top.path().join("shared"), 0o777);
    std::fs::copy(&ascend, under_open.join(ASCEND)).unwrap();
    set_mode(&under_open.join(ASCEND), 0o644);
    let under_sticky = mkdir("tmp-like/plugins", 0o755);
    set_mode(&top.path().join("tmp-like"), 0o1777);
    std::fs::copy(&ascend, under_sticky.join("libascend_sticky.so")).unwrap();
    set_mode(&under_sticky.join("libascend_sticky.so"), 0o644);

    let out = verl_core(
        &[
            "plugins",
            "list",
            "--json",
            "--plugin-dir",
            open.to_str().unwrap(),
            "--plugin-dir",
            sticky.to_str().unwrap(),
            "--plugin-dir",
            under_open.to_str().unwrap(),
            "--plugin-dir",
            under_sticky.to_str().unwrap(),
            "--plugin-dir",
            safe.to_str().unwrap(),
        ],
        &[],
    );
    let list = stdout_json(&out);
    assert_rejected(
        &list,
        "liblinked.so",
        &[
            &format!("directory {} ", open.display()),
            "writable by group or others (mode 777)",
        ],
    );
    assert_rejected(
        &list,
        "libsticky.so",
        &[
            &format!("directory {} ", sticky.display()),
            "writable by group or others (mode 1777)",
        ],
    );
    assert_rejected(
        &list,
        ASCEND,
        &[
            &format!("directory {} ", top.path().join("shared").display()),
            "writable by others without the sticky bit (mode 777)",
        ],
    );
    assert_loaded(&list, "libascend_sticky.so");
    assert_loaded(&list, ROCM);
    // The refusals are listed, one line each, in the text view too; the rest is unaffected.
    let out = verl_core(
        &[
            "plugins",
            "list",
            "--plugin-dir",
            open.to_str().unwrap(),
            "--plugin-dir",
            safe.to_str().unwrap(),
        ],
        &[],
    );
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(" loaded, 1 rejected\n")
            && text.contains(&format!(
                "[rejected] {}\n      {}: refused before loading: directory",
                open.join("liblinked.so").display(),
                open.join("liblinked.so").display()
            )),
        "{text}"
    );
}

/// The race the descriptor closes: the path is checked, then replaced by another library before it
/// is loaded. What loads is the checked file.
#[test]
fn a_path_replaced_after_the_check_still_loads_the_checked_file() {
    use verl_testkit::host::{load_manifest, vet};
    let dir = plugin_dir(&[
        ("libswap.so", &bundled_plugin("verl_plugin_rocm")),
        ("ascend.next", &bundled_plugin("verl_plugin_ascend")),
    ]);
    let path = dir.path().join("libswap.so");
    let checked = vet::open(&path, None).unwrap();
    std::fs::rename(dir.path().join("ascend.next"), &path).unwrap();
    let loaded = load_manifest(checked).unwrap().info().unwrap();
    assert_eq!(loaded.name, "rocm");
    // The swap did happen: the path now leads to the other plugin.
    let now = load_manifest(vet::open(&path, None).unwrap())
        .unwrap()
        .info()
        .unwrap();
    assert_eq!(now.name, "ascend");
}

#[test]
fn a_run_that_needs_a_refused_plugin_says_why_it_was_refused() {
    let dir = bundled_plugins(&["verl_plugin_native", "verl_plugin_fsdp"]);
    let native = dir.path().join("libverl_plugin_native.so");
    set_mode(&native, 0o664);
    let model = workspace_root().join("runtime/model/fixtures/tiny-llama");
    let out = verl_core(
        &[
            "generate",
            "--plugin-dir",
            dir.path().to_str().unwrap(),
            "--model",
            model.to_str().unwrap(),
            "--prompt-ids",
            "1,2,3",
        ],
        &[],
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no rollout component named `native`")
            && stderr.contains(&format!(
                "{}: refused before loading: file {} is writable by group or others (mode 664)",
                native.display(),
                native.display()
            ))
            && !stderr.contains("panicked"),
        "{stderr}"
    );
}

#[test]
fn allow_list_admits_only_listed_digests() {
    let rocm = bundled_plugin("verl_plugin_rocm");
    let dir = plugin_dir(&[
        (ROCM, &rocm),
        (ASCEND, &bundled_plugin("verl_plugin_ascend")),
    ]);
    let digest = String::from_utf8(
        std::process::Command::new("sha256sum")
            .arg(&rocm)
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    let allow = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(allow.path(), digest).unwrap();
    let out = verl_core(
        &[
            "plugins",
            "list",
            "--json",
            "--plugin-dir",
            dir.path().to_str().unwrap(),
        ],
        &[("VERL_PLUGIN_ALLOWLIST", allow.path().to_str().unwrap())],
    );
    let list = stdout_json(&out);
    assert_loaded(&list, ROCM);
    assert_rejected(&list, ASCEND, &["not in the allow-list"]);
}

#[test]
fn discovery_order_is_flags_then_env_path() {
    let rocm = bundled_plugin("verl_plugin_rocm");
    let first = plugin_dir(&[("liba_rocm.so", &rocm)]);
    let second = plugin_dir(&[(ASCEND, &bundled_plugin("verl_plugin_ascend"))]);
    let missing = first.path().join("nope");
    let out = verl_core(
        &[
            "plugins",
            "list",
            "--json",
            "--plugin-dir",
            first.path().to_str().unwrap(),
        ],
        &[(
            "VERL_PLUGIN_PATH",
            &format!("{}:{}", second.path().display(), missing.display()),
        )],
    );
    let list = stdout_json(&out);
    let paths: Vec<&str> = list["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["path"].as_str().unwrap())
        .collect();
    let pos = |needle: &str| {
        paths
            .iter()
            .position(|p| p.ends_with(needle))
            .unwrap_or_else(|| panic!("{needle} in {paths:?}"))
    };
    assert!(
        pos("<built-in>") < pos("liba_rocm.so") && pos("liba_rocm.so") < pos(ASCEND),
        "{paths:?}"
    );
    assert_rejected(&list, "nope", &["cannot read plugin directory"]);
}
