//! The command line: clap's definitions of every command, flag and value parser.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "verl-core",
    version,
    about = "RL post-training of LLMs with pluggable engines, rollouts, devices and trackers"
)]
pub struct Cli {
    #[command(flatten)]
    pub plugins: PluginArgs,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Args, Clone)]
pub struct PluginArgs {
    /// Directory to load plugins from; repeatable, searched before VERL_PLUGIN_PATH and the
    /// `plugins` directory next to the binary.
    #[arg(long = "plugin-dir", value_name = "DIR", global = true)]
    pub plugin_dirs: Vec<PathBuf>,
    /// sha256 allow-list (sha256sum format); only listed plugin files are loaded.
    #[arg(
        long,
        value_name = "FILE",
        global = true,
        env = "VERL_PLUGIN_ALLOWLIST"
    )]
    pub plugin_allowlist: Option<PathBuf>,
    /// Time budget for each device detection, in milliseconds.
    #[arg(long, value_name = "MS", global = true, default_value_t = 2000)]
    pub detect_timeout_ms: u64,
}

#[derive(Subcommand)]
pub enum Command {
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
pub struct LaunchArgs {
    /// Ranks to start on this node.
    #[arg(long, value_name = "N")]
    pub nproc_per_node: u32,
    /// Nodes in the job.
    #[arg(long, value_name = "M", default_value_t = 1)]
    pub nnodes: u32,
    /// This node's index (0 hosts rank 0 and the rendezvous store).
    #[arg(long, value_name = "R", default_value_t = 0)]
    pub node_rank: u32,
    /// Address of node 0; default 127.0.0.1 on one node, required with several.
    #[arg(long, value_name = "A")]
    pub master_addr: Option<String>,
    /// Rendezvous port on node 0; default a free port on one node, 29500 with several.
    #[arg(long, value_name = "P")]
    pub master_port: Option<u16>,
    /// After a rank fails or a signal is forwarded, seconds the others get before SIGKILL.
    #[arg(long, value_name = "S", default_value_t = 10)]
    pub stop_timeout_s: u64,
    /// What every rank runs: `run`, `sft`, `score`, `generate` or `platform`, with its arguments.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

#[derive(Args)]
pub struct RunArgs {
    /// YAML or TOML config; without it, `run` uses the embedded examples/quickstart.yaml.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// verl-style overrides: `trainer.total_training_steps=10 trainer.logger=[console,file]`.
    pub overrides: Vec<String>,
}

#[derive(Subcommand)]
pub enum ConfigCommand {
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
pub enum DataCommand {
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
pub struct GenerateArgs {
    /// Hugging Face model directory (config.json, model.safetensors, tokenizer.json).
    #[arg(long)]
    pub model: PathBuf,
    /// A text prompt (tokenized with the model's tokenizer.json); repeatable.
    #[arg(long = "prompt")]
    pub prompts: Vec<String>,
    /// A prompt as comma-separated token ids; repeatable, one prompt per flag.
    #[arg(
        long = "prompt-ids",
        value_name = "ID,ID,...",
        value_parser = token_ids,
        allow_negative_numbers = true
    )]
    pub prompt_ids: Vec<TokenIds>,
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: u32,
    /// Greedy decoding (the default unless --temperature is given).
    #[arg(long, conflicts_with_all = ["temperature", "top_p", "top_k"])]
    pub greedy: bool,
    #[arg(long, value_parser = finite, allow_negative_numbers = true)]
    pub temperature: Option<f32>,
    #[arg(long, value_parser = finite, allow_negative_numbers = true)]
    pub top_p: Option<f32>,
    /// Keep the k most likely tokens; -1 (or any k ≤ 0) keeps all.
    #[arg(long, allow_negative_numbers = true)]
    pub top_k: Option<i32>,
    /// Samples per prompt.
    #[arg(long, default_value_t = 1)]
    pub n: u32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Rollout component to generate with (default: actor_rollout_ref.rollout.name, native).
    #[arg(long)]
    pub rollout: Option<String>,
    #[arg(long)]
    pub json: bool,
    /// verl config and `key=value` overrides, as `run` takes them: the rollout gets the keys of
    /// `actor_rollout_ref.rollout` they set (the model is --model's, sampling the flags').
    #[command(flatten)]
    pub config: RunArgs,
}

/// One `--prompt-ids` value: a prompt's token ids.
#[derive(Clone, Debug)]
pub struct TokenIds(pub Vec<u32>);

pub fn token_ids(text: &str) -> Result<TokenIds, String> {
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
pub fn absolute(text: &str) -> Result<PathBuf, String> {
    std::path::absolute(text).map_err(|e| e.to_string())
}

/// A float that is a number (NaN and infinities cannot cross the plugin boundary as JSON).
pub fn finite(text: &str) -> Result<f32, String> {
    match text.parse::<f32>() {
        Ok(v) if v.is_finite() => Ok(v),
        Ok(v) => Err(format!("{v} is not a finite number")),
        Err(e) => Err(e.to_string()),
    }
}

#[derive(Args)]
pub struct ScoreArgs {
    #[arg(long)]
    pub model: PathBuf,
    /// JSONL: one {"prompt_ids": [...], "response_ids": [...]} per line.
    #[arg(long)]
    pub input: PathBuf,
    /// Engine strategy to score with (default: the reference role's,
    /// actor_rollout_ref.actor.strategy unless actor_rollout_ref.ref.strategy is set).
    #[arg(long)]
    pub engine: Option<String>,
    #[arg(long)]
    pub json: bool,
    /// verl config and `key=value` overrides, as `run` takes them: the engine gets the reference
    /// role's section (`actor_rollout_ref.actor` overlaid with `actor_rollout_ref.ref`).
    #[command(flatten)]
    pub config: RunArgs,
}

#[derive(Subcommand)]
pub enum PluginsCommand {
    /// Every plugin found (loaded or rejected, with the reason), its components, and the device table.
    List {
        #[arg(long)]
        json: bool,
        /// Each component's config section and declared capabilities, one `key=value` a line.
        #[arg(long, short)]
        verbose: bool,
    },
    /// Load one plugin file and show what it registers; exits non-zero when it is rejected.
    Check {
        #[arg(value_parser = absolute)]
        file: PathBuf,
        #[arg(long)]
        json: bool,
        /// Each component's config section and declared capabilities.
        #[arg(long, short)]
        verbose: bool,
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
        /// transformers' expected.json); default: runtime/model/fixtures/tiny-llama
        /// (engines) and plugins/vllm/fixtures/tiny-qwen2-hd32 (rollouts) of a verl-core checkout
        /// above the current directory or the binary.
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
pub enum BenchCommand {
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
        /// Width of the random model: a multiple of 32 (head size 64, else 32).
        #[arg(long, default_value_t = 512)]
        hidden_size: usize,
        #[arg(long, default_value_t = 8)]
        layers: usize,
        #[arg(long, default_value_t = 10)]
        runs: usize,
    },
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

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
}
