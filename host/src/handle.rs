//! Typed handles on created components: plain Rust signatures over the stable objects, with the
//! records encoded and decoded here, so callers (the trainer, the conformance suites) never see
//! the wire format.

use verl_plugin_api::abi_stable::std_types::RResult;
use verl_plugin_api::wire::{decode, encode};
use verl_plugin_api::{
    Batch, CheckpointBox, ComponentInit, Detection, DeviceBox, DeviceInfo, EngineBox,
    GenerateOutput, GenerateRequest, Handover, Metric, PluginError, ProbeContext, RewardBox,
    RewardOutput, RewardRequest, RolloutBox, Table, TensorRef, TrackerBox, WeightSource,
};

fn done<T>(r: RResult<T, PluginError>) -> Result<T, PluginError> {
    r.into_result()
}

pub struct DeviceHandle(pub(crate) DeviceBox);

impl DeviceHandle {
    pub fn info(&self) -> Result<DeviceInfo, PluginError> {
        decode("device info", &done(self.0.info())?)
    }
    pub fn detect(&self, probe: &ProbeContext) -> Result<Detection, PluginError> {
        decode("detection", &done(self.0.detect(encode(probe).as_rstr()))?)
    }
}

pub struct EngineHandle(pub(crate) EngineBox);

impl EngineHandle {
    pub fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError> {
        done(self.0.init(encode(init).as_rstr()))
    }
    pub fn compute_log_prob(&mut self, batch: &Batch) -> Result<Batch, PluginError> {
        done(self.0.compute_log_prob(batch))
    }
    pub fn compute_values(&mut self, batch: &Batch) -> Result<Batch, PluginError> {
        done(self.0.compute_values(batch))
    }
    pub fn update_actor(&mut self, batch: &Batch) -> Result<Vec<Metric>, PluginError> {
        done(self.0.update_actor(batch)).map(Vec::from)
    }
    pub fn update_critic(&mut self, batch: &Batch) -> Result<Vec<Metric>, PluginError> {
        done(self.0.update_critic(batch)).map(Vec::from)
    }
    pub fn save_checkpoint(&mut self, dir: &str, global_step: u64) -> Result<(), PluginError> {
        done(self.0.save_checkpoint(dir.into(), global_step))
    }
    pub fn load_checkpoint(&mut self, dir: &str) -> Result<u64, PluginError> {
        done(self.0.load_checkpoint(dir.into()))
    }
    /// Views into the engine's memory; the borrow keeps the engine from being called meanwhile.
    pub fn weights(&mut self) -> Result<Vec<TensorRef<'_>>, PluginError> {
        done(self.0.weights()).map(Vec::from)
    }
    pub fn export_hf(&mut self, dir: &str) -> Result<(), PluginError> {
        done(self.0.export_hf(dir.into()))
    }
    /// Every rank's `bytes` in rank order (a collective over the engine's process group). An
    /// engine built against plugin API 2.0 has no such entry: unsupported.
    pub fn all_gather_object(&mut self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, PluginError> {
        done(self.0.all_gather_object(bytes.into()))
            .map(|all| all.into_iter().map(Vec::from).collect())
    }
}

pub struct RolloutHandle(pub(crate) RolloutBox);

impl RolloutHandle {
    pub fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError> {
        done(self.0.init(encode(init).as_rstr()))
    }
    pub fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, PluginError> {
        decode(
            "generate output",
            &done(self.0.generate(encode(request).as_rstr()))?,
        )
    }
    pub fn update_weights(&mut self, source: &WeightSource<'_>) -> Result<(), PluginError> {
        done(self.0.update_weights(source))
    }
    pub fn sleep(&mut self, level: u32) -> Result<(), PluginError> {
        done(self.0.sleep(level))
    }
    pub fn wake_up(&mut self) -> Result<(), PluginError> {
        done(self.0.wake_up())
    }
}

pub struct CheckpointHandle(pub(crate) CheckpointBox);

impl CheckpointHandle {
    pub fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError> {
        done(self.0.init(encode(init).as_rstr()))
    }
    pub fn send_weights(&mut self, weights: &WeightSource<'_>) -> Result<Handover, PluginError> {
        decode("handover", &done(self.0.send_weights(weights))?)
    }
    pub fn finalize(&mut self) -> Result<(), PluginError> {
        done(self.0.finalize())
    }
}

pub struct TrackerHandle(pub(crate) TrackerBox);

impl TrackerHandle {
    pub fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError> {
        done(self.0.init(encode(init).as_rstr()))
    }
    pub fn log(&mut self, step: u64, metrics: &[Metric]) -> Result<(), PluginError> {
        done(self.0.log(step, metrics.into()))
    }
    pub fn log_table(&mut self, step: u64, table: &Table) -> Result<(), PluginError> {
        done(self.0.log_table(step, encode(table).as_rstr()))
    }
    pub fn finish(&mut self, exit_code: i32) -> Result<(), PluginError> {
        done(self.0.finish(exit_code))
    }
}

pub struct RewardHandle(pub(crate) RewardBox);

impl RewardHandle {
    pub fn init(&mut self, init: &ComponentInit) -> Result<(), PluginError> {
        done(self.0.init(encode(init).as_rstr()))
    }
    /// The scores of `request`'s items; a reply with another number of scores is an error.
    pub fn compute(&mut self, request: &RewardRequest) -> Result<RewardOutput, PluginError> {
        let output: RewardOutput = decode(
            "reward output",
            &done(self.0.compute(encode(request).as_rstr()))?,
        )?;
        if output.scores.len() != request.items.len() {
            return Err(PluginError::other(format!(
                "returned {} scores for {} items",
                output.scores.len(),
                request.items.len()
            )));
        }
        Ok(output)
    }
}
