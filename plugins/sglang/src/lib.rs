//! # verl-plugin-sglang
//!
//! The `sglang` rollout: generation on SGLang's native server API, started by the plugin or
//! attached to, and weights reloaded from the files the `disk` weight sync writes. Servers,
//! concurrency, retries and errors are [`verl_rollout_http`]'s; this crate is SGLang's protocol.
//!
//! **Servers.** `actor_rollout_ref.rollout.engine_kwargs.sglang.urls` (or the `VERL_SGLANG_URLS`
//! environment variable, comma-separated) attaches to running servers, load-balanced. Otherwise
//! the plugin starts one: `<python> -m sglang.launch_server --model-path <model.path> …` (`python`
//! default `python3`, or `command`), on a free port, its log in `<run_dir>/sglang/`. SGLang needs
//! a GPU: PyPI has no CPU build of its kernel library, so a started server fails on a CPU-only
//! machine and the error says so.
//!
//! **Generation.** One `POST /generate` per prompt, a batch of its `n` samples (`input_ids` the
//! prompt `n` times, one `sampling_params` each): SGLang's `n` would give every sample the same
//! `sampling_seed`, and so the same tokens. Every sampling setting is sent, so the model's
//! `generation_config.json` defaults never apply; `return_logprob` gives each token's log-prob in
//! `meta_info.output_token_logprobs`, checked token by token against `output_ids`: by default
//! (without `SGLANG_RETURN_ORIGINAL_LOGPROB`) SGLang's sampler reports the log-prob under the
//! temperature-scaled distribution, as the actor computes it.
//!
//! **Weights.** By file: on `update_weights` each server runs `/update_weights_from_disk
//! {model_path, weight_version, flush_cache}` then `/flush_cache` (no cached prefix keeps the old
//! weights' KV), and must then report the new version. Before each generation every server's
//! `/model_info` (`/get_model_info` on older servers) must report the version the plugin last
//! set, and every answer's `meta_info.weight_version` must be it: a restarted server, or a reload
//! that failed on one replica, stops the run instead of producing samples from stale weights.
//!
//! **By collective transfer** (`weight_sync: collective`; see [`collective`]): the trainer's
//! tensors, lent by the `naive` weight sync, are broadcast from the trainer (rank 0) to every
//! server's workers. Once: `/init_weights_update_group {master_address, master_port,
//! rank_offset, world_size, group_name, backend}` on every server while the trainer forms the
//! torch.distributed group with them. Each sync: `/update_weights_from_distributed {names,
//! dtypes, shapes, group_name, flush_cache, weight_version}` while the trainer broadcasts each
//! tensor, then `/flush_cache`, then every server must report the step as its version. With
//! `group_backend: nccl` (SGLang's default) it needs a GPU; with `gloo` it runs on a CPU, which
//! is how it is tested here, against a protocol server that receives with SGLang's own group code.
//!
//! **Sleep/wake.** `/release_memory_occupation` and `/resume_memory_occupation`, which free and
//! restore GPU memory on a server started with `--enable-memory-saver` (the plugin adds it to a
//! server it starts unless `enable_memory_saver: false`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use verl_plugin_api::{
    ComponentInit, ConfigKeys, FinishReason, GenerateOutput, GenerateRequest, PluginBuilder,
    PluginError, Rollout, RolloutCapabilities, SamplingParams, WeightSource, WeightSourceKind,
};
use verl_rollout_http::{
    Collective, CollectiveSettings, HttpError, Launch, Method, Pool, Protocol, Sample,
    ServerSettings, WeightSync, check_weights_dir, excerpt, prompt_seed, server_section,
};

pub mod collective;

/// The section this plugin owns, where verl keeps SGLang's engine settings.
pub const SECTION: &str = "actor_rollout_ref.rollout.engine_kwargs.sglang";
/// Attach to these servers (comma-separated URLs) when the section names none.
pub const URLS_ENV: &str = "VERL_SGLANG_URLS";
const SERVER_MODULE: &str = "sglang.launch_server";
/// Why a started server may not come up, added to every start failure.
const NO_CPU_BUILD: &str = "SGLang needs a GPU: PyPI has no CPU build of its kernel library \
     (sgl-kernel), so `sglang.launch_server` cannot serve on a CPU-only machine; attach to a \
     server on a GPU machine with `urls`, or use the `vllm` or `native` rollout";

/// SGLang's own keys of the section, in its server-argument names (the server keys are
/// [`ServerSettings`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SglangSettings {
    /// `--dtype`; default the rollout's `dtype`, else SGLang's `auto`.
    pub dtype: Option<String>,
    /// `--context-length`; default the rollout's `max_model_len`, else prompt + response length.
    pub context_length: Option<u64>,
    /// `--mem-fraction-static`; default the rollout's `gpu_memory_utilization`.
    pub mem_fraction_static: Option<f64>,
    /// `--enable-memory-saver`: lets sleep/wake free and restore GPU memory.
    pub enable_memory_saver: bool,
    /// How new weights reach the servers: `file` (default; `/update_weights_from_disk` of the
    /// `disk` weight sync's directory) or `collective` (`/update_weights_from_distributed` of the
    /// trainer's broadcasts; the `naive` weight sync).
    pub weight_sync: WeightSync,
    /// The group of the `collective` weight sync.
    pub collective: CollectiveSettings,
    /// Its torch.distributed group name (SGLang's default).
    pub group_name: String,
    /// Its backend: `nccl` (SGLang's default; GPU) or `gloo`.
    pub group_backend: String,
}

impl Default for SglangSettings {
    fn default() -> Self {
        Self {
            dtype: None,
            context_length: None,
            mem_fraction_static: None,
            enable_memory_saver: true,
            weight_sync: WeightSync::File,
            collective: CollectiveSettings::default(),
            group_name: "weight_update_group".into(),
            group_backend: "nccl".into(),
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
    gpu_memory_utilization: Option<f64>,
    ignore_eos: bool,
    engine_kwargs: Value,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ModelKeys {
    path: PathBuf,
}

/// SGLang's native `/generate` with token-id prompts.
#[derive(Debug, Clone)]
pub struct Generate {
    pub ignore_eos: bool,
    /// The weight version every answer must carry.
    pub weight_version: String,
}

impl Generate {
    fn sampling_params(&self, s: &SamplingParams, seed: Option<u64>) -> Value {
        let greedy = s.greedy || s.temperature <= 0.0;
        let mut params = json!({
            "max_new_tokens": s.max_new_tokens,
            "temperature": if greedy { 0.0 } else { s.temperature },
            "top_p": if greedy { 1.0 } else { s.top_p },
            // SGLang disables top-k with -1 (and rejects 0), as verl does.
            "top_k": if greedy || s.top_k <= 0 { -1 } else { s.top_k },
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "stop_token_ids": s.stop_token_ids,
            "ignore_eos": self.ignore_eos,
        });
        if let Some(seed) = seed {
            params["sampling_seed"] = json!(seed);
        }
        params
    }
}

impl Protocol for Generate {
    fn path(&self) -> &str {
        "/generate"
    }

    fn body(&self, prompt: &[u32], s: &SamplingParams, seed: Option<u64>) -> Value {
        let n = s.n as usize;
        let params: Vec<Value> = (0..n)
            .map(|j| self.sampling_params(s, seed.map(|seed| prompt_seed(seed, j))))
            .collect();
        json!({
            "input_ids": vec![prompt; n],
            "sampling_params": params,
            "return_logprob": true,
        })
    }

    fn samples(&self, answer: &Value) -> Result<Vec<Sample>, String> {
        let outputs = answer
            .as_array()
            .ok_or_else(|| format!("not a list of outputs: {}", excerpt(answer)))?;
        outputs
            .iter()
            .enumerate()
            .map(|(index, out)| self.sample(index, out))
            .collect()
    }
}

impl Generate {
    fn sample(&self, index: usize, out: &Value) -> Result<Sample, String> {
        let token_ids: Vec<u32> = serde_json::from_value(out["output_ids"].clone())
            .map_err(|e| format!("output {index}: `output_ids`: {e}"))?;
        let meta = &out["meta_info"];
        if let Some(version) = meta["weight_version"].as_str()
            && version != self.weight_version
        {
            return Err(format!(
                "output {index} was generated with weights of version `{version}`, not `{}`",
                self.weight_version
            ));
        }
        // Each entry is `[logprob, token_id, text]`.
        let entries: Vec<(Option<f32>, u32, Value)> =
            serde_json::from_value(meta["output_token_logprobs"].clone())
                .map_err(|e| format!("output {index}: `meta_info.output_token_logprobs`: {e}"))?;
        if entries.len() != token_ids.len() {
            return Err(format!(
                "output {index}: {} log-probs for {} tokens",
                entries.len(),
                token_ids.len()
            ));
        }
        let logprobs = entries
            .into_iter()
            .zip(&token_ids)
            .enumerate()
            .map(|(t, ((logprob, id, _), &want))| {
                if id != want {
                    return Err(format!(
                        "output {index}: token {t} is {want} but its log-prob is for {id}"
                    ));
                }
                logprob.ok_or_else(|| format!("output {index}: token {t} has no log-prob"))
            })
            .collect::<Result<_, _>>()?;
        let finish_reason = match meta["finish_reason"]["type"].as_str() {
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
    }
}

/// The server command line and environment of a started server.
fn launch(
    init: &ComponentInit,
    keys: &RolloutKeys,
    server: &ServerSettings,
    sglang: &SglangSettings,
    port: u16,
) -> Result<Launch, HttpError> {
    let (program, mut args) = match server.command.split_first() {
        Some((program, rest)) => (PathBuf::from(program), rest.to_vec()),
        None => (
            server
                .python
                .clone()
                .unwrap_or_else(|| PathBuf::from("python3")),
            vec!["-m".into(), SERVER_MODULE.into()],
        ),
    };
    if keys.model.path.as_os_str().is_empty() {
        return Err(HttpError::Config(
            "starting SGLang needs the model directory: `actor_rollout_ref.model.path` is empty"
                .into(),
        ));
    }
    let context_length = sglang.context_length.or(keys.max_model_len).or(
        match (keys.prompt_length, keys.response_length) {
            (Some(p), Some(r)) => Some(p + r),
            _ => None,
        },
    );
    let mut add = |flag: &str, value: String| {
        args.push(flag.into());
        args.push(value);
    };
    add("--model-path", keys.model.path.display().to_string());
    add("--host", server.host.clone());
    add("--port", port.to_string());
    add("--random-seed", init.run.seed.to_string());
    if let Some(dtype) = sglang.dtype.clone().or_else(|| keys.dtype.clone()) {
        add("--dtype", dtype);
    }
    if let Some(len) = context_length {
        add("--context-length", len.to_string());
    }
    if let Some(fraction) = sglang.mem_fraction_static.or(keys.gpu_memory_utilization) {
        add("--mem-fraction-static", fraction.to_string());
    }
    if sglang.enable_memory_saver {
        args.push("--enable-memory-saver".into());
    }
    args.extend(server.extra_args.iter().cloned());

    let mut env: Vec<(String, String)> = vec![
        // The model is a local directory: nothing to fetch.
        ("HF_HUB_OFFLINE".into(), "1".into()),
        ("TRANSFORMERS_OFFLINE".into(), "1".into()),
    ];
    env.extend(server.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    let log_dir = match &server.log_dir {
        Some(dir) => dir.clone(),
        None if !init.run.run_dir.is_empty() => PathBuf::from(&init.run.run_dir).join("sglang"),
        None => std::env::temp_dir().join(format!("verl-sglang-{}", std::process::id())),
    };
    Ok(Launch {
        name: format!("SGLang server on {}:{port}", server.host),
        program,
        args,
        env,
        log: log_dir.join(format!("server-{port}.log")),
    })
}

/// A running rollout: its servers and what they hold.
struct Active {
    pool: Pool,
    /// Its `weight_version` is what every server must report.
    protocol: Generate,
    /// The trainer step of the weights the servers hold (`None`: the model directory's).
    weight_version: Option<u64>,
    /// Seeds for requests that bring none, from the run seed.
    run_seed: u64,
    calls: u64,
    /// The `collective` weight sync, when it is the mode.
    collective: Option<collective::Transfer>,
}

impl Active {
    fn start(init: &ComponentInit, transport: &Transport) -> Result<Self, PluginError> {
        let keys: RolloutKeys = init.config("sglang")?;
        let (path, server, sglang): (String, ServerSettings, SglangSettings) =
            server_section(init, &keys.engine_kwargs, "sglang", SECTION, URLS_ENV)?;
        let pool = if server.urls.is_empty() {
            let (port, url) = server.address()?;
            let launch = launch(init, &keys, &server, &sglang, port)?;
            Pool::spawn("SGLang", &server, &launch, &url).map_err(|e| {
                let e = PluginError::from(e);
                PluginError::new(e.kind, format!("{}\n{NO_CPU_BUILD}", e.message()))
            })?
        } else {
            Pool::attach("SGLang", &server)?
        };
        let weight_version = pool.agreed_version(weight_versions(&pool)?)?;
        Ok(Self {
            pool,
            protocol: Generate {
                ignore_eos: keys.ignore_eos,
                weight_version,
            },
            weight_version: None,
            run_seed: init.run.seed,
            calls: 0,
            collective: (sglang.weight_sync == WeightSync::Collective).then(|| {
                let transport = transport(&sglang.group_name, &sglang.group_backend);
                collective::Transfer::new(transport, &sglang, path)
            }),
        })
    }

    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, PluginError> {
        if request.sampling.n == 0 {
            return Err(PluginError::invalid_config(
                "`n` (samples per prompt) must be at least 1",
            ));
        }
        let by_collective = self.collective.is_some();
        let restore = |pool: &Pool, i: usize| match self.weight_version {
            Some(_) if by_collective => Err(verl_rollout_http::lost_server(pool, i)),
            // A started server comes back with the model directory's weights.
            Some(step) => pool.kept_weights().map_or(Ok(()), |dir| {
                reload(pool, i, &dir.to_string_lossy(), &step.to_string())
            }),
            None => Ok(()),
        };
        self.pool.recover(&restore)?;
        for (i, reported) in weight_versions(&self.pool)?.into_iter().enumerate() {
            if reported != self.protocol.weight_version {
                return Err(stale(&self.pool, i, &reported, &self.protocol.weight_version).into());
            }
        }
        let seed = request.sampling.seed.unwrap_or_else(|| {
            self.calls += 1;
            prompt_seed(self.run_seed, self.calls as usize)
        });
        let completions = self
            .pool
            .generate(&self.protocol, request, Some(seed), &restore)?;
        Ok(GenerateOutput::new(completions, self.weight_version))
    }

    fn update_weights(&mut self, source: &WeightSource<'_>) -> Result<(), PluginError> {
        let handover = source.handover()?;
        if let Some(transfer) = &mut self.collective {
            WeightSync::Collective.check_source(handover.kind)?;
            let version = source.version.to_string();
            transfer.join(&mut self.pool)?;
            // Until every server has taken the new weights, none is trusted to hold known ones.
            self.protocol.weight_version = format!("(update to {version} incomplete)");
            transfer.update(&self.pool, &source.tensors, &version)?;
            for i in 0..self.pool.servers().len() {
                let reported = weight_version(&self.pool, i)?;
                if reported != version {
                    return Err(stale(&self.pool, i, &reported, &version).into());
                }
            }
            self.protocol.weight_version = version;
            self.weight_version = Some(source.version);
            return Ok(());
        }
        WeightSync::File.check_source(handover.kind)?;
        check_weights_dir(Path::new(&handover.path))?;
        let version = source.version.to_string();
        // Until every server has reloaded, none is trusted to hold known weights.
        self.protocol.weight_version = format!("(reload to {version} incomplete)");
        // A started server that died gets the new weights below.
        self.pool.recover(&|_, _| Ok(()))?;
        for i in 0..self.pool.servers().len() {
            reload(&self.pool, i, &handover.path, &version)?;
        }
        self.pool
            .keep_weights(Path::new(&handover.path), &version)?;
        self.protocol.weight_version = version;
        self.weight_version = Some(source.version);
        Ok(())
    }

    fn memory(&self, path: &str) -> Result<(), PluginError> {
        self.pool.broadcast(Method::Post, path, Some(&json!({})))?;
        Ok(())
    }
}

/// Server `i` reloads the weights in `dir`, tagged `version`: `/update_weights_from_disk`, then
/// `/flush_cache` (no cached prefix keeps the old weights' KV), then it must report `version`.
fn reload(pool: &Pool, i: usize, dir: &str, version: &str) -> Result<(), HttpError> {
    let url = pool.servers()[i].url();
    let body = json!({"model_path": dir, "weight_version": version, "flush_cache": true});
    let answer =
        pool.block_on(pool.request(i, Method::Post, "/update_weights_from_disk", Some(&body)))?;
    if answer["success"] != json!(true) {
        return Err(HttpError::protocol(
            format!("{url}/update_weights_from_disk"),
            format!(
                "the reload of {dir} failed: {}",
                answer["message"]
                    .as_str()
                    .map_or_else(|| excerpt(&answer), str::to_owned)
            ),
        ));
    }
    pool.block_on(pool.request(i, Method::Post, "/flush_cache", None))?;
    let reported = weight_version(pool, i)?;
    if reported != version {
        return Err(stale(pool, i, &reported, version));
    }
    Ok(())
}

/// Server `i` reports weights of version `reported`, not `expected` (the global step the rollout
/// last loaded, `default` before any, or a reload that did not complete).
fn stale(pool: &Pool, i: usize, reported: &str, expected: &str) -> HttpError {
    HttpError::Stale {
        server: format!("SGLang server {}", pool.servers()[i].url()),
        reported: reported.to_owned(),
        expected: expected.to_owned(),
    }
}

/// Server `i`'s weight version: `/model_info`, or `/get_model_info` where a server predates it.
fn weight_version(pool: &Pool, i: usize) -> Result<String, HttpError> {
    let answer = match pool.block_on(pool.request(i, Method::Get, "/model_info", None)) {
        Err(HttpError::Status { status: 404, .. }) => {
            pool.block_on(pool.request(i, Method::Get, "/get_model_info", None))?
        }
        other => other?,
    };
    answer["weight_version"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| {
            HttpError::protocol(
                format!("{}/model_info", pool.servers()[i].url()),
                format!("no `weight_version` string in {}", excerpt(&answer)),
            )
        })
}

fn weight_versions(pool: &Pool) -> Result<Vec<String>, HttpError> {
    (0..pool.servers().len())
        .map(|i| weight_version(pool, i))
        .collect()
}

/// The `sglang` rollout as the ABI sees it: servers once `init` has run.
pub struct SglangRollout {
    active: Option<Active>,
    /// The trainer's end of the `collective` weight sync (this build's, or a test's).
    transport: Box<Transport>,
}

/// Makes the trainer's end of a `collective` weight sync for a group name and backend.
pub type Transport = dyn Fn(&str, &str) -> Box<dyn Collective> + Send;

impl Default for SglangRollout {
    fn default() -> Self {
        Self::with_transport(collective::torch_group)
    }
}

impl SglangRollout {
    /// A rollout whose `collective` weight sync joins groups with what `transport(group_name,
    /// group_backend)` makes (the default: SGLang's torch.distributed group through
    /// verl-distributed, in a build with the `collective` feature).
    pub fn with_transport(
        transport: impl Fn(&str, &str) -> Box<dyn Collective> + Send + 'static,
    ) -> Self {
        Self {
            active: None,
            transport: Box::new(transport),
        }
    }

    fn active(&mut self) -> Result<&mut Active, PluginError> {
        self.active.as_mut().ok_or_else(|| {
            PluginError::other("the sglang rollout is not initialised: call `init` first")
        })
    }
}

impl Rollout for SglangRollout {
    fn capabilities() -> RolloutCapabilities {
        RolloutCapabilities::default()
            // Memory: the trainer's tensors, which `weight_sync: collective` broadcasts.
            .weight_sources([WeightSourceKind::File, WeightSourceKind::Memory])
            .logprobs(true)
            .sleep_wake(true)
            .config_keys(
                ConfigKeys::default()
                    .acts_on([
                        "dtype",
                        "max_model_len",
                        "prompt_length",
                        "gpu_memory_utilization",
                    ])
                    .no_effect(
                        "deterministic",
                        false,
                        "the SGLang server runs as started: its own deterministic inference \
                 (`--enable-deterministic-inference`, GPU attention backends) can be asked for in \
                 its extra_args, and even then its log-probs are not bit-identical to the \
                 engine's; the native rollout with the fsdp engine gives the bit-identical mode",
                    ),
            )
    }
    fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError> {
        // A second init replaces the servers (the old ones stop when dropped).
        self.active = None;
        self.active = Some(Active::start(init, &*self.transport)?);
        Ok(())
    }
    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, PluginError> {
        self.active()?.generate(request)
    }
    fn update_weights(&mut self, source: &WeightSource<'_>) -> Result<(), PluginError> {
        self.active()?.update_weights(source)
    }
    /// Every level releases everything SGLang holds (weights and KV cache).
    fn sleep(&mut self, _level: u32) -> Result<(), PluginError> {
        self.active()?.memory("/release_memory_occupation")
    }
    fn wake_up(&mut self) -> Result<(), PluginError> {
        self.active()?.memory("/resume_memory_occupation")
    }
}

verl_plugin_api::export_plugin!(
    PluginBuilder::new(
        "sglang",
        env!("CARGO_PKG_VERSION"),
        "SGLang inference servers (native /generate API), started or attached"
    )
    .rollout(
        "sglang",
        100,
        "generation on SGLang servers; weights reloaded from the disk weight sync's files",
        SglangRollout::default
    )
    .config_section("sglang")
);

#[cfg(test)]
mod tests;
