//! The devices every host has without plugins: `cpu` (the fallback) and `cuda` (NVIDIA).

mod cpu;
mod cuda;

pub use cpu::CpuDevice;
pub use cuda::CudaDevice;

use verl_plugin_api::PluginBuilder;

use crate::BuiltinPlugin;

pub const PLUGIN_NAME: &str = "verl-core";

fn builtin_devices() -> PluginBuilder {
    PluginBuilder::new(
        PLUGIN_NAME,
        env!("CARGO_PKG_VERSION"),
        "devices built into verl-core",
    )
    .device(
        "cpu",
        0,
        "host CPUs (gloo); always available, the fallback platform",
        || CpuDevice,
    )
    .device(
        "cuda",
        100,
        "NVIDIA GPUs (nccl), detected from the driver's /proc and /dev entries",
        || CudaDevice,
    )
}

inventory::submit! { BuiltinPlugin(builtin_devices) }
