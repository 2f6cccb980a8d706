//! The engine's process group: one c10d process group per process (verl-distributed), made
//! by the first engine initialised with `world_size > 1` and shared by every engine of the
//! process (actor, reference, critic) — sharded or replicated — so their collectives and the
//! trainer's object exchange run in one sequence on every rank. The group is left (an orderly close, which peers still
//! waiting report at once) when the last engine holding it is dropped.

use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tch::{Device, Kind, Tensor};
use verl_actor::Reduction;
use verl_distributed::{DistError, Options, ProcessGroup, ReduceOp};
use verl_model::ModelError;
use verl_plugin_api::{PluginError, RunContext};

/// The process's group while any engine holds it.
static GROUP: Mutex<Weak<Mutex<ProcessGroup>>> = Mutex::new(Weak::new());

/// This rank's view of the job's ranks: none (one rank) or the shared group.
#[derive(Clone)]
pub struct Ranks {
    rank: u32,
    world_size: u32,
    group: Option<Arc<Mutex<ProcessGroup>>>,
}

impl std::fmt::Debug for Ranks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rank {} of {}", self.rank, self.world_size)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the group is caught at the ABI boundary; the group itself records
    // a failed collective as broken, so its state stays meaningful.
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// Reduces `values` over `group`'s ranks in place, f64 end to end, through a tensor on `device`
/// (NCCL reduces device tensors only).
pub fn all_reduce(
    group: &mut ProcessGroup,
    values: &mut [f64],
    op: Reduction,
    device: Device,
) -> Result<(), DistError> {
    if values.is_empty() {
        return Ok(());
    }
    let mut tensor = Tensor::from_slice(values).to_device(device);
    let op = match op {
        Reduction::Sum => ReduceOp::Sum,
        Reduction::Max => ReduceOp::Max,
    };
    group.all_reduce(&mut tensor, op)?;
    let summed =
        Vec::<f64>::try_from(&tensor.to_device(Device::Cpu)).map_err(|e| DistError::Invalid {
            op: "all_reduce".into(),
            reason: e.to_string(),
        })?;
    values.copy_from_slice(&summed);
    Ok(())
}

/// A collective's failure as a libtorch-style model error (naming the lost rank when one is).
pub fn model_error(e: DistError) -> ModelError {
    ModelError::Torch(format!("data-parallel group: {e}"))
}

impl Ranks {
    /// Joins (or, for the first engine of the process, creates) the job's group from the run
    /// context; a collective may take at most `timeout` (verl's `nccl_timeout`), a peer that dies
    /// is reported within a few seconds whatever the timeout.
    pub fn join(run: &RunContext, timeout: Duration) -> Result<Self, PluginError> {
        let single = Self {
            rank: 0,
            world_size: 1,
            group: None,
        };
        if run.world_size <= 1 {
            return Ok(single);
        }
        let mut slot = lock(&GROUP);
        let group = match slot.upgrade() {
            Some(group) => {
                let (rank, world_size) = {
                    let g = lock(&group);
                    (g.rank(), g.world_size())
                };
                if (rank, world_size) != (run.rank, run.world_size) {
                    return Err(PluginError::other(format!(
                        "the process's data-parallel group is rank {rank} of {world_size}, this engine's run context says rank {} of {}",
                        run.rank, run.world_size
                    )));
                }
                group
            }
            None => {
                let options = Options {
                    timeout,
                    ..Options::default()
                };
                let group = ProcessGroup::from_run(run, &options).map_err(|e| {
                    PluginError::other(format!("joining the data-parallel group: {e}"))
                })?;
                let group = Arc::new(Mutex::new(group));
                *slot = Arc::downgrade(&group);
                group
            }
        };
        Ok(Self {
            rank: run.rank,
            world_size: run.world_size,
            group: Some(group),
        })
    }

    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The shared group (`None` on one rank).
    pub fn group(&self) -> Option<&Arc<Mutex<ProcessGroup>>> {
        self.group.as_ref()
    }

    /// Reduces `values` over the ranks, in place (f64 end to end).
    pub fn all_reduce(&self, values: &mut [f64], op: Reduction) -> Result<(), DistError> {
        match &self.group {
            Some(group) => all_reduce(&mut lock(group), values, op, Device::Cpu),
            None => Ok(()),
        }
    }

    /// Sums `tensors` (gradients, all of one dtype and device) over the ranks in place, as one
    /// flat buffer: one collective whatever the number of parameters.
    pub fn all_reduce_sum_tensors(&self, tensors: &mut [Tensor]) -> Result<(), DistError> {
        let Some(group) = &self.group else {
            return Ok(());
        };
        if tensors.is_empty() {
            return Ok(());
        }
        let flat: Vec<Tensor> = tensors.iter().map(|t| t.reshape([-1])).collect();
        let mut buffer = Tensor::cat(&flat, 0);
        lock(group).all_reduce(&mut buffer, ReduceOp::Sum)?;
        let mut offset = 0;
        tch::no_grad(|| {
            for tensor in tensors.iter_mut() {
                let n = tensor.numel() as i64;
                let part = buffer.narrow(0, offset, n).view_as(tensor);
                tensor.copy_(&part);
                offset += n;
            }
        });
        Ok(())
    }

    /// Every rank's `bytes`, in rank order: the lengths first, then the bytes padded to the
    /// longest.
    pub fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
        let Some(group) = &self.group else {
            return Ok(vec![bytes.to_vec()]);
        };
        let invalid = |reason: String| DistError::Invalid {
            op: "all_gather_object".into(),
            reason,
        };
        let world = i64::from(self.world_size);
        let mut group = lock(group);
        let mut lens = Tensor::zeros([world], (Kind::Int64, Device::Cpu));
        group.all_gather_into(&mut lens, &Tensor::from_slice(&[bytes.len() as i64]))?;
        let lens = Vec::<i64>::try_from(&lens).map_err(|e| invalid(e.to_string()))?;
        let longest = lens.iter().copied().max().unwrap_or(0).max(1);
        let mut padded = bytes.to_vec();
        padded.resize(longest as usize, 0);
        let mut all = Tensor::zeros([world * longest], (Kind::Uint8, Device::Cpu));
        group.all_gather_into(&mut all, &Tensor::from_slice(&padded))?;
        let all = Vec::<u8>::try_from(&all).map_err(|e| invalid(e.to_string()))?;
        Ok(all
            .chunks(longest as usize)
            .zip(&lens)
            .map(|(chunk, &len)| chunk[..len as usize].to_vec())
            .collect())
    }
}
