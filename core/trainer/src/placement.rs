//! Where this process's components run: the selected device platform and this process's rank.
//! Ranks are read with torchrun's convention (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, which `verl-core launch` sets too), or, in a
//! Slurm step started by `srun`, from Slurm's (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`,
//! `SLURM_NTASKS_PER_NODE`, with `MASTER_ADDR` and `MASTER_PORT` defaulting to 29500);
//! torchrun's win when both are set. Every component gets its [`RunContext`] from here, so all
//! of them agree on it.

use verl_plugin_api::RunContext;
use verl_plugin_host::{DeviceReport, PlatformReport};

/// torchrun's default rendezvous port, used for Slurm steps that set no `MASTER_PORT`.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlacementError {
    #[error("environment variable {name}={value}: {reason}")]
    Env {
        name: &'static str,
        value: String,
        reason: String,
    },
    #[error(
        "trainer.nnodes={nnodes} × trainer.n_gpus_per_node={n_gpus_per_node} = {}, but this run has \
         {world_size} ranks ({origin}); set both keys so that their product is the number of ranks",
        nnodes * n_gpus_per_node
    )]
    WorldSize {
        nnodes: usize,
        n_gpus_per_node: usize,
        world_size: u32,
        origin: RankSource,
    },
    #[error(
        "multi-rank {what} is not supported by this build yet: this is rank {rank} of {world_size} \
         ({origin}); run a single process (without `verl-core launch`, torchrun or srun)"
    )]
    MultiRankUnsupported {
        what: &'static str,
        rank: u32,
        world_size: u32,
        origin: RankSource,
    },
}

/// Where this process's rank came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankSource {
    /// No rank variables: one process.
    Single,
    /// torchrun's variables (also set by `verl-core launch`).
    Torchrun,
    /// Slurm's, in a step started by srun.
    Slurm,
}

impl std::fmt::Display for RankSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Single => "a single process",
            Self::Torchrun => "RANK/WORLD_SIZE from torchrun or verl-core launch",
            Self::Slurm => "SLURM_PROCID/SLURM_NTASKS from srun",
        })
    }
}

/// The platform and rank a process computes on.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    run: RunContext,
    source: RankSource,
    /// The product name of this rank's device (`CPU` on the CPU, as verl names it), for the
    /// peak FLOP/s of the MFU metrics; empty when the platform cannot tell.
    device_name: String,
}

/// Reads one rendezvous variable through `env`.
fn env_number<T: std::str::FromStr>(
    env: &impl Fn(&str) -> Option<String>,
    name: &'static str,
    default: T,
) -> Result<T, PlacementError>
where
    T::Err: std::fmt::Display,
{
    match env(name) {
        None => Ok(default),
        Some(value) => value
            .trim()
            .parse()
            .map_err(|e: T::Err| PlacementError::Env {
                name,
                value,
                reason: e.to_string(),
            }),
    }
}

/// The names a [`RankSource`] reads rank, world size, local rank and local world size from.
struct RankVars {
    rank: &'static str,
    world_size: &'static str,
    local_rank: &'static str,
    local_world_size: &'static str,
}

const TORCHRUN: RankVars = RankVars {
    rank: "RANK",
    world_size: "WORLD_SIZE",
    local_rank: "LOCAL_RANK",
    local_world_size: "LOCAL_WORLD_SIZE",
};

const SLURM: RankVars = RankVars {
    rank: "SLURM_PROCID",
    world_size: "SLURM_NTASKS",
    local_rank: "SLURM_LOCALID",
    local_world_size: "SLURM_NTASKS_PER_NODE",
};

/// torchrun's variables when any of RANK / WORLD_SIZE is set; else Slurm's inside an srun step
/// (`SLURM_STEP_ID`: a batch script itself also has SLURM_NTASKS and SLURM_PROCID=0, but it is
/// one process, not one of the job's ranks); else a single process.
fn rank_source(env: &impl Fn(&str) -> Option<String>) -> RankSource {
    if env("RANK").is_some() || env("WORLD_SIZE").is_some() {
        RankSource::Torchrun
    } else if env("SLURM_PROCID").is_some() && env("SLURM_STEP_ID").is_some() {
        RankSource::Slurm
    } else {
        RankSource::Single
    }
}

impl Placement {
    /// This process on `device` (the selected platform's report), ranks from the process
    /// environment.
    pub fn on_platform(device: &DeviceReport, seed: u64) -> Result<Self, PlacementError> {
        Self::with_env(device, seed, |name| std::env::var(name).ok())
    }

    /// As [`Placement::on_platform`], reading variables through `env` (tests).
    pub fn with_env(
        device: &DeviceReport,
        seed: u64,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, PlacementError> {
        let source = rank_source(&env);
        let (vars, default_port) = match source {
            RankSource::Slurm => (SLURM, DEFAULT_MASTER_PORT),
            RankSource::Torchrun | RankSource::Single => (TORCHRUN, 0),
        };
        let world_size: u32 = env_number(&env, vars.world_size, 1)?;
        let rank: u32 = env_number(&env, vars.rank, 0)?;
        let local_rank: u32 = env_number(&env, vars.local_rank, 0)?;
        let local_world_size: u32 = env_number(&env, vars.local_world_size, world_size)?;
        let master_port: u16 = env_number(&env, "MASTER_PORT", default_port)?;
        if world_size == 0 {
            return Err(PlacementError::Env {
                name: vars.world_size,
                value: "0".into(),
                reason: "must be at least 1".into(),
            });
        }
        if rank >= world_size {
            return Err(PlacementError::Env {
                name: vars.rank,
                value: rank.to_string(),
                reason: format!("must be below {}={world_size}", vars.world_size),
            });
        }
        if local_rank >= local_world_size {
            return Err(PlacementError::Env {
                name: vars.local_rank,
                value: local_rank.to_string(),
                reason: format!("must be below {}={local_world_size}", vars.local_world_size),
            });
        }
        let master_addr = env("MASTER_ADDR").unwrap_or_default();
        if source == RankSource::Slurm && world_size > 1 && master_addr.trim().is_empty() {
            return Err(PlacementError::Env {
                name: "MASTER_ADDR",
                value: String::new(),
                reason: format!(
                    "must name the first node of the Slurm step (rank {rank} of {world_size}), e.g. \
                     `export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)`"
                ),
            });
        }
        let on_cpu = device.device_type == "cpu";
        let mut run = RunContext::default();
        run.device = if on_cpu {
            "cpu".to_owned()
        } else {
            format!("{}:{local_rank}", device.device_type)
        };
        run.device_type = device.device_type.clone();
        run.device_index = (!on_cpu).then_some(local_rank);
        run.comm_backend = device.comm_backend.clone();
        run.rank = rank;
        run.world_size = world_size;
        run.local_rank = local_rank;
        run.local_world_size = local_world_size;
        run.master_addr = master_addr;
        run.master_port = master_port;
        run.seed = seed;
        let device_name = if on_cpu {
            "CPU".to_owned()
        } else {
            device
                .device_names
                .get(local_rank as usize)
                .cloned()
                .unwrap_or_default()
        };
        Ok(Self {
            run,
            source,
            device_name,
        })
    }

    /// Where the rank came from.
    pub fn source(&self) -> RankSource {
        self.source
    }

    /// One line for `verl-core platform`: this process's rank, device and rendezvous.
    pub fn summary(&self) -> String {
        let run = &self.run;
        let mut line = format!(
            "Rank: {} of {} (local {} of {}; {}), device {}, comm {}",
            run.rank,
            run.world_size,
            run.local_rank,
            run.local_world_size,
            self.source,
            run.device,
            run.comm_backend
        );
        if run.world_size > 1 {
            line.push_str(&format!(
                ", rendezvous {}:{}",
                run.master_addr, run.master_port
            ));
        }
        line
    }

    /// The same as JSON (the `placement` object of `platform --json`).
    pub fn to_json(&self) -> serde_json::Value {
        let run = &self.run;
        let source = match self.source {
            RankSource::Single => "single",
            RankSource::Torchrun => "torchrun",
            RankSource::Slurm => "slurm",
        };
        serde_json::json!({
            "rank": run.rank,
            "world_size": run.world_size,
            "local_rank": run.local_rank,
            "local_world_size": run.local_world_size,
            "source": source,
            "device": run.device,
            "comm_backend": run.comm_backend,
            "master_addr": run.master_addr,
            "master_port": run.master_port,
        })
    }

    /// verl sizes a job as `trainer.nnodes × trainer.n_gpus_per_node` ranks: with more than one
    /// rank, that product must be the world size. (One process may run a config written for a
    /// cluster; it then trains on its one device.)
    pub fn check_world_size(
        &self,
        nnodes: usize,
        n_gpus_per_node: usize,
    ) -> Result<(), PlacementError> {
        let world_size = self.run.world_size;
        if world_size > 1 && nnodes * n_gpus_per_node != world_size as usize {
            return Err(PlacementError::WorldSize {
                nnodes,
                n_gpus_per_node,
                world_size,
                origin: self.source,
            });
        }
        Ok(())
    }

    /// For commands that run as one process only: with more than one rank every rank fails at
    /// once (rather than N copies doing the same work into the same files).
    pub fn require_single_rank(&self, what: &'static str) -> Result<(), PlacementError> {
        if self.run.world_size > 1 {
            return Err(PlacementError::MultiRankUnsupported {
                what,
                rank: self.run.rank,
                world_size: self.run.world_size,
                origin: self.source,
            });
        }
        Ok(())
    }

    pub fn run(&self) -> &RunContext {
        &self.run
    }

    /// This process as a job of its own (rank 0 of 1, on the same device): for work one rank
    /// does for all of them, such as the quickstart's preparation.
    pub fn alone(&self) -> Self {
        let mut run = self.run.clone();
        run.rank = 0;
        run.world_size = 1;
        run.local_rank = 0;
        run.local_world_size = 1;
        run.master_addr.clear();
        run.master_port = 0;
        Self {
            run,
            source: RankSource::Single,
            device_name: self.device_name.clone(),
        }
    }

    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// The context with the run's names and output directory filled in.
    pub fn for_run(&self, project: &str, experiment: &str, run_dir: &str) -> RunContext {
        let mut run = self.run.clone();
        run.project = project.to_owned();
        run.experiment = experiment.to_owned();
        run.run_dir = run_dir.to_owned();
        run
    }
}

/// How the variables the selected platform asks for (e.g. `CUDA_VISIBLE_DEVICES` translated from
/// `HIP_VISIBLE_DEVICES`) reach the process before any component initialises, so that the
/// libraries they load see them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnvUpdates {
    /// Every variable already has its value.
    Unchanged,
    /// Set them here: no detection thread is left that could read the environment meanwhile.
    Set(Vec<(String, String)>),
    /// A detection that did not finish still runs plugin code, which may read the environment
    /// while it changes (undefined behaviour with glibc): the process restarts (exec) with them.
    Restart(Vec<(String, String)>),
}

/// What applying `device`'s environment updates takes; `current` reads a variable's value.
pub fn env_updates(
    report: &PlatformReport,
    device: &DeviceReport,
    current: impl Fn(&str) -> Option<String>,
) -> EnvUpdates {
    let changed: Vec<(String, String)> = device
        .env_updates
        .iter()
        .filter(|(key, value)| current(key).as_deref() != Some(value.as_str()))
        .map(|(key, value)| (key.clone(), value.clone()))
        .collect();
    if changed.is_empty() {
        EnvUpdates::Unchanged
    } else if report.unfinished.is_empty() {
        EnvUpdates::Set(changed)
    } else {
        EnvUpdates::Restart(changed)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn device(device_type: &str) -> DeviceReport {
        serde_json::from_value(serde_json::json!({
            "name": device_type, "available": true, "count": 2, "reason": "", "priority": 0, "plugin": "", "origin": "",
            "vendor": "", "device_type": device_type, "comm_backend": "nccl", "visible_devices_env": [], "device_names": [],
            "env_updates": [],
        }))
        .unwrap()
    }

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    /// Variables already at their value are left alone; the others are set here unless a
    /// detection still runs, and then the process restarts with them.
    #[test]
    fn env_updates_wait_for_no_running_detection() {
        let mut rocm = device("cuda");
        rocm.env_updates = vec![
            ("CUDA_VISIBLE_DEVICES".into(), "0,1".into()),
            ("HIP_VISIBLE_DEVICES".into(), "0,1".into()),
        ];
        let mut report = PlatformReport {
            selected: Some("cuda".into()),
            error: None,
            override_value: None,
            devices: vec![rocm.clone()],
            unfinished: Vec::new(),
        };
        let current = env(&[("HIP_VISIBLE_DEVICES", "0,1")]);
        let wanted = vec![("CUDA_VISIBLE_DEVICES".to_owned(), "0,1".to_owned())];
        assert_eq!(
            env_updates(&report, &rocm, &current),
            EnvUpdates::Set(wanted.clone())
        );
        report.unfinished = vec!["ascend".into()];
        assert_eq!(
            env_updates(&report, &rocm, &current),
            EnvUpdates::Restart(wanted)
        );
        let done = env(&[
            ("HIP_VISIBLE_DEVICES", "0,1"),
            ("CUDA_VISIBLE_DEVICES", "0,1"),
        ]);
        assert_eq!(env_updates(&report, &rocm, done), EnvUpdates::Unchanged);
    }

    #[test]
    fn single_process_defaults() {
        let p = Placement::with_env(&device("cpu"), 7, env(&[])).unwrap();
        let run = p.run();
        assert_eq!(
            (
                run.rank,
                run.world_size,
                run.local_rank,
                run.local_world_size
            ),
            (0, 1, 0, 1)
        );
        assert_eq!(
            (run.device.as_str(), run.device_index, run.seed),
            ("cpu", None, 7)
        );
        assert_eq!(p.device_name(), "CPU");
    }

    #[test]
    fn torchrun_variables_place_the_rank() {
        let vars = [
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ];
        let mut gpus = device("cuda");
        gpus.device_names = vec!["NVIDIA H100 80GB HBM3".into(), "NVIDIA H200".into()];
        let p = Placement::with_env(&gpus, 0, env(&vars)).unwrap();
        let run = p.run();
        assert_eq!((run.rank, run.world_size, run.local_rank), (3, 4, 1));
        assert_eq!((run.device.as_str(), run.device_index), ("cuda:1", Some(1)));
        // The local rank's device, for the MFU metrics' peak FLOP/s.
        assert_eq!(p.device_name(), "NVIDIA H200");
        assert_eq!(p.alone().device_name(), "NVIDIA H200");
        assert_eq!(
            (
                run.master_addr.as_str(),
                run.master_port,
                run.comm_backend.as_str()
            ),
            ("10.0.0.1", 29500, "nccl")
        );
    }

    #[test]
    fn bad_rank_variables_are_named() {
        let err = Placement::with_env(
            &device("cpu"),
            0,
            env(&[("RANK", "2"), ("WORLD_SIZE", "2")]),
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("RANK=2") && err.to_string().contains("WORLD_SIZE=2"),
            "{err}"
        );
        let err =
            Placement::with_env(&device("cpu"), 0, env(&[("MASTER_PORT", "http")])).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("environment variable MASTER_PORT=http"),
            "{err}"
        );
    }

    const SLURM_STEP: [(&str, &str); 6] = [
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NTASKS_PER_NODE", "4"),
        ("SLURM_STEP_ID", "0"),
        ("MASTER_ADDR", "node-a"),
    ];

    #[test]
    fn slurm_step_variables_place_the_rank() {
        let p = Placement::with_env(&device("cuda"), 0, env(&SLURM_STEP)).unwrap();
        let run = p.run();
        assert_eq!(p.source(), RankSource::Slurm);
        assert_eq!(
            (
                run.rank,
                run.world_size,
                run.local_rank,
                run.local_world_size
            ),
            (5, 8, 1, 4)
        );
        assert_eq!((run.device.as_str(), run.device_index), ("cuda:1", Some(1)));
        // MASTER_PORT defaults to torchrun's.
        assert_eq!(
            (run.master_addr.as_str(), run.master_port),
            ("node-a", 29500)
        );
        let mut vars = SLURM_STEP.to_vec();
        vars.push(("MASTER_PORT", "1234"));
        let p = Placement::with_env(&device("cuda"), 0, env(&vars)).unwrap();
        assert_eq!(p.run().master_port, 1234);
    }

    #[test]
    fn torchrun_variables_win_over_slurm() {
        let mut vars = SLURM_STEP.to_vec();
        vars.extend([("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "4000")]);
        let p = Placement::with_env(&device("cpu"), 0, env(&vars)).unwrap();
        let run = p.run();
        assert_eq!(p.source(), RankSource::Torchrun);
        assert_eq!(
            (run.rank, run.world_size, run.local_rank, run.master_port),
            (1, 2, 0, 4000)
        );
    }

    #[test]
    fn a_batch_script_outside_a_step_is_one_process() {
        // sbatch's own shell has the job's task count but is not one of its ranks.
        let vars: Vec<_> = SLURM_STEP
            .iter()
            .copied()
            .filter(|(k, _)| *k != "SLURM_STEP_ID")
            .collect();
        let p = Placement::with_env(&device("cpu"), 0, env(&vars)).unwrap();
        assert_eq!(p.source(), RankSource::Single);
        assert_eq!((p.run().rank, p.run().world_size), (0, 1));
    }

    #[test]
    fn slurm_errors_name_slurm_variables() {
        let mut vars: Vec<_> = SLURM_STEP
            .iter()
            .copied()
            .filter(|(k, _)| *k != "MASTER_ADDR")
            .collect();
        let err = Placement::with_env(&device("cpu"), 0, env(&vars)).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("environment variable MASTER_ADDR=: must name the first node")
                && err.to_string().contains("scontrol show hostnames"),
            "{err}"
        );
        vars.push(("MASTER_ADDR", "node-a"));
        vars.retain(|(k, _)| *k != "SLURM_PROCID");
        vars.push(("SLURM_PROCID", "8"));
        let err = Placement::with_env(&device("cpu"), 0, env(&vars)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "environment variable SLURM_PROCID=8: must be below SLURM_NTASKS=8"
        );
    }

    #[test]
    fn world_size_must_match_the_trainer_keys() {
        let two = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ]);
        let p = Placement::with_env(&device("cpu"), 0, two).unwrap();
        assert!(p.check_world_size(1, 2).is_ok());
        assert!(p.check_world_size(2, 1).is_ok());
        let err = p.check_world_size(1, 8).unwrap_err().to_string();
        assert!(
            err.starts_with("trainer.nnodes=1 × trainer.n_gpus_per_node=8 = 8, but this run has 2 ranks (RANK/WORLD_SIZE"),
            "{err}"
        );
        // One process may run a config sized for a cluster.
        let single = Placement::with_env(&device("cpu"), 0, env(&[])).unwrap();
        assert!(single.check_world_size(4, 8).is_ok());
    }

    #[test]
    fn single_rank_commands_refuse_every_rank() {
        for rank in ["0", "1"] {
            let vars = env(&[("RANK", rank), ("WORLD_SIZE", "2")]);
            let p = Placement::with_env(&device("cpu"), 0, vars).unwrap();
            let err = p.require_single_rank("training").unwrap_err().to_string();
            assert!(
                err.starts_with(&format!(
                    "multi-rank training is not supported by this build yet: this is rank {rank} of 2"
                )),
                "{err}"
            );
        }
        let single = Placement::with_env(&device("cpu"), 0, env(&[])).unwrap();
        assert!(single.require_single_rank("training").is_ok());
    }
}
