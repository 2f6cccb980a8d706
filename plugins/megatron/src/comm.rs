//! The engine's process groups, as Megatron-LM lays them out: the job's ranks in a
//! data-parallel × context-parallel × tensor-parallel grid, tensor-parallel ranks adjacent
//! (rank `(d·cp + c)·tp + t`). One c10d group per process (verl-distributed), made by the first
//! engine initialised with more than one rank and shared by every engine of the process (actor,
//! reference, critic), with the subgroup splits of each layout in use; all their collectives run
//! in one sequence on every rank.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tch::{Device, Kind, Tensor};
use verl_distributed::{DistError, Options, ProcessGroup, ReduceOp, SubGroup};
use verl_model::ModelError;
use verl_plugin_api::{PluginError, RunContext};

/// The groups a collective can run in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The ranks sharing one copy of the layers' weights (the same data and context slice).
    Tensor,
    /// The ranks holding the other slices of the same sequences.
    Context,
    /// One rank per data-parallel replica (the same tensor and context rank).
    Data,
    /// One copy of the model: tensor × context ranks (the same rows of the batch).
    Model,
    /// Every replica of one weight shard: data × context ranks (whose gradients sum).
    DataContext,
    World,
}

const SPLITS: [Scope; 5] = [
    Scope::Tensor,
    Scope::Context,
    Scope::Data,
    Scope::Model,
    Scope::DataContext,
];

impl Scope {
    fn name(self) -> &'static str {
        match self {
            Self::Tensor => "tensor-parallel",
            Self::Context => "context-parallel",
            Self::Data => "data-parallel",
            Self::Model => "model-parallel",
            Self::DataContext => "data- and context-parallel",
            Self::World => "job",
        }
    }
}

/// The process's group and its splits while any engine holds them.
struct Shared {
    group: ProcessGroup,
    /// `((tp, cp), a subgroup per scope of SPLITS)`.
    splits: Vec<((u32, u32), [SubGroup; 5])>,
}

static GROUP: Mutex<Weak<Mutex<Shared>>> = Mutex::new(Weak::new());

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the group is caught at the ABI boundary; the group records a
    // failed collective as broken, so its state stays meaningful.
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// A collective's failure as a model error naming the group.
fn failed(scope: Scope) -> impl Fn(DistError) -> ModelError {
    move |e| ModelError::Torch(format!("megatron {} group: {e}", scope.name()))
}

/// Bytes this rank has sent in collectives, counted as a ring algorithm sends them (what
/// Megatron-LM's analysis counts): an all-reduce of `S` bytes over `n` ranks sends
/// `2(n−1)/n · S`, an all-gather or reduce-scatter of a whole of `S` bytes `(n−1)/n · S`.
#[derive(Debug, Default)]
pub struct Traffic {
    /// Tensor-, context- and model-parallel groups: the activations and the batch's rows.
    pub model_parallel: AtomicU64,
    /// Data-parallel groups: gradients and counts.
    pub data_parallel: AtomicU64,
}

fn bytes(tensor: &Tensor) -> usize {
    tensor.numel() * tensor.kind().elt_size_in_bytes()
}

/// This rank's place in the grid and the shared groups (`None` on one rank).
#[derive(Clone)]
pub struct Comm {
    rank: u32,
    world: u32,
    tp: u32,
    cp: u32,
    shared: Option<Arc<Mutex<Shared>>>,
    subgroups: Option<[SubGroup; 5]>,
    traffic: Arc<Traffic>,
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rank {} of {} (tensor-parallel rank {} of {}, context-parallel rank {} of {}, data-parallel rank {} of {})",
            self.rank,
            self.world,
            self.tp_rank(),
            self.tp,
            self.cp_rank(),
            self.cp,
            self.dp_rank(),
            self.dp_size()
        )
    }
}

impl Comm {
    /// Joins (or, for the first engine of the process, creates) the job's group and its splits
    /// for tensor-parallel size `tp` and context-parallel size `cp` (`tp · cp` divides the world
    /// size); a collective may take at most `timeout` (verl's `nccl_timeout`).
    pub fn join(
        run: &RunContext,
        tp: u32,
        cp: u32,
        timeout: Duration,
    ) -> Result<Self, PluginError> {
        let world = run.world_size.max(1);
        let mut comm = Self {
            rank: run.rank,
            world,
            tp,
            cp,
            shared: None,
            subgroups: None,
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
            let subgroups = match s.splits.iter().find(|(layout, _)| *layout == (tp, cp)) {
                Some((_, subgroups)) => *subgroups,
                None => {
                    let mut made = Vec::with_capacity(SPLITS.len());
                    for scope in SPLITS {
                        let partition = partition(scope, world, tp, cp);
                        let name = format!("{scope:?}-tp{tp}-cp{cp}").to_lowercase();
                        made.push(s.group.split(&name, &partition).map_err(|e| {
                            PluginError::other(format!("making the {} groups: {e}", scope.name()))
                        })?);
                    }
                    let subgroups: [SubGroup; 5] = made.try_into().expect("one subgroup per scope");
                    s.splits.push(((tp, cp), subgroups));
                    subgroups
                }
            };
            comm.subgroups = Some(subgroups);
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

    pub fn cp_size(&self) -> u32 {
        self.cp
    }

    pub fn cp_rank(&self) -> u32 {
        self.rank / self.tp % self.cp
    }

    pub fn dp_size(&self) -> u32 {
        self.world / (self.tp * self.cp)
    }

    pub fn dp_rank(&self) -> u32 {
        self.rank / (self.tp * self.cp)
    }

    /// Ranks in `scope`'s group.
    pub fn size(&self, scope: Scope) -> u32 {
        match scope {
            Scope::Tensor => self.tp,
            Scope::Context => self.cp,
            Scope::Data => self.dp_size(),
            Scope::Model => self.tp * self.cp,
            Scope::DataContext => self.dp_size() * self.cp,
            Scope::World => self.world,
        }
    }

    /// This rank's position in `scope`'s group.
    pub fn rank_in(&self, scope: Scope) -> u32 {
        match scope {
            Scope::Tensor => self.tp_rank(),
            Scope::Context => self.cp_rank(),
            Scope::Data => self.dp_rank(),
            Scope::Model => self.rank % (self.tp * self.cp),
            Scope::DataContext => self.dp_rank() * self.cp + self.cp_rank(),
            Scope::World => self.rank,
        }
    }

    /// Runs `op` on the shared group with `scope`'s subgroup (`None` for the job), counting
    /// `passes` ring passes over `whole` bytes; `Ok(None)` when the group has one rank.
    fn with<T>(
        &self,
        scope: Scope,
        whole: usize,
        passes: u64,
        op: impl FnOnce(&mut ProcessGroup, Option<SubGroup>) -> Result<T, DistError>,
    ) -> verl_model::Result<Option<T>> {
        let size = self.size(scope);
        let Some(shared) = self.shared.as_ref().filter(|_| size > 1) else {
            return Ok(None);
        };
        let sub = match scope {
            Scope::World => None,
            other => {
                let index = SPLITS
                    .iter()
                    .position(|s| *s == other)
                    .expect("a split scope");
                Some(self.subgroups.expect("made with the group")[index])
            }
        };
        let out = op(&mut lock(shared).group, sub).map_err(failed(scope))?;
        let counter = match scope {
            Scope::Data | Scope::DataContext | Scope::World => &self.traffic.data_parallel,
            _ => &self.traffic.model_parallel,
        };
        let n = u64::from(size);
        counter.fetch_add(passes * (n - 1) * whole as u64 / n, Ordering::Relaxed);
        Ok(Some(out))
    }

    /// Reduces `tensor` in place over `scope`'s group.
    pub fn all_reduce(
        &self,
        scope: Scope,
        tensor: &mut Tensor,
        op: ReduceOp,
    ) -> verl_model::Result<()> {
        let whole = bytes(tensor);
        self.with(scope, whole, 2, |g, sub| match sub {
            Some(sub) => g.all_reduce_in(sub, tensor, op),
            None => g.all_reduce(tensor, op),
        })
        .map(drop)
    }

    /// Every rank's `tensor` of `scope`'s group (all of one shape), stacked `[n, ..]` in the
    /// group's rank order.
    pub fn all_gather(&self, scope: Scope, tensor: &Tensor) -> verl_model::Result<Tensor> {
        // c10d's flat all-gather: 1-D input, 1-D output of n × its elements.
        let input = tensor.reshape([-1]).contiguous();
        let n = i64::from(self.size(scope));
        let mut out = Tensor::empty([n * input.numel() as i64], (input.kind(), input.device()));
        let whole = bytes(&out);
        let done = self.with(scope, whole, 1, |g, sub| match sub {
            Some(sub) => g.all_gather_into_in(sub, &mut out, &input),
            None => g.all_gather_into(&mut out, &input),
        })?;
        let mut shape = vec![n];
        shape.extend(tensor.size());
        Ok(match done {
            Some(()) => out.view(shape.as_slice()),
            None => tensor.unsqueeze(0),
        })
    }

    /// Sums `input` `[n, ..]` over `scope`'s group and returns this rank's slice.
    pub fn reduce_scatter(&self, scope: Scope, input: &Tensor) -> verl_model::Result<Tensor> {
        // c10d's flat reduce-scatter: 1-D input of n × the output's elements.
        let flat = input.reshape([-1]).contiguous();
        let n = i64::from(self.size(scope));
        let mut out = Tensor::empty([flat.numel() as i64 / n], (flat.kind(), flat.device()));
        let done = self.with(scope, bytes(&flat), 1, |g, sub| match sub {
            Some(sub) => g.reduce_scatter_in(sub, &mut out, &flat, ReduceOp::Sum),
            None => g.reduce_scatter(&mut out, &flat, ReduceOp::Sum),
        })?;
        Ok(match done {
            Some(()) => out.view(&input.size()[1..]),
            None => input.select(0, 0),
        })
    }

    /// Reduces `values` over the data-parallel ranks, in place (f64 end to end).
    pub fn all_reduce_dp(&self, values: &mut [f64], op: ReduceOp) -> verl_model::Result<()> {
        if values.is_empty() || self.dp_size() == 1 {
            return Ok(());
        }
        let mut tensor = Tensor::from_slice(values);
        self.all_reduce(Scope::Data, &mut tensor, op)?;
        let summed = Vec::<f64>::try_from(&tensor).map_err(|e| ModelError::Torch(e.to_string()))?;
        values.copy_from_slice(&summed);
        Ok(())
    }

    /// Sums `tensors` (all of one dtype and device) in place over `scope`'s group, as one flat
    /// buffer.
    pub fn all_reduce_tensors(
        &self,
        scope: Scope,
        tensors: &mut [Tensor],
    ) -> verl_model::Result<()> {
        if tensors.is_empty() || self.size(scope) == 1 {
            return Ok(());
        }
        let flat: Vec<Tensor> = tensors.iter().map(|t| t.reshape([-1])).collect();
        let mut buffer = Tensor::cat(&flat, 0);
        self.all_reduce(scope, &mut buffer, ReduceOp::Sum)?;
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
    pub fn all_agree(&self, yes: bool) -> verl_model::Result<bool> {
        let mut flag = Tensor::from_slice(&[i64::from(yes)]);
        self.all_reduce(Scope::World, &mut flag, ReduceOp::Min)?;
        Ok(flag.int64_value(&[0]) == 1)
    }

    /// Every rank's `bytes`, in rank order (the trainer's object exchange).
    pub fn all_gather_bytes(&self, bytes: &[u8]) -> verl_model::Result<Vec<Vec<u8>>> {
        let lens = self.all_gather(Scope::World, &Tensor::from_slice(&[bytes.len() as i64]))?;
        let lens: Vec<i64> = (0..lens.size()[0])
            .map(|r| lens.int64_value(&[r, 0]))
            .collect();
        let longest = lens.iter().copied().max().unwrap_or(0).max(1);
        let mut padded = bytes.to_vec();
        padded.resize(longest as usize, 0);
        let all = self.all_gather(Scope::World, &Tensor::from_slice(&padded))?;
        let all = Vec::<u8>::try_from(
            &all.reshape([-1])
                .to_device(Device::Cpu)
                .to_kind(Kind::Uint8),
        )
        .map_err(|e| ModelError::Torch(e.to_string()))?;
        Ok(all
            .chunks(longest as usize)
            .zip(&lens)
            .map(|(chunk, &len)| chunk[..len as usize].to_vec())
            .collect())
    }
}

/// The groups of `scope` over `world` ranks laid out as data × context × tensor, tensor ranks
/// adjacent: rank `(d·cp + c)·tp + t`.
fn partition(scope: Scope, world: u32, tp: u32, cp: u32) -> Vec<Vec<u32>> {
    let dp = world / (tp * cp);
    let rank = |d: u32, c: u32, t: u32| (d * cp + c) * tp + t;
    let grid = |outer: &[(u32, u32)], inner: &dyn Fn(u32, u32) -> Vec<u32>| -> Vec<Vec<u32>> {
        outer.iter().map(|&(a, b)| inner(a, b)).collect()
    };
    let pairs = |n: u32, m: u32| -> Vec<(u32, u32)> {
        (0..n).flat_map(|a| (0..m).map(move |b| (a, b))).collect()
    };
    match scope {
        Scope::Tensor => grid(&pairs(dp, cp), &|d, c| {
            (0..tp).map(|t| rank(d, c, t)).collect()
        }),
        Scope::Context => grid(&pairs(dp, tp), &|d, t| {
            (0..cp).map(|c| rank(d, c, t)).collect()
        }),
        Scope::Data => grid(&pairs(cp, tp), &|c, t| {
            (0..dp).map(|d| rank(d, c, t)).collect()
        }),
        Scope::Model => grid(&pairs(dp, 1), &|d, _| {
            (d * cp * tp..(d + 1) * cp * tp).collect()
        }),
        Scope::DataContext => grid(&pairs(tp, 1), &|t, _| {
            pairs(dp, cp)
                .into_iter()
                .map(|(d, c)| rank(d, c, t))
                .collect()
        }),
        Scope::World => vec![(0..world).collect()],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_follow_megatrons_order() {
        // 8 ranks: dp 2 × cp 2 × tp 2.
        assert_eq!(
            partition(Scope::Tensor, 8, 2, 2),
            [[0, 1], [2, 3], [4, 5], [6, 7]]
        );
        assert_eq!(
            partition(Scope::Context, 8, 2, 2),
            [[0, 2], [1, 3], [4, 6], [5, 7]]
        );
        assert_eq!(
            partition(Scope::Data, 8, 2, 2),
            [[0, 4], [1, 5], [2, 6], [3, 7]]
        );
        assert_eq!(
            partition(Scope::Model, 8, 2, 2),
            [[0, 1, 2, 3], [4, 5, 6, 7]]
        );
        assert_eq!(
            partition(Scope::DataContext, 8, 2, 2),
            [[0, 2, 4, 6], [1, 3, 5, 7]]
        );
        // Each rank's position in its groups, as `Comm` computes it.
        for rank in 0..8 {
            let comm = Comm {
                rank,
                world: 8,
                tp: 2,
                cp: 2,
                shared: None,
                subgroups: None,
                traffic: Arc::default(),
            };
            for scope in SPLITS {
                let group = partition(scope, 8, 2, 2)
                    .into_iter()
                    .find(|g| g.contains(&rank))
                    .unwrap();
                let position = group.iter().position(|&r| r == rank).unwrap() as u32;
                assert_eq!(comm.rank_in(scope), position, "rank {rank} {scope:?}");
                assert_eq!(comm.size(scope), group.len() as u32, "{scope:?}");
            }
        }
    }
}
