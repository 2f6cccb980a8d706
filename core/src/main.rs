use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use verl_core::config::{
    Config, ConfigSource, EngineRole, FileFormat, PluginSections, SectionKind,
};
use verl_core::data::synthetic::AdditionTask;
use verl_core::launch::{self, LaunchError, LaunchSpec};
use verl_core::placement::{self, Placement};
use verl_core::quickstart::TinyModel;
use verl_core::{bench, config_audit, inference, quickstart, report, sft, trainer};
use verl_plugin_api::{ComponentKind, SamplingParams};
use verl_plugin_host::{PluginSearch, Registry, detect_platform, process_probe};
use verl_testkit::conformance::{self, Options};

#[derive(Parser)]
#[command(
    name = "verl-core",
    version,
    about = "RL post-training of LLMs with pluggable engines, rollouts, devices and trackers"
)]
struct Cli {
    #[command(flatten)]
    plugins: PluginArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Args, Clone)]
struct PluginArgs {
    /// Directory to load plugins from; repeatable, searched before VERL_PLUGIN_PATH and the
    /// `plugins` directory next to the binary.
    #[arg(long = "plugin-dir", value_name = "DIR", global = true)]
    plugin_dirs: Vec<PathBuf>,
    /// sha256 allow-list (sha256sum format); only listed plugin files are loaded.
    #[arg(
        long,
        value_name = "FILE",
        global = true,
        env = "VERL_PLUGIN_ALLOWLIST"
    )]
    plugin_allowlist: Option<PathBuf>,
    /// Time budget for each device detection, in milliseconds.
    #[arg(long, value_name = "MS", global = true, default_value_t = 2000)]
    detect_timeout_ms: u64,
}

#[derive(Subcommand)]
enum Command {
    /// Inspect plugins.
    #[command(subcommand)]
    Plugins(PluginsCommand),
    /// Show the selected device platform and every candidate's detection.
    Platform {
        #[arg(long)]
        json: bool,
    },
    /// Train: GRPO/PPO/… with verl's config keys. Without --config, runs the embedded quickstart.
    Run(RunArgs),
    /// Supervised fine-tuning on the data's reference answers (`sft.*` keys).
    Sft(RunArgs),
    /// Show the resolved config.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Datasets.
    #[command(subcommand)]
    Data(DataCommand),
    /// Generate from a Hugging Face model directory with a rollout plugin (default: native).
    Generate(GenerateArgs),
    /// Per-token log-probs of given responses under a model, computed by an engine plugin.
    Score(ScoreArgs),
    /// Measure the plugin system.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Start this node's ranks of a multi-rank job: N children of this binary with torchrun's
    /// variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, ...).
    Launch(LaunchArgs),
    #[command(hide = true, name = "__startup-probe")]
    StartupProbe,
}

#[derive(Args)]
struct LaunchArgs {
    /// Ranks to start on this node.
    #[arg(long, value_name = "N")]
    nproc_per_node: u32,
    /// Nodes in the job.
    #[arg(long, value_name = "M", default_value_t = 1)]
    nnodes: u32,
    /// This node's index (0 hosts rank 0 and the rendezvous store).
    #[arg(long, value_name = "R", default_value_t = 0)]
    node_rank: u32,
    /// Address of node 0; default 127.0.0.1 on one node, required with several.
    #[arg(long, value_name = "A")]
    master_addr: Option<String>,
    /// Rendezvous port on node 0; default a free port on one node, 29500 with several.
    #[arg(long, value_name = "P")]
    master_port: Option<u16>,
    /// After a rank fails or a signal is forwarded, seconds the others get before SIGKILL.
    #[arg(long, value_name = "S", default_value_t = 10)]
    stop_timeout_s: u64,
    /// What every rank runs: `run`, `sft`, `score`, `generate` or `platform`, with its arguments.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    command: Vec<OsString>,
}

#[derive(Args)]
struct RunArgs {
    /// YAML or TOML config; without it, `run` uses the embedded examples/quickstart.yaml.
    #[arg(long)]
    config: Option<PathBuf>,
    /// verl-style overrides: `trainer.total_training_steps=10 trainer.logger=[console,file]`.
    overrides: Vec<String>,
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Print the config after defaults, file, VERL_* variables and overrides.
    Show {
        #[command(flatten)]
        run: RunArgs,
        #[arg(long)]
        json: bool,
    },
    /// List the keys set that nothing acts on: errors (not supported yet) and warnings (no
    /// effect), as `run` would report them; exits non-zero on an error.
    Check {
        #[command(flatten)]
        run: RunArgs,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum DataCommand {
    /// Write the synthetic addition task in verl's parquet format (train.parquet, test.parquet).
    Gen {
        #[arg(long, default_value = "data/addition")]
        output: PathBuf,
        #[arg(long, default_value_t = 2048)]
        train_size: usize,
        #[arg(long, default_value_t = 128)]
        val_size: usize,
        #[arg(long, default_value_t = 1)]
        min_digits: u32,
        #[arg(long, default_value_t = 2)]
        max_digits: u32,
        #[arg(long, default_value_t = 2)]
        operands: u32,
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// Also write the task's character-level tokenizer into this directory.
        #[arg(long)]
        tokenizer: bool,
    },
}

#[derive(Args)]
struct GenerateArgs {
    /// Hugging Face model directory (config.json, model.safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// A text prompt (tokenized with the model's tokenizer.json); repeatable.
    #[arg(long = "prompt")]
    prompts: Vec<String>,
    /// A prompt as comma-separated token ids; repeatable, one prompt per flag.
    #[arg(
        long = "prompt-ids",
        value_name = "ID,ID,...",
        value_parser = token_ids,
        allow_negative_numbers = true
    )]
    prompt_ids: Vec<TokenIds>,
    #[arg(long, default_value_t = 64)]
    max_new_tokens: u32,
    /// Greedy decoding (the default unless --temperature is given).
    #[arg(long, conflicts_with_all = ["temperature", "top_p", "top_k"])]
    greedy: bool,
    #[arg(long, value_parser = finite, allow_negative_numbers = true)]
    temperature: Option<f32>,
    #[arg(long, value_parser = finite, allow_negative_numbers = true)]
    top_p: Option<f32>,
    /// Keep the k most likely tokens; -1 (or any k ≤ 0) keeps all.
    #[arg(long, allow_negative_numbers = true)]
    top_k: Option<i32>,
    /// Samples per prompt.
    #[arg(long, default_value_t = 1)]
    n: u32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Rollout component to generate with (default: actor_rollout_ref.rollout.name, native).
    #[arg(long)]
    rollout: Option<String>,
    #[arg(long)]
    json: bool,
    /// verl config and `key=value` overrides, as `run` takes them: the rollout gets the keys of
    /// `actor_rollout_ref.rollout` they set (the model is --model's, sampling the flags').
    #[command(flatten)]
    config: RunArgs,
}

/// One `--prompt-ids` value: a prompt's token ids.
#[derive(Clone, Debug)]
struct TokenIds(Vec<u32>);

fn token_ids(text: &str) -> Result<TokenIds, String> {
    text.split(',')
        .map(|id| {
            id.trim().parse().map_err(|_| {
                format!(
                    "`{id}` is not a token id (a whole number from 0 to {})",
                    u32::MAX
                )
            })
        })
        .collect::<Result<_, _>>()
        .map(TokenIds)
}

/// A plugin file as an absolute path, so reports and the registry name it unambiguously (the host
/// opens the file itself and loads that descriptor, so a bare name is never searched for).
fn absolute(text: &str) -> Result<PathBuf, String> {
    std::path::absolute(text).map_err(|e| e.to_string())
}

/// A float that is a number (NaN and infinities cannot cross the plugin boundary as JSON).
fn finite(text: &str) -> Result<f32, String> {
    match text.parse::<f32>() {
        Ok(v) if v.is_finite() => Ok(v),
        Ok(v) => Err(format!("{v} is not a finite number")),
        Err(e) => Err(e.to_string()),
    }
}

#[derive(Args)]
struct ScoreArgs {
    #[arg(long)]
    model: PathBuf,
    /// JSONL: one {"prompt_ids": [...], "response_ids": [...]} per line.
    #[arg(long)]
    input: PathBuf,
    /// Engine strategy to score with (default: the reference role's,
    /// actor_rollout_ref.actor.strategy unless actor_rollout_ref.ref.strategy is set).
    #[arg(long)]
    engine: Option<String>,
    #[arg(long)]
    json: bool,
    /// verl config and `key=value` overrides, as `run` takes them: the engine gets the reference
    /// role's section (`actor_rollout_ref.actor` overlaid with `actor_rollout_ref.ref`).
    #[command(flatten)]
    config: RunArgs,
}

#[derive(Subcommand)]
enum PluginsCommand {
    /// Every plugin found (loaded or rejected, with the reason), its components, and the device table.
    List {
        #[arg(long)]
        json: bool,
    },
    /// Load one plugin file and show what it registers; exits non-zero when it is rejected.
    Check {
        #[arg(value_parser = absolute)]
        file: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Run the conformance suite of every component a plugin file registers (or, with
    /// `--builtin`, of the components built into verl-core) and print a pass/fail table per
    /// check; exits non-zero on any failure.
    Certify {
        #[arg(
            required_unless_present = "builtin",
            conflicts_with = "builtin",
            value_parser = absolute
        )]
        file: Option<PathBuf>,
        /// Certify the built-in components (cpu, cuda, console, file, naive, disk).
        #[arg(long)]
        builtin: bool,
        /// Model fixture for the engine and rollout suites (a Hugging Face directory with
        /// transformers' expected.json); default: runtime/model/fixtures/tiny-llama of a verl-core
        /// checkout above the current directory or the binary.
        #[arg(long, value_name = "DIR")]
        fixture: Option<PathBuf>,
        /// Limit of one check, in seconds.
        #[arg(long, value_name = "S", default_value_t = 120)]
        check_timeout_s: u64,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Start-up cost (discover + check + load + detect) and cross-ABI call overhead.
    Plugins {
        /// Start-up runs (each in a fresh process).
        #[arg(long, default_value_t = 20)]
        runs: usize,
    },
    /// Weight sync by reference (naive and disk, against a memcpy of the model) and the record
    /// boundary's cost on `generate`, through the engine and rollout plugins.
    Components {
        /// A Hugging Face model directory; default: a random Llama of the given shape.
        #[arg(long)]
        model: Option<PathBuf>,
        #[arg(long, default_value = "fsdp")]
        engine: String,
        #[arg(long, default_value = "native")]
        rollout: String,
        #[arg(long, default_value_t = 512)]
        hidden_size: usize,
        #[arg(long, default_value_t = 8)]
        layers: usize,
        #[arg(long, default_value_t = 10)]
        runs: usize,
    },
}

/// The exit status of a panic (a bug): Rust's own, so scripts see what they always saw.
const PANIC_EXIT: u8 = 101;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    // With RUST_BACKTRACE set, the standard hook stays, for developers.
    if std::env::var_os("RUST_BACKTRACE").is_none() {
        quiet_panics();
    }
    let cli = Cli::parse();
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(cli))) {
        Ok(Ok(code)) => code,
        Ok(Err(e)) => {
            print_error(&error_chain(&e));
            ExitCode::FAILURE
        }
        Err(_) => {
            let panic = LAST_PANIC
                .lock()
                .ok()
                .and_then(|mut last| last.take())
                .unwrap_or_else(|| "unknown panic".to_owned());
            print_error(&format!(
                "internal error, a bug in verl-core (please report it): {panic}"
            ));
            ExitCode::from(PANIC_EXIT)
        }
    }
}

/// The last panic's reason and place, for `main` to print as one line.
static LAST_PANIC: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// Replaces the panic hook, whose `thread … panicked at …` text (and backtrace hint) is no message
/// for a user: a panic is recorded for `main`, which reports it in one line and exits with
/// [`PANIC_EXIT`]; one on another thread is a debug log, its error reaching `main` through the
/// thread's owner.
fn quiet_panics() {
    std::panic::set_hook(Box::new(|info| {
        let reason = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "non-string panic payload".to_owned());
        let place = info
            .location()
            .map(|l| format!(" ({}:{})", l.file(), l.line()))
            .unwrap_or_default();
        let text = format!("{}{place}", without_cpp_trace(&reason));
        tracing::debug!("panic: {text}");
        if let Ok(mut last) = LAST_PANIC.lock() {
            *last = Some(text);
        }
    }));
}

/// `text` without a C++ stack trace: libtorch appends one (`frame #0: …`, `Exception raised from
/// …`) to its errors, raw or escaped inside a quoted error. Plugins built with this release cut
/// it themselves; this keeps any other plugin's from reaching the user.
fn without_cpp_trace(text: &str) -> &str {
    let cut = ["\nframe #", "\\nframe #", "Exception raised from"]
        .iter()
        .filter_map(|marker| text.find(marker))
        .min()
        .unwrap_or(text.len());
    text[..cut].trim_end()
}

/// `error: {message}` on stderr in one write: the ranks of a job share the stream, and a line
/// written in pieces (as `eprintln!` may) can be cut by another rank's.
fn print_error(message: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("error: {message}\n").as_bytes());
}

/// The error and its causes joined with ": ", leaving out a cause whose text an outer message
/// already includes (many errors print their source as part of their own message).
fn error_chain(error: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in error.chain() {
        let text = without_cpp_trace(&cause.to_string()).to_owned();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

/// `--plugin-allowlist`, read.
fn allow_list(args: &PluginArgs) -> anyhow::Result<Option<verl_plugin_host::vet::AllowList>> {
    Ok(args
        .plugin_allowlist
        .as_deref()
        .map(verl_plugin_host::vet::AllowList::from_file)
        .transpose()?)
}

fn load_registry(args: &PluginArgs) -> anyhow::Result<Registry> {
    let search = PluginSearch::standard(&args.plugin_dirs, args.plugin_allowlist.as_deref())?;
    let mut registry = Registry::with_builtins();
    registry.load_all(&search);
    Ok(registry)
}

/// The config sections the registry's plugins declare (`config_section` of each loaded component).
fn plugin_sections(registry: &Registry) -> PluginSections {
    let mut sections = PluginSections::new();
    let declared = registry
        .plugins()
        .iter()
        .filter(|p| p.status.is_ok())
        .flat_map(|p| &p.components);
    for component in declared {
        let Some(section) = &component.config_section else {
            continue;
        };
        let kind = match component.kind {
            ComponentKind::ENGINE => SectionKind::Engine,
            ComponentKind::ROLLOUT => SectionKind::Rollout,
            ComponentKind::CHECKPOINT => SectionKind::Checkpoint,
            ComponentKind::TRACKER => SectionKind::Tracker,
            _ => continue,
        };
        sections.declare(kind, section.clone());
    }
    sections
}

/// The config from `--config` (or, for `run`, the embedded quickstart), VERL_* variables and
/// overrides, with the sections of `registry`'s plugins.
fn load_config(
    args: &RunArgs,
    embedded_default: bool,
    registry: &Registry,
) -> anyhow::Result<Config> {
    let sections = plugin_sections(registry);
    let source = match (&args.config, embedded_default) {
        (Some(path), _) => Some(ConfigSource::File(path)),
        (None, true) => Some(ConfigSource::Text {
            text: quickstart::QUICKSTART_YAML,
            format: FileFormat::Yaml,
            name: "the embedded examples/quickstart.yaml",
        }),
        (None, false) => None,
    };
    Ok(Config::from_process_source(
        source,
        &args.overrides,
        &sections,
    )?)
}

/// This process's placement for training: `trainer.device=auto` follows platform selection,
/// anything else names a platform (or a torch device type) explicitly. The platform's
/// environment updates are applied before any component exists.
fn training_placement(
    config: &Config,
    registry: &Registry,
    timeout: Duration,
) -> anyhow::Result<Placement> {
    let wanted = config.trainer.device.trim().to_ascii_lowercase();
    if wanted.is_empty() || wanted == "auto" {
        return placement(registry, timeout, config.trainer.seed);
    }
    let (report, _) = detect_platform(registry, &process_probe(), timeout);
    let device = report
        .devices
        .iter()
        .find(|d| d.name == wanted || d.device_type == wanted)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "trainer.device={wanted} names no platform; known: {}",
                report
                    .devices
                    .iter()
                    .map(|d| d.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })?;
    anyhow::ensure!(
        device.available,
        "trainer.device={wanted}: {} is not available: {}",
        device.name,
        device.reason
    );
    placement::apply_env_updates(device);
    Ok(Placement::on_platform(device, config.trainer.seed)?)
}

/// A training command's ranks against `trainer.nnodes × trainer.n_gpus_per_node`: every rank
/// stops here, before anything is written.
fn check_training_ranks(placement: &Placement, config: &Config) -> anyhow::Result<()> {
    Ok(placement.check_world_size(config.trainer.nnodes, config.trainer.n_gpus_per_node)?)
}

/// This process on the selected platform; a selection error stops the command.
fn placement(registry: &Registry, timeout: Duration, seed: u64) -> anyhow::Result<Placement> {
    let (report, selection) = detect_platform(registry, &process_probe(), timeout);
    selection.context("selecting the device platform (see `verl-core platform`)")?;
    let device = report
        .selected_device()
        .expect("a selected platform has a report");
    placement::apply_env_updates(device);
    Ok(Placement::on_platform(device, seed)?)
}

/// The config audit of a training command, sized by its ranks, on its device type.
fn audit_training(
    config: &Config,
    registry: &Registry,
    placement: &Placement,
) -> anyhow::Result<()> {
    let run = placement.run();
    let context = config_audit::context(config, registry, &run.device_type, Some(run.world_size));
    config_audit::check(config, &context)?;
    Ok(())
}

/// `verl-core launch`: every rank runs this binary with the global options given to launch.
fn run_launch(plugins: &PluginArgs, args: LaunchArgs) -> anyhow::Result<ExitCode> {
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

fn print_json(value: &impl serde::Serialize) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let timeout = Duration::from_millis(cli.plugins.detect_timeout_ms);
    match cli.command {
        Command::Plugins(PluginsCommand::List { json }) => {
            let registry = load_registry(&cli.plugins)?;
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
                    report::plugins_text(&plugins, &conflicts),
                    report::platform_text(&platform),
                    report::engines_text(&engines)
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Plugins(PluginsCommand::Check { file, json }) => {
            let allow_list = allow_list(&cli.plugins)?;
            let mut registry = Registry::with_builtins();
            let loaded = registry
                .load_file(&file, allow_list.as_ref())
                .status
                .is_ok();
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
                print!("{}", report::plugins_text(&plugins, &conflicts));
            }
            Ok(if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Command::Plugins(PluginsCommand::Certify {
            file,
            builtin,
            fixture,
            check_timeout_s,
            json,
        }) => {
            let mut options = Options::default();
            if let Some(dir) = fixture {
                anyhow::ensure!(
                    dir.join("expected.json").is_file(),
                    "--fixture {}: no expected.json there",
                    dir.display()
                );
                options.fixture = Some(dir);
            }
            options.check_timeout = Duration::from_secs(check_timeout_s);
            let report = match (file, builtin) {
                (Some(file), _) => {
                    let allow_list = allow_list(&cli.plugins)?;
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
        Command::Platform { json } => {
            let registry = load_registry(&cli.plugins)?;
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
        Command::Run(args) => {
            let mut registry = load_registry(&cli.plugins)?;
            let config = load_config(&args, true, &registry)?;
            // A reward plugin named by custom_reward_function.path joins the registry.
            let allow_list = allow_list(&cli.plugins)?;
            verl_core::reward::select::load_library(&mut registry, &config, allow_list.as_ref())?;
            let placement = training_placement(&config, &registry, timeout)?;
            check_training_ranks(&placement, &config)?;
            audit_training(&config, &registry, &placement)?;
            quickstart::prepare(&config, &registry, &placement)?;
            trainer::install_interrupt_handler().context("installing the Ctrl-C handler")?;
            let summary = trainer::run(config, &registry, &placement)?;
            // Rank 0 owns the console.
            if placement.run().rank > 0 {
                return Ok(ExitCode::SUCCESS);
            }
            if let (Some(first), Some(last)) =
                (summary.validations.first(), summary.validations.last())
            {
                for (key, value) in &last.1 {
                    let before = first.1.get(key).copied().unwrap_or(f64::NAN);
                    eprintln!(
                        "{key}: {before:.3} (step {}) -> {value:.3} (step {})",
                        first.0, last.0
                    );
                }
            }
            if let Some(model) = summary.final_model {
                eprintln!("final model: {}", model.display());
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Sft(args) => {
            let registry = load_registry(&cli.plugins)?;
            let config = load_config(&args, false, &registry)?;
            let placement = training_placement(&config, &registry, timeout)?;
            check_training_ranks(&placement, &config)?;
            placement.require_single_rank("supervised fine-tuning")?;
            audit_training(&config, &registry, &placement)?;
            sft::run_sft(&config, &config.sft, &registry, &placement)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Config(ConfigCommand::Show { run, json }) => {
            let config = load_config(&run, true, &load_registry(&cli.plugins)?)?;
            if json {
                print_json(&config.to_json())?;
            } else {
                print!("{}", config.to_yaml());
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Config(ConfigCommand::Check { run, json }) => {
            let registry = load_registry(&cli.plugins)?;
            let config = load_config(&run, true, &registry)?;
            // The world size as `run` would see it; the device `trainer.device` names need not be
            // on this machine to check a config.
            let placement = placement(&registry, timeout, config.trainer.seed)?;
            let context = config_audit::context(
                &config,
                &registry,
                &placement.run().device_type,
                Some(placement.run().world_size),
            );
            let findings = verl_core::config::audit(&config, &context);
            let errors = findings
                .iter()
                .filter(|f| f.severity == verl_core::config::Severity::Error)
                .count();
            if json {
                print_json(&serde_json::json!({
                    "findings": findings,
                    "errors": errors,
                    "warnings": findings.len() - errors,
                }))?;
            } else if findings.is_empty() {
                println!("every key set is acted on");
            } else {
                for finding in &findings {
                    println!("{}: {finding}", finding.severity.as_str());
                }
            }
            Ok(if errors == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Command::Data(DataCommand::Gen {
            output,
            train_size,
            val_size,
            min_digits,
            max_digits,
            operands,
            seed,
            tokenizer,
        }) => {
            let task = AdditionTask {
                min_digits,
                max_digits,
                operands,
                train_size,
                val_size,
                seed,
            };
            let (train, val) = task.write(&output)?;
            println!("{}\n{}", train.display(), val.display());
            if tokenizer {
                verl_core::data::synthetic::write_tokenizer(&output)?;
                println!("{}", output.join("tokenizer.json").display());
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Generate(args) => {
            let registry = load_registry(&cli.plugins)?;
            let mut config = load_config(&args.config, false, &registry)?;
            // The config as given is audited (a trainer.seed in it is reported: --seed seeds the
            // request and the run).
            let given = config.clone();
            config.trainer.seed = args.seed;
            let placement = training_placement(&config, &registry, timeout)?;
            placement.require_single_rank("generation")?;
            let context = config_audit::command_context(
                &registry,
                &placement.run().device_type,
                inference::generate_scope(),
                &[(
                    "actor_rollout_ref.rollout",
                    ComponentKind::ROLLOUT,
                    args.rollout
                        .as_deref()
                        .unwrap_or(&config.actor_rollout_ref.rollout.name),
                )],
            );
            config_audit::check(&given, &context)?;
            let tokenizer = if args.prompts.is_empty() && !args.json {
                None
            } else {
                inference::load_tokenizer(&args.model).ok()
            };
            let mut prompts: Vec<Vec<u32>> = Vec::new();
            for text in &args.prompts {
                let tokenizer = tokenizer.as_ref().ok_or_else(|| {
                    anyhow::anyhow!("--prompt needs {}/tokenizer.json", args.model.display())
                })?;
                prompts.push(inference::encode(tokenizer, text)?);
            }
            prompts.extend(args.prompt_ids.iter().map(|ids| ids.0.clone()));
            anyhow::ensure!(
                !prompts.is_empty(),
                "give at least one --prompt or --prompt-ids"
            );
            let mut sampling = SamplingParams::default();
            sampling.n = args.n;
            sampling.greedy = args.temperature.is_none() || args.greedy;
            sampling.temperature = args.temperature.unwrap_or(1.0);
            sampling.top_p = args.top_p.unwrap_or(1.0);
            sampling.top_k = args.top_k.unwrap_or(-1);
            sampling.max_new_tokens = args.max_new_tokens;
            sampling.seed = Some(args.seed);
            let rollout = args
                .rollout
                .as_deref()
                .unwrap_or(&config.actor_rollout_ref.rollout.name);
            let results = inference::generate(
                &inference::GenerateSpec {
                    registry: &registry,
                    config: &config,
                    rollout,
                    model: &args.model,
                    placement: &placement,
                },
                prompts,
                sampling,
                tokenizer.as_ref(),
            )?;
            if args.json {
                print_json(&serde_json::json!({ "results": results }))?;
            } else {
                for r in &results {
                    println!(
                        "[{}] ({}) {}",
                        r.prompt_index,
                        r.finish_reason,
                        r.text
                            .clone()
                            .unwrap_or_else(|| format!("{:?}", r.response_ids))
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Score(args) => {
            let registry = load_registry(&cli.plugins)?;
            let config = load_config(&args.config, false, &registry)?;
            let placement = training_placement(&config, &registry, timeout)?;
            let engine = args
                .engine
                .as_deref()
                .unwrap_or(config.engine_strategy(EngineRole::Ref));
            let context = config_audit::command_context(
                &registry,
                &placement.run().device_type,
                inference::score_scope(),
                // The reference engine reads the actor's section under its own (engine_json).
                &[
                    ("actor_rollout_ref.actor", ComponentKind::ENGINE, engine),
                    ("actor_rollout_ref.ref", ComponentKind::ENGINE, engine),
                ],
            );
            config_audit::check(&config, &context)?;
            let (prompts, responses) = inference::read_score_input(&args.input, &args.model)?;
            let spec = inference::ScoreSpec {
                registry: &registry,
                config: &config,
                engine: args.engine.as_deref(),
                model: &args.model,
                placement: &placement,
            };
            let results = inference::score(&spec, &prompts, &responses)?;
            // Every rank holds every result; rank 0 owns the console.
            if placement.run().rank > 0 {
                return Ok(ExitCode::SUCCESS);
            }
            if args.json {
                print_json(&serde_json::json!({ "results": results }))?;
            } else {
                for (i, r) in results.iter().enumerate() {
                    println!(
                        "[{i}] sum {:.6}  {:?}",
                        r.logprobs.iter().map(|&x| f64::from(x)).sum::<f64>(),
                        r.logprobs
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench(BenchCommand::Plugins { runs }) => {
            let exe = std::env::current_exe().context("locating the verl-core binary")?;
            print!("{}", bench::plugins(&exe, &cli.plugins.plugin_dirs, runs)?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench(BenchCommand::Components {
            model,
            engine,
            rollout,
            hidden_size,
            layers,
            runs,
        }) => {
            let registry = load_registry(&cli.plugins)?;
            let placement = placement(&registry, timeout, 0)?;
            let tiny = TinyModel {
                hidden_size,
                intermediate_size: hidden_size * 4,
                num_hidden_layers: layers,
                num_attention_heads: (hidden_size / 64).max(1),
                num_key_value_heads: (hidden_size / 64).max(1),
                ..TinyModel::default()
            };
            let bench = bench::ComponentBench {
                registry: &registry,
                placement: &placement,
                engine: &engine,
                rollout: &rollout,
                model: model.as_deref(),
                tiny,
                runs: runs.max(1),
            };
            print!("{}", bench::components(&bench)?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Launch(args) => run_launch(&cli.plugins, args),
        Command::StartupProbe => {
            let elapsed = bench::startup_once(&cli.plugins.plugin_dirs, timeout)?;
            println!("{}", elapsed.as_nanos());
            Ok(ExitCode::SUCCESS)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpp_stack_traces_are_cut() {
        let raw = "libtorch: not enough memory: you tried to allocate 8 bytes\nframe #0: c10::alloc_cpu(unsigned long) + 0x3a4";
        assert_eq!(
            without_cpp_trace(raw),
            "libtorch: not enough memory: you tried to allocate 8 bytes"
        );
        let escaped = r#"panicked in generate: Torch("oom\nframe #0: c10::Error")"#;
        assert_eq!(
            without_cpp_trace(escaped),
            r#"panicked in generate: Torch("oom"#
        );
        let raised = "bad shape\nException raised from view at aten/src/ATen/native/View.cpp:12";
        assert_eq!(without_cpp_trace(raised), "bad shape");
        let toml = "TOML parse error at line 1, column 6\n  |\n1 | [data\n";
        assert_eq!(without_cpp_trace(toml), toml.trim_end(), "other lines stay");
    }

    #[test]
    fn each_prompt_ids_flag_is_one_prompt() {
        let cli = Cli::try_parse_from([
            "verl-core",
            "generate",
            "--model",
            "m",
            "--prompt-ids",
            "4,5,6",
            "--prompt-ids",
            "7, 8",
            "--top-k",
            "-1",
        ])
        .unwrap();
        let Command::Generate(args) = cli.command else {
            panic!("parsed as another command")
        };
        let prompts: Vec<Vec<u32>> = args.prompt_ids.into_iter().map(|p| p.0).collect();
        assert_eq!(prompts, vec![vec![4, 5, 6], vec![7, 8]]);
        assert_eq!(args.top_k, Some(-1));
        for bad in ["4,,5", "", "-1", "4294967296", "x"] {
            let error =
                Cli::try_parse_from(["verl-core", "generate", "--model", "m", "--prompt-ids", bad])
                    .err()
                    .unwrap_or_else(|| panic!("{bad:?} parsed"));
            assert!(error.to_string().contains("--prompt-ids"), "{error}");
        }
        let nan = Cli::try_parse_from([
            "verl-core",
            "generate",
            "--model",
            "m",
            "--temperature",
            "NaN",
        ]);
        assert!(
            nan.err()
                .unwrap()
                .to_string()
                .contains("not a finite number")
        );
    }

    /// A panic is recorded for `main`'s one line, message and place, without the C++ trace.
    #[test]
    fn the_panic_hook_records_one_line() {
        quiet_panics();
        let outcome = std::panic::catch_unwind(|| {
            panic!("Torch(\"oom\\nframe #0: c10::Error\")");
        });
        assert!(outcome.is_err());
        let recorded = LAST_PANIC.lock().unwrap().take().unwrap();
        assert!(recorded.starts_with("Torch(\"oom ("), "{recorded}");
        assert!(recorded.contains("main.rs:"), "{recorded}");
        let _ = std::panic::take_hook();
    }
}
