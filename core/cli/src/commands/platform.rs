//! `verl-core platform`: the selected device platform, every candidate's detection, and where
//! this process would compute.

use std::process::ExitCode;
use std::time::Duration;

use verl_plugin_host::{detect_platform, process_probe};
use verl_trainer::placement::Placement;

use crate::args::PluginArgs;
use crate::common::{load_registry, print_json};
use crate::report;

pub fn run(plugins: &PluginArgs, timeout: Duration, json: bool) -> anyhow::Result<ExitCode> {
    let registry = load_registry(plugins)?;
    let (platform, selection) = detect_platform(&registry, &process_probe(), timeout);
    // Where this process would compute, by rank (what `launch -- platform` shows).
    let placement = platform
        .selected_device()
        .map(|device| Placement::on_platform(device, 0));
    if json {
        let mut value = serde_json::to_value(&platform)?;
        if let Some(placement) = placement {
            value["placement"] = match placement {
                Ok(p) => p.to_json(),
                Err(e) => serde_json::json!({ "error": e.to_string() }),
            };
        }
        print_json(&value)?;
    } else {
        print!("{}", report::platform_text(&platform));
        match placement {
            Some(Ok(p)) => println!("{}", p.summary()),
            Some(Err(e)) => println!("Rank: error: {e}"),
            None => {}
        }
    }
    Ok(if selection.is_ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
