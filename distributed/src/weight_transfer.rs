//! The trainer's end of a weight transfer to inference servers: rank 0 of a group that the
//! servers' workers join (at ranks 1..), broadcasting each named tensor in order, as the servers'
//! own trainer-side code does.
//!
//! - **vLLM 0.32** (`vllm/distributed/weight_transfer/nccl_engine.py`, non-packed): the workers
//!   meet in `StatelessProcessGroup.create(host, port, rank, world_size)`, a TCPStore rank 0
//!   hosts; `PyNcclCommunicator` then reads rank 0's NCCL unique id with `broadcast_obj(None,
//!   src=0)` (the key `broadcast_from/0/0`, a pickled `ncclUniqueId`), every rank calls
//!   `ncclCommInitRank` and a one-element all-reduce, and each tensor is one `ncclBroadcast`
//!   from rank 0. [`StatelessGroupHost`] is the store side (tested against vLLM's own Python
//!   here), [`VllmSender`] adds the NCCL communicator (GPU only).
//! - **SGLang 0.5.23** (`init_custom_process_group` in `sglang/srt/utils/common.py`):
//!   torch.distributed's `tcp://` rendezvous (a TCPStore rank 0 hosts), the group's keys under
//!   SGLang's and torch's prefixes (see [`torch_group_prefix`]), a c10d process group of the
//!   requested backend, and one `broadcast(src=0)` per tensor. [`TorchGroupSender`] is that
//!   group; with Gloo it runs on a CPU (tested against SGLang's own function here), with NCCL it
//!   needs the `nccl` feature and a GPU.

use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};
use verl_plugin_api::{DType, TensorRef};

use crate::shim::{Group, Store, WorkState};
use crate::{Backend, DistError, nccl};

/// Where the group meets: rank 0 (this process) hosts the TCPStore at `addr:port`, and
/// `world_size` counts it and every server worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupAddress {
    pub addr: String,
    pub port: u16,
    pub world_size: u32,
    /// Bounds joining and each broadcast.
    pub timeout: Duration,
}

impl GroupAddress {
    fn host(&self) -> Result<Store, DistError> {
        if self.world_size < 2 {
            return Err(DistError::Config(format!(
                "a weight-transfer group needs the trainer and at least one server worker, not \
                 world size {}",
                self.world_size
            )));
        }
        Store::connect(&self.addr, self.port, true, self.world_size, self.timeout).map_err(
            |reason| self.failed(format!("rank 0 cannot host the rendezvous store: {reason}")),
        )
    }

    fn failed(&self, reason: String) -> DistError {
        DistError::Rendezvous {
            addr: self.addr.clone(),
            port: self.port,
            rank: 0,
            world_size: self.world_size,
            reason,
        }
    }
}

/// Rank 0 of vLLM's `StatelessProcessGroup` (`vllm/distributed/utils.py`): the TCPStore server
/// the other ranks' `StatelessProcessGroup.create` connects to, and its `broadcast_obj` from
/// rank 0.
pub struct StatelessGroupHost {
    store: Store,
    address: GroupAddress,
    /// `broadcast_send_counter`: the next `broadcast_from/0/<n>` key.
    sent: u64,
}

impl StatelessGroupHost {
    /// Hosts the store; returns at once (the other ranks connect whenever they come).
    pub fn host(address: &GroupAddress) -> Result<Self, DistError> {
        Ok(Self {
            store: address.host()?,
            address: address.clone(),
            sent: 0,
        })
    }

    /// `broadcast_obj(obj, src=0)` with `obj` already pickled: every other rank's
    /// `broadcast_obj(None, src=0)` returns it, in the order they were sent.
    pub fn broadcast_pickled(&mut self, pickled: &[u8]) -> Result<(), DistError> {
        let key = format!("broadcast_from/0/{}", self.sent);
        self.store
            .set(&key, pickled)
            .map_err(|e| self.address.failed(format!("setting `{key}`: {e}")))?;
        self.sent += 1;
        Ok(())
    }
}

/// `pickle.dumps(id)` of vLLM's `ncclUniqueId` (a ctypes structure of 128 bytes, module
/// `vllm.distributed.device_communicators.pynccl_wrapper`), as ctypes reduces it:
/// `_ctypes._unpickle(ncclUniqueId, ({}, <bytes>))`. Protocol 3 opcodes.
pub fn pickle_nccl_unique_id(id: &[u8; nccl::UNIQUE_ID_BYTES]) -> Vec<u8> {
    let mut out = vec![0x80, 3];
    out.extend_from_slice(b"c_ctypes\n_unpickle\n");
    out.extend_from_slice(b"cvllm.distributed.device_communicators.pynccl_wrapper\nncclUniqueId\n");
    // EMPTY_DICT, SHORT_BINBYTES <len> <bytes>, TUPLE2 (dict, bytes), TUPLE2 (class, state),
    // REDUCE, STOP.
    out.push(b'}');
    out.push(b'C');
    out.push(nccl::UNIQUE_ID_BYTES as u8);
    out.extend_from_slice(id);
    out.extend_from_slice(&[0x86, 0x86, b'R', b'.']);
    out
}

fn kind_of(dtype: DType) -> Option<Kind> {
    Some(match dtype {
        DType::F32 => Kind::Float,
        DType::F64 => Kind::Double,
        DType::F16 => Kind::Half,
        DType::BF16 => Kind::BFloat16,
        DType::I64 => Kind::Int64,
        DType::I32 => Kind::Int,
        DType::U8 => Kind::Uint8,
        DType::BOOL => Kind::Bool,
        _ => return None,
    })
}

/// A copy of `t` on `device`.
fn to_tensor(t: &TensorRef<'_>, device: Device) -> Result<Tensor, DistError> {
    let kind = kind_of(t.dtype).ok_or_else(|| DistError::Invalid {
        op: "broadcast".into(),
        reason: format!(
            "tensor `{}` has dtype code {}, which torch has no kind for",
            t.name, t.dtype.0
        ),
    })?;
    Ok(Tensor::from_data_size(t.data.as_slice(), t.shape.as_slice(), kind).to_device(device))
}

/// Device bytes a sender keeps in flight before waiting for the broadcasts to land.
const IN_FLIGHT_BYTES: usize = 256 << 20;

/// Rank 0 of a vLLM weight-transfer group (see the module docs): the store, the NCCL
/// communicator, and the broadcasts. GPU only; **untested here** (no GPU on the machine this
/// was written on) beyond the store side.
pub struct VllmSender {
    /// Kept for the group's life: the workers' store clients stay connected to it.
    _host: StatelessGroupHost,
    comm: nccl::Communicator,
    device: usize,
}

impl VllmSender {
    /// Fails at once (nothing hosted) without a CUDA device or NCCL, with
    /// [`nccl::NEEDS_CUDA`]'s message.
    pub fn check() -> Result<(), DistError> {
        nccl::available()
    }

    /// Hosts the store, publishes a fresh NCCL unique id there and joins the communicator on
    /// CUDA device `device`: returns once every worker has joined (the servers must be told to
    /// join concurrently: vLLM's `/init_weight_transfer_engine` returns when they have).
    pub fn join(address: &GroupAddress, device: usize) -> Result<Self, DistError> {
        Self::check()?;
        let mut host = StatelessGroupHost::host(address)?;
        let id = nccl::unique_id()?;
        host.broadcast_pickled(&pickle_nccl_unique_id(&id))?;
        let comm = nccl::Communicator::join(&id, address.world_size, 0, device)?;
        Ok(Self {
            _host: host,
            comm,
            device,
        })
    }

    /// Broadcasts each tensor from rank 0, in order, as the workers' `receive_weights` expects
    /// them (one `ncclBroadcast` each, in its own dtype and shape); returns when all landed.
    pub fn send(&mut self, tensors: &[TensorRef<'_>]) -> Result<(), DistError> {
        let mut in_flight = Vec::new();
        let mut bytes = 0;
        for t in tensors {
            let tensor = to_tensor(t, Device::Cuda(self.device))?;
            self.comm.broadcast(&tensor, 0)?;
            bytes += t.data.len();
            in_flight.push(tensor);
            if bytes >= IN_FLIGHT_BYTES {
                self.comm.synchronize();
                in_flight.clear();
                bytes = 0;
            }
        }
        self.comm.synchronize();
        Ok(())
    }
}

/// The store prefix under which torch.distributed's backend of a group created by SGLang's
/// `init_custom_process_group(..., group_name=name)` keeps its keys. c10d's `PrefixStore` joins a
/// prefix and a key with `/`; the layers, outermost first: SGLang's `PrefixStore(group_name,
/// store)`, `_new_process_group_helper`'s `PrefixStore(f"{group_name}/", …)` and its per-device
/// `PrefixStore(f"{device}/", …)` (`cpu` for Gloo, `cuda` for NCCL).
pub fn torch_group_prefix(group_name: &str, backend: Backend) -> String {
    let device = match backend {
        Backend::Gloo => "cpu",
        Backend::Nccl => "cuda",
    };
    format!("{group_name}/{group_name}//{device}/")
}

/// Rank 0 of the group an SGLang server's workers create with `init_custom_process_group`
/// (torch.distributed over `tcp://addr:port`), broadcasting each tensor from rank 0.
pub struct TorchGroupSender {
    /// Kept for the group's life (the server side of the store).
    _store: Store,
    group: Group,
    device: Device,
    timeout: Duration,
}

impl TorchGroupSender {
    /// Fails at once when this process cannot hold a `backend` group (NCCL needs the `nccl`
    /// feature and a CUDA device).
    pub fn check(backend: Backend) -> Result<(), DistError> {
        match backend {
            Backend::Gloo => Ok(()),
            Backend::Nccl if !cfg!(feature = "nccl") => Err(DistError::Unavailable(format!(
                "{} (this build of verl-distributed has no `nccl` feature)",
                nccl::NEEDS_CUDA
            ))),
            Backend::Nccl if !tch::Cuda::is_available() => Err(DistError::Unavailable(format!(
                "{} (libtorch sees no CUDA device)",
                nccl::NEEDS_CUDA
            ))),
            Backend::Nccl => Ok(()),
        }
    }

    /// Hosts the store and creates the group as rank 0. With Gloo this returns once every
    /// worker has joined (the servers must be told to join concurrently); NCCL connects on the
    /// first broadcast. `device` is the CUDA device of an NCCL group.
    pub fn join(
        address: &GroupAddress,
        group_name: &str,
        backend: Backend,
        device: usize,
    ) -> Result<Self, DistError> {
        Self::check(backend)?;
        let store = address.host()?;
        let group = Group::new(
            &store,
            &torch_group_prefix(group_name, backend),
            backend.code(),
            0,
            address.world_size,
            address.timeout,
        )
        .map_err(|e| {
            address.failed(format!(
                "creating the {} group `{group_name}`: {e}",
                backend.as_str()
            ))
        })?;
        Ok(Self {
            _store: store,
            group,
            device: match backend {
                Backend::Gloo => Device::Cpu,
                Backend::Nccl => Device::Cuda(device),
            },
            timeout: address.timeout,
        })
    }

    /// Broadcasts each tensor from rank 0, in order, as SGLang's
    /// `receive_weights_from_distributed` receives them; returns when all landed.
    pub fn send(&mut self, tensors: &[TensorRef<'_>]) -> Result<(), DistError> {
        let mut works = Vec::new();
        let mut bytes = 0;
        for t in tensors {
            let mut tensor = to_tensor(t, self.device)?;
            let work =
                self.group
                    .broadcast(&mut tensor, 0)
                    .map_err(|message| DistError::Collective {
                        op: format!("broadcast of `{}`", t.name),
                        message,
                    })?;
            bytes += t.data.len();
            works.push((t.name.as_str(), work, tensor));
            if bytes >= IN_FLIGHT_BYTES {
                self.wait(&mut works)?;
                bytes = 0;
            }
        }
        self.wait(&mut works)
    }

    fn wait(&self, works: &mut Vec<(&str, crate::shim::Work, Tensor)>) -> Result<(), DistError> {
        let start = Instant::now();
        for (name, work, _) in works.iter() {
            loop {
                match work.wait(Duration::from_millis(200)) {
                    WorkState::Done => break,
                    WorkState::Failed(message) => {
                        return Err(DistError::Collective {
                            op: format!("broadcast of `{name}`"),
                            message,
                        });
                    }
                    WorkState::Running if start.elapsed() >= self.timeout => {
                        return Err(DistError::Timeout {
                            op: format!("broadcast of `{name}`"),
                            seconds: start.elapsed().as_secs_f64(),
                            detail: "the server's workers did not receive it".into(),
                        });
                    }
                    WorkState::Running => {}
                }
            }
        }
        works.clear();
        Ok(())
    }
}
