//! The trainer's end of the weight transfer to inference servers, against the servers' own Python
//! code as the other ranks (`tests/peers/*.py`): vLLM's `StatelessProcessGroup` from the venv of
//! `scripts/setup-vllm.sh`, SGLang's `init_custom_process_group` from the venv of
//! `scripts/setup-sglang-protocol.sh`. What needs a GPU (vLLM's NCCL communicator, SGLang's NCCL
//! group) is not run here; the CPU gate in front of it is.
//!
//! `cargo test -p verl-distributed --test weight_transfer`

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use verl_distributed::Backend;
use verl_distributed::nccl::{NEEDS_CUDA, UNIQUE_ID_BYTES};
use verl_distributed::weight_transfer::{
    GroupAddress, StatelessGroupHost, TorchGroupSender, VllmSender, pickle_nccl_unique_id,
};
use verl_plugin_api::{DType, TensorRef};

/// `<cache>/verl-core/<dir>/venv/bin/python`, or under `$<env>` when set.
fn venv_python(env: &str, dir: &str, script: &str) -> PathBuf {
    let root = std::env::var_os(env).map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var("HOME").expect("HOME is set"))
            .join(".cache/verl-core")
            .join(dir)
    });
    let python = root.join("venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run {script}",
        python.display()
    );
    python
}

fn peer(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/peers")
        .join(name)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn address(port: u16, world_size: u32) -> GroupAddress {
    GroupAddress {
        addr: "127.0.0.1".into(),
        port,
        world_size,
        // The peers import torch and vLLM or SGLang first: minutes on a loaded machine.
        timeout: Duration::from_secs(300),
    }
}

fn spawn(python: &Path, script: &Path, args: &[String]) -> std::process::Child {
    Command::new(python)
        .arg(script)
        .args(args)
        .env("TORCH_CPP_LOG_LEVEL", "ERROR")
        .env("PYTHONUNBUFFERED", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The peer's last stdout line as JSON; its stderr in the panic when it failed.
fn answer(output: Output) -> Value {
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "peer failed ({}):\n{stdout}\n{stderr}",
        output.status
    );
    serde_json::from_str(stdout.lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("peer output {stdout:?}: {e}\n{stderr}"))
}

fn id(seed: u8) -> [u8; UNIQUE_ID_BYTES] {
    std::array::from_fn(|i| (i as u8).wrapping_mul(37).wrapping_add(seed))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// One vLLM server with two workers (tensor parallel 2) joins the group our rank 0 hosts, as
/// `/init_weight_transfer_engine` makes them: each worker derives its rank from the `init_info`
/// the plugin sends, connects with vLLM's `StatelessProcessGroup.create`, and reads rank 0's
/// objects in the order they were broadcast, as vLLM `ncclUniqueId`s with our bytes (byte values
/// above 127 included: ctypes keeps them signed).
#[test]
fn vllms_stateless_process_group_meets_our_rank_0() {
    let python = venv_python("VERL_VLLM_DIR", "vllm-cpu", "scripts/setup-vllm.sh");
    let port = free_port();
    let mut host = StatelessGroupHost::host(&address(port, 3)).unwrap();
    let init_info = json!({
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 3,
        "packed": false,
    });
    let peers: Vec<_> = (0..2)
        .map(|worker| {
            spawn(
                &python,
                &peer("vllm_stateless_peer.py"),
                &[init_info.to_string(), worker.to_string(), "2".into()],
            )
        })
        .collect();
    let (first, second) = (id(1), id(200));
    host.broadcast_pickled(&pickle_nccl_unique_id(&first))
        .unwrap();
    host.broadcast_pickled(&pickle_nccl_unique_id(&second))
        .unwrap();
    let mut ranks = Vec::new();
    for child in peers {
        let seen = answer(child.wait_with_output().unwrap());
        assert_eq!(seen["world_size"], 3, "{seen}");
        assert_eq!(
            seen["unique_ids"],
            json!([hex(&first), hex(&second)]),
            "{seen}"
        );
        ranks.push(seen["rank"].as_u64().unwrap());
    }
    ranks.sort_unstable();
    assert_eq!(ranks, [1, 2]);
}

/// On a machine without CUDA, vLLM's sender stops before hosting anything, saying what it needs
/// (the plugin checks this before any server is asked to join).
#[test]
fn without_cuda_the_vllm_sender_says_what_it_needs() {
    if tch::Cuda::is_available() {
        eprintln!("this machine has CUDA: the CPU gate is not what runs here");
        return;
    }
    let port = free_port();
    let err = VllmSender::join(&address(port, 2), 0)
        .err()
        .expect("no CUDA: no sender");
    assert!(err.to_string().contains(NEEDS_CUDA), "{err}");
    // Nothing was hosted: the port is still free.
    std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    let err = TorchGroupSender::check(Backend::Nccl).unwrap_err();
    assert!(err.to_string().contains(NEEDS_CUDA), "{err}");
    TorchGroupSender::check(Backend::Gloo).unwrap();
}

fn bytes_of<T: Copy>(values: &[T], to_le: impl Fn(T) -> Vec<u8>) -> Vec<u8> {
    values.iter().flat_map(|&v| to_le(v)).collect()
}

/// Two SGLang workers (one server, tensor parallel 2) form SGLang's weight-update group with our
/// rank 0 (Gloo, so it runs on a CPU) and receive three tensors of three dtypes as SGLang's
/// worker receives them: every value arrives, in the declared dtype and shape.
#[test]
fn sglangs_weight_update_group_receives_our_broadcasts() {
    let python = venv_python(
        "VERL_SGLANG_PROTOCOL_DIR",
        "sglang-protocol",
        "scripts/setup-sglang-protocol.sh (after scripts/setup-vllm.sh)",
    );
    let port = free_port();
    let group = "weight_update_group";
    let weights: [f32; 6] = [0.5, -1.25, 3.0, 1e-3, -7.5, 2.0];
    // bfloat16 of 1.0, -2.0, 0.5, 256.0 (the top halves of their float32 bits).
    let halves: [u16; 4] = [0x3f80, 0xc000, 0x3f00, 0x4380];
    let ids: [i64; 3] = [7, -1, 1 << 40];
    let (w, h, i) = (
        bytes_of(&weights, |v| v.to_le_bytes().to_vec()),
        bytes_of(&halves, |v| v.to_le_bytes().to_vec()),
        bytes_of(&ids, |v| v.to_le_bytes().to_vec()),
    );
    let tensors = [
        TensorRef::new("model.layers.0.mlp.weight", DType::F32, &[2, 3], &w).unwrap(),
        TensorRef::new("model.norm.weight", DType::BF16, &[4], &h).unwrap(),
        TensorRef::new("model.counts", DType::I64, &[3], &i).unwrap(),
    ];
    let init = json!({
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 3,
        "group_name": group, "backend": "gloo",
    });
    let update = json!({
        "names": ["model.layers.0.mlp.weight", "model.norm.weight", "model.counts"],
        "dtypes": ["float32", "bfloat16", "int64"], "shapes": [[2, 3], [4], [3]],
        "group_name": group, "flush_cache": true, "weight_version": "1",
    });
    let peers: Vec<_> = (0..2)
        .map(|tp_rank| {
            spawn(
                &python,
                &peer("sglang_group_peer.py"),
                &[init.to_string(), update.to_string(), tp_rank.to_string()],
            )
        })
        .collect();
    let joined = TorchGroupSender::join(&address(port, 3), group, Backend::Gloo, 0)
        .and_then(|mut sender| sender.send(&tensors));
    if let Err(e) = joined {
        let outputs: Vec<String> = peers
            .into_iter()
            .map(|mut child| {
                let _ = child.kill();
                let out = child.wait_with_output().unwrap();
                String::from_utf8_lossy(&out.stderr).into_owned()
            })
            .collect();
        panic!("{e}\npeers:\n{}", outputs.join("\n---\n"));
    }
    let want = json!([
        {"name": "model.layers.0.mlp.weight", "dtype": "torch.float32", "shape": [2, 3],
         "values": weights.iter().map(|&v| f64::from(v)).collect::<Vec<_>>()},
        {"name": "model.norm.weight", "dtype": "torch.bfloat16", "shape": [4],
         "values": [1.0, -2.0, 0.5, 256.0]},
        {"name": "model.counts", "dtype": "torch.int64", "shape": [3],
         "values": ids.iter().map(|&v| v as f64).collect::<Vec<_>>()},
    ]);
    for child in peers {
        assert_eq!(answer(child.wait_with_output().unwrap()), want);
    }
}
