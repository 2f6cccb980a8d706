//! The `collective` weight sync on SGLang 0.5.23's distributed weight update
//! (`/init_weights_update_group`, `/update_weights_from_distributed`;
//! `sglang/srt/entrypoints/http_server.py`, `model_runner_components/weight_updater.py`): every
//! server's workers join a torch.distributed group with the trainer (rank 0; SGLang's
//! `init_custom_process_group` over `tcp://`), and each tensor is one `broadcast(src=0)` that the
//! workers receive in order while `/update_weights_from_distributed` runs.

use serde_json::{Value, json};
use verl_plugin_api::{PluginError, TensorRef};
use verl_rollout_http::{
    Collective, CollectiveGroup, GroupPlan, HttpError, Method, Pool, TensorList, excerpt,
};

use crate::SglangSettings;

/// The `collective` weight sync of one rollout.
pub(crate) struct Transfer {
    group: CollectiveGroup,
    group_name: String,
    backend: String,
}

/// `InitWeightsUpdateGroupReqInput` for server `i`.
pub fn init_body(plan: &GroupPlan, i: usize, group_name: &str, backend: &str) -> Value {
    json!({
        "master_address": plan.master_addr,
        "master_port": plan.master_port,
        "rank_offset": plan.rank_offsets[i],
        "world_size": plan.world_size,
        "group_name": group_name,
        "backend": backend,
    })
}

/// `UpdateWeightsFromDistributedReqInput` for `list`, tagged `version`.
pub fn update_body(list: &TensorList, group_name: &str, version: &str) -> Value {
    json!({
        "names": list.names,
        "dtypes": list.dtypes,
        "shapes": list.shapes,
        "group_name": group_name,
        "flush_cache": true,
        "weight_version": version,
    })
}

/// SGLang answers `{success, message}`; `success: false` comes with HTTP 400, but a 200 is read
/// too.
fn succeeded(pool: &Pool, path: &str, answers: &[Value]) -> Result<(), HttpError> {
    for (i, answer) in answers.iter().enumerate() {
        if answer["success"] != json!(true) {
            return Err(HttpError::protocol(
                format!("{}{path}", pool.servers()[i].url()),
                answer["message"]
                    .as_str()
                    .map_or_else(|| excerpt(answer), str::to_owned),
            ));
        }
    }
    Ok(())
}

impl Transfer {
    pub(crate) fn new(
        transport: Box<dyn Collective>,
        settings: &SglangSettings,
        section: String,
    ) -> Self {
        Self {
            group: CollectiveGroup::new(transport, settings.collective.clone(), section),
            group_name: settings.group_name.clone(),
            backend: settings.group_backend.clone(),
        }
    }

    /// Forms the group with every server unless it has (no weights change).
    pub(crate) fn join(&mut self, pool: &mut Pool) -> Result<(), PluginError> {
        let (name, backend) = (self.group_name.as_str(), self.backend.as_str());
        self.group
            .join(pool, "/init_weights_update_group", |plan, i| {
                init_body(plan, i, name, backend)
            })
    }

    /// Every server (in the group: [`Transfer::join`] first) takes `tensors`, tagged `version`,
    /// and flushes its cache.
    pub(crate) fn update(
        &mut self,
        pool: &Pool,
        tensors: &[TensorRef<'_>],
        version: &str,
    ) -> Result<(), PluginError> {
        let list = TensorList::of(tensors)?;
        let name = self.group_name.as_str();
        let path = "/update_weights_from_distributed";
        let bodies = vec![update_body(&list, name, version); pool.servers().len()];
        let answers = self.group.send(pool, path, &bodies, tensors)?;
        succeeded(pool, path, &answers)?;
        // No cached prefix keeps the old weights' KV (the update flushed too, unless requests
        // were running).
        pool.broadcast(Method::Post, "/flush_cache", None)?;
        Ok(())
    }
}

/// This build's transport for a group named `group_name` on `backend`: SGLang's
/// torch.distributed group through verl-distributed with the `collective` feature, else one that
/// says how to get it.
pub fn torch_group(group_name: &str, backend: &str) -> Box<dyn Collective> {
    #[cfg(feature = "collective")]
    {
        Box::new(real::TorchGroup {
            group_name: group_name.to_owned(),
            backend: backend.to_owned(),
        })
    }
    #[cfg(not(feature = "collective"))]
    {
        let _ = (group_name, backend);
        Box::new(verl_rollout_http::NoCollective {
            krate: "verl-plugin-sglang",
        })
    }
}

#[cfg(feature = "collective")]
mod real {
    use verl_distributed::weight_transfer::{GroupAddress, TorchGroupSender};
    use verl_distributed::{Backend, DistError};
    use verl_plugin_api::{ErrorKind, PluginError, TensorRef};
    use verl_rollout_http::{Collective, GroupPlan, WeightSender};

    pub(super) struct TorchGroup {
        pub(super) group_name: String,
        pub(super) backend: String,
    }

    fn plugin_error(e: DistError) -> PluginError {
        let kind = match e {
            DistError::Unavailable(_) | DistError::Backend { .. } => ErrorKind::UNSUPPORTED,
            DistError::Timeout { .. } => ErrorKind::TIMEOUT,
            _ => ErrorKind::OTHER,
        };
        PluginError::new(kind, format!("SGLang weight transfer: {e}"))
    }

    impl TorchGroup {
        fn backend(&self) -> Result<Backend, PluginError> {
            Backend::for_comm_backend(&self.backend).map_err(plugin_error)
        }
    }

    impl Collective for TorchGroup {
        fn check(&self) -> Result<(), PluginError> {
            TorchGroupSender::check(self.backend()?).map_err(plugin_error)
        }

        fn join(&mut self, plan: &GroupPlan) -> Result<Box<dyn WeightSender>, PluginError> {
            let address = GroupAddress {
                addr: plan.master_addr.clone(),
                port: plan.master_port,
                world_size: plan.world_size,
                timeout: plan.timeout,
            };
            let sender = TorchGroupSender::join(
                &address,
                &self.group_name,
                self.backend()?,
                plan.device as usize,
            )
            .map_err(plugin_error)?;
            Ok(Box::new(Sender(sender)))
        }
    }

    struct Sender(TorchGroupSender);

    impl WeightSender for Sender {
        fn send(&mut self, tensors: &[TensorRef<'_>]) -> Result<(), PluginError> {
            self.0.send(tensors).map_err(plugin_error)
        }
    }
}
