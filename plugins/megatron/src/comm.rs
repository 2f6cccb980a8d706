//! The engine's process groups, as Megatron-LM lays them out: the job's ranks in a
//! data-parallel × tensor-parallel grid, tensor-parallel ranks adjacent (group `d` holds ranks
//! `d·tp .. (d+1)·tp`, data-parallel group `t` the ranks `t, t + tp, …`). One c10d group per
//! process (verl-distributed), made by the first engine initialised with more than one rank and
//! shared by every engine of the process (actor, reference, critic), with the two subgroup
//! splits of each tensor-parallel size in use; all their collectives run in one sequence on
//! every rank.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tch::{Device, Kind, Tensor};
use verl_distributed::{DistError, Options, ProcessGroup, ReduceOp, SubGroup};
use verl_plugin_api::{PluginError, RunContext};
use verl_torch_runtime::ModelError;

/// The process's group and its splits while any engine holds them.
struct Shared {
    group: ProcessGroup,
    /// `(tensor-parallel size, tensor-parallel subgroup, data-parallel subgroup)`.
    splits: Vec<(u32, SubGroup, SubGroup)>,
}

static GROUP: Mutex<Weak<Mutex<Shared>>> = Mutex::new(Weak::new());

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the group is caught at the ABI boundary; the group records a
    // failed collective as broken, so its state stays meaningful.
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// Which group a collective runs in (for messages).
#[derive(Debug, Clone, Copy)]
enum Scope {
    Tensor,
    Data,
    World,
}

impl Scope {
    fn name(self) -> &'static str {
        match self {
            Self::Tensor => "tensor-parallel",
            Self::Data => "data-parallel",
            Self::World => "job",
        }
    }
}

/// A collective's failure as a model error naming the group.
fn failed(scope: Scope) -> impl Fn(DistError) -> ModelError {
    move |e| ModelError::Torch(format!("megatron {} group: {e}", scope.name()))
}

/// This rank's place in the grid and the shared groups (`None` on one rank).
#[derive(Clone)]
pub struct Comm {
    rank: u32,
    world: u32,
    tp: u32,
    shared: Option<Arc<Mutex<Shared>>>,
    tp_group: Option<SubGroup>,
    dp_group: Option<SubGroup>,
    traffic: Arc<Traffic>,
}

/// Bytes this rank has sent in tensor- and data-parallel collectives, counted as a ring
/// algorithm sends them (what Megatron-LM's analysis counts): an all-reduce of `S` bytes over
/// `n` ranks sends `2(n−1)/n · S`, an all-gather or reduce-scatter of a whole of `S` bytes
/// `(n−1)/n · S`.
#[derive(Debug, Default)]
pub struct Traffic {
    pub tensor_parallel: AtomicU64,
    pub data_parallel: AtomicU64,
}

impl Traffic {
    fn add(counter: &AtomicU64, ranks: u32, whole_bytes: usize, passes: u64) {
        let n = u64::from(ranks);
        counter.fetch_add(passes * (n - 1) * whole_bytes as u64 / n, Ordering::Relaxed);
    }
}

fn bytes(tensor: &Tensor) -> usize {
    tensor.numel() * tensor.kind().elt_size_in_bytes()
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rank {} of {} (tensor-parallel rank {} of {}, data-parallel rank {} of {})",
            self.rank,
            self.world,
            self.tp_rank(),
            self.tp,
            self.dp_rank(),
            self.dp_size()
        )
    }
}

impl Comm {
    /// Joins (or, for the first engine of the process, creates) the job's group and its split
    /// for tensor-parallel size `tp` (which divides the world size); a collective may take at
    /// most `timeout` (verl's `nccl_timeout`).
    pub fn join(run: &RunContext, tp: u32, timeout: Duration) -> Result<Self, PluginError> {
        let world = run.world_size.max(1);
        let mut comm = Self {
            rank: run.rank,
            world,
            tp,
            shared: None,
            tp_group: None,
            dp_group: None,
            traffic: Arc::default(),
        };
        if world == 1 {
            return Ok(comm);
        }
        let mut slot = lock(&GROUP);
        let shared = match slot.upgrade() {
            Some(shared) => shared,
            None => {
                let options = Options {
                    timeout,
                    ..Options::default()
                };
                let group = ProcessGroup::from_run(run, &options)
                    .map_err(|e| PluginError::other(format!("joining the job's group: {e}")))?;
                let shared = Arc::new(Mutex::new(Shared {
                    group,
                    splits: Vec::new(),
                }));
                *slot = Arc::downgrade(&shared);
                shared
            }
        };
        {
            let mut s = lock(&shared);
            if (s.group.rank(), s.group.world_size()) != (run.rank, world) {
                return Err(PluginError::other(format!(
                    "the process's group is rank {} of {}, this engine's run context says rank {} of {world}",
                    s.group.rank(),
                    s.group.world_size(),
                    run.rank
                )));
            }
            let (tp_group, dp_group) = match s.splits.iter().find(|(size, ..)| *size == tp) {
                Some(&(_, t, d)) => (t, d),
                None => {
                    let dp = world / tp;
                    let tensor: Vec<Vec<u32>> =
                        (0..dp).map(|d| (d * tp..(d + 1) * tp).collect()).collect();
                    let data: Vec<Vec<u32>> = (0..tp)
                        .map(|t| (0..dp).map(|d| d * tp + t).collect())
                        .collect();
                    let split = |s: &mut Shared, name: &str, partition: &[Vec<u32>]| {
                        s.group
                            .split(&format!("{name}{tp}"), partition)
                            .map_err(|e| {
                                PluginError::other(format!("making the {name} groups: {e}"))
                            })
                    };
                    let t = split(&mut s, "tp", &tensor)?;
                    let d = split(&mut s, "dp", &data)?;
                    s.splits.push((tp, t, d));
                    (t, d)
                }
            };
            comm.tp_group = Some(tp_group);
            comm.dp_group = Some(dp_group);
        }
        comm.shared = Some(shared);
        Ok(comm)
    }

    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// What this engine's collectives have sent so far.
    pub fn traffic(&self) -> &Traffic {
        &self.traffic
    }

    pub fn tp_size(&self) -> u32 {
        self.tp
    }

    pub fn tp_rank(&self) -> u32 {
        self.rank % self.tp
    }

    pub fn dp_size(&self) -> u32 {
        self.world / self.tp
    }

    pub fn dp_rank(&self) -> u32 {
        self.rank / self.tp
    }

    /// Runs `op` on the shared group with the subgroup of `scope` (`None` for the job's), or
    /// returns `Ok(None)` when that group has one rank.
    fn with<T>(
        &self,
        scope: Scope,
        op: impl FnOnce(&mut ProcessGroup, Option<SubGroup>) -> Result<T, DistError>,
    ) -> verl_torch_runtime::Result<Option<T>> {
        let (size, sub) = match scope {
            Scope::Tensor => (self.tp, self.tp_group),
            Scope::Data => (self.dp_size(), self.dp_group),
            Scope::World => (self.world, None),
        };
        let Some(shared) = self.shared.as_ref().filter(|_| size > 1) else {
            return Ok(None);
        };
        op(&mut lock(shared).group, sub)
            .map(Some)
            .map_err(failed(scope))
    }

    /// Reduces `tensor` in place over the tensor-parallel group.
    pub fn all_reduce_tp(
        &self,
        tensor: &mut Tensor,
        op: ReduceOp,
    ) -> verl_torch_runtime::Result<()> {
        let size = bytes(tensor);
        let done = self.with(Scope::Tensor, |g, sub| {
            g.all_reduce_in(sub.expect("tensor-parallel subgroup"), tensor, op)
        })?;
        if done.is_some() {
            Traffic::add(&self.traffic.tensor_parallel, self.tp, size, 2);
        }
        Ok(())
    }

    /// Every tensor-parallel rank's `tensor` (all of one shape), stacked `[tp, ..]`.
    pub fn all_gather_tp(&self, tensor: &Tensor) -> verl_torch_runtime::Result<Tensor> {
        // c10d's flat all-gather: 1-D input, 1-D output of tp × its elements.
        let input = tensor.reshape([-1]).contiguous();
        let mut out = Tensor::empty(
            [i64::from(self.tp) * input.numel() as i64],
            (input.kind(), input.device()),
        );
        let done = self.with(Scope::Tensor, |g, sub| {
            g.all_gather_into_in(sub.expect("tensor-parallel subgroup"), &mut out, &input)
        })?;
        let mut shape = vec![i64::from(self.tp)];
        shape.extend(tensor.size());
        Ok(match done {
            Some(()) => {
                Traffic::add(&self.traffic.tensor_parallel, self.tp, bytes(&out), 1);
                out.view(shape.as_slice())
            }
            None => tensor.unsqueeze(0),
        })
    }

    /// Sums `input` `[tp, ..]` over the tensor-parallel group and returns this rank's slice.
    pub fn reduce_scatter_tp(&self, input: &Tensor) -> verl_torch_runtime::Result<Tensor> {
        // c10d's flat reduce-scatter: 1-D input of tp × the output's elements.
        let flat = input.reshape([-1]).contiguous();
        let part = &input.size()[1..];
        let mut out = Tensor::empty(
            [flat.numel() as i64 / i64::from(self.tp)],
            (flat.kind(), flat.device()),
        );
        let done = self.with(Scope::Tensor, |g, sub| {
            g.reduce_scatter_in(
                sub.expect("tensor-parallel subgroup"),
                &mut out,
                &flat,
                ReduceOp::Sum,
            )
        })?;
        Ok(match done {
            Some(()) => {
                Traffic::add(&self.traffic.tensor_parallel, self.tp, bytes(&flat), 1);
                out.view(part)
            }
            None => input.select(0, 0),
        })
    }

    /// Sums `values` over the data-parallel ranks, in place (f64 end to end).
    pub fn all_reduce_dp(&self, values: &mut [f64]) -> verl_torch_runtime::Result<()> {
        if values.is_empty() {
            return Ok(());
        }
        let mut tensor = Tensor::from_slice(values);
        let done = self.with(Scope::Data, |g, sub| {
            g.all_reduce_in(
                sub.expect("data-parallel subgroup"),
                &mut tensor,
                ReduceOp::Sum,
            )
        })?;
        if done.is_some() {
            let summed =
                Vec::<f64>::try_from(&tensor).map_err(|e| ModelError::Torch(e.to_string()))?;
            values.copy_from_slice(&summed);
        }
        Ok(())
    }

    /// Sums `tensors` (all of one dtype and device) over the data-parallel ranks in place, as
    /// one flat buffer.
    pub fn all_reduce_dp_tensors(&self, tensors: &mut [Tensor]) -> verl_torch_runtime::Result<()> {
        if tensors.is_empty() || self.dp_size() == 1 {
            return Ok(());
        }
        let flat: Vec<Tensor> = tensors.iter().map(|t| t.reshape([-1])).collect();
        let mut buffer = Tensor::cat(&flat, 0);
        self.with(Scope::Data, |g, sub| {
            g.all_reduce_in(
                sub.expect("data-parallel subgroup"),
                &mut buffer,
                ReduceOp::Sum,
            )
        })?;
        Traffic::add(
            &self.traffic.data_parallel,
            self.dp_size(),
            bytes(&buffer),
            2,
        );
        let mut offset = 0;
        tch::no_grad(|| {
            for tensor in tensors.iter_mut() {
                let n = tensor.numel() as i64;
                tensor.copy_(&buffer.narrow(0, offset, n).view_as(tensor));
                offset += n;
            }
        });
        Ok(())
    }

    /// Whether every rank of the job says yes.
    pub fn all_agree(&self, yes: bool) -> verl_torch_runtime::Result<bool> {
        let mut flag = Tensor::from_slice(&[i64::from(yes)]);
        self.with(Scope::World, |g, _| g.all_reduce(&mut flag, ReduceOp::Min))?;
        Ok(flag.int64_value(&[0]) == 1)
    }

    /// Every rank's `bytes`, in rank order (the trainer's object exchange).
    pub fn all_gather_bytes(&self, bytes: &[u8]) -> verl_torch_runtime::Result<Vec<Vec<u8>>> {
        let gathered = self.with(Scope::World, |g, _| {
            let world = i64::from(g.world_size());
            let mut lens = Tensor::zeros([world], (Kind::Int64, Device::Cpu));
            g.all_gather_into(&mut lens, &Tensor::from_slice(&[bytes.len() as i64]))?;
            let lens: Vec<i64> = (0..world).map(|i| lens.int64_value(&[i])).collect();
            let longest = lens.iter().copied().max().unwrap_or(0).max(1);
            let mut padded = bytes.to_vec();
            padded.resize(longest as usize, 0);
            let mut all = Tensor::zeros([world * longest], (Kind::Uint8, Device::Cpu));
            g.all_gather_into(&mut all, &Tensor::from_slice(&padded))?;
            let all = Vec::<u8>::try_from(&all).map_err(|e| DistError::Invalid {
                op: "all_gather_object".into(),
                reason: e.to_string(),
            })?;
            Ok(all
                .chunks(longest as usize)
                .zip(&lens)
                .map(|(chunk, &len)| chunk[..len as usize].to_vec())
                .collect())
        })?;
        Ok(gathered.unwrap_or_else(|| vec![bytes.to_vec()]))
    }
}
