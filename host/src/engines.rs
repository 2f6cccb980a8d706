//! Which engine component a verl `strategy` runs on, on the selected platform's device type.
//!
//! verl keys its engines by backend *and* device: `EngineRegistry.register(model_type, backend,
//! device)` and `get_engine_cls(model_type, backend)` looks up `[backend][get_device_name()]`
//! (`verl/workers/engine/base.py`); `verl/workers/engine/mindspeed/transformer_impl.py` registers
//! `MindspeedEngineWithLMHead` with `backend="megatron", device="npu"`, so on an Ascend NPU
//! `strategy=megatron` runs MindSpeed. Here an engine declares the same in its capabilities
//! ([`EngineCapabilities::strategies`] and `devices`), and [`Registry::resolve_engine`] applies
//! the rule:
//! 1. an engine that declares it serves `strategy` and names `device_type` among its devices
//!    (highest priority; two at the same priority are ambiguous);
//! 2. else the engine named `strategy`, when it runs on `device_type` (no devices declared:
//!    any);
//! 3. else an error naming the strategy, the device type and what the named engine runs on.

use verl_plugin_api::{ComponentKind, EngineCapabilities};

use crate::registry::{Component, LookupError, Registry};

impl Registry {
    /// The engine that serves `strategy` on `device_type` devices (see the module's rule).
    pub fn resolve_engine(
        &self,
        strategy: &str,
        device_type: &str,
    ) -> Result<Component, LookupError> {
        let mut serving: Vec<Component> = self
            .active_engines()
            .filter(|(c, caps)| {
                c.name != strategy
                    && caps.strategies.iter().any(|s| s == strategy)
                    && caps.devices.iter().any(|d| d == device_type)
            })
            .map(|(c, _)| c)
            .collect();
        serving.sort_by_key(|c| std::cmp::Reverse(c.priority));
        if let Some(top) = serving.first() {
            let tied: Vec<String> = serving
                .iter()
                .filter(|c| c.priority == top.priority)
                .map(|c| format!("`{}` ({})", c.name, c.origin.describe()))
                .collect();
            if tied.len() > 1 {
                return Err(LookupError::AmbiguousEngine {
                    strategy: strategy.to_owned(),
                    device_type: device_type.to_owned(),
                    priority: top.priority,
                    engines: tied,
                });
            }
            return Ok(top.clone());
        }
        let named = self.resolve(ComponentKind::ENGINE, strategy)?;
        let caps: EngineCapabilities = named.capabilities();
        if caps.supports_device(device_type) {
            return Ok(named);
        }
        Err(LookupError::NoEngineForDevice {
            strategy: strategy.to_owned(),
            device_type: device_type.to_owned(),
            devices: caps.devices,
        })
    }

    /// Every strategy an engine is named after or declares it serves, sorted, each with what it
    /// resolves to on `device_type` (what `plugins list` shows).
    pub fn engine_routes(
        &self,
        device_type: &str,
    ) -> Vec<(String, Result<Component, LookupError>)> {
        let mut strategies: Vec<String> = self
            .active_engines()
            .flat_map(|(c, caps)| std::iter::once(c.name).chain(caps.strategies))
            .collect();
        strategies.sort();
        strategies.dedup();
        strategies
            .into_iter()
            .map(|s| {
                let resolved = self.resolve_engine(&s, device_type);
                (s, resolved)
            })
            .collect()
    }

    /// The engine components in use (the winner of each name), with their capabilities.
    fn active_engines(&self) -> impl Iterator<Item = (Component, EngineCapabilities)> {
        self.names(ComponentKind::ENGINE)
            .into_iter()
            .filter_map(|name| self.resolve(ComponentKind::ENGINE, &name).ok())
            .map(|c| {
                let caps = c.capabilities();
                (c, caps)
            })
    }
}

#[cfg(test)]
mod tests {
    use verl_plugin_api::{ComponentInit, Engine, EngineCapabilities, PluginBuilder, PluginError};

    use super::*;

    /// An engine type declaring `$caps` (capabilities are an associated function: one type each).
    macro_rules! engine {
        ($name:ident, $caps:expr) => {
            #[derive(Default)]
            struct $name;
            impl Engine for $name {
                fn capabilities() -> EngineCapabilities {
                    $caps
                }
                fn init(&mut self, _: &ComponentInit) -> Result<(), PluginError> {
                    Ok(())
                }
            }
        };
    }
    engine!(
        Megatron,
        EngineCapabilities::default().devices(["cpu", "cuda"])
    );
    engine!(
        MindSpeed,
        EngineCapabilities::default()
            .strategies(["megatron"])
            .devices(["npu"])
    );
    engine!(AnyDevice, EngineCapabilities::default());

    fn registry(with_mindspeed: bool) -> Registry {
        let mut registry = Registry::default();
        registry.add_builtin(
            PluginBuilder::new("megatron", "1.0.0", "t")
                .engine("megatron", 10, "d", Megatron::default)
                .engine("fsdp", 10, "d", AnyDevice::default),
        );
        if with_mindspeed {
            registry.add_builtin(PluginBuilder::new("ms", "1.0.0", "t").engine(
                "mindspeed",
                10,
                "d",
                MindSpeed::default,
            ));
        }
        registry
    }

    fn engine_of(registry: &Registry, strategy: &str, device: &str) -> Result<String, String> {
        registry
            .resolve_engine(strategy, device)
            .map(|c| c.name)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn megatron_on_npu_resolves_to_the_engine_serving_it_there() {
        let r = registry(true);
        assert_eq!(engine_of(&r, "megatron", "npu"), Ok("mindspeed".into()));
        assert_eq!(engine_of(&r, "megatron", "cpu"), Ok("megatron".into()));
        assert_eq!(engine_of(&r, "megatron", "cuda"), Ok("megatron".into()));
        // Asked for by name, it is itself; fsdp declares no devices and runs anywhere.
        assert_eq!(engine_of(&r, "mindspeed", "npu"), Ok("mindspeed".into()));
        assert_eq!(engine_of(&r, "fsdp", "npu"), Ok("fsdp".into()));
        let routes: Vec<String> = r
            .engine_routes("npu")
            .into_iter()
            .map(|(s, c)| format!("{s}->{}", c.map_or_else(|e| e.to_string(), |c| c.name)))
            .collect();
        assert_eq!(
            routes,
            ["fsdp->fsdp", "megatron->mindspeed", "mindspeed->mindspeed"]
        );
    }

    #[test]
    fn megatron_on_npu_without_mindspeed_says_what_is_missing() {
        let err = engine_of(&registry(false), "megatron", "npu").unwrap_err();
        assert_eq!(
            err,
            "strategy `megatron` has no engine for `npu` devices: engine `megatron` runs on [cpu, cuda]; \
             load a plugin whose engine declares strategies [megatron] and devices [npu] (verl runs MindSpeed there: \
             an engine named `mindspeed` that serves `megatron` on `npu`), or select another platform (VERL_PLATFORM, trainer.device)"
        );
        let unknown = engine_of(&registry(false), "deepspeed", "npu").unwrap_err();
        assert_eq!(
            unknown,
            "no engine component named `deepspeed`; available: fsdp, megatron"
        );
    }

    #[test]
    fn two_engines_serving_a_strategy_at_one_priority_are_ambiguous() {
        let mut r = registry(true);
        r.add_builtin(PluginBuilder::new("ms2", "1.0.0", "t").engine(
            "mindspeed-llm",
            10,
            "d",
            MindSpeed::default,
        ));
        let err = engine_of(&r, "megatron", "npu").unwrap_err();
        assert!(
            err.starts_with("strategy `megatron` on `npu` is served by several engines at priority 10: `mindspeed` (<built-in>), `mindspeed-llm` (<built-in>)"),
            "{err}"
        );
        // A higher priority settles it.
        r.add_builtin(PluginBuilder::new("ms3", "1.0.0", "t").engine(
            "mindspeed-best",
            20,
            "d",
            MindSpeed::default,
        ));
        assert_eq!(
            engine_of(&r, "megatron", "npu"),
            Ok("mindspeed-best".into())
        );
    }
}
