//! What the libtorch plugins' benches share: thread count, load, medians, issue 14's model, a
//! driven reference process.

/// Intra-op threads; `VERL_BENCH_THREADS` overrides the documented 2.
pub fn threads() -> i32 {
    std::env::var("VERL_BENCH_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(2)
}

/// The machine's 1/5/15-minute load: on a shared machine, a load above the core count distorts
/// every figure.
pub fn load_average() -> String {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    load.split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

pub fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// A reference process (Python) driven one request per stdin line, answering one stdout line
/// each; it prints `ready` once set up. Killed when dropped.
#[allow(dead_code)] // Only the benches with a Python side use it.
pub struct Driven {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

#[allow(dead_code)]
impl Driven {
    /// Spawns `command` with piped stdin/stdout and waits for its `ready`.
    pub fn start(mut command: std::process::Command) -> Result<Self, String> {
        use std::process::Stdio;
        let program = command.get_program().to_string_lossy().into_owned();
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("{program}: {e}"))?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = std::io::BufReader::new(child.stdout.take().expect("piped"));
        let mut driven = Self {
            child,
            stdin,
            stdout,
        };
        match driven.line()?.as_str() {
            "ready" => Ok(driven),
            other => Err(format!("unexpected output {other:?}")),
        }
    }

    fn line(&mut self) -> Result<String, String> {
        use std::io::BufRead;
        let mut line = String::new();
        match self.stdout.read_line(&mut line) {
            Ok(0) => Err("the reference process exited (see its stderr above)".into()),
            Ok(_) => Ok(line.trim().to_owned()),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Sends one request line and returns the answer line.
    pub fn ask(&mut self, request: &str) -> Result<String, String> {
        use std::io::Write;
        writeln!(self.stdin, "{request}").map_err(|e| e.to_string())?;
        self.line()
    }
}

impl Drop for Driven {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The vocabulary of issue 14's model.
#[allow(dead_code)] // Only the benches on issue 14's model use it.
pub const ISSUE14_VOCAB: i64 = 512;

/// Issue 14's model in `dir`: a random Qwen2 (q/k/v biases), hidden 256, intermediate 768, 4
/// layers, 4 heads / 2 key-value heads, vocab 512, untied head, fp32; ids 0/1/2 are pad/bos/eos.
#[allow(dead_code)]
pub fn write_issue14_model(dir: &std::path::Path) {
    use verl_model::{CausalLM, ModelConfig, ModelOptions};
    let config = serde_json::json!({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": ISSUE14_VOCAB,
        "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false,
        "initializer_range": 0.02, "hidden_act": "silu", "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    CausalLM::random(
        ModelConfig::from_dir(dir).unwrap(),
        &ModelOptions::default(),
    )
    .unwrap()
    .save_pretrained(dir, None)
    .unwrap();
}
