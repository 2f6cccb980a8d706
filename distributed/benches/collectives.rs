//! Collective bandwidth on local ranks (Gloo on CPU): all-reduce, all-gather (flat) and
//! reduce-scatter (flat) of 4 KiB, 4 MiB and 64 MiB of f32, on 2 ranks by default.
//!
//! `cargo bench -p verl-distributed --bench collectives [-- --ranks N]`
//!
//! The bench runs itself once per rank (VERL_DIST_BENCH_RANK). "size" is the full tensor: the
//! all-reduce's, the all-gather's output, the reduce-scatter's input. algbw = size / time;
//! busbw is nccl-tests' bus bandwidth (all-reduce 2(n-1)/n × algbw, the others (n-1)/n ×).

use std::process::Command;
use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};
use verl_distributed::{Backend, DistError, Options, ProcessGroup, ReduceOp, Rendezvous};

const RANK_ENV: &str = "VERL_DIST_BENCH_RANK";
const SIZES: [(usize, &str, usize); 3] = [
    (4 << 10, "4 KiB", 500),
    (4 << 20, "4 MiB", 30),
    (64 << 20, "64 MiB", 6),
];

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

/// Median time of `iterations` runs of `op` (after two warm-up runs), each started together
/// on every rank.
fn time(
    group: &mut ProcessGroup,
    iterations: usize,
    mut op: impl FnMut(&mut ProcessGroup) -> Result<(), DistError>,
) -> Result<Duration, DistError> {
    for _ in 0..2 {
        op(group)?;
    }
    let mut samples = Vec::with_capacity(iterations);
    for _ in 0..iterations {
        group.barrier()?;
        let start = Instant::now();
        op(group)?;
        samples.push(start.elapsed());
    }
    // Every rank's median; the slowest one is the collective's.
    let mine = median(samples).as_secs_f64();
    let all: Vec<f64> = group.all_gather_object(&mine)?;
    Ok(Duration::from_secs_f64(all.into_iter().fold(0.0, f64::max)))
}

fn rank_main(rank: u32) -> Result<(), DistError> {
    let rendezvous = Rendezvous {
        rank,
        world_size: std::env::var("WORLD_SIZE").unwrap().parse().unwrap(),
        master_addr: "127.0.0.1".to_owned(),
        master_port: std::env::var("MASTER_PORT").unwrap().parse().unwrap(),
    };
    let mut group = ProcessGroup::init(&rendezvous, Backend::Gloo, &Options::default())?;
    let n = group.world_size() as usize;
    if rank == 0 {
        println!(
            "{n} ranks, gloo, f32, median of N runs (the slowest rank's)\n{:<8} {:<16} {:>10} {:>12} {:>12}",
            "size", "collective", "ms", "algbw GB/s", "busbw GB/s"
        );
    }
    for (bytes, label, iterations) in SIZES {
        let elements = (bytes / 4) as i64;
        let shard = elements / n as i64;
        let cpu = (Kind::Float, Device::Cpu);
        let mut full = Tensor::ones([elements], cpu);
        let part = Tensor::ones([shard], cpu);
        let mut gathered = Tensor::zeros([shard * n as i64], cpu);
        let mut scattered = Tensor::zeros([shard], cpu);
        let rows = [
            (
                "all_reduce",
                time(&mut group, iterations, |g| {
                    g.all_reduce(&mut full, ReduceOp::Sum)
                })?,
                2.0 * (n as f64 - 1.0) / n as f64,
            ),
            (
                "all_gather",
                time(&mut group, iterations, |g| {
                    g.all_gather_into(&mut gathered, &part)
                })?,
                (n as f64 - 1.0) / n as f64,
            ),
            (
                "reduce_scatter",
                time(&mut group, iterations, |g| {
                    g.reduce_scatter(&mut scattered, &full, ReduceOp::Sum)
                })?,
                (n as f64 - 1.0) / n as f64,
            ),
        ];
        if rank == 0 {
            for (name, t, bus) in rows {
                let algbw = bytes as f64 / t.as_secs_f64() / 1e9;
                println!(
                    "{label:<8} {name:<16} {:>10.3} {algbw:>12.3} {:>12.3}",
                    t.as_secs_f64() * 1e3,
                    algbw * bus
                );
            }
        }
    }
    group.barrier()
}

fn main() {
    if let Ok(rank) = std::env::var(RANK_ENV) {
        if let Err(e) = rank_main(rank.parse().unwrap()) {
            eprintln!("rank {rank}: {e}");
            std::process::exit(1);
        }
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    let ranks: u32 = args
        .iter()
        .position(|a| a == "--ranks")
        .and_then(|i| args.get(i + 1))
        .map_or(2, |n| n.parse().expect("--ranks N"));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let children: Vec<_> = (0..ranks)
        .map(|rank| {
            Command::new(std::env::current_exe().unwrap())
                .env(RANK_ENV, rank.to_string())
                .env("WORLD_SIZE", ranks.to_string())
                .env("MASTER_PORT", port.to_string())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut ok = true;
    for mut child in children {
        ok &= child.wait().unwrap().success();
    }
    if !ok {
        std::process::exit(1);
    }
}
