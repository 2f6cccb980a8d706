//! Multi-rank communication for engines on PyTorch's own c10d: a TCPStore rendezvous hosted by
//! rank 0 and a process group (Gloo on CPU; NCCL behind the `nccl` feature) driven through a
//! small C++ shim, with tensors crossing as tch's `at::Tensor` pointers.
//!
//! Ranks follow torchrun's convention (what [`RunContext`] carries: rank, world size, master
//! address and port), so `verl-core launch`, torchrun, Slurm or Kubernetes can start them. The
//! backend comes from the selected device platform's report (`RunContext::comm_backend`).
//!
//! Every collective is bounded: it returns within [`Options::timeout`], and a peer that dies
//! (its heartbeat in the store stops, or it closes its group) makes every waiting rank fail
//! within about [`Options::peer_lost_after`] with an error naming that rank — never a hang.
//! After a failure the group is unusable ([`DistError::Broken`]); the job is meant to stop.
//!
//! ```no_run
//! use verl_distributed::{Options, ProcessGroup, ReduceOp};
//! # fn demo(run: &verl_plugin_api::RunContext) -> Result<(), verl_distributed::DistError> {
//! let mut group = ProcessGroup::from_run(run, &Options::default())?;
//! let mut grad = tch::Tensor::ones([4], (tch::Kind::Float, tch::Device::Cpu));
//! group.all_reduce(&mut grad, ReduceOp::Avg)?;
//! let names: Vec<String> = group.all_gather_object(&format!("rank {}", group.rank()))?;
//! # Ok(()) }
//! ```

mod group;
mod liveness;
pub mod nccl;
mod shim;
pub mod weight_transfer;

use std::time::Duration;

pub use group::{ProcessGroup, SubGroup};
use verl_plugin_api::RunContext;

/// A collective backend this build can create.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// ProcessGroupGloo: CPU tensors.
    Gloo,
    /// ProcessGroupNCCL (RCCL on ROCm builds of libtorch): CUDA tensors; only with the `nccl`
    /// feature.
    Nccl,
}

impl Backend {
    /// The backend for a platform's comm backend name (`DeviceInfo::comm_backend`, carried in
    /// `RunContext::comm_backend`). A backend this build cannot create is an error saying why.
    pub fn for_comm_backend(name: &str) -> Result<Self, DistError> {
        let unsupported = |reason: &str| DistError::Backend {
            name: name.to_owned(),
            reason: reason.to_owned(),
        };
        match name.trim().to_ascii_lowercase().as_str() {
            "gloo" => Ok(Self::Gloo),
            "nccl" if cfg!(feature = "nccl") => Ok(Self::Nccl),
            "nccl" => Err(unsupported(
                "this build has no NCCL; build verl-distributed with `--features nccl` against the CUDA libtorch \
                 (README, section Multi-rank), or run on CPU with gloo (trainer.device=cpu)",
            )),
            "hccl" => Err(unsupported(
                "HCCL comes with torch_npu, which this build does not link; Ascend multi-rank is future work",
            )),
            _ => Err(unsupported(&format!(
                "unknown collective backend; this build creates {}",
                if cfg!(feature = "nccl") {
                    "gloo and nccl"
                } else {
                    "gloo"
                }
            ))),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Gloo => "gloo",
            Self::Nccl => "nccl",
        }
    }

    /// The shim's code for this backend.
    fn code(self) -> i32 {
        match self {
            Self::Gloo => 0,
            Self::Nccl => 1,
        }
    }
}

/// How values combine in [`ProcessGroup::all_reduce`] and [`ProcessGroup::reduce_scatter`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Max,
    Min,
    /// The mean over ranks: Gloo has no AVG, so a sum divided by the world size (floating-point
    /// tensors only).
    Avg,
}

impl ReduceOp {
    /// The shim's code for the reduction c10d runs (AVG runs as SUM).
    fn code(self) -> i32 {
        match self {
            Self::Sum | Self::Avg => 0,
            Self::Max => 1,
            Self::Min => 2,
        }
    }
}

/// Where this rank is in the job, with torchrun's meaning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendezvous {
    pub rank: u32,
    pub world_size: u32,
    /// Host of rank 0, which hosts the TCPStore.
    pub master_addr: String,
    pub master_port: u16,
}

impl Rendezvous {
    /// The rendezvous facts of a component's run context; a multi-rank context must name the
    /// master address and port.
    pub fn from_run(run: &RunContext) -> Result<Self, DistError> {
        let rendezvous = Self {
            rank: run.rank,
            world_size: run.world_size,
            master_addr: run.master_addr.clone(),
            master_port: run.master_port,
        };
        rendezvous.check()?;
        Ok(rendezvous)
    }

    fn check(&self) -> Result<(), DistError> {
        let invalid = |reason: String| Err(DistError::Config(reason));
        if self.world_size == 0 {
            return invalid("WORLD_SIZE must be at least 1".to_owned());
        }
        if self.rank >= self.world_size {
            return invalid(format!(
                "RANK={} must be below WORLD_SIZE={}",
                self.rank, self.world_size
            ));
        }
        if self.world_size > 1 && self.master_addr.trim().is_empty() {
            return invalid(format!(
                "MASTER_ADDR is not set (rank {} of {}): the address of rank 0, which hosts the rendezvous store",
                self.rank, self.world_size
            ));
        }
        if self.world_size > 1 && self.master_port == 0 {
            return invalid(format!(
                "MASTER_PORT is not set (rank {} of {}): the port rank 0 hosts the rendezvous store on",
                self.rank, self.world_size
            ));
        }
        Ok(())
    }
}

/// Bounds of a process group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// Rendezvous (every rank joining) and each collective must finish within this.
    pub timeout: Duration,
    /// How often each rank writes its heartbeat to the store, and how often a waiting rank
    /// reads its peers'.
    pub heartbeat: Duration,
    /// A peer whose heartbeat has not changed for this long is reported as lost.
    pub peer_lost_after: Duration,
}

impl Default for Options {
    /// 10 minutes per collective (torch's NCCL default; its Gloo default is 30), heartbeats
    /// every 200 ms, a peer lost after 3 s of silence.
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(600),
            heartbeat: Duration::from_millis(200),
            peer_lost_after: Duration::from_secs(3),
        }
    }
}

/// A failure of rendezvous or of a collective.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    #[error("collective backend `{name}`: {reason}")]
    Backend { name: String, reason: String },
    #[error("rendezvous: {0}")]
    Config(String),
    #[error("rendezvous at {addr}:{port} (rank {rank} of {world_size}): {reason}")]
    Rendezvous {
        addr: String,
        port: u16,
        rank: u32,
        world_size: u32,
        reason: String,
    },
    /// A rank stopped responding, closed its group or lost its store during a collective.
    #[error("{op} failed: rank {rank}{peer} {how}")]
    PeerLost {
        op: String,
        rank: u32,
        /// " (pid P on HOST)" when the peer registered one.
        peer: String,
        how: String,
    },
    #[error("{op} timed out after {seconds:.1} s: {detail}")]
    Timeout {
        op: String,
        seconds: f64,
        detail: String,
    },
    #[error("{op} failed: {message}")]
    Collective { op: String, message: String },
    #[error("{op}: {reason}")]
    Invalid { op: String, reason: String },
    #[error("the process group is unusable after an earlier failure ({0})")]
    Broken(String),
    /// This process cannot take part (no CUDA device, no NCCL library, a build without NCCL).
    #[error("{0}")]
    Unavailable(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backends_are_chosen_from_the_platform_report() {
        assert_eq!(Backend::for_comm_backend("gloo").unwrap(), Backend::Gloo);
        assert_eq!(Backend::for_comm_backend(" GLOO ").unwrap(), Backend::Gloo);
        let hccl = Backend::for_comm_backend("hccl").unwrap_err().to_string();
        assert!(
            hccl.starts_with("collective backend `hccl`: HCCL comes with torch_npu"),
            "{hccl}"
        );
        let ccl = Backend::for_comm_backend("ccl").unwrap_err().to_string();
        assert!(ccl.contains("unknown collective backend"), "{ccl}");
        let nccl = Backend::for_comm_backend("nccl");
        if cfg!(feature = "nccl") {
            assert_eq!(nccl.unwrap(), Backend::Nccl);
        } else {
            let err = nccl.unwrap_err().to_string();
            assert!(err.contains("--features nccl"), "{err}");
        }
    }

    #[test]
    fn a_multi_rank_context_must_name_the_rendezvous() {
        let mut run = RunContext::default();
        assert_eq!(Rendezvous::from_run(&run).unwrap().world_size, 1);
        run.world_size = 2;
        run.rank = 1;
        let err = Rendezvous::from_run(&run).unwrap_err().to_string();
        assert!(
            err.starts_with("rendezvous: MASTER_ADDR is not set (rank 1 of 2)"),
            "{err}"
        );
        run.master_addr = "10.0.0.1".into();
        let err = Rendezvous::from_run(&run).unwrap_err().to_string();
        assert!(
            err.starts_with("rendezvous: MASTER_PORT is not set"),
            "{err}"
        );
        run.master_port = 29500;
        assert_eq!(
            Rendezvous::from_run(&run).unwrap(),
            Rendezvous {
                rank: 1,
                world_size: 2,
                master_addr: "10.0.0.1".into(),
                master_port: 29500,
            }
        );
        run.rank = 2;
        let err = Rendezvous::from_run(&run).unwrap_err().to_string();
        assert_eq!(err, "rendezvous: RANK=2 must be below WORLD_SIZE=2");
    }
}
