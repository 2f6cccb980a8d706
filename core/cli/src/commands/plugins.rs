//! `verl-core plugins list | check | certify`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use verl_plugin_host::{Registry, detect_platform, process_probe};
use verl_testkit::conformance::{self, Options};

use crate::args::{PluginArgs, PluginsCommand};
use crate::common::{allow_list, load_registry, print_json};
use crate::report;

pub fn run(
    plugins: &PluginArgs,
    timeout: Duration,
    command: PluginsCommand,
) -> anyhow::Result<ExitCode> {
    match command {
        PluginsCommand::List { json, verbose } => list(plugins, timeout, json, verbose),
        PluginsCommand::Check {
            file,
            json,
            verbose,
        } => check(plugins, &file, json, verbose),
        PluginsCommand::Certify {
            file,
            builtin,
            fixture,
            check_timeout_s,
            json,
        } => certify(plugins, file, builtin, fixture, check_timeout_s, json),
    }
}

fn list(
    plugins: &PluginArgs,
    timeout: Duration,
    json: bool,
    verbose: bool,
) -> anyhow::Result<ExitCode> {
    let registry = load_registry(plugins)?;
    let (platform, _) = detect_platform(&registry, &process_probe(), timeout);
    let plugins = report::plugins_json(&registry);
    let conflicts = report::conflicts_json(&registry);
    let engines = report::engines_json(&registry, &platform);
    if json {
        print_json(&report::ListJson {
            plugins,
            conflicts,
            platform: Some(&platform),
            engines,
        })?;
    } else {
        print!(
            "{}\n{}\n{}",
            report::plugins_text(&plugins, &conflicts, verbose),
            report::platform_text(&platform),
            report::engines_text(&engines)
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn check(
    plugins: &PluginArgs,
    file: &std::path::Path,
    json: bool,
    verbose: bool,
) -> anyhow::Result<ExitCode> {
    let allow_list = allow_list(plugins)?;
    let mut registry = Registry::with_builtins();
    let loaded = registry.load_file(file, allow_list.as_ref()).status.is_ok();
    let plugins: Vec<_> = report::plugins_json(&registry)
        .into_iter()
        .filter(|p| p.path != "<built-in>")
        .collect();
    let conflicts = report::conflicts_json(&registry);
    let ok = loaded && conflicts.is_empty();
    if json {
        print_json(&report::ListJson {
            plugins,
            conflicts,
            platform: None,
            engines: Vec::new(),
        })?;
    } else {
        print!("{}", report::plugins_text(&plugins, &conflicts, verbose));
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn certify(
    plugins: &PluginArgs,
    file: Option<PathBuf>,
    builtin: bool,
    fixture: Option<PathBuf>,
    check_timeout_s: u64,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let mut options = Options::default();
    if let Some(dir) = fixture {
        anyhow::ensure!(
            dir.join("expected.json").is_file(),
            "--fixture {}: no expected.json there",
            dir.display()
        );
        options = options.fixture(Some(dir));
    }
    options.check_timeout = Duration::from_secs(check_timeout_s);
    let report = match (file, builtin) {
        (Some(file), _) => {
            let allow_list = allow_list(plugins)?;
            conformance::certify_file(&file, allow_list.as_ref(), &options)?
        }
        (None, _) => conformance::certify_builtins(&options),
    };
    if json {
        print_json(&report)?;
    } else {
        print!("{}", report.table());
    }
    Ok(if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
