//! The fused distillation scores keep one `[N, V]` log-softmax alive for the backward pass; the
//! log-probs and the teacher-top-k log-probs computed separately keep two. Measured as the bytes
//! malloc holds (libtorch's CPU allocator is malloc), alone in this test binary so that no other
//! test allocates meanwhile.

use tch::{Device, Kind, Tensor};
use verl_model::{ScoreOutputs, fused_scores, log_probs_from_logits};

/// Bytes malloc holds now, over every arena plus mmapped chunks.
fn held_bytes() -> f64 {
    // SAFETY: mallinfo2 only reads the allocator's counters.
    let info = unsafe { libc::mallinfo2() };
    (info.uordblks + info.hblkhd) as f64
}

#[test]
fn fused_scores_hold_one_log_softmax_for_backward() {
    tch::set_num_threads(1);
    let (n, v, k) = (128i64, 32_768i64, 16i64);
    let one = (n * v * 4) as f64;
    let logits = Tensor::randn([n, v], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let labels = Tensor::randint(v, [n], (Kind::Int64, Device::Cpu));
    let ids = Tensor::randint(v, [n, k], (Kind::Int64, Device::Cpu));

    let before = held_bytes();
    let fused = fused_scores(&logits, &labels, &ids, ScoreOutputs::NONE);
    let fused_loss = fused.log_probs.sum(Kind::Float) + fused.topk_log_probs.sum(Kind::Float);
    drop(fused);
    let fused_held = held_bytes() - before;

    let before = held_bytes();
    let lp = log_probs_from_logits(&logits, &labels);
    let topk = logits.log_softmax(-1, Kind::Float).gather(-1, &ids, false);
    let separate_loss = lp.sum(Kind::Float) + topk.sum(Kind::Float);
    drop((lp, topk));
    let separate_held = held_bytes() - before;
    println!(
        "held for backward: fused {:.2} MiB, separate {:.2} MiB (one [N, V] fp32 = {:.2} MiB)",
        fused_held / 1048576.0,
        separate_held / 1048576.0,
        one / 1048576.0
    );
    assert!(
        fused_held > 0.9 * one && fused_held < 1.2 * one,
        "fused holds {fused_held} bytes, one log-softmax is {one}"
    );
    assert!(
        separate_held > 1.9 * one,
        "separate holds {separate_held} bytes, one log-softmax is {one}"
    );
    // Same values, same gradients.
    assert!((fused_loss.double_value(&[]) - separate_loss.double_value(&[])).abs() < 1e-2);
    let g_fused = Tensor::run_backward(&[fused_loss], &[&logits], false, false);
    let g_separate = Tensor::run_backward(&[separate_loss], &[&logits], false, false);
    let diff = (&g_fused[0] - &g_separate[0]).abs().max().double_value(&[]);
    assert!(diff < 1e-5, "{diff}");
}
