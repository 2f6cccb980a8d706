//! `verl-core launch`: this node's ranks of a multi-rank job.

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;

use crate::args::{LaunchArgs, PluginArgs};
use crate::launch::{self, LaunchError, LaunchSpec};
use crate::print_error;

/// `verl-core launch`: every rank runs this binary with the global options given to launch.
pub fn run(plugins: &PluginArgs, args: LaunchArgs) -> anyhow::Result<ExitCode> {
    let subcommand = args.command[0].to_string_lossy();
    anyhow::ensure!(
        launch::LAUNCHABLE.contains(&subcommand.as_ref()),
        "launch runs one of {} after `--` (got `{subcommand}`); options such as --plugin-dir go before `--`",
        launch::LAUNCHABLE.join(", ")
    );
    let mut child_args: Vec<OsString> = Vec::new();
    for dir in &plugins.plugin_dirs {
        child_args.extend(["--plugin-dir".into(), dir.into()]);
    }
    if let Some(list) = &plugins.plugin_allowlist {
        child_args.extend(["--plugin-allowlist".into(), list.into()]);
    }
    child_args.extend([
        "--detect-timeout-ms".into(),
        plugins.detect_timeout_ms.to_string().into(),
    ]);
    child_args.extend(args.command);
    let spec = LaunchSpec {
        nproc_per_node: args.nproc_per_node,
        nnodes: args.nnodes,
        node_rank: args.node_rank,
        master_addr: args.master_addr,
        master_port: args.master_port,
        stop_timeout: Duration::from_secs(args.stop_timeout_s),
    };
    let exe = std::env::current_exe().context("locating the verl-core binary")?;
    launch::install_signal_forwarding()?;
    match launch::launch(
        &spec,
        &exe,
        &child_args,
        &launch::Output::Inherit,
        &mut launch::take_received_signal,
    ) {
        Ok(()) => Ok(ExitCode::SUCCESS),
        // The shell's convention for a job ended by a signal.
        Err(e @ LaunchError::Interrupted { signal_number, .. }) => {
            print_error(&e.to_string());
            Ok(ExitCode::from(
                u8::try_from(128 + signal_number).unwrap_or(u8::MAX),
            ))
        }
        Err(e) => Err(e.into()),
    }
}
