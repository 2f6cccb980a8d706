//! The `collective` weight sync on vLLM 0.32's weight transfer engine (`nccl` backend,
//! non-packed; `vllm/entrypoints/rl/online/api_router.py` and
//! `vllm/distributed/weight_transfer/nccl_engine.py`): the trainer is rank 0 of a
//! `StatelessProcessGroup` + NCCL group that every server's workers join, and broadcasts each
//! tensor while the servers receive it in `/update_weights`. The request sequence is vLLM's own
//! HTTP client's (`HTTPVLLMWeightSyncClient`), inside a pause so no generation runs on half the
//! weights. GPU only: on a CPU the sync stops before any server is contacted, saying so.

use serde_json::{Value, json};
use verl_plugin_api::{PluginError, TensorRef};
use verl_rollout_http::{
    Collective, CollectiveGroup, CollectiveSettings, GroupPlan, Method, Pool, TensorList,
};

/// The `collective` weight sync of one rollout.
pub(crate) struct Transfer {
    group: CollectiveGroup,
}

/// vLLM's `init_info` for server `i` (`NCCLWeightTransferInitInfo`: the TCPStore rendezvous,
/// this server's first rank, one tensor per broadcast).
pub fn init_body(plan: &GroupPlan, i: usize) -> Value {
    json!({"init_info": {
        "master_address": plan.master_addr,
        "master_port": plan.master_port,
        "rank_offset": plan.rank_offsets[i],
        "world_size": plan.world_size,
        "packed": false,
    }})
}

/// vLLM's `update_info` (`NCCLWeightTransferUpdateInfo`) for `list`.
pub fn update_body(list: &TensorList) -> Value {
    json!({"update_info": {
        "names": list.names,
        "dtype_names": list.dtypes,
        "shapes": list.shapes,
    }})
}

impl Transfer {
    pub(crate) fn new(
        transport: Box<dyn Collective>,
        settings: CollectiveSettings,
        section: String,
    ) -> Self {
        Self {
            group: CollectiveGroup::new(transport, settings, section),
        }
    }

    /// Forms the group with every server unless it has (no weights change).
    pub(crate) fn join(&mut self, pool: &mut Pool) -> Result<(), PluginError> {
        self.group
            .join(pool, "/init_weight_transfer_engine", init_body)
    }

    /// Every server (in the group: [`Transfer::join`] first) takes `tensors` and is tagged
    /// `version`; the servers are resumed whatever happens once they are paused.
    pub(crate) fn update(
        &mut self,
        pool: &Pool,
        tensors: &[TensorRef<'_>],
        version: &str,
    ) -> Result<(), PluginError> {
        let list = TensorList::of(tensors)?;
        pool.broadcast(Method::Post, "/pause?mode=wait", None)?;
        let steps = (|| {
            pool.broadcast(Method::Post, "/start_weight_update", None)?;
            let bodies = vec![update_body(&list); pool.servers().len()];
            self.group.send(pool, "/update_weights", &bodies, tensors)?;
            let tag = json!({"weight_version": version});
            pool.broadcast(Method::Post, "/finish_weight_update", Some(&tag))?;
            // A cached prefix would keep the old weights' KV.
            pool.broadcast(Method::Post, "/reset_prefix_cache", None)?;
            Ok::<_, PluginError>(())
        })();
        let resumed = pool.broadcast(Method::Post, "/resume", None);
        steps?;
        resumed?;
        Ok(())
    }
}

/// This build's transport: vLLM's group through verl-distributed with the `collective` feature,
/// else one that says how to get it.
pub fn nccl() -> Box<dyn Collective> {
    #[cfg(feature = "collective")]
    {
        Box::new(real::VllmNccl)
    }
    #[cfg(not(feature = "collective"))]
    {
        Box::new(verl_rollout_http::NoCollective {
            krate: "verl-plugin-vllm",
        })
    }
}

#[cfg(feature = "collective")]
mod real {
    use verl_distributed::DistError;
    use verl_distributed::weight_transfer::{GroupAddress, VllmSender};
    use verl_plugin_api::{ErrorKind, PluginError, TensorRef};
    use verl_rollout_http::{Collective, GroupPlan, WeightSender};

    pub(super) struct VllmNccl;

    fn plugin_error(e: DistError) -> PluginError {
        let kind = match e {
            DistError::Unavailable(_) => ErrorKind::UNSUPPORTED,
            DistError::Timeout { .. } => ErrorKind::TIMEOUT,
            _ => ErrorKind::OTHER,
        };
        PluginError::new(kind, format!("vLLM weight transfer: {e}"))
    }

    impl Collective for VllmNccl {
        fn check(&self) -> Result<(), PluginError> {
            VllmSender::check().map_err(plugin_error)
        }

        fn join(&mut self, plan: &GroupPlan) -> Result<Box<dyn WeightSender>, PluginError> {
            let address = GroupAddress {
                addr: plan.master_addr.clone(),
                port: plan.master_port,
                world_size: plan.world_size,
                timeout: plan.timeout,
            };
            let sender = VllmSender::join(&address, plan.device as usize).map_err(plugin_error)?;
            Ok(Box::new(Sender(sender)))
        }
    }

    struct Sender(VllmSender);

    impl WeightSender for Sender {
        fn send(&mut self, tensors: &[TensorRef<'_>]) -> Result<(), PluginError> {
            self.0.send(tensors).map_err(plugin_error)
        }
    }
}
