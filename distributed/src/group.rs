//! [`ProcessGroup`]: rendezvous, collectives waited on in slices (checking the peers' heartbeats
//! between slices), object exchange, and an orderly close.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;
use tch::{Device, Kind, Tensor};
use verl_plugin_api::RunContext;

use crate::liveness::{self, Heartbeat, Lost, Peers};
use crate::shim::{self, Group, Store, Work, WorkState};
use crate::{Backend, DistError, Options, ReduceOp, Rendezvous};

/// Store prefix of the c10d process group's own keys.
const GROUP_PREFIX: &str = "verl/pg";
/// How often a rank polls the store while waiting for the others to join.
const JOIN_POLL: Duration = Duration::from_millis(10);

/// A process group over every rank of the job. Collectives must be called in the same order on
/// every rank (as in torch.distributed); each one returns within [`Options::timeout`] and fails
/// with an error naming a lost peer within about [`Options::peer_lost_after`].
pub struct ProcessGroup {
    group: Option<Group>,
    store: Store,
    heartbeat: Option<Heartbeat>,
    peers: Peers,
    /// Collectives started by this rank (read by the heartbeat thread).
    started: Arc<AtomicU64>,
    rendezvous: Rendezvous,
    backend: Backend,
    options: Options,
    /// " (pid P on HOST)" of every rank, for messages.
    described: Vec<String>,
    /// The first failure; every later call returns it.
    broken: Option<String>,
    /// A collective was left running: c10d's group cannot be freed without waiting for it.
    stuck: bool,
    /// The subgroups this rank belongs to ([`Self::split`]).
    subgroups: Vec<Member>,
}

/// A subgroup of the job's ranks made by [`ProcessGroup::split`]; its collectives go through
/// the [`ProcessGroup`] that made it (`*_in` methods), which watches every rank's liveness.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubGroup(usize);

/// This rank's membership of one subgroup.
struct Member {
    group: Group,
    /// The job ranks of the subgroup, in subgroup-rank order.
    ranks: Vec<u32>,
    /// This rank's position in `ranks`.
    rank: u32,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.rendezvous.rank)
            .field("world_size", &self.rendezvous.world_size)
            .field("backend", &self.backend)
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "?".to_owned())
}

fn ranks_text(ranks: &[u32]) -> String {
    let list: Vec<String> = ranks.iter().map(u32::to_string).collect();
    format!(
        "{} {}",
        if ranks.len() == 1 { "rank" } else { "ranks" },
        list.join(", ")
    )
}

impl ProcessGroup {
    /// Joins the job's process group through the run context's rendezvous facts, on the
    /// backend its platform reports.
    pub fn from_run(run: &RunContext, options: &Options) -> Result<Self, DistError> {
        let backend = Backend::for_comm_backend(&run.comm_backend)?;
        Self::init(&Rendezvous::from_run(run)?, backend, options)
    }

    /// Rendezvous: rank 0 hosts a TCPStore at `master_addr:master_port`, every rank registers
    /// there and waits (up to `options.timeout`) for all the others, then the c10d group
    /// connects. A rank that does not come is named in the error.
    pub fn init(
        rendezvous: &Rendezvous,
        backend: Backend,
        options: &Options,
    ) -> Result<Self, DistError> {
        rendezvous.check()?;
        shim::quiet_logs(rendezvous.rank);
        let Rendezvous {
            rank,
            world_size,
            ref master_addr,
            master_port,
        } = *rendezvous;
        let fail = |reason: String| DistError::Rendezvous {
            addr: master_addr.clone(),
            port: master_port,
            rank,
            world_size,
            reason,
        };
        let host = if master_addr.is_empty() {
            "127.0.0.1"
        } else {
            master_addr
        };
        let store = Store::connect(host, master_port, rank == 0, world_size, options.timeout)
            .map_err(|e| {
                fail(if rank == 0 {
                    format!("rank 0 cannot host the rendezvous store: {e}")
                } else {
                    format!("rank 0 (the rendezvous store's host) is not reachable: {e}")
                })
            })?;
        let store_error = |e: String| fail(format!("the rendezvous store failed: {e}"));
        if rank == 0 {
            store.set(liveness::LOST_KEY, b"").map_err(store_error)?;
        }
        let me = format!(
            "{world_size} {} {} {}",
            backend.as_str(),
            std::process::id(),
            hostname()
        );
        store
            .set(&liveness::heartbeat_key(rank), b"0 0")
            .map_err(store_error)?;
        store
            .set(&liveness::rank_key(rank), me.as_bytes())
            .map_err(store_error)?;
        let described = join(&store, rendezvous, backend, options.timeout).map_err(fail)?;
        let started = Arc::new(AtomicU64::new(0));
        let heartbeat = if world_size > 1 {
            let client = Store::connect(host, master_port, false, world_size, options.timeout)
                .map_err(|e| fail(format!("connecting the heartbeat: {e}")))?;
            Some(Heartbeat::start(
                client,
                rank,
                Arc::clone(&started),
                options.heartbeat,
            ))
        } else {
            None
        };
        // c10d's own bound stays above ours, so a stuck collective is reported by the wait
        // loop (naming ranks) rather than by Gloo's bare timeout.
        let group_timeout = options.timeout + options.peer_lost_after + Duration::from_secs(1);
        let group = Group::new(
            &store,
            GROUP_PREFIX,
            backend.code(),
            rank,
            world_size,
            group_timeout,
        )
        .map_err(|e| {
            fail(format!(
                "creating the {} process group: {e}",
                backend.as_str()
            ))
        })?;
        Ok(Self {
            group: Some(group),
            store,
            heartbeat,
            peers: Peers::new(rank, world_size, options.peer_lost_after),
            started,
            rendezvous: rendezvous.clone(),
            backend,
            options: options.clone(),
            described,
            broken: None,
            stuck: false,
            subgroups: Vec::new(),
        })
    }

    /// Splits the job's ranks into disjoint subgroups (`partition` lists every rank once, the
    /// same on every rank, as torch's `new_subgroups_by_enumeration`) and joins the one holding
    /// this rank: a c10d group of its own under `name` over the job's store. Every rank calls it
    /// at the same point. Tensor parallelism splits into tensor-parallel and data-parallel
    /// groups this way.
    pub fn split(&mut self, name: &str, partition: &[Vec<u32>]) -> Result<SubGroup, DistError> {
        const OP: &str = "split";
        let world = self.world_size();
        let mut seen = vec![false; world as usize];
        for &rank in partition.iter().flatten() {
            match seen.get_mut(rank as usize) {
                Some(slot) if !*slot => *slot = true,
                Some(_) => {
                    return Err(invalid(
                        OP,
                        format!("rank {rank} is in two subgroups of `{name}`"),
                    ));
                }
                None => {
                    return Err(invalid(
                        OP,
                        format!(
                            "rank {rank} of subgroup `{name}` is not below the world size {world}"
                        ),
                    ));
                }
            }
        }
        if let Some(missing) = seen.iter().position(|s| !s) {
            return Err(invalid(
                OP,
                format!("rank {missing} is in no subgroup of `{name}`"),
            ));
        }
        let me = self.rank();
        let (index, ranks) = partition
            .iter()
            .enumerate()
            .find(|(_, ranks)| ranks.contains(&me))
            .expect("every rank was checked to be in one subgroup");
        let rank = ranks.iter().position(|&r| r == me).expect("found above") as u32;
        let group_timeout =
            self.options.timeout + self.options.peer_lost_after + Duration::from_secs(1);
        let group = Group::new(
            &self.store,
            &format!("{GROUP_PREFIX}/{name}/{index}"),
            self.backend.code(),
            rank,
            ranks.len() as u32,
            group_timeout,
        )
        .map_err(|e| DistError::Collective {
            op: format!("{OP} `{name}`"),
            message: trim_source(&e).to_owned(),
        })?;
        self.subgroups.push(Member {
            group,
            ranks: ranks.clone(),
            rank,
        });
        Ok(SubGroup(self.subgroups.len() - 1))
    }

    /// The job ranks of `sub`, in subgroup-rank order.
    pub fn subgroup_ranks(&self, sub: SubGroup) -> &[u32] {
        &self.subgroups[sub.0].ranks
    }

    /// This rank's position in `sub`.
    pub fn subgroup_rank(&self, sub: SubGroup) -> u32 {
        self.subgroups[sub.0].rank
    }

    /// Ranks in `sub` (`None`: the whole job).
    fn size_of(&self, sub: Option<SubGroup>) -> u32 {
        sub.map_or(self.world_size(), |s| {
            self.subgroups[s.0].ranks.len() as u32
        })
    }

    /// [`Self::all_reduce`] over the ranks of `sub`.
    pub fn all_reduce_in(
        &mut self,
        sub: SubGroup,
        tensor: &mut Tensor,
        op: ReduceOp,
    ) -> Result<(), DistError> {
        self.all_reduce_on(Some(sub), tensor, op)
    }

    /// [`Self::all_gather_into`] over the ranks of `sub` (`output` holds its size × `input`).
    pub fn all_gather_into_in(
        &mut self,
        sub: SubGroup,
        output: &mut Tensor,
        input: &Tensor,
    ) -> Result<(), DistError> {
        self.all_gather_into_on(Some(sub), output, input)
    }

    /// [`Self::reduce_scatter`] over the ranks of `sub` (`input` holds its size × `output`).
    pub fn reduce_scatter_in(
        &mut self,
        sub: SubGroup,
        output: &mut Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<(), DistError> {
        self.reduce_scatter_on(Some(sub), output, input, op)
    }

    pub fn rank(&self) -> u32 {
        self.rendezvous.rank
    }

    pub fn world_size(&self) -> u32 {
        self.rendezvous.world_size
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    pub fn options(&self) -> &Options {
        &self.options
    }

    /// Reduces `tensor` over every rank, in place.
    pub fn all_reduce(&mut self, tensor: &mut Tensor, op: ReduceOp) -> Result<(), DistError> {
        self.all_reduce_on(None, tensor, op)
    }

    fn all_reduce_on(
        &mut self,
        sub: Option<SubGroup>,
        tensor: &mut Tensor,
        op: ReduceOp,
    ) -> Result<(), DistError> {
        const OP: &str = "all_reduce";
        check_avg(OP, tensor, op)?;
        self.collective_on(sub, OP, |group| group.all_reduce(tensor, op.code()))?;
        self.finish_avg(sub, tensor, op);
        Ok(())
    }

    /// Copies rank `root`'s `tensor` into every rank's `tensor`.
    pub fn broadcast(&mut self, tensor: &mut Tensor, root: u32) -> Result<(), DistError> {
        const OP: &str = "broadcast";
        self.check_root(OP, root)?;
        self.collective(OP, |group| group.broadcast(tensor, root))
    }

    /// Every rank's `tensor`, indexed by rank.
    pub fn all_gather(&mut self, tensor: &Tensor) -> Result<Vec<Tensor>, DistError> {
        let mut outputs: Vec<Tensor> = (0..self.world_size())
            .map(|_| tensor.empty_like())
            .collect();
        self.collective("all_gather", |group| group.all_gather(&mut outputs, tensor))?;
        Ok(outputs)
    }

    /// Every rank's `input` concatenated, in rank order, into `output` (contiguous, with
    /// world size × `input`'s elements; the flat form FSDP-style sharding uses).
    pub fn all_gather_into(
        &mut self,
        output: &mut Tensor,
        input: &Tensor,
    ) -> Result<(), DistError> {
        self.all_gather_into_on(None, output, input)
    }

    fn all_gather_into_on(
        &mut self,
        sub: Option<SubGroup>,
        output: &mut Tensor,
        input: &Tensor,
    ) -> Result<(), DistError> {
        const OP: &str = "all_gather_into";
        self.check_flat(sub, OP, "output", output, input)?;
        self.collective_on(sub, OP, |group| group.all_gather_flat(output, input))
    }

    /// Reduces `input` (world size × `output`'s elements) over every rank and leaves slice
    /// `rank` of the result in this rank's `output`.
    pub fn reduce_scatter(
        &mut self,
        output: &mut Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<(), DistError> {
        self.reduce_scatter_on(None, output, input, op)
    }

    fn reduce_scatter_on(
        &mut self,
        sub: Option<SubGroup>,
        output: &mut Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<(), DistError> {
        const OP: &str = "reduce_scatter";
        check_avg(OP, input, op)?;
        self.check_flat(sub, OP, "input", input, output)?;
        self.collective_on(sub, OP, |group| {
            group.reduce_scatter_flat(output, input, op.code())
        })?;
        self.finish_avg(sub, output, op);
        Ok(())
    }

    /// Returns once every rank has called it.
    pub fn barrier(&mut self) -> Result<(), DistError> {
        self.collective("barrier", Group::barrier)
    }

    /// Every rank's `value` (serialised as JSON), indexed by rank: for metadata such as
    /// shapes, counts or names, not bulk data.
    pub fn all_gather_object<T: Serialize + DeserializeOwned>(
        &mut self,
        value: &T,
    ) -> Result<Vec<T>, DistError> {
        const OP: &str = "all_gather_object";
        let bytes = serde_json::to_vec(value).map_err(|e| invalid(OP, e.to_string()))?;
        let len = i64::try_from(bytes.len()).map_err(|e| invalid(OP, e.to_string()))?;
        let world = self.world_size() as usize;
        let mut lens = Tensor::zeros([world as i64], (Kind::Int64, Device::Cpu));
        self.all_gather_into(&mut lens, &Tensor::from_slice(&[len]))?;
        let lens: Vec<i64> = elements(OP, &lens)?;
        let longest = lens.iter().copied().max().unwrap_or(0);
        let mut padded = vec![0u8; longest as usize];
        padded[..bytes.len()].copy_from_slice(&bytes);
        let mut all = Tensor::zeros([world as i64 * longest], (Kind::Uint8, Device::Cpu));
        self.all_gather_into(&mut all, &Tensor::from_slice(&padded))?;
        let all: Vec<u8> = elements(OP, &all)?;
        all.chunks(longest.max(1) as usize)
            .zip(&lens)
            .enumerate()
            .map(|(rank, (chunk, &len))| {
                serde_json::from_slice(&chunk[..len as usize])
                    .map_err(|e| invalid(OP, format!("rank {rank}'s value: {e}")))
            })
            .collect()
    }

    /// Rank `root`'s value on every rank: `root` passes `Some`, the others anything (it is not
    /// read). `None` at the root is an error on every rank.
    pub fn broadcast_object<T: Serialize + DeserializeOwned>(
        &mut self,
        value: Option<&T>,
        root: u32,
    ) -> Result<T, DistError> {
        const OP: &str = "broadcast_object";
        self.check_root(OP, root)?;
        let bytes = match value {
            Some(v) if self.rank() == root => {
                Some(serde_json::to_vec(v).map_err(|e| invalid(OP, e.to_string()))?)
            }
            _ => None,
        };
        // -1 tells the others that the root had nothing to send.
        let len = bytes.as_ref().map_or(-1, |b| b.len() as i64);
        let mut header = Tensor::from_slice(&[len]);
        self.broadcast(&mut header, root)?;
        let len = header.int64_value(&[0]);
        if len < 0 {
            return Err(invalid(
                OP,
                format!("rank {root} (the root) passed no value"),
            ));
        }
        let mut payload = match bytes {
            Some(bytes) => Tensor::from_slice(&bytes),
            None => Tensor::zeros([len], (Kind::Uint8, Device::Cpu)),
        };
        self.broadcast(&mut payload, root)?;
        let payload: Vec<u8> = elements(OP, &payload)?;
        serde_json::from_slice(&payload).map_err(|e| invalid(OP, e.to_string()))
    }

    fn check_root(&self, op: &str, root: u32) -> Result<(), DistError> {
        if root >= self.world_size() {
            return Err(invalid(
                op,
                format!(
                    "root rank {root} is not below the world size {}",
                    self.world_size()
                ),
            ));
        }
        Ok(())
    }

    /// `flat` must hold the group's size × `part`'s elements, of `part`'s kind.
    fn check_flat(
        &self,
        sub: Option<SubGroup>,
        op: &str,
        name: &str,
        flat: &Tensor,
        part: &Tensor,
    ) -> Result<(), DistError> {
        let size = self.size_of(sub);
        let expected = part.numel() * size as usize;
        if flat.numel() != expected || flat.kind() != part.kind() {
            return Err(invalid(
                op,
                format!(
                    "{name} has {} {:?} elements; expected {} {size} × {} = {expected} {:?}",
                    flat.numel(),
                    flat.kind(),
                    if sub.is_some() {
                        "subgroup size"
                    } else {
                        "world size"
                    },
                    part.numel(),
                    part.kind()
                ),
            ));
        }
        Ok(())
    }

    /// The sum becomes the mean.
    fn finish_avg(&self, sub: Option<SubGroup>, tensor: &mut Tensor, op: ReduceOp) {
        if op == ReduceOp::Avg {
            let _ = tensor.g_div_scalar_(f64::from(self.size_of(sub)));
        }
    }

    /// Starts one collective over every rank and waits for it (see [`Self::wait`]).
    fn collective(
        &mut self,
        op: &str,
        launch: impl FnOnce(&Group) -> Result<Work, String>,
    ) -> Result<(), DistError> {
        self.collective_on(None, op, launch)
    }

    /// Starts one collective over `sub` (`None`: every rank) and waits for it. Subgroup
    /// collectives count in the same sequence as the others: SPMD ranks run every subgroup's
    /// collectives at the same points, so the count still tells which rank is behind.
    fn collective_on(
        &mut self,
        sub: Option<SubGroup>,
        op: &str,
        launch: impl FnOnce(&Group) -> Result<Work, String>,
    ) -> Result<(), DistError> {
        if let Some(first) = &self.broken {
            return Err(DistError::Broken(first.clone()));
        }
        let started = self.started.fetch_add(1, Ordering::Relaxed) + 1;
        let group = match sub {
            Some(s) => &self.subgroups[s.0].group,
            None => self.group.as_ref().expect("the group lives until drop"),
        };
        let outcome = match launch(group) {
            Ok(work) => self.wait(op, started, &work),
            Err(message) => Err(DistError::Collective {
                op: op.to_owned(),
                message: trim_source(&message).to_owned(),
            }),
        };
        if let Err(error) = &outcome {
            // One rank leaving the sequence desynchronises the group for good.
            self.broken = Some(error.to_string());
        }
        outcome
    }

    /// Waits for `work` in heartbeat-long slices, reading the peers' heartbeats between
    /// slices: done, a peer lost, the timeout, or a c10d error (then the peers are watched
    /// for up to `peer_lost_after` to name the one that caused it).
    fn wait(&mut self, op: &str, started: u64, work: &Work) -> Result<(), DistError> {
        let begin = Instant::now();
        let slice = self.options.heartbeat.max(Duration::from_millis(1));
        loop {
            let left = self.options.timeout.saturating_sub(begin.elapsed());
            match work.wait(slice.min(left)) {
                WorkState::Done => return Ok(()),
                WorkState::Failed(message) => {
                    return Err(self.explain_failure(op, started, message));
                }
                WorkState::Running => {}
            }
            let error = if begin.elapsed() >= self.options.timeout {
                self.explain_timeout(op, started, begin.elapsed())
            } else if self.world_size() == 1 {
                continue;
            } else {
                match self.peers.poll(&self.store, started) {
                    Ok(None) => continue,
                    Ok(Some(lost)) => self.lost(op, lost, None),
                    Err(store) => self.store_lost(op, &store),
                }
            };
            self.stuck = true;
            return Err(error);
        }
    }

    fn explain_failure(&mut self, op: &str, started: u64, message: String) -> DistError {
        let deadline = Instant::now() + self.options.peer_lost_after + self.options.heartbeat * 2;
        while self.world_size() > 1 && Instant::now() < deadline {
            match self.peers.poll(&self.store, started) {
                Ok(None) => std::thread::sleep(self.options.heartbeat),
                Ok(Some(lost)) => return self.lost(op, lost, Some(&message)),
                Err(store) => return self.store_lost(op, &store),
            }
        }
        DistError::Collective {
            op: op.to_owned(),
            message: trim_source(&message).to_owned(),
        }
    }

    /// A timeout names the ranks that have not reached the collective (from their
    /// heartbeats), and publishes the first of them for the other ranks.
    fn explain_timeout(&mut self, op: &str, started: u64, waited: Duration) -> DistError {
        match self.peers.poll(&self.store, started) {
            Ok(Some(lost)) if lost.reported_by.is_none() => return self.lost(op, lost, None),
            Err(store) => return self.store_lost(op, &store),
            Ok(_) => {}
        }
        let behind = self.peers.behind(started);
        let detail = if let Some(&(rank, at)) = behind.first() {
            let verdict = Lost {
                rank,
                how: format!("is alive but has not reached collective #{started} (it is at #{at})"),
                reported_by: None,
            };
            self.peers.publish(&self.store, &verdict);
            let ranks: Vec<u32> = behind.iter().map(|(r, _)| *r).collect();
            let at: Vec<String> = behind
                .iter()
                .map(|(r, n)| format!("rank {r} is at #{n}"))
                .collect();
            format!(
                "{} alive but {} not reached this collective (#{started} here; {})",
                ranks_text(&ranks),
                if ranks.len() == 1 { "has" } else { "have" },
                at.join(", ")
            )
        } else if let Some(seen) = self.peers.published(&self.store) {
            format!(
                "rank {}{} {} (seen by rank {})",
                seen.rank,
                self.describe(seen.rank),
                seen.how,
                seen.reported_by.unwrap_or(seen.rank)
            )
        } else {
            format!("every rank is alive and has started collective #{started}")
        };
        DistError::Timeout {
            op: op.to_owned(),
            seconds: waited.as_secs_f64(),
            detail,
        }
    }

    fn lost(&self, op: &str, lost: Lost, cause: Option<&str>) -> DistError {
        self.peers.publish(&self.store, &lost);
        let mut how = lost.how;
        if let Some(reporter) = lost.reported_by.filter(|&r| r != self.rank()) {
            how.push_str(&format!(" (seen by rank {reporter})"));
        }
        if let Some(cause) = cause {
            how.push_str(&format!(
                "; {}: {}",
                self.backend.as_str(),
                trim_source(cause)
            ));
        }
        DistError::PeerLost {
            op: op.to_owned(),
            rank: lost.rank,
            peer: self.describe(lost.rank),
            how,
        }
    }

    /// The store lives in rank 0's process: losing it means rank 0 is gone.
    fn store_lost(&self, op: &str, error: &str) -> DistError {
        DistError::PeerLost {
            op: op.to_owned(),
            rank: 0,
            peer: self.describe(0),
            how: format!("is gone: the rendezvous store it hosts does not answer ({error})"),
        }
    }

    fn describe(&self, rank: u32) -> String {
        self.described
            .get(rank as usize)
            .cloned()
            .unwrap_or_default()
    }
}

impl Drop for ProcessGroup {
    /// Leaves the group: stops the heartbeat and marks this rank closed, so peers still waiting
    /// report it at once. Rank 0 keeps the store up (at most `peer_lost_after`) until every
    /// other rank has closed or gone silent, so they can still read why.
    fn drop(&mut self) {
        if let Some(heartbeat) = self.heartbeat.take() {
            heartbeat.stop();
        }
        let closed = liveness::closed_value(self.started.load(Ordering::Relaxed));
        let _ = self
            .store
            .set(&liveness::heartbeat_key(self.rank()), closed.as_bytes());
        if self.rank() == 0 && self.world_size() > 1 {
            let deadline = Instant::now() + self.options.peer_lost_after;
            while Instant::now() < deadline && !self.peers.all_gone(&self.store) {
                std::thread::sleep(self.options.heartbeat.min(Duration::from_millis(50)));
            }
        }
        // With a stuck collective c10d's destructor would join the worker blocked in it, so the
        // group is left to the process's exit (which is about to report the failure).
        if !self.stuck {
            for member in self.subgroups.drain(..) {
                member.group.close();
            }
        }
        if let Some(group) = self.group.take().filter(|_| !self.stuck) {
            group.close();
        }
    }
}

fn invalid(op: &str, reason: String) -> DistError {
    DistError::Invalid {
        op: op.to_owned(),
        reason,
    }
}

/// c10d's message without the source location it starts with (`[/path/pair.cc:553] `).
fn trim_source(message: &str) -> &str {
    message
        .strip_prefix('[')
        .and_then(|rest| rest.split_once("] "))
        .map_or(message, |(_, text)| text)
}

/// A CPU tensor's elements.
fn elements<T: tch::kind::Element + Copy>(op: &str, tensor: &Tensor) -> Result<Vec<T>, DistError> {
    Vec::<T>::try_from(tensor).map_err(|e: tch::TchError| invalid(op, e.to_string()))
}

fn check_avg(op: &str, tensor: &Tensor, reduce: ReduceOp) -> Result<(), DistError> {
    if reduce == ReduceOp::Avg && !tensor.is_floating_point() {
        return Err(invalid(
            op,
            format!(
                "AVG needs a floating-point tensor (Gloo has no AVG: it is a sum divided by the world size), got {:?}",
                tensor.kind()
            ),
        ));
    }
    Ok(())
}

/// Waits until every rank has registered, then checks that they agree on the world size and
/// backend. Returns " (pid P on HOST)" per rank.
fn join(
    store: &Store,
    rendezvous: &Rendezvous,
    backend: Backend,
    timeout: Duration,
) -> Result<Vec<String>, String> {
    let world = rendezvous.world_size;
    let keys: Vec<String> = (0..world).map(liveness::rank_key).collect();
    let begin = Instant::now();
    while !store.check(&keys)? {
        if begin.elapsed() >= timeout {
            let mut missing = Vec::new();
            for (rank, key) in (0..world).zip(&keys) {
                if !store.check(std::slice::from_ref(key))? {
                    missing.push(rank);
                }
            }
            return Err(format!(
                "timed out after {:.1} s waiting for {}/{world} ranks: {} did not join",
                begin.elapsed().as_secs_f64(),
                missing.len(),
                ranks_text(&missing)
            ));
        }
        std::thread::sleep(JOIN_POLL);
    }
    let values = store.multi_get(&keys)?;
    let mut described = Vec::with_capacity(values.len());
    for (rank, value) in values.iter().enumerate() {
        let value = String::from_utf8_lossy(value);
        let fields: Vec<&str> = value.splitn(4, ' ').collect();
        let [their_world, their_backend, pid, host] = fields[..] else {
            return Err(format!(
                "rank {rank} registered `{value}`, not a verl-distributed rank"
            ));
        };
        if their_world != world.to_string() || their_backend != backend.as_str() {
            return Err(format!(
                "rank {rank} (pid {pid} on {host}) has WORLD_SIZE={their_world} and backend {their_backend}, \
                 rank {} has WORLD_SIZE={world} and backend {}",
                rendezvous.rank,
                backend.as_str()
            ));
        }
        described.push(format!(" (pid {pid} on {host})"));
    }
    Ok(described)
}
