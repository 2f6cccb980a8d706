//! Parity of the top-k distillation losses, their gradients and the teacher's top-k log-probs
//! with a hand-written PyTorch reference (`scripts/reference/distill_reference.py`, which writes
//! `tests/data/distill_reference.json`): verl's `forward_kl_topk` / `forward_kl_topk_tail` and
//! the reverse counterparts, with and without the log-prob clamp.

use serde::Deserialize;
use tch::{Kind, Tensor};
use verl_actor::distill::{DistillLossMode, TopkKlConfig, topk_kl};
use verl_model::{ScoreOutputs, fused_scores, topk_log_probs};

#[derive(Deserialize)]
struct Case {
    mode: DistillLossMode,
    log_prob_min_clamp: Option<f64>,
    tail_mass_eps: f64,
    n: i64,
    v: i64,
    k: i64,
    student_logits: Vec<f32>,
    teacher_logits: Vec<f32>,
    labels: Vec<i64>,
    weight: Vec<f32>,
    teacher_ids: Vec<i64>,
    teacher_log_probs: Vec<f32>,
    label_log_probs: Vec<f32>,
    loss: Vec<f32>,
    student_mass: Vec<f32>,
    teacher_mass: Vec<f32>,
    grad: Vec<f32>,
}

#[derive(Deserialize)]
struct Reference {
    cases: Vec<Case>,
}

fn max_diff(a: &Tensor, b: &[f32]) -> f64 {
    let b = Tensor::from_slice(b).view_as(a);
    (a - b).abs().max().double_value(&[])
}

#[test]
fn losses_and_gradients_match_the_torch_reference() {
    let text = include_str!("data/distill_reference.json");
    let reference: Reference = serde_json::from_str(text).unwrap();
    assert_eq!(reference.cases.len(), 12);
    let mut clamped = 0;
    for (i, c) in reference.cases.iter().enumerate() {
        let what = format!("case {i} ({:?}, clamp {:?})", c.mode, c.log_prob_min_clamp);
        // The teacher's top-k from its logits.
        let teacher_logits = Tensor::from_slice(&c.teacher_logits).view([c.n, c.v]);
        let top = topk_log_probs(&teacher_logits, c.k).unwrap();
        assert_eq!(
            Vec::<i64>::try_from(top.ids.reshape([-1])).unwrap(),
            c.teacher_ids,
            "{what}: teacher ids"
        );
        assert!(
            max_diff(&top.log_probs, &c.teacher_log_probs) < 1e-5,
            "{what}: teacher lp"
        );

        let logits = Tensor::from_slice(&c.student_logits)
            .view([c.n, c.v])
            .set_requires_grad(true);
        let labels = Tensor::from_slice(&c.labels);
        let ids = Tensor::from_slice(&c.teacher_ids).view([c.n, c.k]);
        let teacher = Tensor::from_slice(&c.teacher_log_probs).view([c.n, c.k]);
        let fused = fused_scores(&logits, &labels, &ids, ScoreOutputs::NONE);
        assert!(
            max_diff(&fused.log_probs, &c.label_log_probs) < 1e-5,
            "{what}: label lp"
        );
        let config = TopkKlConfig {
            loss_mode: c.mode,
            log_prob_min_clamp: c.log_prob_min_clamp,
            tail_mass_eps: c.tail_mass_eps,
        };
        let kl = topk_kl(&fused.topk_log_probs, &teacher, &config);
        assert!(
            max_diff(&kl.loss, &c.loss) < 1e-5,
            "{what}: loss {:?}",
            kl.loss
        );
        assert!(
            max_diff(&kl.student_mass, &c.student_mass) < 1e-5,
            "{what}: student mass"
        );
        assert!(
            max_diff(&kl.teacher_mass, &c.teacher_mass) < 1e-5,
            "{what}: teacher mass"
        );
        let weight = Tensor::from_slice(&c.weight);
        let total = (kl.loss * weight).sum(Kind::Float);
        let grad = Tensor::run_backward(&[total], &[&logits], false, false);
        assert!(max_diff(&grad[0], &c.grad) < 1e-5, "{what}: gradient");
        // The clamp is exercised: some student or teacher log-prob lies below it.
        if let Some(min) = c.log_prob_min_clamp {
            let below = fused.topk_log_probs.lt(min).any().int64_value(&[]) == 1
                || teacher.lt(min).any().int64_value(&[]) == 1;
            clamped += i32::from(below);
        }
    }
    assert!(clamped >= 4, "only {clamped} cases reach the clamp");
}
