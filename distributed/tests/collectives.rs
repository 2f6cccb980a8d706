//! Ranks as real processes on one machine. The test binary runs itself again once per rank,
//! with the case to play in VERL_DIST_TEST_CASE and torchrun's variables (RANK, WORLD_SIZE,
//! MASTER_ADDR, MASTER_PORT on a free port); the parent checks every rank's exit status, its
//! output and how long it took. `harness = false`: `main` is both the runner and the rank.
//!
//! `cargo test -p verl-distributed --test collectives [NAME-FILTER]`

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};
use verl_distributed::{Backend, DistError, Options, ProcessGroup, ReduceOp, Rendezvous};

const CASE: &str = "VERL_DIST_TEST_CASE";
const TIMEOUT_MS: &str = "VERL_DIST_TEST_TIMEOUT_MS";
const LOST_MS: &str = "VERL_DIST_TEST_LOST_MS";

// ---------------------------------------------------------------------------------------------
// The rank side.

fn env_u64(name: &str) -> u64 {
    std::env::var(name)
        .unwrap_or_else(|_| panic!("{name} is set by the parent"))
        .parse()
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn join_group() -> Result<ProcessGroup, DistError> {
    let rendezvous = Rendezvous {
        rank: env_u64("RANK") as u32,
        world_size: env_u64("WORLD_SIZE") as u32,
        master_addr: std::env::var("MASTER_ADDR").unwrap(),
        master_port: env_u64("MASTER_PORT") as u16,
    };
    let options = Options {
        timeout: Duration::from_millis(env_u64(TIMEOUT_MS)),
        heartbeat: Duration::from_millis(100),
        peer_lost_after: Duration::from_millis(env_u64(LOST_MS)),
    };
    ProcessGroup::init(&rendezvous, Backend::Gloo, &options)
}

fn floats(t: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(&t.to_kind(Kind::Double)).unwrap()
}

fn ints(t: &Tensor) -> Vec<i64> {
    Vec::<i64>::try_from(&t.to_kind(Kind::Int64)).unwrap()
}

/// Each collective against the value computed by hand for rank r of n.
fn play_collectives(group: &mut ProcessGroup) -> Result<(), DistError> {
    let r = f64::from(group.rank());
    let n = f64::from(group.world_size());
    let sum_1_to_n = n * (n + 1.0) / 2.0;

    let mut t = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0]) * (r + 1.0);
    group.all_reduce(&mut t, ReduceOp::Sum)?;
    assert_eq!(
        floats(&t),
        [1.0, 2.0, 3.0, 4.0, 5.0].map(|x| x * sum_1_to_n),
        "sum"
    );

    let mut t = Tensor::from_slice(&[r, -r]);
    group.all_reduce(&mut t, ReduceOp::Max)?;
    assert_eq!(floats(&t), [n - 1.0, 0.0], "max");
    let mut t = Tensor::from_slice(&[r, -r]);
    group.all_reduce(&mut t, ReduceOp::Min)?;
    assert_eq!(floats(&t), [0.0, -(n - 1.0)], "min");
    let mut t = Tensor::from_slice(&[r + 1.0, 10.0 * r]);
    group.all_reduce(&mut t, ReduceOp::Avg)?;
    assert_eq!(floats(&t), [(n + 1.0) / 2.0, 10.0 * (n - 1.0) / 2.0], "avg");

    // AVG of integers is refused before anything is sent, so the group stays usable.
    let mut t = Tensor::from_slice(&[1i64]);
    let err = group.all_reduce(&mut t, ReduceOp::Avg).unwrap_err();
    assert!(
        err.to_string()
            .contains("AVG needs a floating-point tensor"),
        "{err}"
    );

    let root = group.world_size() - 1;
    let mut t = Tensor::from_slice(&[r, r, r]);
    group.broadcast(&mut t, root)?;
    assert_eq!(floats(&t), [f64::from(root); 3], "broadcast");

    let mine = Tensor::from_slice(&[r as i64 * 10, r as i64 * 10 + 1]);
    let all = group.all_gather(&mine)?;
    assert_eq!(all.len(), n as usize);
    for (k, t) in all.iter().enumerate() {
        assert_eq!(
            ints(t),
            [k as i64 * 10, k as i64 * 10 + 1],
            "all_gather[{k}]"
        );
    }

    let mut flat = Tensor::zeros([2 * n as i64], (Kind::Float, Device::Cpu));
    group.all_gather_into(&mut flat, &Tensor::from_slice(&[r as f32, r as f32 + 0.5]))?;
    let expected: Vec<f64> = (0..n as usize)
        .flat_map(|k| [k as f64, k as f64 + 0.5])
        .collect();
    assert_eq!(floats(&flat), expected, "all_gather_into");

    // input[j] = (r + 1) * j: the sum over ranks is sum_1_to_n * j; rank r keeps [2r, 2r + 1].
    let input = Tensor::arange(2 * n as i64, (Kind::Float, Device::Cpu)) * (r + 1.0);
    let mut out = Tensor::zeros([2], (Kind::Float, Device::Cpu));
    group.reduce_scatter(&mut out, &input, ReduceOp::Sum)?;
    assert_eq!(
        floats(&out),
        [2.0 * r * sum_1_to_n, (2.0 * r + 1.0) * sum_1_to_n],
        "reduce_scatter sum"
    );
    group.reduce_scatter(&mut out, &input, ReduceOp::Avg)?;
    assert_eq!(
        floats(&out),
        [2.0 * r * sum_1_to_n / n, (2.0 * r + 1.0) * sum_1_to_n / n],
        "reduce_scatter avg"
    );
    let mut wrong = Tensor::zeros([3], (Kind::Float, Device::Cpu));
    let err = group
        .reduce_scatter(&mut wrong, &input, ReduceOp::Sum)
        .unwrap_err();
    assert!(err.to_string().contains("expected world size"), "{err}");

    group.barrier()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Meta {
    rank: u32,
    name: String,
    shape: Vec<i64>,
}

fn play_objects(group: &mut ProcessGroup) -> Result<(), DistError> {
    let r = group.rank();
    // Values of different lengths on every rank.
    let mine = Meta {
        rank: r,
        name: format!("rank-{r}{}", "x".repeat(r as usize * 7)),
        shape: vec![i64::from(r); r as usize],
    };
    let all: Vec<Meta> = group.all_gather_object(&mine)?;
    for (k, meta) in all.iter().enumerate() {
        let k = k as u32;
        assert_eq!(
            meta,
            &Meta {
                rank: k,
                name: format!("rank-{k}{}", "x".repeat(k as usize * 7)),
                shape: vec![i64::from(k); k as usize],
            }
        );
    }
    let root = 1;
    let table: BTreeMap<String, f64> =
        [("lr".to_owned(), 1e-6), ("rank".to_owned(), f64::from(r))].into();
    let got: BTreeMap<String, f64> = group.broadcast_object(Some(&table), root)?;
    assert_eq!(got["rank"], f64::from(root));
    assert_eq!(got["lr"], 1e-6);
    // A root without a value fails on every rank, and the group stays usable.
    let err = group.broadcast_object::<u32>(None, root).unwrap_err();
    assert!(
        err.to_string()
            .contains("rank 1 (the root) passed no value"),
        "{err}"
    );
    group.barrier()
}

fn rank_main(case: &str) {
    let rank = env_u64("RANK");
    let result = match case {
        "collectives" => join_group().and_then(|mut g| play_collectives(&mut g)),
        "objects" => join_group().and_then(|mut g| play_objects(&mut g)),
        "subgroups" => join_group().and_then(|mut g| play_subgroups(&mut g)),
        "join" => join_group().and_then(|mut g| g.barrier()),
        // The victim joins, says so and waits to be killed; the others wait in a collective.
        "killed" => join_group().and_then(|mut g| {
            g.barrier()?;
            if rank == 1 {
                println!("ready");
                std::thread::sleep(Duration::from_secs(600));
            }
            let mut t = Tensor::ones([4], (Kind::Float, Device::Cpu));
            g.all_reduce(&mut t, ReduceOp::Sum)
        }),
        // Rank 1 stays alive (heartbeating) but never reaches the collective.
        "silent" => join_group().and_then(|mut g| {
            g.barrier()?;
            if rank == 1 {
                std::thread::sleep(Duration::from_millis(env_u64(TIMEOUT_MS) * 3));
                return Ok(());
            }
            let mut t = Tensor::ones([4], (Kind::Float, Device::Cpu));
            let first = g.all_reduce(&mut t, ReduceOp::Sum);
            // After a failure every call names the first one.
            let again = g.barrier().unwrap_err();
            assert!(matches!(again, DistError::Broken(_)), "{again}");
            first
        }),
        other => panic!("unknown case {other}"),
    };
    if let Err(e) = result {
        eprintln!("rank {rank}: {e}");
        std::process::exit(3);
    }
    println!("rank {rank}: ok");
}

// ---------------------------------------------------------------------------------------------
// The runner side.

struct Rank {
    rank: u32,
    child: Child,
    stdout: mpsc::Receiver<String>,
    stderr: std::thread::JoinHandle<String>,
}

struct Outcome {
    rank: u32,
    status: ExitStatus,
    stdout: String,
    stderr: String,
    /// Since the ranks were started.
    elapsed: Duration,
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rank {} ({}, {:.2} s)\n--- stdout\n{}--- stderr\n{}",
            self.rank,
            self.status,
            self.elapsed.as_secs_f64(),
            self.stdout,
            self.stderr
        )
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts `ranks` of a `world`-rank job playing `case`, its store on a free port.
fn spawn_job(case: &str, world: u32, ranks: &[u32], timeout_ms: u64, lost_ms: u64) -> Vec<Rank> {
    spawn(case, world, ranks, free_port(), timeout_ms, lost_ms)
}

fn spawn(
    case: &str,
    world: u32,
    ranks: &[u32],
    port: u16,
    timeout_ms: u64,
    lost_ms: u64,
) -> Vec<Rank> {
    let port = port.to_string();
    ranks
        .iter()
        .map(|&rank| {
            let mut child = Command::new(std::env::current_exe().unwrap())
                .env(CASE, case)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env(TIMEOUT_MS, timeout_ms.to_string())
                .env(LOST_MS, lost_ms.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            let (lines, stdout) = mpsc::channel();
            let out = child.stdout.take().unwrap();
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines() {
                    let Ok(line) = line else { break };
                    if lines.send(line).is_err() {
                        break;
                    }
                }
            });
            let mut err = child.stderr.take().unwrap();
            let stderr = std::thread::spawn(move || {
                let mut text = String::new();
                let _ = err.read_to_string(&mut text);
                text
            });
            Rank {
                rank,
                child,
                stdout,
                stderr,
            }
        })
        .collect()
}

/// Waits for every rank (killing them all past `bound`, which fails the test).
fn finish(ranks: Vec<Rank>, started: Instant, bound: Duration) -> Vec<Outcome> {
    let mut outcomes = Vec::new();
    let mut pending = ranks;
    while !pending.is_empty() {
        if started.elapsed() > bound {
            for rank in &mut pending {
                let _ = rank.child.kill();
            }
            panic!(
                "ranks {:?} still running after {bound:?}",
                pending.iter().map(|r| r.rank).collect::<Vec<_>>()
            );
        }
        let mut still = Vec::new();
        for mut rank in pending {
            match rank.child.try_wait().unwrap() {
                Some(status) => {
                    let elapsed = started.elapsed();
                    outcomes.push(Outcome {
                        rank: rank.rank,
                        status,
                        stdout: rank.stdout.try_iter().map(|l| l + "\n").collect(),
                        stderr: rank.stderr.join().unwrap(),
                        elapsed,
                    });
                }
                None => still.push(rank),
            }
        }
        pending = still;
        std::thread::sleep(Duration::from_millis(10));
    }
    outcomes.sort_by_key(|o| o.rank);
    outcomes
}

fn all_pass(case: &str, world: u32) {
    let ranks: Vec<u32> = (0..world).collect();
    let started = Instant::now();
    let outcomes = finish(
        spawn_job(case, world, &ranks, 20_000, 3_000),
        started,
        Duration::from_secs(60),
    );
    for o in &outcomes {
        assert!(o.status.success(), "{o}");
        assert!(o.stdout.contains(&format!("rank {}: ok", o.rank)), "{o}");
    }
}

/// One rank: the store and group still work (the degenerate job a single process runs).
fn collectives_1_rank() {
    all_pass("collectives", 1);
}

fn collectives_2_ranks() {
    all_pass("collectives", 2);
}

fn collectives_4_ranks() {
    all_pass("collectives", 4);
}

fn objects_2_ranks() {
    all_pass("objects", 2);
}

fn objects_4_ranks() {
    all_pass("objects", 4);
}

/// Only rank 0 of 2 comes: it reports the missing rank within its timeout.
fn missing_rank_times_out() {
    let started = Instant::now();
    let outcomes = finish(
        spawn_job("join", 2, &[0], 1_500, 1_000),
        started,
        Duration::from_secs(20),
    );
    let o = &outcomes[0];
    assert_eq!(o.status.code(), Some(3), "{o}");
    assert!(
        o.stderr.contains("timed out after")
            && o.stderr
                .contains("waiting for 1/2 ranks: rank 1 did not join"),
        "{o}"
    );
    assert!(o.elapsed < Duration::from_secs(8), "{o}");
}

/// Only rank 1 of 2 comes: it cannot reach rank 0's store, within its timeout.
fn missing_store_host_times_out() {
    let started = Instant::now();
    let outcomes = finish(
        spawn_job("join", 2, &[1], 1_500, 1_000),
        started,
        Duration::from_secs(20),
    );
    let o = &outcomes[0];
    assert_eq!(o.status.code(), Some(3), "{o}");
    assert!(
        o.stderr
            .contains("rank 0 (the rendezvous store's host) is not reachable"),
        "{o}"
    );
    assert!(o.elapsed < Duration::from_secs(8), "{o}");
}

/// Rank 1 of `world` is killed while the others wait in an all-reduce whose timeout is far
/// away: every survivor fails quickly, naming rank 1.
fn killed_peer(world: u32) {
    let ranks: Vec<u32> = (0..world).collect();
    let started = Instant::now();
    let mut procs = spawn_job("killed", world, &ranks, 60_000, 1_500);
    let victim = procs.iter_mut().find(|p| p.rank == 1).unwrap();
    let line = victim
        .stdout
        .recv_timeout(Duration::from_secs(30))
        .expect("rank 1 joins");
    assert_eq!(line, "ready");
    victim.child.kill().unwrap();
    let killed_at = started.elapsed();
    let outcomes = finish(procs, started, Duration::from_secs(40));
    for o in outcomes.iter().filter(|o| o.rank != 1) {
        assert_eq!(o.status.code(), Some(3), "{o}");
        assert!(o.stderr.contains("all_reduce failed: rank 1 (pid"), "{o}");
        let after_kill = o.elapsed - killed_at;
        assert!(
            after_kill < Duration::from_secs(6),
            "took {after_kill:?} after the kill\n{o}"
        );
        eprintln!(
            "    rank {} failed {:.2} s after the kill",
            o.rank,
            after_kill.as_secs_f64()
        );
    }
}

fn killed_peer_2_ranks() {
    killed_peer(2);
}

fn killed_peer_4_ranks() {
    killed_peer(4);
}

/// Rank 1 is alive but never calls the collective: the others time out within their bound,
/// naming it.
fn silent_peer_times_out() {
    let started = Instant::now();
    let outcomes = finish(
        spawn_job("silent", 3, &[0, 1, 2], 2_000, 10_000),
        started,
        Duration::from_secs(40),
    );
    for o in outcomes.iter().filter(|o| o.rank != 1) {
        assert_eq!(o.status.code(), Some(3), "{o}");
        // Its own timeout, or the verdict of a rank that timed out a moment earlier.
        let own = o.stderr.contains("all_reduce timed out after 2.")
            && o.stderr.contains(
                "rank 1 alive but has not reached this collective (#2 here; rank 1 is at #1)",
            );
        let adopted = o.stderr.contains("all_reduce failed: rank 1 (pid")
            && o.stderr
                .contains("is alive but has not reached collective #2 (it is at #1) (seen by rank");
        assert!(own || adopted, "{o}");
    }
}

/// Two ranks that disagree on the world size are told so at rendezvous.
fn world_size_mismatch() {
    let port = free_port();
    let started = Instant::now();
    let mut procs = spawn("join", 2, &[0], port, 3_000, 1_000);
    // Rank 1 of a 3-rank job, on the same store.
    procs.extend(spawn("join", 3, &[1], port, 3_000, 1_000));
    let outcomes = finish(procs, started, Duration::from_secs(30));
    for o in &outcomes {
        assert_eq!(o.status.code(), Some(3), "{o}");
    }
    assert!(
        outcomes[0].stderr.contains(
            "has WORLD_SIZE=3 and backend gloo, rank 0 has WORLD_SIZE=2 and backend gloo"
        ),
        "{}",
        outcomes[0]
    );
}

/// 4 ranks as a 2 × 2 grid: rows `[[0, 1], [2, 3]]` and columns `[[0, 2], [1, 3]]` (tensor-
/// and data-parallel groups); each subgroup's collectives against hand values, interleaved
/// with a whole-group one; a partition that misses a rank is refused.
fn play_subgroups(group: &mut ProcessGroup) -> Result<(), DistError> {
    let r = group.rank();
    let err = group.split("bad", &[vec![0, 1], vec![2]]).unwrap_err();
    assert!(
        err.to_string()
            .contains("rank 3 is in no subgroup of `bad`"),
        "{err}"
    );
    let rows = group.split("rows", &[vec![0, 1], vec![2, 3]])?;
    let cols = group.split("cols", &[vec![0, 2], vec![1, 3]])?;
    assert_eq!(
        group.subgroup_ranks(rows),
        if r < 2 { [0, 1] } else { [2, 3] }
    );
    assert_eq!(group.subgroup_rank(cols), r / 2);
    let mut t = Tensor::from_slice(&[f64::from(r)]);
    group.all_reduce_in(rows, &mut t, ReduceOp::Sum)?;
    // Rows {0, 1} sum to 1, rows {2, 3} to 5.
    assert_eq!(floats(&t), [if r < 2 { 1.0 } else { 5.0 }]);
    let mut t = Tensor::from_slice(&[f64::from(r)]);
    group.all_reduce_in(cols, &mut t, ReduceOp::Avg)?;
    assert_eq!(floats(&t), [if r.is_multiple_of(2) { 1.0 } else { 2.0 }]);
    let mut all = Tensor::zeros([4], (Kind::Float, Device::Cpu));
    group.all_gather_into(&mut all, &Tensor::from_slice(&[r as f32]))?;
    assert_eq!(floats(&all), [0.0, 1.0, 2.0, 3.0]);
    let mut gathered = Tensor::zeros([4], (Kind::Int64, Device::Cpu));
    let mine = Tensor::from_slice(&[i64::from(r), 10 * i64::from(r)]);
    group.all_gather_into_in(cols, &mut gathered, &mine)?;
    let other = i64::from(r % 2 + 2);
    let first = i64::from(r % 2);
    assert_eq!(ints(&gathered), [first, 10 * first, other, 10 * other]);
    // Rank r contributes [r, 2r]; each row member keeps its slot of the row's sum.
    let mut out = Tensor::zeros([1], (Kind::Float, Device::Cpu));
    let input = Tensor::from_slice(&[r as f32, 2.0 * r as f32]);
    group.reduce_scatter_in(rows, &mut out, &input, ReduceOp::Sum)?;
    let row_sum = if r < 2 { 1.0 } else { 5.0 };
    assert_eq!(floats(&out), [row_sum * f64::from(r % 2 + 1)]);
    let err = group
        .all_gather_into_in(
            rows,
            &mut Tensor::zeros([3], (Kind::Float, Device::Cpu)),
            &out,
        )
        .unwrap_err();
    assert!(
        err.to_string().contains("expected subgroup size 2"),
        "{err}"
    );
    group.barrier()
}

fn subgroups_4_ranks() {
    all_pass("subgroups", 4);
}

fn main() {
    if let Ok(case) = std::env::var(CASE) {
        rank_main(&case);
        return;
    }
    let tests: &[(&str, fn())] = &[
        ("collectives_1_rank", collectives_1_rank),
        ("collectives_2_ranks", collectives_2_ranks),
        ("collectives_4_ranks", collectives_4_ranks),
        ("objects_2_ranks", objects_2_ranks),
        ("objects_4_ranks", objects_4_ranks),
        ("subgroups_4_ranks", subgroups_4_ranks),
        ("missing_rank_times_out", missing_rank_times_out),
        ("missing_store_host_times_out", missing_store_host_times_out),
        ("killed_peer_2_ranks", killed_peer_2_ranks),
        ("killed_peer_4_ranks", killed_peer_4_ranks),
        ("silent_peer_times_out", silent_peer_times_out),
        ("world_size_mismatch", world_size_mismatch),
    ];
    verl_testkit::run_rank_tests(tests);
}
