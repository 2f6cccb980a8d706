//! What the backends' collective weight syncs share: the settings of the group the trainer and
//! the servers' workers form, the rank plan over the replicas, and the trainer's end of the
//! transfer as a trait. The backends implement the trait with `verl-distributed` (their
//! `collective` feature, which links libtorch); tests implement it with a recorder.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use verl_plugin_api::{DType, PluginError, TensorRef};

use crate::{HttpError, Method, Pool};

/// How new weights reach the servers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightSync {
    /// The servers read the safetensors directory the `disk` weight sync writes.
    #[default]
    File,
    /// The trainer broadcasts its tensors (lent by the `naive` weight sync) to the servers'
    /// workers over NCCL: GPU only.
    Collective,
}

impl WeightSync {
    /// The `checkpoint_engine.backend` this mode takes weights from.
    pub fn weight_sync_backend(self) -> &'static str {
        match self {
            Self::File => "disk",
            Self::Collective => "naive",
        }
    }
}

impl WeightSync {
    /// Whether a handover of `kind` suits this mode; the error names the weight sync that does.
    pub fn check_source(self, kind: verl_plugin_api::WeightSourceKind) -> Result<(), PluginError> {
        use verl_plugin_api::WeightSourceKind;
        let (wanted, how) = match self {
            Self::File => (
                WeightSourceKind::File,
                "the rollout reloads from files: set \
                 actor_rollout_ref.rollout.checkpoint_engine.backend=disk, or \
                 `weight_sync: collective` on a GPU",
            ),
            Self::Collective => (
                WeightSourceKind::Memory,
                "`weight_sync: collective` broadcasts the trainer's tensors: set \
                 actor_rollout_ref.rollout.checkpoint_engine.backend=naive",
            ),
        };
        if kind == wanted {
            Ok(())
        } else {
            Err(PluginError::unsupported(&format!(
                "update_weights from a {} source ({how})",
                kind.as_str()
            )))
        }
    }
}

/// `collective`: the group the trainer (rank 0) and every server's workers (ranks 1..) form.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CollectiveSettings {
    /// The address the servers' workers reach this trainer at (it hosts the group's store).
    pub master_addr: String,
    /// The store's port; default a free one.
    pub master_port: Option<u16>,
    /// Workers of one server (its tensor × pipeline parallel size; × data parallel size for
    /// vLLM's internal data parallelism).
    pub workers_per_server: u32,
    /// Seconds joining the group and one transfer may take.
    pub timeout_s: f64,
    /// The trainer's CUDA device the broadcasts start from.
    pub device: u32,
}

impl Default for CollectiveSettings {
    fn default() -> Self {
        Self {
            master_addr: "127.0.0.1".into(),
            master_port: None,
            workers_per_server: 1,
            timeout_s: 600.0,
            device: 0,
        }
    }
}

/// The group of one sync: where it meets, its size and each server's first rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupPlan {
    pub master_addr: String,
    pub master_port: u16,
    pub world_size: u32,
    /// Server `i`'s workers are ranks `rank_offsets[i]..rank_offsets[i] + workers_per_server`.
    pub rank_offsets: Vec<u32>,
    pub timeout: Duration,
    pub device: u32,
}

impl CollectiveSettings {
    /// The plan for `servers` servers; `section` names the settings in errors.
    pub fn plan(&self, servers: usize, section: &str) -> Result<GroupPlan, HttpError> {
        if self.workers_per_server == 0 {
            return Err(HttpError::Config(format!(
                "`{section}.collective.workers_per_server` must be at least 1"
            )));
        }
        if self.timeout_s.is_nan() || self.timeout_s <= 0.0 {
            return Err(HttpError::Config(format!(
                "`{section}.collective.timeout_s` must be positive, not {}",
                self.timeout_s
            )));
        }
        let servers = u32::try_from(servers).expect("a handful of servers");
        let master_port = match self.master_port {
            Some(port) => port,
            None => crate::free_port(&self.master_addr).map_err(|e| {
                HttpError::Config(format!(
                    "`{section}.collective.master_addr` {}: no free port to host the group's \
                     store on: {e}",
                    self.master_addr
                ))
            })?,
        };
        Ok(GroupPlan {
            master_addr: self.master_addr.clone(),
            master_port,
            world_size: 1 + servers * self.workers_per_server,
            rank_offsets: (0..servers)
                .map(|i| 1 + i * self.workers_per_server)
                .collect(),
            timeout: Duration::from_secs_f64(self.timeout_s),
            device: self.device,
        })
    }
}

/// The torch dtype name a server's request carries for `dtype` (it allocates each tensor with
/// `getattr(torch, name)`).
fn torch_dtype_name(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::F32 => "float32",
        DType::F64 => "float64",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::I64 => "int64",
        DType::I32 => "int32",
        DType::U8 => "uint8",
        DType::BOOL => "bool",
        _ => return None,
    })
}

/// What the servers are told to receive: the tensors' names, torch dtype names and shapes, in
/// the order they are broadcast.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorList {
    pub names: Vec<String>,
    pub dtypes: Vec<String>,
    pub shapes: Vec<Vec<i64>>,
}

impl TensorList {
    pub fn of(tensors: &[TensorRef<'_>]) -> Result<Self, PluginError> {
        let mut list = Self {
            names: Vec::with_capacity(tensors.len()),
            dtypes: Vec::with_capacity(tensors.len()),
            shapes: Vec::with_capacity(tensors.len()),
        };
        for t in tensors {
            let dtype = torch_dtype_name(t.dtype).ok_or_else(|| {
                PluginError::other(format!(
                    "tensor `{}`: dtype code {} has no torch name to send a server",
                    t.name, t.dtype.0
                ))
            })?;
            list.names.push(t.name.to_string());
            list.dtypes.push(dtype.to_owned());
            list.shapes.push(t.shape.to_vec());
        }
        Ok(list)
    }
}

/// The trainer's end of a collective transfer, as rank 0 of a group the servers' workers join.
pub trait WeightSender: Send {
    /// Broadcasts `tensors` in order; returns once every worker has them.
    fn send(&mut self, tensors: &[TensorRef<'_>]) -> Result<(), PluginError>;
}

/// Joins the group a [`GroupPlan`] describes as rank 0 (a backend's protocol: vLLM's
/// `StatelessProcessGroup` + NCCL, SGLang's torch.distributed group). Two steps, so a machine
/// that cannot take part says so before any server is asked to join.
pub trait Collective: Send {
    /// Fails when this process cannot take part (no CUDA, no NCCL, a build without the
    /// backend's `collective` feature); contacts nothing.
    fn check(&self) -> Result<(), PluginError>;
    /// Hosts the group's store and joins; blocks until the servers' workers have joined (they
    /// are told to, concurrently, by the caller).
    fn join(&mut self, plan: &GroupPlan) -> Result<Box<dyn WeightSender>, PluginError>;
}

/// The transport of a build without a backend's `collective` feature: says so.
pub struct NoCollective {
    /// The plugin crate, as `cargo build -p` names it.
    pub krate: &'static str,
}

impl Collective for NoCollective {
    fn check(&self) -> Result<(), PluginError> {
        Err(PluginError::new(
            verl_plugin_api::ErrorKind::UNSUPPORTED,
            format!(
                "collective weight sync needs CUDA + NCCL; use weight_sync=file (this build of \
                 {} has no collective transfer: build it with `--features collective` on a CUDA \
                 machine)",
                self.krate
            ),
        ))
    }

    fn join(&mut self, _plan: &GroupPlan) -> Result<Box<dyn WeightSender>, PluginError> {
        Err(self.check().expect_err("never available"))
    }
}

/// The group of a backend's `collective` weight sync: joined on the first sync, kept for the
/// next ones.
pub struct CollectiveGroup {
    transport: Box<dyn Collective>,
    settings: CollectiveSettings,
    /// The backend's section, for errors.
    section: String,
    sender: Option<Box<dyn WeightSender>>,
}

impl CollectiveGroup {
    pub fn new(
        transport: Box<dyn Collective>,
        settings: CollectiveSettings,
        section: String,
    ) -> Self {
        Self {
            transport,
            settings,
            section,
            sender: None,
        }
    }

    /// Joins the group unless it has: `init_path` with `init_body(plan, i)` to every server `i`
    /// while this process joins as rank 0. A server started again since the group formed holds
    /// neither the group nor the weights sent through it: an error.
    pub fn join(
        &mut self,
        pool: &mut Pool,
        init_path: &str,
        init_body: impl Fn(&GroupPlan, usize) -> Value,
    ) -> Result<(), PluginError> {
        let formed = self.sender.is_some();
        pool.recover(&|pool, i| {
            if formed {
                Err(lost_server(pool, i))
            } else {
                Ok(())
            }
        })?;
        if formed {
            return Ok(());
        }
        self.transport.check()?;
        let plan = self.settings.plan(pool.servers().len(), &self.section)?;
        let bodies: Vec<Value> = (0..pool.servers().len())
            .map(|i| init_body(&plan, i))
            .collect();
        let transport = &mut self.transport;
        let (answers, joined) = pool.while_requesting(init_path, &bodies, || transport.join(&plan));
        match (joined, answers) {
            (Ok(sender), Ok(_)) => {
                self.sender = Some(sender);
                Ok(())
            }
            (Err(e), Ok(_)) => Err(e),
            (Ok(_), Err(e)) => Err(e.into()),
            (Err(e), Err(server)) => Err(PluginError::new(
                e.kind,
                format!("{} (and the servers: {server})", e.message()),
            )),
        }
    }

    /// `path` with `bodies[i]` to every server `i` while this process broadcasts `tensors`;
    /// the servers' answers. After a failure the group is left (its state is unknown) and the
    /// next sync forms it again.
    pub fn send(
        &mut self,
        pool: &Pool,
        path: &str,
        bodies: &[Value],
        tensors: &[TensorRef<'_>],
    ) -> Result<Vec<Value>, PluginError> {
        let Some(sender) = self.sender.as_mut() else {
            return Err(PluginError::other("the collective group was not joined"));
        };
        let (answers, sent) = pool.while_requesting(path, bodies, || sender.send(tensors));
        if sent.is_err() || answers.is_err() {
            self.sender = None;
        }
        match (sent, answers) {
            (Ok(()), Ok(answers)) => Ok(answers),
            (Err(e), Ok(_)) => Err(e),
            (Ok(()), Err(e)) => Err(e.into()),
            (Err(e), Err(server)) => Err(PluginError::new(
                e.kind,
                format!("{} (and the servers: {server})", e.message()),
            )),
        }
    }
}

/// Server `i` was started again after it died: it lost the collective group and the weights sent
/// through it.
pub fn lost_server(pool: &Pool, i: usize) -> HttpError {
    HttpError::Config(format!(
        "{} server {} was started again after it died: it left the collective weight-sync group \
         and holds its launch weights, which `weight_sync: collective` cannot give back (the \
         trainer's tensors are lent only during a sync); use `weight_sync: file`, or \
         `max_restarts: 0` to stop at a death",
        pool.backend(),
        pool.servers()[i].url()
    ))
}

impl Pool {
    /// Sends `bodies[i]` to server `i` (all at once, on another thread) while `work` runs on this
    /// one; returns both outcomes once both are done. A collective transfer needs both ends at
    /// once: a server answers its join or update request only when the trainer's side of the
    /// collective has run.
    pub fn while_requesting<T>(
        &self,
        path: &str,
        bodies: &[Value],
        work: impl FnOnce() -> T,
    ) -> (Result<Vec<Value>, HttpError>, T) {
        std::thread::scope(|scope| {
            let requests = scope.spawn(|| {
                self.block_on(futures_util::future::try_join_all(
                    bodies
                        .iter()
                        .enumerate()
                        .map(|(i, body)| self.request(i, Method::Post, path, Some(body))),
                ))
            });
            let done = work();
            let answers = requests
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            (answers, done)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_gives_each_server_its_ranks_after_the_trainers() {
        let mut settings = CollectiveSettings {
            workers_per_server: 4,
            master_port: Some(1234),
            ..CollectiveSettings::default()
        };
        let plan = settings.plan(3, "sec").unwrap();
        assert_eq!((plan.world_size, plan.master_port), (13, 1234));
        assert_eq!(plan.rank_offsets, [1, 5, 9]);
        settings.master_port = None;
        assert_ne!(settings.plan(1, "sec").unwrap().master_port, 0);

        settings.workers_per_server = 0;
        let err = settings.plan(1, "sec").unwrap_err().to_string();
        assert!(err.contains("`sec.collective.workers_per_server`"), "{err}");
        settings.workers_per_server = 1;
        for bad in [0.0, -1.0, f64::NAN] {
            settings.timeout_s = bad;
            let err = settings.plan(1, "sec").unwrap_err().to_string();
            assert!(err.contains("`sec.collective.timeout_s`"), "{err}");
        }
    }

    #[test]
    fn tensor_lists_carry_torchs_dtype_names() {
        let (f, b) = ([0u8; 8], [0u8; 4]);
        let tensors = [
            TensorRef::new("w", DType::F32, &[2], &f).unwrap(),
            TensorRef::new("n", DType::BF16, &[1, 2], &b).unwrap(),
        ];
        let list = TensorList::of(&tensors).unwrap();
        assert_eq!(list.names, ["w", "n"]);
        assert_eq!(list.dtypes, ["float32", "bfloat16"]);
        assert_eq!(list.shapes, [vec![2], vec![1, 2]]);
    }
}
