//! AdamW with its moments as tensors (so they save and restore bit-exactly), gradient-norm
//! clipping, verl's learning-rate schedules, and save/load of the full training state.

use std::collections::HashMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use verl_model::interop::{floats, floats_mut, is_host_f32};
use verl_model::{
    CausalLM, ModelError, Result, Rng, assign, read_json, read_safetensors, write_json,
    write_safetensors,
};

/// AdamW hyper-parameters: torch's betas/eps and verl's `optim.weight_decay = 0.01` by default.
/// The learning rate comes from an [`LrSchedule`] at each step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// `torch.optim.AdamW` (single-tensor path) over named parameters.
#[derive(Debug)]
pub struct AdamW {
    config: AdamWConfig,
    params: Vec<(String, Tensor)>,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
    steps: u64,
}

const EXP_AVG: &str = "exp_avg.";
const EXP_AVG_SQ: &str = "exp_avg_sq.";

impl AdamW {
    /// Optimises the given tensors (which must require grad).
    pub fn new(params: Vec<(String, Tensor)>, config: AdamWConfig) -> Self {
        let zeros =
            |params: &[(String, Tensor)]| params.iter().map(|(_, p)| p.zeros_like()).collect();
        Self {
            config,
            exp_avg: zeros(&params),
            exp_avg_sq: zeros(&params),
            params,
            steps: 0,
        }
    }

    /// Optimises every trainable parameter of a model.
    pub fn for_model(model: &CausalLM, config: AdamWConfig) -> Self {
        let params = model
            .named_tensors()
            .into_iter()
            .filter(|(_, p)| p.requires_grad())
            .collect();
        Self::new(params, config)
    }

    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// Updates applied so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    pub fn zero_grad(&self) {
        for (_, p) in &self.params {
            let mut grad = p.grad();
            if grad.defined() {
                let _ = grad.zero_();
            }
        }
    }

    /// Scales gradients so that their global L2 norm is at most `max_norm` (torch's
    /// `clip_grad_norm_`) and returns the norm before clipping (`actor/grad_norm`). A non-finite
    /// norm is returned as is; verl then skips the update.
    pub fn clip_grad_norm(&self, max_norm: f64) -> f64 {
        let grads: Vec<Tensor> = self
            .params
            .iter()
            .map(|(_, p)| p.grad())
            .filter(Tensor::defined)
            .collect();
        if grads.is_empty() {
            return 0.0;
        }
        let norms: Vec<Tensor> = grads
            .iter()
            .map(|g| g.to_kind(Kind::Float).norm())
            .collect();
        let total = Tensor::stack(&norms, 0).norm().double_value(&[]);
        let coef = (max_norm / (total + 1e-6)).min(1.0);
        if total.is_finite() {
            tch::no_grad(|| {
                for mut g in grads {
                    let _ = g.g_mul_scalar_(coef);
                }
            });
        }
        total
    }

    /// One AdamW update with learning rate `lr`, from the gradients now in the parameters, unless
    /// it would leave a parameter or a moment non-finite: then nothing changes and `false` is
    /// returned. Parameters without a gradient are left alone.
    ///
    /// The update is computed twice: once to check it, then in place. Both passes run the same
    /// arithmetic on the same values, so what is applied is exactly what was checked. Host fp32
    /// parameters (with their gradients and moments) go through one fused pass over
    /// their elements; the others (a GPU, other dtypes) through the tensor rule, whose check
    /// works aside in six buffers as long as the largest parameter, the update's temporaries in
    /// three of them, all made once per step (on CPU every fresh tensor is a fresh mapping whose
    /// pages are faulted in, which cost more than the arithmetic).
    #[must_use = "a refused update must be reported"]
    pub fn step(&mut self, lr: f64) -> bool {
        let grads: Vec<Tensor> = self.params.iter().map(|(_, p)| p.grad()).collect();
        let Ok(applied) = self.step_with_grads(lr, &grads, Ok::<bool, std::convert::Infallible>);
        applied
    }

    /// [`Self::step`] with the gradients given (one per parameter, in order; an undefined tensor
    /// for none) instead of read from the parameters, and a say for the caller between the check
    /// and the update: `agree` receives whether this optimizer's update is finite and returns
    /// whether to apply it. A sharded optimizer all-reduces the verdict there, so that every rank
    /// applies its shard's update or every rank skips.
    pub fn step_with_grads<E>(
        &mut self,
        lr: f64,
        grads: &[Tensor],
        agree: impl FnOnce(bool) -> std::result::Result<bool, E>,
    ) -> std::result::Result<bool, E> {
        assert_eq!(grads.len(), self.params.len(), "one gradient per parameter");
        let rule = self.rule(lr);
        let updated: Vec<usize> = (0..grads.len()).filter(|&i| grads[i].defined()).collect();
        let host = |i: usize| {
            [
                &self.params[i].1,
                &grads[i],
                &self.exp_avg[i],
                &self.exp_avg_sq[i],
            ]
            .into_iter()
            .all(is_host_f32)
        };
        let (on_host, on_device): (Vec<usize>, Vec<usize>) =
            updated.iter().partition(|&&i| host(i));
        let host_rule = HostRule::from(&rule);
        let scratch = Scratch::for_params(on_device.iter().map(|&i| &self.params[i].1));
        let finite = tch::no_grad(|| {
            // SAFETY (both host passes): host fp32 tensors (checked above), distinct (a parameter,
            // its gradient and its moments), and nothing else touches them during the step.
            let host_finite = on_host.iter().all(|&i| unsafe {
                host_rule.check(
                    floats(&self.params[i].1),
                    floats(&grads[i]),
                    floats(&self.exp_avg[i]),
                    floats(&self.exp_avg_sq[i]),
                )
            });
            // 0 × x is NaN exactly when x is not finite: one sum per tensor, one read per step.
            let mut sums = Vec::with_capacity(3 * on_device.len());
            for &i in &on_device {
                let param = &self.params[i].1;
                let [mut p, mut m, mut v, sq, denom, scaled] = scratch.views(param);
                p.copy_(param);
                m.copy_(&self.exp_avg[i]);
                v.copy_(&self.exp_avg_sq[i]);
                rule.apply([&mut p, &mut m, &mut v], &grads[i], [sq, denom, scaled]);
                for mut t in [p, m, v] {
                    sums.push(t.g_mul_scalar_(0.0).sum(Kind::Float));
                }
            }
            host_finite
                && (sums.is_empty() || Tensor::stack(&sums, 0).isnan().any().int64_value(&[]) == 0)
        });
        if !agree(finite)? {
            return Ok(false);
        }
        tch::no_grad(|| {
            for &i in &on_host {
                let [mut p, mut m, mut v] = [
                    self.params[i].1.shallow_clone(),
                    self.exp_avg[i].shallow_clone(),
                    self.exp_avg_sq[i].shallow_clone(),
                ];
                // SAFETY: as for the check.
                unsafe {
                    host_rule.apply(
                        floats_mut(&mut p),
                        floats(&grads[i]),
                        floats_mut(&mut m),
                        floats_mut(&mut v),
                    );
                }
            }
            for &i in &on_device {
                let [sq, denom, scaled] = scratch.views(&self.params[i].1);
                let mut state = [
                    self.params[i].1.shallow_clone(),
                    self.exp_avg[i].shallow_clone(),
                    self.exp_avg_sq[i].shallow_clone(),
                ];
                let [p, m, v] = &mut state;
                rule.apply([p, m, v], &grads[i], [sq, denom, scaled]);
            }
        });
        self.steps += 1;
        Ok(true)
    }

    /// The next update's constants (torch's rule: decoupled decay, moment updates,
    /// bias-corrected step).
    fn rule(&self, lr: f64) -> AdamWRule {
        let steps = self.steps as i32 + 1;
        let (beta1, beta2) = self.config.betas;
        AdamWRule {
            decay: 1.0 - lr * self.config.weight_decay,
            beta1,
            beta2,
            bias_correction2_sqrt: (1.0 - beta2.powi(steps)).sqrt(),
            step_size: lr / (1.0 - beta1.powi(steps)),
            eps: self.config.eps,
        }
    }

    /// Moves the moments to `device` (a no-op where they are): optimizer offloading keeps them
    /// on the host between updates.
    pub fn moments_to(&mut self, device: tch::Device) {
        for moment in self.exp_avg.iter_mut().chain(self.exp_avg_sq.iter_mut()) {
            *moment = moment.to_device(device);
        }
    }

    /// Sets the count of updates applied (the bias corrections' position) when moments are
    /// restored through [`Self::state_tensors`].
    pub fn restore_steps(&mut self, steps: u64) {
        self.steps = steps;
    }

    /// The moments as named tensors (`exp_avg.<param>`, `exp_avg_sq.<param>`).
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let moments = |prefix: &str, tensors: &[Tensor]| {
            self.params
                .iter()
                .zip(tensors)
                .map(|((name, _), t)| (format!("{prefix}{name}"), t.shallow_clone()))
                .collect::<Vec<_>>()
        };
        let mut out = moments(EXP_AVG, &self.exp_avg);
        out.extend(moments(EXP_AVG_SQ, &self.exp_avg_sq));
        out
    }
}

/// One AdamW update's constants, applied in place to (parameter, first moment, second moment).
struct AdamWRule {
    decay: f64,
    beta1: f64,
    beta2: f64,
    bias_correction2_sqrt: f64,
    step_size: f64,
    eps: f64,
}

impl AdamWRule {
    /// The update in place, with the arithmetic (and so the rounding) of torch's single-tensor
    /// AdamW as this optimizer has always computed it; `temps` receive g², the denominator and
    /// the scaled first moment.
    fn apply(
        &self,
        [param, exp_avg, exp_avg_sq]: [&mut Tensor; 3],
        grad: &Tensor,
        temps: [Tensor; 3],
    ) {
        let [mut sq, mut denom, scaled] = temps;
        let _ = param.g_mul_scalar_(self.decay);
        let _ = exp_avg.lerp_(grad, 1.0 - self.beta1);
        let _ = grad.mul_out(&sq, grad);
        let _ = exp_avg_sq
            .g_mul_scalar_(self.beta2)
            .g_add_(&sq.g_mul_scalar_(1.0 - self.beta2));
        let _ = exp_avg_sq.sqrt_out(&denom);
        let _ = denom
            .g_div_scalar_(self.bias_correction2_sqrt)
            .g_add_scalar_(self.eps);
        let _ = exp_avg.mul_scalar_out(&scaled, -self.step_size);
        let _ = param.addcdiv_(&scaled, &denom);
    }
}

/// [`AdamWRule`] for host fp32 tensors, as slices: each element's update computed in registers
/// with the same fp32 operations in the same order (torch's `lerp_` is a fused multiply-add
/// there too), one pass instead of the tensor rule's nine. The check and the update run the same
/// arithmetic, so what is applied is what was checked. On issue 14's bench model (3.4 M
/// parameters, 2 threads) a step takes 3.5 ms this way and took 15 ms through the tensor rule.
struct HostRule {
    decay: f32,
    /// `lerp`'s weight `1 − β1`.
    weight: f32,
    beta2: f32,
    one_minus_beta2: f32,
    bias_correction2_sqrt: f32,
    eps: f32,
    neg_step_size: f32,
}

impl From<&AdamWRule> for HostRule {
    /// The constants as libtorch passes a double scalar to an fp32 kernel: rounded to fp32.
    fn from(r: &AdamWRule) -> Self {
        Self {
            decay: r.decay as f32,
            weight: (1.0 - r.beta1) as f32,
            beta2: r.beta2 as f32,
            one_minus_beta2: (1.0 - r.beta2) as f32,
            bias_correction2_sqrt: r.bias_correction2_sqrt as f32,
            eps: r.eps as f32,
            neg_step_size: -r.step_size as f32,
        }
    }
}

impl HostRule {
    /// One element's (parameter, first moment, second moment) after the update.
    #[inline(always)]
    fn element(&self, p: f32, g: f32, m: f32, v: f32) -> (f32, f32, f32) {
        let p = p * self.decay;
        // torch's lerp: `start + w·(end − start)` for w < 0.5, else `end − (1 − w)·(end − start)`,
        // each one fused multiply-add in its vectorised kernel.
        let m = if self.weight < 0.5 {
            self.weight.mul_add(g - m, m)
        } else {
            (self.weight - 1.0).mul_add(g - m, g)
        };
        let v = v * self.beta2 + (g * g) * self.one_minus_beta2;
        let denom = v.sqrt() / self.bias_correction2_sqrt + self.eps;
        (p + (m * self.neg_step_size) / denom, m, v)
    }

    /// Whether the update of every element is finite.
    fn check(&self, p: &[f32], g: &[f32], m: &[f32], v: &[f32]) -> bool {
        host_check(self, p, g, m, v)
    }

    /// The update, in place.
    fn apply(&self, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        host_apply(self, p, g, m, v);
    }
}

#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl+fma", "x86_64+avx2+fma"))]
fn host_check(rule: &HostRule, p: &[f32], g: &[f32], m: &[f32], v: &[f32]) -> bool {
    // An OR of "not finite" flags vectorises; a float sum (fixed order) would not.
    let mut bad = 0u32;
    for (((&p, &g), &m), &v) in p.iter().zip(g).zip(m).zip(v) {
        let (p, m, v) = rule.element(p, g, m, v);
        bad |= u32::from(!(p.is_finite() && m.is_finite() && v.is_finite()));
    }
    bad == 0
}

#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl+fma", "x86_64+avx2+fma"))]
fn host_apply(rule: &HostRule, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        (*p, *m, *v) = rule.element(*p, g, *m, *v);
    }
}

/// Buffers for one step: six per parameter dtype and device, each as long as the largest
/// parameter of its kind; views of them stand in for fresh tensors.
struct Scratch {
    sets: Vec<(Kind, tch::Device, Vec<Tensor>)>,
}

impl Scratch {
    fn for_params<'a>(params: impl Iterator<Item = &'a Tensor>) -> Self {
        let mut longest: Vec<(Kind, tch::Device, i64)> = Vec::new();
        for p in params {
            let (kind, device, numel) = (p.kind(), p.device(), p.numel() as i64);
            match longest
                .iter_mut()
                .find(|(k, d, _)| *k == kind && *d == device)
            {
                Some((_, _, n)) => *n = (*n).max(numel),
                None => longest.push((kind, device, numel)),
            }
        }
        let sets = longest
            .into_iter()
            .map(|(kind, device, numel)| {
                let buffers = (0..6)
                    .map(|_| Tensor::empty([numel], (kind, device)))
                    .collect();
                (kind, device, buffers)
            })
            .collect();
        Self { sets }
    }

    /// `N` (at most six) views shaped like `like`, on distinct buffers.
    fn views<const N: usize>(&self, like: &Tensor) -> [Tensor; N] {
        let (kind, device) = (like.kind(), like.device());
        let (_, _, buffers) = self
            .sets
            .iter()
            .find(|(k, d, _)| *k == kind && *d == device)
            .expect("a buffer set for every parameter's dtype and device");
        let (numel, shape) = (like.numel() as i64, like.size());
        std::array::from_fn(|j| buffers[j].narrow(0, 0, numel).view(shape.as_slice()))
    }
}

/// How the learning rate decays after warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum LrDecay {
    Constant,
    /// Half a cosine (for `num_cycles = 0.5`) from the base rate down to `min_lr_ratio` × it at
    /// `total_steps`. As in verl, steps past `total_steps` continue along the cosine.
    Cosine {
        min_lr_ratio: f64,
        num_cycles: f64,
    },
}

/// verl's `get_constant_schedule_with_warmup` / `get_cosine_schedule_with_warmup`: the rate rises
/// linearly from 0 over `warmup_steps`, then decays.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    pub base_lr: f64,
    pub warmup_steps: u64,
    pub total_steps: u64,
    pub decay: LrDecay,
}

impl LrSchedule {
    pub fn constant(base_lr: f64, warmup_steps: u64) -> Self {
        Self {
            base_lr,
            warmup_steps,
            total_steps: 0,
            decay: LrDecay::Constant,
        }
    }

    /// The rate of update number `step` (0-based, as torch's `LambdaLR`).
    pub fn lr_at(&self, step: u64) -> f64 {
        let step = step as f64;
        let warmup = self.warmup_steps as f64;
        let factor = match self.decay {
            _ if step < warmup => step / warmup.max(1.0),
            LrDecay::Constant => 1.0,
            LrDecay::Cosine {
                min_lr_ratio,
                num_cycles,
            } => {
                let progress = (step - warmup) / (self.total_steps as f64 - warmup).max(1.0);
                let x = (std::f64::consts::PI * num_cycles * 2.0 * progress).cos();
                (x * (1.0 - min_lr_ratio) * 0.5 + (1.0 + min_lr_ratio) * 0.5).max(min_lr_ratio)
            }
        };
        self.base_lr * factor
    }
}

/// The [`TrainState`] of a checkpoint, next to the weights and moments.
pub const TRAIN_STATE_FILE: &str = "train_state.json";
/// AdamW's moments in a training checkpoint, named as [`AdamW::state_tensors`] names them.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";

/// The non-tensor part of a training checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// Optimizer updates done (the schedule's position).
    pub step: u64,
    pub optimizer: AdamWConfig,
    pub schedule: LrSchedule,
    /// The caller's generator (sampling, shuffling), to continue the same random sequence.
    pub rng: Rng,
}

/// Saves weights (`model.safetensors` + `config.json`, a loadable HF directory), optimizer moments
/// (`optimizer.safetensors`) and [`TrainState`] (`train_state.json`) into `dir`.
pub fn save_training_state(
    dir: &Path,
    model: &CausalLM,
    optimizer: &AdamW,
    schedule: &LrSchedule,
    rng: &Rng,
) -> Result<()> {
    model.save_pretrained(dir, None)?;
    write_safetensors(&dir.join(OPTIMIZER_FILE), &optimizer.state_tensors())?;
    let state = TrainState {
        step: optimizer.steps,
        optimizer: optimizer.config,
        schedule: *schedule,
        rng: rng.clone(),
    };
    write_json(&dir.join(TRAIN_STATE_FILE), &state)
}

/// Restores what [`save_training_state`] saved into an existing model and optimizer built for the
/// same parameters; the next update is then bit-identical to an uninterrupted run.
pub fn load_training_state(
    dir: &Path,
    model: &CausalLM,
    optimizer: &mut AdamW,
) -> Result<TrainState> {
    let state: TrainState = read_json(&dir.join(TRAIN_STATE_FILE))?;
    model.load_weights_dir(dir)?;
    let path = dir.join(OPTIMIZER_FILE);
    let saved: HashMap<String, Tensor> = read_safetensors(&path)?.into_iter().collect();
    restore_optimizer(&path, &saved, optimizer, &state)?;
    Ok(state)
}

/// As [`load_training_state`] for a checkpoint saved in another layout (the fsdp engine's
/// shards): the [`TrainState`] from `dir`, the parameters by name and AdamW's moments as
/// [`AdamW::state_tensors`] names them from `tensors`, which were read from `source`.
pub fn load_training_state_from(
    dir: &Path,
    source: &Path,
    tensors: &HashMap<String, Tensor>,
    model: &CausalLM,
    optimizer: &mut AdamW,
) -> Result<TrainState> {
    let state: TrainState = read_json(&dir.join(TRAIN_STATE_FILE))?;
    for (name, param) in model.named_tensors() {
        assign(&param, checked(source, tensors, &name, &param)?)?;
    }
    restore_optimizer(source, tensors, optimizer, &state)?;
    Ok(state)
}

/// `tensors[name]`, shaped as `like`.
fn checked<'a>(
    path: &Path,
    tensors: &'a HashMap<String, Tensor>,
    name: &str,
    like: &Tensor,
) -> Result<&'a Tensor> {
    let source = tensors.get(name).ok_or_else(|| ModelError::MissingTensor {
        path: path.to_owned(),
        tensor: name.to_owned(),
    })?;
    if source.size() != like.size() {
        return Err(ModelError::ShapeMismatch {
            path: path.to_owned(),
            tensor: name.to_owned(),
            found: source.size(),
            expected: like.size(),
        });
    }
    Ok(source)
}

/// The moments, update count and settings of `state` into `optimizer`.
fn restore_optimizer(
    path: &Path,
    saved: &HashMap<String, Tensor>,
    optimizer: &mut AdamW,
    state: &TrainState,
) -> Result<()> {
    for (prefix, moments) in [
        (EXP_AVG, &optimizer.exp_avg),
        (EXP_AVG_SQ, &optimizer.exp_avg_sq),
    ] {
        for ((name, _), moment) in optimizer.params.iter().zip(moments) {
            let key = format!("{prefix}{name}");
            assign(moment, checked(path, saved, &key, moment)?)?;
        }
    }
    optimizer.steps = state.step;
    optimizer.config = state.optimizer;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adamw_matches_hand_computed_first_steps() {
        // One parameter p = 1, gradient 0.5, lr 0.1, wd 0.01, betas (0.9, 0.999), eps 1e-8.
        // Step 1: p ← 1·(1 − 0.001) = 0.999; m = 0.05, v = 0.00025; m̂ = 0.5, v̂ = 0.25
        //         p ← 0.999 − 0.1·0.5/(0.5 + 1e-8) = 0.899 (+2e-9).
        let p = Tensor::from_slice(&[1.0f64]).set_requires_grad(true);
        let mut opt = AdamW::new(
            vec![("p".into(), p.shallow_clone())],
            AdamWConfig::default(),
        );
        (&p * 0.5).sum(Kind::Double).backward();
        assert!(opt.step(0.1));
        assert!(
            (p.double_value(&[0]) - 0.899).abs() < 1e-8,
            "{}",
            p.double_value(&[0])
        );
        // Clipping: a gradient of norm 0.5 clipped to 0.25 halves; the pre-clip norm is returned.
        assert!((opt.clip_grad_norm(0.25) - 0.5).abs() < 1e-9);
        assert!((p.grad().double_value(&[0]) - 0.25).abs() < 1e-6);
        opt.zero_grad();
        assert_eq!(p.grad().double_value(&[0]), 0.0);
    }

    #[test]
    fn an_update_that_would_be_non_finite_changes_nothing() {
        // f32 parameters: lr 1e39 is a finite f64 whose update overflows f32.
        let p = Tensor::from_slice(&[1.0f32, -2.0]).set_requires_grad(true);
        let mut opt = AdamW::new(
            vec![("p".into(), p.shallow_clone())],
            AdamWConfig::default(),
        );
        (&p * 0.5).sum(Kind::Float).backward();
        assert!(opt.step(0.1));
        let before: Vec<Tensor> = [&p, &opt.exp_avg[0], &opt.exp_avg_sq[0]]
            .iter()
            .map(|t| t.copy())
            .collect();
        assert!(!opt.step(1e39), "the update overflows, so it is refused");
        let after = [&p, &opt.exp_avg[0], &opt.exp_avg_sq[0]];
        for (b, a) in before.iter().zip(after) {
            assert!(b.equal(a), "refused updates change nothing");
        }
        assert_eq!(opt.steps(), 1);
        // A NaN gradient would make the moments NaN: refused too.
        let mut grad = p.grad();
        let _ = grad.fill_(f64::NAN);
        assert!(!opt.step(0.1));
        assert!(before[0].equal(&p) && opt.steps() == 1);
        // And a finite one is applied as before.
        let _ = grad.fill_(0.5);
        assert!(opt.step(0.1));
        assert!(!before[0].equal(&p) && opt.steps() == 2);
    }

    #[test]
    fn given_gradients_step_as_stored_ones_and_the_verdict_is_the_callers() {
        let stored = Tensor::from_slice(&[1.0f64, -2.0]).set_requires_grad(true);
        let given = stored.detach().copy();
        let mut by_grad = AdamW::new(
            vec![("p".into(), stored.shallow_clone())],
            AdamWConfig::default(),
        );
        let mut by_arg = AdamW::new(
            vec![("p".into(), given.shallow_clone())],
            AdamWConfig::default(),
        );
        (&stored * 0.5).sum(Kind::Double).backward();
        let grad = [stored.grad().copy()];
        // The caller refuses a finite update: nothing changes.
        let verdicts = std::cell::Cell::new(Vec::new());
        let refused = by_arg.step_with_grads(0.1, &grad, |finite| {
            verdicts.set(vec![finite]);
            Ok::<_, ()>(false)
        });
        assert_eq!((refused, verdicts.take()), (Ok(false), vec![true]));
        assert!(given.equal(&stored) && by_arg.steps() == 0);
        assert!(by_grad.step(0.1));
        assert_eq!(by_arg.step_with_grads(0.1, &grad, Ok::<_, ()>), Ok(true));
        assert!(given.equal(&stored) && by_arg.steps() == 1);
        // Moments move and come back unchanged.
        by_arg.moments_to(tch::Device::Cpu);
        assert!(
            by_arg.state_tensors()[0]
                .1
                .equal(&by_grad.state_tensors()[0].1)
        );
    }

    #[test]
    fn the_host_rule_computes_the_tensor_rule() {
        // Lengths with vector tails; β1 below and above ½ (lerp's two forms); first and tenth
        // steps (bias corrections); moments of every scale.
        tch::manual_seed(3);
        let config = |beta1| AdamWConfig {
            betas: (beta1, 0.999),
            ..AdamWConfig::default()
        };
        for (len, beta1, steps) in [(1, 0.9, 0), (17, 0.9, 9), (4099, 0.9, 0), (1000, 0.3, 9)] {
            let mut opt = AdamW::new(Vec::new(), config(beta1));
            opt.restore_steps(steps);
            let rule = opt.rule(1e-3);
            let random = |scale: f64| Tensor::randn([len], (Kind::Float, tch::Device::Cpu)) * scale;
            let grad = random(1e-3);
            let start = [random(1.0), random(1e-4), random(1e-5).square()];
            let [mut p, mut m, mut v] = start.each_ref().map(Tensor::copy);
            let temps = std::array::from_fn(|_| p.empty_like());
            rule.apply([&mut p, &mut m, &mut v], &grad, temps);
            let [mut hp, mut hm, mut hv] = start.each_ref().map(Tensor::copy);
            let host = HostRule::from(&rule);
            // SAFETY: distinct contiguous fp32 tensors made here.
            unsafe {
                assert!(host.check(floats(&hp), floats(&grad), floats(&hm), floats(&hv)));
                host.apply(
                    floats_mut(&mut hp),
                    floats(&grad),
                    floats_mut(&mut hm),
                    floats_mut(&mut hv),
                );
            }
            for (name, tensor, host) in [("p", &p, &hp), ("m", &m, &hm), ("v", &v, &hv)] {
                // Relative to each element: fp32 rounding of the same operations.
                let gap = ((tensor - host).abs() / tensor.abs().clamp_min(1e-30))
                    .max()
                    .double_value(&[]);
                assert!(gap <= 1e-6, "len {len} beta1 {beta1} {name}: {gap}");
            }
        }
    }

    #[test]
    fn schedules_follow_verl() {
        let constant = LrSchedule::constant(1.0, 4);
        assert_eq!(
            [0, 1, 4, 100].map(|s| constant.lr_at(s)),
            [0.0, 0.25, 1.0, 1.0]
        );
        let cosine = LrSchedule {
            base_lr: 2.0,
            warmup_steps: 2,
            total_steps: 12,
            decay: LrDecay::Cosine {
                min_lr_ratio: 0.1,
                num_cycles: 0.5,
            },
        };
        // Warm-up 0, 1; then cos(π·progress) from 1 to min 0.1: at step 7 progress ½ → (1 + 0.1)/2.
        assert_eq!(cosine.lr_at(1), 1.0);
        assert!((cosine.lr_at(2) - 2.0).abs() < 1e-12);
        assert!((cosine.lr_at(7) - 2.0 * 0.55).abs() < 1e-12);
        assert!((cosine.lr_at(12) - 0.2).abs() < 1e-12);
    }
}
