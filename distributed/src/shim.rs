//! Safe handles on csrc/shim.cpp: a c10d store, a process group and a collective's work. Each
//! call returns the C++ exception's message as `Err(String)`; callers add which rank, key or
//! collective it was about.

use std::ffi::{CString, c_char, c_int, c_void};
use std::ptr::NonNull;
use std::time::Duration;

use tch::Tensor;

#[repr(C)]
struct RawStore {
    _private: [u8; 0],
}
#[repr(C)]
struct RawGroup {
    _private: [u8; 0],
}
#[repr(C)]
struct RawWork {
    _private: [u8; 0],
}

/// tch's tensor handle is a pointer to `at::Tensor`, which is what the shim takes.
type RawTensor = torch_sys::C_tensor;

unsafe extern "C" {
    fn vd_free(ptr: *mut c_void);
    fn vd_quiet_logs(rank: i64);
    fn vd_store_new(
        host: *const c_char,
        port: u16,
        is_server: c_int,
        world_size: i64,
        timeout_ms: i64,
        err: *mut *mut c_char,
    ) -> *mut RawStore;
    fn vd_store_free(store: *mut RawStore);
    fn vd_store_set(
        store: *mut RawStore,
        key: *const c_char,
        data: *const u8,
        len: usize,
        err: *mut *mut c_char,
    ) -> bool;
    fn vd_store_check(
        store: *mut RawStore,
        keys: *const *const c_char,
        n: usize,
        exists: *mut c_int,
        err: *mut *mut c_char,
    ) -> bool;
    fn vd_store_multi_get(
        store: *mut RawStore,
        keys: *const *const c_char,
        n: usize,
        data: *mut *mut u8,
        lens: *mut usize,
        err: *mut *mut c_char,
    ) -> bool;
    fn vd_group_new(
        store: *mut RawStore,
        prefix: *const c_char,
        backend: c_int,
        rank: c_int,
        size: c_int,
        timeout_ms: i64,
        err: *mut *mut c_char,
    ) -> *mut RawGroup;
    fn vd_group_free(group: *mut RawGroup);
    fn vd_all_reduce(
        group: *mut RawGroup,
        tensor: *mut RawTensor,
        op: c_int,
        err: *mut *mut c_char,
    ) -> *mut RawWork;
    fn vd_broadcast(
        group: *mut RawGroup,
        tensor: *mut RawTensor,
        root: c_int,
        err: *mut *mut c_char,
    ) -> *mut RawWork;
    fn vd_all_gather(
        group: *mut RawGroup,
        outputs: *const *mut RawTensor,
        n: usize,
        input: *mut RawTensor,
        err: *mut *mut c_char,
    ) -> *mut RawWork;
    fn vd_all_gather_flat(
        group: *mut RawGroup,
        output: *mut RawTensor,
        input: *mut RawTensor,
        err: *mut *mut c_char,
    ) -> *mut RawWork;
    fn vd_reduce_scatter_flat(
        group: *mut RawGroup,
        output: *mut RawTensor,
        input: *mut RawTensor,
        op: c_int,
        err: *mut *mut c_char,
    ) -> *mut RawWork;
    fn vd_barrier(group: *mut RawGroup, err: *mut *mut c_char) -> *mut RawWork;
    fn vd_work_wait(work: *mut RawWork, timeout_ms: i64, err: *mut *mut c_char) -> c_int;
    fn vd_work_free(work: *mut RawWork);
}

/// Takes ownership of the shim's malloc'd error message.
fn take_error(err: *mut c_char) -> String {
    if err.is_null() {
        return "unknown error (the shim returned no message)".to_owned();
    }
    // SAFETY: the shim wrote a NUL-terminated malloc'd string that nothing else owns.
    let text = unsafe { std::ffi::CStr::from_ptr(err) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: allocated by the shim's malloc; freed once, here.
    unsafe { vd_free(err.cast()) };
    text
}

/// Lowers c10's log level to FATAL unless `TORCH_CPP_LOG_LEVEL` is set, and tags log lines
/// with `rank`.
pub(crate) fn quiet_logs(rank: u32) {
    // SAFETY: sets two c10 globals.
    unsafe { vd_quiet_logs(i64::from(rank)) }
}

fn c_string(text: &str) -> Result<CString, String> {
    CString::new(text).map_err(|_| format!("`{text}` contains a NUL byte"))
}

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// A c10d TCPStore: the server on the rank that hosts it, a client elsewhere.
pub(crate) struct Store(NonNull<RawStore>);

// SAFETY: c10d's TCPStore serialises its operations with an internal lock.
unsafe impl Send for Store {}

impl Store {
    pub(crate) fn connect(
        host: &str,
        port: u16,
        server: bool,
        world_size: u32,
        timeout: Duration,
    ) -> Result<Self, String> {
        let host = c_string(host)?;
        let mut err = std::ptr::null_mut();
        // SAFETY: valid C string; err receives a message on failure.
        let raw = unsafe {
            vd_store_new(
                host.as_ptr(),
                port,
                c_int::from(server),
                i64::from(world_size),
                millis(timeout),
                &mut err,
            )
        };
        NonNull::new(raw).map(Self).ok_or_else(|| take_error(err))
    }

    pub(crate) fn set(&self, key: &str, value: &[u8]) -> Result<(), String> {
        let key = c_string(key)?;
        let mut err = std::ptr::null_mut();
        // SAFETY: live store, valid key and value slice.
        let ok = unsafe {
            vd_store_set(
                self.0.as_ptr(),
                key.as_ptr(),
                value.as_ptr(),
                value.len(),
                &mut err,
            )
        };
        if ok { Ok(()) } else { Err(take_error(err)) }
    }

    /// Whether every key is set (no waiting).
    pub(crate) fn check(&self, keys: &[String]) -> Result<bool, String> {
        let names = keys
            .iter()
            .map(|k| c_string(k))
            .collect::<Result<Vec<_>, _>>()?;
        let pointers: Vec<*const c_char> = names.iter().map(|k| k.as_ptr()).collect();
        let mut exists = 0;
        let mut err = std::ptr::null_mut();
        // SAFETY: live store; `pointers` holds `names.len()` valid C strings.
        let ok = unsafe {
            vd_store_check(
                self.0.as_ptr(),
                pointers.as_ptr(),
                pointers.len(),
                &mut exists,
                &mut err,
            )
        };
        if ok {
            Ok(exists != 0)
        } else {
            Err(take_error(err))
        }
    }

    /// The values of `keys` in one round trip; each key must exist (else this waits for it up to
    /// the store's timeout).
    pub(crate) fn multi_get(&self, keys: &[String]) -> Result<Vec<Vec<u8>>, String> {
        let names = keys
            .iter()
            .map(|k| c_string(k))
            .collect::<Result<Vec<_>, _>>()?;
        let pointers: Vec<*const c_char> = names.iter().map(|k| k.as_ptr()).collect();
        let mut lens = vec![0usize; keys.len()];
        let mut data = std::ptr::null_mut();
        let mut err = std::ptr::null_mut();
        // SAFETY: live store; `lens` has one slot per key; data is malloc'd by the shim.
        let ok = unsafe {
            vd_store_multi_get(
                self.0.as_ptr(),
                pointers.as_ptr(),
                pointers.len(),
                &mut data,
                lens.as_mut_ptr(),
                &mut err,
            )
        };
        if !ok {
            return Err(take_error(err));
        }
        let total = lens.iter().sum();
        // SAFETY: the shim wrote `total` bytes at `data`.
        let bytes = unsafe { std::slice::from_raw_parts(data, total) };
        let mut values = Vec::with_capacity(lens.len());
        let mut offset = 0;
        for len in lens {
            values.push(bytes[offset..offset + len].to_vec());
            offset += len;
        }
        // SAFETY: malloc'd by the shim; freed once, here.
        unsafe { vd_free(data.cast()) };
        Ok(values)
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // SAFETY: owned handle, freed once.
        unsafe { vd_store_free(self.0.as_ptr()) }
    }
}

/// A c10d process group (`c10d::Backend`) over a store.
pub(crate) struct Group(NonNull<RawGroup>);

// SAFETY: c10d backends are used from one thread at a time here (`ProcessGroup` takes `&mut`
// for every collective); their worker threads are their own.
unsafe impl Send for Group {}

/// What a collective work reports after a wait slice.
pub(crate) enum WorkState {
    Done,
    Running,
    Failed(String),
}

/// One collective in flight.
pub(crate) struct Work(NonNull<RawWork>);

impl Work {
    fn from_raw(raw: *mut RawWork, err: *mut c_char) -> Result<Self, String> {
        NonNull::new(raw).map(Self).ok_or_else(|| take_error(err))
    }

    /// Waits up to `slice` for the collective to finish.
    pub(crate) fn wait(&self, slice: Duration) -> WorkState {
        let mut err = std::ptr::null_mut();
        // SAFETY: live work handle.
        match unsafe { vd_work_wait(self.0.as_ptr(), millis(slice).max(1), &mut err) } {
            1 => WorkState::Done,
            0 => WorkState::Running,
            _ => WorkState::Failed(take_error(err)),
        }
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        // SAFETY: owned handle, freed once. The group keeps its own reference to running work
        // (and the work to its tensors), so dropping ours early is safe.
        unsafe { vd_work_free(self.0.as_ptr()) }
    }
}

fn tensor_ptr(tensor: &Tensor) -> *mut RawTensor {
    // The shim takes `at::Tensor*` and never replaces the handle; c10d writes results into the
    // tensor's storage, which `&Tensor` callers lend as an output only where documented.
    tensor.as_ptr().cast_mut()
}

impl Group {
    pub(crate) fn new(
        store: &Store,
        prefix: &str,
        backend: c_int,
        rank: u32,
        world_size: u32,
        timeout: Duration,
    ) -> Result<Self, String> {
        let prefix = c_string(prefix)?;
        let rank = c_int::try_from(rank).map_err(|e| e.to_string())?;
        let size = c_int::try_from(world_size).map_err(|e| e.to_string())?;
        let mut err = std::ptr::null_mut();
        // SAFETY: live store; the group keeps its own reference to it.
        let raw = unsafe {
            vd_group_new(
                store.0.as_ptr(),
                prefix.as_ptr(),
                backend,
                rank,
                size,
                millis(timeout),
                &mut err,
            )
        };
        NonNull::new(raw).map(Self).ok_or_else(|| take_error(err))
    }

    pub(crate) fn all_reduce(&self, tensor: &mut Tensor, op: c_int) -> Result<Work, String> {
        let mut err = std::ptr::null_mut();
        // SAFETY: live group and tensor.
        let raw = unsafe { vd_all_reduce(self.0.as_ptr(), tensor.as_mut_ptr(), op, &mut err) };
        Work::from_raw(raw, err)
    }

    pub(crate) fn broadcast(&self, tensor: &mut Tensor, root: u32) -> Result<Work, String> {
        let root = c_int::try_from(root).map_err(|e| e.to_string())?;
        let mut err = std::ptr::null_mut();
        // SAFETY: live group and tensor.
        let raw = unsafe { vd_broadcast(self.0.as_ptr(), tensor.as_mut_ptr(), root, &mut err) };
        Work::from_raw(raw, err)
    }

    pub(crate) fn all_gather(
        &self,
        outputs: &mut [Tensor],
        input: &Tensor,
    ) -> Result<Work, String> {
        let pointers: Vec<*mut RawTensor> = outputs.iter_mut().map(|t| t.as_mut_ptr()).collect();
        let mut err = std::ptr::null_mut();
        // SAFETY: live group; `pointers` holds `outputs.len()` live tensors.
        let raw = unsafe {
            vd_all_gather(
                self.0.as_ptr(),
                pointers.as_ptr(),
                pointers.len(),
                tensor_ptr(input),
                &mut err,
            )
        };
        Work::from_raw(raw, err)
    }

    pub(crate) fn all_gather_flat(
        &self,
        output: &mut Tensor,
        input: &Tensor,
    ) -> Result<Work, String> {
        let mut err = std::ptr::null_mut();
        // SAFETY: live group and tensors.
        let raw = unsafe {
            vd_all_gather_flat(
                self.0.as_ptr(),
                output.as_mut_ptr(),
                tensor_ptr(input),
                &mut err,
            )
        };
        Work::from_raw(raw, err)
    }

    pub(crate) fn reduce_scatter_flat(
        &self,
        output: &mut Tensor,
        input: &Tensor,
        op: c_int,
    ) -> Result<Work, String> {
        let mut err = std::ptr::null_mut();
        // SAFETY: live group and tensors.
        let raw = unsafe {
            vd_reduce_scatter_flat(
                self.0.as_ptr(),
                output.as_mut_ptr(),
                tensor_ptr(input),
                op,
                &mut err,
            )
        };
        Work::from_raw(raw, err)
    }

    pub(crate) fn barrier(&self) -> Result<Work, String> {
        let mut err = std::ptr::null_mut();
        // SAFETY: live group.
        let raw = unsafe { vd_barrier(self.0.as_ptr(), &mut err) };
        Work::from_raw(raw, err)
    }

    /// Frees the group. Only when no collective is stuck in it: c10d's destructor joins the
    /// group's worker threads, which would wait for a stuck one. (The handle has no `Drop`:
    /// a group dropped without `close` is left to the process's exit.)
    pub(crate) fn close(self) {
        // SAFETY: owned handle, freed once (`self` is consumed).
        unsafe { vd_group_free(self.0.as_ptr()) }
    }
}
