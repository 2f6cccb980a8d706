//! Where this process's components run: the selected device platform and this process's rank,
//! read with torchrun's convention (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//! `MASTER_ADDR`, `MASTER_PORT`), so torchrun, Slurm wrappers or Kubernetes can start ranks. Every
//! component gets its [`RunContext`] from here, so all of them agree on it.

use verl_plugin_api::{ComponentInit, RunContext};
use verl_plugin_host::DeviceReport;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlacementError {
    #[error("environment variable {name}={value}: {reason}")]
    Env {
        name: &'static str,
        value: String,
        reason: String,
    },
}

/// The platform and rank a process computes on.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    run: RunContext,
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
        let world_size: u32 = env_number(&env, "WORLD_SIZE", 1)?;
        let rank: u32 = env_number(&env, "RANK", 0)?;
        let local_rank: u32 = env_number(&env, "LOCAL_RANK", 0)?;
        let local_world_size: u32 = env_number(&env, "LOCAL_WORLD_SIZE", world_size)?;
        let master_port: u16 = env_number(&env, "MASTER_PORT", 0)?;
        if world_size == 0 {
            return Err(PlacementError::Env {
                name: "WORLD_SIZE",
                value: "0".into(),
                reason: "must be at least 1".into(),
            });
        }
        if rank >= world_size {
            return Err(PlacementError::Env {
                name: "RANK",
                value: rank.to_string(),
                reason: format!("must be below WORLD_SIZE={world_size}"),
            });
        }
        if local_rank >= local_world_size {
            return Err(PlacementError::Env {
                name: "LOCAL_RANK",
                value: local_rank.to_string(),
                reason: format!("must be below LOCAL_WORLD_SIZE={local_world_size}"),
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
        run.master_addr = env("MASTER_ADDR").unwrap_or_default();
        run.master_port = master_port;
        run.seed = seed;
        Ok(Self { run })
    }

    pub fn run(&self) -> &RunContext {
        &self.run
    }

    /// The context with the run's names and output directory filled in.
    pub fn for_run(&self, project: &str, experiment: &str, run_dir: &str) -> RunContext {
        let mut run = self.run.clone();
        run.project = project.to_owned();
        run.experiment = experiment.to_owned();
        run.run_dir = run_dir.to_owned();
        run
    }

    /// A component's init record for one-off commands (no run directory).
    pub fn init(&self, config: serde_json::Value) -> ComponentInit {
        ComponentInit::new(config, self.run.clone())
    }
}

/// Sets the variables the selected platform asks for (e.g. `CUDA_VISIBLE_DEVICES` translated from
/// `HIP_VISIBLE_DEVICES`) before any component initialises, so the libraries they load see them.
pub fn apply_env_updates(device: &DeviceReport) {
    for (key, value) in &device.env_updates {
        tracing::info!("platform `{}` sets {key}={value}", device.name);
        // SAFETY: called on the main thread before any component (and its threads) exists;
        // detection threads read the probe's snapshot of the environment, never the process's.
        unsafe { std::env::set_var(key, value) };
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

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
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
        let p = Placement::with_env(&device("cuda"), 0, env(&vars)).unwrap();
        let run = p.run();
        assert_eq!((run.rank, run.world_size, run.local_rank), (3, 4, 1));
        assert_eq!((run.device.as_str(), run.device_index), ("cuda:1", Some(1)));
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
}
