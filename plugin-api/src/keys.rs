//! Names of the tensors in a [`Batch`](crate::Batch) exchanged between the trainer and engines,
//! following verl's `DataProto` keys. Layout (verl's): a row is its prompt, left-padded to the
//! batch's prompt length `P`, followed by its response, right-padded to the response length `R`.
//!
//! | key | shape | dtype | meaning |
//! |---|---|---|---|
//! | `input_ids` | `[B, P+R]` | I64 | prompt then response tokens |
//! | `attention_mask` | `[B, P+R]` | I64 | 1 for real tokens, 0 for padding |
//! | `responses` | `[B, R]` | I64 | the response part of `input_ids` |
//! | `response_mask` | `[B, R]` | F32 | 1 for response tokens that count in losses |
//! | `old_log_probs` | `[B, R]` | F32 | log-probs under the policy that generated the batch |
//! | `ref_log_prob` | `[B, R]` | F32 | log-probs under the reference policy (KL) |
//! | `advantages` | `[B, R]` | F32 | per-token advantages |
//! | `returns` | `[B, R]` | F32 | value targets (critic) |
//! | `values` | `[B, R]` | F32 | critic values at generation time |
//! | `log_probs` | `[B, R]` | F32 | output of `compute_log_prob` |
//! | `entropys` | `[B, R]` | F32 | output of `compute_log_prob` (verl's spelling) |
//! | `sum_pi_squared` | `[B, R]` | F32 | Σ_v π(v)² per token, output of `compute_log_prob` when the meta has `"calculate_sum_pi_squared": true` (since 2.4.0) |
//! | `routed_experts` | `[B, P+R, L, k]` | I64 | each token's experts in the `L` sparse layers of a mixture-of-experts model (since 2.4.0): the rollout's (router replay R3), or `compute_log_prob`'s (R2); zeros at padding |
//!
//! `Batch::meta_json` carries per-call settings as a JSON object, e.g.
//! `{"temperature": 1.0, "global_steps": 3, "calculate_entropy": true}`.

pub const INPUT_IDS: &str = "input_ids";
pub const ATTENTION_MASK: &str = "attention_mask";
pub const RESPONSES: &str = "responses";
pub const RESPONSE_MASK: &str = "response_mask";
pub const OLD_LOG_PROBS: &str = "old_log_probs";
pub const REF_LOG_PROB: &str = "ref_log_prob";
pub const ADVANTAGES: &str = "advantages";
pub const RETURNS: &str = "returns";
pub const VALUES: &str = "values";
pub const LOG_PROBS: &str = "log_probs";
pub const ENTROPYS: &str = "entropys";
pub const SUM_PI_SQUARED: &str = "sum_pi_squared";
pub const ROUTED_EXPERTS: &str = "routed_experts";
