//! On-policy distillation in the training step: the teacher engine scores this rank's rows of
//! the student's samples (its top-k tokens and log-probs, or the sampled tokens' log-probs for
//! an estimator loss), and the actor's update batch carries them (verl's `teacher_ids` /
//! `teacher_logprobs`). Kept per rank: only the actor's update reads them.

use serde_json::Value;
use verl_plugin_api::{Batch, Tensor, keys};

use super::{Context, TrainError};
use crate::workers::EngineWorker;
use verl_config::Config;

/// verl's batch keys of the teacher's output (the fsdp engine reads the same names).
const TEACHER_IDS: &str = "teacher_ids";
const TEACHER_LOGPROBS: &str = "teacher_logprobs";

/// Checks what the trainer needs before any engine is built.
pub(super) fn check(config: &Config) -> Result<(), TrainError> {
    let d = &config.distillation;
    if d.enabled
        && d.teacher_model
            .model_path
            .as_deref()
            .is_none_or(str::is_empty)
    {
        return Err(TrainError::Invalid(
            "distillation.enabled=true needs distillation.teacher_model.model_path (a Hugging Face model directory)"
                .into(),
        ));
    }
    Ok(())
}

/// The teacher's tensors for `local` (this rank's rows), to insert into its update batch.
pub(super) fn teacher_outputs(
    teacher: &mut dyn EngineWorker,
    local: &Batch,
    config: &Config,
) -> Result<Vec<(&'static str, Tensor)>, TrainError> {
    let topk = config.distillation.topk();
    let mut request = local.clone();
    let mut meta: Value = serde_json::from_str(&local.meta_json).unwrap_or_default();
    meta["calculate_entropy"] = false.into();
    meta["calculate_sum_pi_squared"] = false.into();
    meta["distill_topk"] = topk.into();
    request.meta_json = meta.to_string().into();
    let out = teacher
        .compute_log_prob(&request)
        .context(|| "scoring the samples with the distillation teacher".to_owned())?;
    let take = |name: &str| {
        out.get(name).cloned().ok_or_else(|| {
            TrainError::Invalid(format!("the distillation teacher returned no `{name}`"))
        })
    };
    Ok(match topk {
        Some(_) => vec![
            (TEACHER_IDS, take(TEACHER_IDS)?),
            (TEACHER_LOGPROBS, take(TEACHER_LOGPROBS)?),
        ],
        None => vec![(TEACHER_LOGPROBS, take(keys::LOG_PROBS)?)],
    })
}
