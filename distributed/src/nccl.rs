//! NCCL's C API, loaded at run time (`dlopen("libnccl.so.2")`), as vLLM's own `pynccl_wrapper`
//! loads it with ctypes: the communicator of a vLLM weight-transfer group is a bare NCCL
//! communicator built from a unique id exchanged out of band, which c10d's ProcessGroupNCCL cannot
//! join (it exchanges its own id under its own store keys). Loading instead of linking keeps every
//! build free of NCCL and CUDA headers; a machine without CUDA or NCCL gets an error saying so.
//!
//! **Untested here** (this machine has no GPU): the calls follow NCCL's documented signatures
//! (nccl.h, NCCL 2.x) and vLLM 0.32's use of them in `pynccl.py`.

use std::ffi::{CStr, c_char, c_int, c_void};

use tch::{Device, Kind, Tensor};

use crate::DistError;

/// `ncclUniqueId`: 128 opaque bytes (`NCCL_UNIQUE_ID_BYTES`).
pub const UNIQUE_ID_BYTES: usize = 128;

#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId {
    internal: [c_char; UNIQUE_ID_BYTES],
}

type Comm = *mut c_void;
type Stream = *mut c_void;
type NcclResult = c_int;

/// nccl.h's `ncclDataType_t` values.
fn nccl_type(kind: Kind) -> Option<c_int> {
    Some(match kind {
        Kind::Int8 => 0,
        Kind::Uint8 | Kind::Bool => 1,
        Kind::Int => 2,
        Kind::Int64 => 4,
        Kind::Half => 6,
        Kind::Float => 7,
        Kind::Double => 8,
        Kind::BFloat16 => 9,
        _ => return None,
    })
}
/// `ncclSum`.
const SUM: c_int = 0;

struct Api {
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> NcclResult,
    comm_init_rank: unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> NcclResult,
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        Stream,
    ) -> NcclResult,
    broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        Stream,
    ) -> NcclResult,
    comm_destroy: unsafe extern "C" fn(Comm) -> NcclResult,
    error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    /// libcudart's `cudaSetDevice`: NCCL binds a communicator to the current device.
    set_device: unsafe extern "C" fn(c_int) -> c_int,
}

fn dlerror() -> String {
    // SAFETY: dlerror returns a thread-local message or null.
    let message = unsafe { libc::dlerror() };
    if message.is_null() {
        "unknown dlopen error".to_owned()
    } else {
        // SAFETY: a NUL-terminated string owned by libdl.
        unsafe { CStr::from_ptr(message) }
            .to_string_lossy()
            .into_owned()
    }
}

/// The first of `names` that loads (already loaded ones, e.g. by libtorch_cuda, are found first).
fn open(names: &[&CStr]) -> Result<*mut c_void, String> {
    let mut errors = Vec::new();
    for name in names {
        // SAFETY: a valid C string; the handle is never closed.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if !handle.is_null() {
            return Ok(handle);
        }
        errors.push(dlerror());
    }
    Err(errors.join("; "))
}

fn symbol(handle: *mut c_void, name: &CStr) -> Result<*mut c_void, String> {
    // SAFETY: a live handle and a valid C string.
    let address = unsafe { libc::dlsym(handle, name.as_ptr()) };
    if address.is_null() {
        Err(format!(
            "no symbol {}: {}",
            name.to_string_lossy(),
            dlerror()
        ))
    } else {
        Ok(address)
    }
}

/// The function `name` of `handle`, as the function pointer type `F`.
///
/// # Safety
/// `F` must be the symbol's C signature.
unsafe fn function<F: Copy>(handle: *mut c_void, name: &CStr) -> Result<F, String> {
    assert_eq!(
        std::mem::size_of::<F>(),
        std::mem::size_of::<*mut c_void>(),
        "a function pointer type"
    );
    let address = symbol(handle, name)?;
    // SAFETY: `F` is a function pointer type of the symbol's signature (the caller's promise).
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&address) })
}

impl Api {
    fn load() -> Result<Self, String> {
        let nccl = open(&[c"libnccl.so.2", c"libnccl.so"])?;
        let cudart = open(&[c"libcudart.so.13", c"libcudart.so.12", c"libcudart.so"])?;
        // SAFETY: each field's type is the C signature nccl.h / cuda_runtime_api.h declare.
        unsafe {
            Ok(Self {
                get_unique_id: function(nccl, c"ncclGetUniqueId")?,
                comm_init_rank: function(nccl, c"ncclCommInitRank")?,
                all_reduce: function(nccl, c"ncclAllReduce")?,
                broadcast: function(nccl, c"ncclBroadcast")?,
                comm_destroy: function(nccl, c"ncclCommDestroy")?,
                error_string: function(nccl, c"ncclGetErrorString")?,
                set_device: function(cudart, c"cudaSetDevice")?,
            })
        }
    }

    fn check(&self, call: &str, result: NcclResult) -> Result<(), DistError> {
        if result == 0 {
            return Ok(());
        }
        // SAFETY: NCCL returns a static string for any result code.
        let text = unsafe { CStr::from_ptr((self.error_string)(result)) }.to_string_lossy();
        Err(DistError::Collective {
            op: call.to_owned(),
            message: format!("NCCL error {result}: {text}"),
        })
    }
}

/// The message every CPU-only path gives.
pub const NEEDS_CUDA: &str = "collective weight sync needs CUDA + NCCL; use weight_sync=file";

/// NCCL and a CUDA device, or why not.
fn api() -> Result<&'static Api, DistError> {
    static API: std::sync::OnceLock<Result<Api, String>> = std::sync::OnceLock::new();
    if !tch::Cuda::is_available() {
        return Err(DistError::Unavailable(format!(
            "{NEEDS_CUDA} (libtorch sees no CUDA device)"
        )));
    }
    API.get_or_init(Api::load)
        .as_ref()
        .map_err(|e| DistError::Unavailable(format!("{NEEDS_CUDA} (loading NCCL: {e})")))
}

/// Whether this process can hold an NCCL communicator: a CUDA device and NCCL's library.
pub fn available() -> Result<(), DistError> {
    api().map(drop)
}

/// A new NCCL unique id (rank 0 mints it; the others receive it out of band).
pub fn unique_id() -> Result<[u8; UNIQUE_ID_BYTES], DistError> {
    let api = api()?;
    let mut id = UniqueId {
        internal: [0; UNIQUE_ID_BYTES],
    };
    // SAFETY: `id` is a writable ncclUniqueId.
    api.check("ncclGetUniqueId", unsafe { (api.get_unique_id)(&mut id) })?;
    Ok(id.internal.map(|b| b as u8))
}

/// An NCCL communicator on one CUDA device, using the device's default stream (the stream tch's
/// operations run on).
pub struct Communicator {
    api: &'static Api,
    comm: Comm,
    device: usize,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time (`&mut self`).
unsafe impl Send for Communicator {}

impl Communicator {
    /// `ncclCommInitRank` (blocks until all `world_size` ranks have called it), then
    /// `PyNcclCommunicator`'s warm-up: a one-element float32 all-reduce every rank issues before
    /// any other collective (vLLM's workers do; skipping it deadlocks them).
    pub fn join(
        id: &[u8; UNIQUE_ID_BYTES],
        world_size: u32,
        rank: u32,
        device: usize,
    ) -> Result<Self, DistError> {
        let api = api()?;
        let int = |v: u32| c_int::try_from(v).expect("ranks fit an int");
        let device_int = c_int::try_from(device).expect("device indices fit an int");
        // SAFETY: a plain runtime call.
        let set = unsafe { (api.set_device)(device_int) };
        if set != 0 {
            return Err(DistError::Collective {
                op: "cudaSetDevice".into(),
                message: format!("CUDA error {set} for device {device}"),
            });
        }
        let id = UniqueId {
            internal: id.map(|b| b as c_char),
        };
        let mut comm: Comm = std::ptr::null_mut();
        // SAFETY: `comm` receives the communicator; the id is passed by value as nccl.h declares.
        api.check("ncclCommInitRank", unsafe {
            (api.comm_init_rank)(&mut comm, int(world_size), id, int(rank))
        })?;
        let communicator = Self { api, comm, device };
        let warm = Tensor::zeros([1], (Kind::Float, Device::Cuda(device)));
        communicator.call("all_reduce (warm-up)", &warm, |send, recv, count, dtype| {
            // SAFETY: `warm` is a live CUDA tensor of `count` elements.
            unsafe { (api.all_reduce)(send, recv, count, dtype, SUM, comm, std::ptr::null_mut()) }
        })?;
        communicator.synchronize();
        Ok(communicator)
    }

    /// Broadcasts `tensor` (a contiguous CUDA tensor on this communicator's device) from `root`;
    /// enqueued on the default stream, complete after [`Communicator::synchronize`].
    pub fn broadcast(&self, tensor: &Tensor, root: u32) -> Result<(), DistError> {
        let api = self.api;
        let comm = self.comm;
        let root = c_int::try_from(root).expect("ranks fit an int");
        self.call("broadcast", tensor, |send, recv, count, dtype| {
            // SAFETY: `tensor` is a live contiguous CUDA tensor of `count` elements.
            unsafe { (api.broadcast)(send, recv, count, dtype, root, comm, std::ptr::null_mut()) }
        })
    }

    fn call(
        &self,
        op: &str,
        tensor: &Tensor,
        f: impl FnOnce(*const c_void, *mut c_void, usize, c_int) -> NcclResult,
    ) -> Result<(), DistError> {
        if tensor.device() != Device::Cuda(self.device) || !tensor.is_contiguous() {
            return Err(DistError::Invalid {
                op: op.to_owned(),
                reason: format!(
                    "NCCL takes a contiguous tensor on cuda:{}, not one on {:?}",
                    self.device,
                    tensor.device()
                ),
            });
        }
        let dtype = nccl_type(tensor.kind()).ok_or_else(|| DistError::Invalid {
            op: op.to_owned(),
            reason: format!("NCCL has no type for {:?}", tensor.kind()),
        })?;
        let data = tensor.data_ptr();
        self.api.check(op, f(data, data, tensor.numel(), dtype))
    }

    /// Waits for everything enqueued on the device.
    pub fn synchronize(&self) {
        tch::Cuda::synchronize(self.device as i64);
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // SAFETY: the communicator is ours and destroyed once.
        unsafe { (self.api.comm_destroy)(self.comm) };
    }
}
