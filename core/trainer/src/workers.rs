//! The trainer's view of its engines and rollout: plain Rust signatures, whatever runs behind them.
//!
//! This is the seam for placement. Today every engine and rollout is one local plugin object (the
//! host's [`EngineHandle`] / [`RolloutHandle`]). A multi-rank worker group implements the same
//! traits by sending each call to its ranks (splitting the batch over data-parallel ranks and
//! gathering the outputs), so the trainer's loop does not change when it scales out.

use std::path::Path;

use verl_plugin_api::{
    Batch, DType, GenerateOutput, GenerateRequest, Handover, Metric, PluginError, TensorRef,
    WeightSource, WeightSourceKind,
};
use verl_plugin_host::{CheckpointHandle, EngineHandle, RolloutHandle};

use crate::builtin::weight_sync::WEIGHTS_FILE;
use crate::weight_slots::SlotStore;

/// A training backend for one role (actor, ref or critic), already initialised.
pub trait EngineWorker {
    fn compute_log_prob(&mut self, batch: &Batch) -> Result<Batch, PluginError>;
    fn compute_values(&mut self, batch: &Batch) -> Result<Batch, PluginError>;
    fn update_actor(&mut self, batch: &Batch) -> Result<Vec<Metric>, PluginError>;
    fn update_critic(&mut self, batch: &Batch) -> Result<Vec<Metric>, PluginError>;
    fn save_checkpoint(&mut self, dir: &str, global_step: u64) -> Result<(), PluginError>;
    fn load_checkpoint(&mut self, dir: &str) -> Result<u64, PluginError>;
    /// The full weights as views, valid while the borrow lasts.
    fn weights(&mut self) -> Result<Vec<TensorRef<'_>>, PluginError>;
    fn export_hf(&mut self, dir: &str) -> Result<(), PluginError>;
    /// Every rank's `bytes`, in rank order, over the engine's process group.
    fn all_gather_object(&mut self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, PluginError>;
}

/// A generator, already initialised.
pub trait RolloutWorker {
    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, PluginError>;
    fn update_weights(&mut self, source: &WeightSource<'_>) -> Result<(), PluginError>;
    fn sleep(&mut self, level: u32) -> Result<(), PluginError>;
    fn wake_up(&mut self) -> Result<(), PluginError>;
}

impl EngineWorker for EngineHandle {
    fn compute_log_prob(&mut self, batch: &Batch) -> Result<Batch, PluginError> {
        EngineHandle::compute_log_prob(self, batch)
    }
    fn compute_values(&mut self, batch: &Batch) -> Result<Batch, PluginError> {
        EngineHandle::compute_values(self, batch)
    }
    fn update_actor(&mut self, batch: &Batch) -> Result<Vec<Metric>, PluginError> {
        EngineHandle::update_actor(self, batch)
    }
    fn update_critic(&mut self, batch: &Batch) -> Result<Vec<Metric>, PluginError> {
        EngineHandle::update_critic(self, batch)
    }
    fn save_checkpoint(&mut self, dir: &str, global_step: u64) -> Result<(), PluginError> {
        EngineHandle::save_checkpoint(self, dir, global_step)
    }
    fn load_checkpoint(&mut self, dir: &str) -> Result<u64, PluginError> {
        EngineHandle::load_checkpoint(self, dir)
    }
    fn weights(&mut self) -> Result<Vec<TensorRef<'_>>, PluginError> {
        EngineHandle::weights(self)
    }
    fn export_hf(&mut self, dir: &str) -> Result<(), PluginError> {
        EngineHandle::export_hf(self, dir)
    }
    fn all_gather_object(&mut self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, PluginError> {
        EngineHandle::all_gather_object(self, bytes)
    }
}

impl RolloutWorker for RolloutHandle {
    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, PluginError> {
        RolloutHandle::generate(self, request)
    }
    fn update_weights(&mut self, source: &WeightSource<'_>) -> Result<(), PluginError> {
        RolloutHandle::update_weights(self, source)
    }
    fn sleep(&mut self, level: u32) -> Result<(), PluginError> {
        RolloutHandle::sleep(self, level)
    }
    fn wake_up(&mut self) -> Result<(), PluginError> {
        RolloutHandle::wake_up(self)
    }
}

/// Which step of a weight sync failed.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("taking the actor's weights: {0}")]
    Export(PluginError),
    #[error("weight sync `{backend}`: {error}")]
    Publish { backend: String, error: PluginError },
    #[error("updating the rollout's weights: {0}")]
    Update(PluginError),
    /// The actor lent weights holding a NaN or an infinity; nothing was handed over.
    #[error("the actor's weights hold non-finite values (tensor `{tensor}`)")]
    NonFinite { tensor: String },
    /// The two-slot store the weights were handed over in could not be read.
    #[error("reading the handed-over weights: {0}")]
    Slots(#[from] crate::weight_slots::SlotError),
}

/// The first of `weights` (floating-point dtypes) holding a NaN or an infinity. One read of the
/// weights, which the sync reads anyway: non-finite weights never reach the rollout.
pub fn first_non_finite<'a>(weights: &'a [TensorRef<'_>]) -> Option<&'a str> {
    weights
        .iter()
        .find(|t| {
            let data = t.data.as_slice();
            // A float is NaN or infinite exactly when its exponent bits are all ones.
            match t.dtype {
                DType::F32 => any_exponent_all_ones::<4>(data, 0x7f80_0000),
                DType::F64 => any_exponent_all_ones::<8>(data, 0x7ff0_0000_0000_0000),
                DType::F16 => any_exponent_all_ones::<2>(data, 0x7c00),
                DType::BF16 => any_exponent_all_ones::<2>(data, 0x7f80),
                _ => false,
            }
        })
        .map(|t| t.name.as_str())
}

/// Whether any `W`-byte little-endian value of `data` (the ABI's byte order) has all bits of
/// `exponent` set. Blocks are folded without an early exit, so the compiler vectorises them.
fn any_exponent_all_ones<const W: usize>(data: &[u8], exponent: u64) -> bool {
    data.chunks(1 << 16).any(|block| {
        block.chunks_exact(W).fold(false, |found, value| {
            let mut bits = [0u8; 8];
            bits[..W].copy_from_slice(value);
            found | (u64::from_le_bytes(bits) & exponent == exponent)
        })
    })
}

/// What one sync moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncStats {
    /// Bytes of weights the actor lent (the rollout copies them once).
    pub bytes: usize,
    pub tensors: usize,
}

/// Actor → weight sync → rollout, by reference: the actor lends views of its weights, the weight
/// sync publishes them (memory: as they are; file: a directory; collective: a transfer) and the
/// rollout takes them from where the sync says. The views outlive neither call.
pub fn sync_weights(
    actor: &mut dyn EngineWorker,
    weight_sync: &mut CheckpointHandle,
    backend: &str,
    rollout: &mut dyn RolloutWorker,
    version: u64,
) -> Result<SyncStats, SyncError> {
    let views = actor.weights().map_err(SyncError::Export)?;
    if let Some(tensor) = first_non_finite(&views) {
        return Err(SyncError::NonFinite {
            tensor: tensor.to_owned(),
        });
    }
    let lent = WeightSource::memory(version, &views);
    let stats = SyncStats {
        bytes: lent.bytes(),
        tensors: views.len(),
    };
    let publish = |error| SyncError::Publish {
        backend: backend.to_owned(),
        error,
    };
    let handover = weight_sync.send_weights(&lent).map_err(publish)?;
    let mut update = |handover: &Handover, version: u64| {
        rollout.update_weights(&WeightSource::from_handover(
            version,
            &views,
            &WeightSource::encode_handover(handover),
        ))
    };
    let slots = (handover.kind == WeightSourceKind::File)
        .then(|| SlotStore::of_slot_dir(Path::new(&handover.path), WEIGHTS_FILE))
        .flatten();
    match slots {
        // A double-buffered store: the rollout loads the newest complete slot while holding it
        // (no writer can rewrite it meanwhile), after its checksum was verified.
        Some(store) => {
            let (_, updated) = store.read(|payload, record| {
                let dir = payload.parent().unwrap_or(payload);
                update(&Handover::file(dir.to_string_lossy()), record.version)
            })?;
            updated.map_err(SyncError::Update)?;
        }
        None => update(&handover, version).map_err(SyncError::Update)?,
    }
    drop(views);
    weight_sync.finalize().map_err(publish)?;
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view<'a>(name: &'a str, dtype: DType, shape: &'a [i64], data: &'a [u8]) -> TensorRef<'a> {
        TensorRef::new(name, dtype, shape, data).unwrap()
    }

    #[test]
    fn non_finite_weights_are_found_in_every_float_dtype() {
        // A value past the first block, so the block loop is exercised too.
        let mut f32s = vec![0.5f32; 40_000];
        let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let shape = [40_000i64];
        let clean = f32_bytes(&f32s);
        assert_eq!(
            first_non_finite(&[view("a", DType::F32, &shape, &clean)]),
            None
        );
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            f32s[33_333] = bad;
            let data = f32_bytes(&f32s);
            let views = [
                view("clean", DType::F32, &shape, &clean),
                view("bad", DType::F32, &shape, &data),
            ];
            assert_eq!(first_non_finite(&views), Some("bad"), "{bad}");
        }
        // The largest finite values are finite.
        let max = f32_bytes(&[f32::MAX, f32::MIN, f32::MIN_POSITIVE]);
        assert_eq!(first_non_finite(&[view("m", DType::F32, &[3], &max)]), None);

        let f64s: Vec<u8> = [1.0f64, f64::MAX, f64::NAN]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(
            first_non_finite(&[view("d", DType::F64, &[2], &f64s[..16])]),
            None
        );
        assert_eq!(
            first_non_finite(&[view("d", DType::F64, &[3], &f64s)]),
            Some("d")
        );
        // Half precision: 0x7bff is f16's largest finite value, 0x7c00 its infinity; bf16's
        // infinity is 0x7f80, and 0x7c00 is a finite bf16.
        let halves = |v: &[u16]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let (f16_max, inf_f16) = (halves(&[0x3c00, 0x7bff]), halves(&[0x3c00, 0x7c00]));
        assert_eq!(
            first_non_finite(&[view("h", DType::F16, &[2], &f16_max)]),
            None
        );
        assert_eq!(
            first_non_finite(&[view("h", DType::F16, &[2], &inf_f16)]),
            Some("h")
        );
        assert_eq!(
            first_non_finite(&[view("b", DType::BF16, &[2], &inf_f16)]),
            None
        );
        let nan_bf16 = halves(&[0x7fc1]);
        assert_eq!(
            first_non_finite(&[view("b", DType::BF16, &[1], &nan_bf16)]),
            Some("b")
        );
        // Integers are never checked.
        let ints = [0xffu8; 8];
        assert_eq!(
            first_non_finite(&[view("i", DType::I64, &[1], &ints)]),
            None
        );
    }
}
