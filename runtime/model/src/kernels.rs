//! fp32 kernels on plain slices for the CPU decode step and greedy picking: RMSNorm, residual
//! adds, SwiGLU's `silu(gate)·up`, attention of one query over a cached head, and the greedy
//! token with its log-probability. The hot ones have a portable version and an AVX-512 version
//! chosen at run time: left to the auto-vectoriser, the portable loops ran several times slower
//! (`expf` is a call per element, and horizontal sums went through memory). Both versions compute
//! the same formulas; the tests check them against each other and against libtorch. The portable
//! versions are branch-free and libm-free in their inner loops and are also compiled for AVX2 (the
//! `multiversion` crate picks at run time), for CPUs without AVX-512.

/// `x += y`.
pub(crate) fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Vector width of the portable loops: sixteen independent lanes, one AVX-512 register.
const LANES: usize = 16;

/// `Σ a·b` over sixteen independent lanes, so that the loop vectorises without reassociating.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; LANES];
    let (a_chunks, a_rest) = a.as_chunks::<LANES>();
    let (b_chunks, b_rest) = b.as_chunks::<LANES>();
    for (x, y) in a_chunks.iter().zip(b_chunks) {
        for i in 0..LANES {
            lanes[i] += x[i] * y[i];
        }
    }
    let tail: f32 = a_rest.iter().zip(b_rest).map(|(x, y)| x * y).sum();
    // A tree over the lanes: four dependent steps, in registers.
    let half: [f32; 8] = std::array::from_fn(|i| lanes[i] + lanes[i + 8]);
    let quarter: [f32; 4] = std::array::from_fn(|i| half[i] + half[i + 4]);
    let eighth: [f32; 2] = std::array::from_fn(|i| quarter[i] + quarter[i + 2]);
    eighth[0] + eighth[1] + tail
}

/// transformers' RMSNorm in fp32, row by row: `w · (x / sqrt(mean(x²) + eps))`.
pub(crate) fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let width = weight.len();
    for (row, out) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        let inverse = 1.0 / (dot(row, row) / width as f32 + eps).sqrt();
        for ((o, v), w) in out.iter_mut().zip(row).zip(weight) {
            *o = w * (v * inverse);
        }
    }
}

/// SwiGLU's product for rows laid out `[gate | up]`, `width` each: `out = silu(gate)·up` with
/// `silu(g) = g / (1 + e^-g)`; `out` is `[rows, width]`.
pub(crate) fn silu_mul(gate_up: &[f32], width: usize, out: &mut [f32]) {
    for (pair, out) in gate_up
        .chunks_exact(2 * width)
        .zip(out.chunks_exact_mut(width))
    {
        let (gate, up) = pair.split_at(width);
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F; the three slices have the same length.
            unsafe { avx512::silu_mul(gate, up, out) };
            continue;
        }
        portable_silu_mul(gate, up, out);
    }
}

#[multiversion::multiversion(targets("x86_64+avx2+fma"))]
fn portable_silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + exp(-g)) * u;
    }
}

/// The first index of the row's maximum, as `argmax` (NaN counts as the maximum).
fn argmax(row: &[f32]) -> usize {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F.
        if let Some(index) = unsafe { avx512::argmax(row) } {
            return index;
        }
    }
    portable_argmax(row)
}

fn portable_argmax(row: &[f32]) -> usize {
    let (index, _) = row
        .iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(i, m), (j, &x)| {
            if x > m || (x.is_nan() && !m.is_nan()) {
                (j, x)
            } else {
                (i, m)
            }
        });
    index
}

/// The greedy token of a row of logits and its log-probability `-ln Σ e^(x - max)`. `scratch`
/// is at least as long as the row.
pub(crate) fn greedy(logits: &[f32], scratch: &mut [f32]) -> (usize, f32) {
    let token = argmax(logits);
    let total = softmax_terms(logits, 1.0, logits[token], scratch);
    (token, -total.ln())
}

/// A token drawn from `softmax(logits / temperature)` by inverse CDF with the uniform `u` in
/// `[0, 1)`, in vocabulary order, and its log-probability under that distribution. `scratch` is
/// at least as long as the row.
pub(crate) fn sample(
    logits: &[f32],
    temperature: f32,
    u: f32,
    scratch: &mut [f32],
) -> (usize, f32) {
    // Dividing by a positive temperature keeps the order, so the maximum divides exactly.
    let max = logits[argmax(logits)] / temperature;
    let total = softmax_terms(logits, temperature, max, scratch);
    let weights = &scratch[..logits.len()];
    let target = u * total;
    let mut cumulative = 0.0;
    let token = weights
        .iter()
        .position(|w| {
            cumulative += w;
            cumulative > target
        })
        // Rounding can leave the sum short of the target: the last token with weight.
        .unwrap_or_else(|| weights.iter().rposition(|&w| w > 0.0).unwrap_or(0));
    (token, logits[token] / temperature - max - total.ln())
}

/// Writes `e^(x / temperature - shift)` for each logit `x` into `out` and returns their sum.
fn softmax_terms(logits: &[f32], temperature: f32, shift: f32, out: &mut [f32]) -> f32 {
    let out = &mut out[..logits.len()];
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F; `out` is as long as `logits`.
        return unsafe { avx512::softmax_terms(logits, temperature, shift, out) };
    }
    portable_softmax_terms(logits, temperature, shift, out)
}

#[multiversion::multiversion(targets("x86_64+avx2+fma"))]
fn portable_softmax_terms(logits: &[f32], temperature: f32, shift: f32, out: &mut [f32]) -> f32 {
    for (o, &x) in out.iter_mut().zip(logits) {
        *o = exp(x / temperature - shift);
    }
    let mut lanes = [0f32; LANES];
    let (chunks, rest) = out.as_chunks::<LANES>();
    for chunk in chunks {
        for i in 0..LANES {
            lanes[i] += chunk[i];
        }
    }
    lanes.iter().sum::<f32>() + rest.iter().sum::<f32>()
}

/// One query head over `keys`/`values` `[S, d]` (`S = mask.len()`):
/// `out = softmax(q·Kᵀ·scale + mask) · V`. `scores` is scratch of at least `S`.
pub(crate) fn attend_head(
    q: &[f32],
    (keys, values): (&[f32], &[f32]),
    mask: &[f32],
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let (d, n) = (q.len(), mask.len());
    assert!(keys.len() >= n * d && values.len() >= n * d);
    assert!(scores.len() >= n && out.len() == d);
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") && d % avx512::LANES == 0 {
        // SAFETY: the CPU has AVX-512F and the lengths are as asserted.
        unsafe { avx512::attend_head(q, (keys, values), mask, scale, scores, out) };
        return;
    }
    portable_attend_head(q, (keys, values), mask, scale, scores, out);
}

#[multiversion::multiversion(targets("x86_64+avx2+fma"))]
fn portable_attend_head(
    q: &[f32],
    (keys, values): (&[f32], &[f32]),
    mask: &[f32],
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let d = q.len();
    let scores = &mut scores[..mask.len()];
    for ((score, key), m) in scores.iter_mut().zip(keys.chunks_exact(d)).zip(mask) {
        *score = dot(q, key) * scale + m;
    }
    let max = scores.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let mut total = 0.0;
    for score in scores.iter_mut() {
        *score = exp(*score - max);
        total += *score;
    }
    out.fill(0.0);
    for (p, value) in scores.iter().zip(values.chunks_exact(d)) {
        for (o, v) in out.iter_mut().zip(value) {
            *o += p * v;
        }
    }
    let inverse = 1.0 / total;
    for o in out.iter_mut() {
        *o *= inverse;
    }
}

/// Below this `e^x` is under f32's smallest normal and the kernels return 0 (what softmax
/// needs at masked positions); above `EXP_MAX` it overflows to infinity.
const EXP_MIN: f32 = -87.0;
const EXP_MAX: f32 = 89.0;
/// `ln 2` split in two so that `n·LN2_HI` is exact.
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// Taylor coefficients of `e^r` from degree 6 down to 0, for `|r| ≤ ln 2 / 2`: relative error
/// below 2e-7, about 2 ulp.
const EXP_POLY: [f32; 7] = [
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];

/// `e^x` as `2^n · p(r)` with `x = n·ln 2 + r`: the AVX-512 kernels' arithmetic, one lane,
/// written branch-free and without libm calls so that loops over it vectorise.
#[inline(always)]
fn exp(x: f32) -> f32 {
    // Clamped, so that NaN is the only value the selects below must carry through.
    let clamped = x.clamp(EXP_MIN, EXP_MAX);
    // Round to nearest by adding and subtracting 1.5·2^23 (exact for |v| < 2^22).
    const ROUND: f32 = 12_582_912.0;
    let n = (clamped * std::f32::consts::LOG2_E + ROUND) - ROUND;
    let r = (clamped - n * LN2_HI) - n * LN2_LO;
    let p = EXP_POLY.iter().fold(0.0, |acc, c| acc * r + c);
    // `2^n` from exponent bits, in two factors: `2^128` alone overflows where `p·2^128` does not.
    let n = n as i32;
    let power = |k: i32| f32::from_bits(((k + 127) as u32) << 23);
    let e = p * power(n / 2) * power(n - n / 2);
    if x.is_nan() {
        x
    } else if x < EXP_MIN {
        0.0
    } else {
        e
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! The hot kernels in AVX-512F intrinsics.
    use std::arch::x86_64::*;

    use super::{EXP_MAX, EXP_MIN, EXP_POLY, LN2_HI, LN2_LO};

    pub(super) const LANES: usize = 16;

    /// Lanes `0..n` (n ≤ 16) of a mask.
    fn first(n: usize) -> __mmask16 {
        if n >= LANES { !0 } else { (1u16 << n) - 1 }
    }

    /// [`super::exp`] on sixteen lanes; `scalef` applies the `2^n`.
    #[target_feature(enable = "avx512f")]
    fn exp(x: __m512) -> __m512 {
        let kept = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_set1_ps(EXP_MIN));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
        // `min` returns its second operand when either is NaN: NaN stays NaN.
        let x = _mm512_min_ps(_mm512_set1_ps(EXP_MAX), x);
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
        let p = EXP_POLY.iter().fold(_mm512_setzero_ps(), |acc, &c| {
            _mm512_fmadd_ps(acc, r, _mm512_set1_ps(c))
        });
        // Below EXP_MIN: 0; NaN stays NaN through the arithmetic.
        _mm512_mask_mov_ps(_mm512_setzero_ps(), kept | nan, _mm512_scalef_ps(p, n))
    }

    /// The first index of the maximum: one pass for the maximum, one to find it. `None` when the
    /// row is empty or holds a NaN (the portable version decides those).
    ///
    /// # Safety
    /// The CPU supports AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn argmax(row: &[f32]) -> Option<usize> {
        let mut max = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut nan: __mmask16 = 0;
        for start in (0..row.len()).step_by(LANES) {
            let k = first(row.len() - start);
            // SAFETY: the mask keeps the load inside `row`.
            let x = unsafe { _mm512_mask_loadu_ps(max, k, row.as_ptr().add(start)) };
            nan |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
            max = _mm512_max_ps(max, x);
        }
        if nan != 0 || row.is_empty() {
            return None;
        }
        let max = _mm512_reduce_max_ps(max);
        let target = _mm512_set1_ps(max);
        for start in (0..row.len()).step_by(LANES) {
            let k = first(row.len() - start);
            // SAFETY: the mask keeps the load inside `row`.
            let x = unsafe { _mm512_maskz_loadu_ps(k, row.as_ptr().add(start)) };
            let hits = _mm512_mask_cmp_ps_mask::<_CMP_EQ_OQ>(k, x, target);
            if hits != 0 {
                return Some(start + hits.trailing_zeros() as usize);
            }
        }
        None
    }

    /// # Safety
    /// The CPU supports AVX-512F; `out` is as long as `logits`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn softmax_terms(
        logits: &[f32],
        temperature: f32,
        shift: f32,
        out: &mut [f32],
    ) -> f32 {
        assert_eq!(logits.len(), out.len());
        let (temperature, shift) = (_mm512_set1_ps(temperature), _mm512_set1_ps(shift));
        let mut total = _mm512_setzero_ps();
        for start in (0..logits.len()).step_by(LANES) {
            let k = first(logits.len() - start);
            // SAFETY: the mask keeps loads and stores inside the slices.
            unsafe {
                let x = _mm512_maskz_loadu_ps(k, logits.as_ptr().add(start));
                let x = _mm512_sub_ps(_mm512_div_ps(x, temperature), shift);
                let e = _mm512_maskz_mov_ps(k, exp(x));
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(start), k, e);
                total = _mm512_add_ps(total, e);
            }
        }
        _mm512_reduce_add_ps(total)
    }

    /// # Safety
    /// The CPU supports AVX-512F; the slices have the same length.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
        assert!(gate.len() == out.len() && up.len() == out.len());
        let one = _mm512_set1_ps(1.0);
        for start in (0..out.len()).step_by(LANES) {
            let k = first(out.len() - start);
            // SAFETY: the mask keeps loads and stores inside the slices.
            unsafe {
                let g = _mm512_maskz_loadu_ps(k, gate.as_ptr().add(start));
                let u = _mm512_maskz_loadu_ps(k, up.as_ptr().add(start));
                let e = exp(_mm512_sub_ps(_mm512_setzero_ps(), g));
                let silu = _mm512_div_ps(g, _mm512_add_ps(one, e));
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(start), k, _mm512_mul_ps(silu, u));
            }
        }
    }

    /// # Safety
    /// The CPU supports AVX-512F, `q.len()` is a multiple of 16, and the lengths are as
    /// [`super::attend_head`] asserts.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn attend_head(
        q: &[f32],
        (keys, values): (&[f32], &[f32]),
        mask: &[f32],
        scale: f32,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        let (d, n) = (q.len(), mask.len());
        let chunks = d / LANES;
        // SAFETY (every load and store): indices stay within the asserted lengths.
        unsafe {
            let (q, keys, values) = (q.as_ptr(), keys.as_ptr(), values.as_ptr());
            let mut max = f32::NEG_INFINITY;
            // Scores, four positions at a time for independent dependency chains.
            for s in (0..n).step_by(4) {
                let block = (n - s).min(4);
                let mut sums = [_mm512_setzero_ps(); 4];
                for c in 0..chunks {
                    let qc = _mm512_loadu_ps(q.add(c * LANES));
                    for (j, sum) in sums.iter_mut().enumerate().take(block) {
                        let k = _mm512_loadu_ps(keys.add((s + j) * d + c * LANES));
                        *sum = _mm512_fmadd_ps(qc, k, *sum);
                    }
                }
                for (j, sum) in sums.iter().enumerate().take(block) {
                    let score = _mm512_reduce_add_ps(*sum) * scale + mask[s + j];
                    scores[s + j] = score;
                    max = max.max(score);
                }
            }
            // Exponentials, sixteen at a time.
            let mut totals = _mm512_setzero_ps();
            let shift = _mm512_set1_ps(max);
            for s in (0..n).step_by(LANES) {
                let k = first(n - s);
                let x = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, scores.as_ptr().add(s)), shift);
                let e = _mm512_maskz_mov_ps(k, exp(x));
                _mm512_mask_storeu_ps(scores.as_mut_ptr().add(s), k, e);
                totals = _mm512_add_ps(totals, e);
            }
            let inverse = _mm512_set1_ps(1.0 / _mm512_reduce_add_ps(totals));
            // Weighted sum of the values, four column chunks at a time held in registers.
            for c in (0..chunks).step_by(4) {
                let block = (chunks - c).min(4);
                let mut sums = [_mm512_setzero_ps(); 4];
                for (position, &p) in scores[..n].iter().enumerate() {
                    let p = _mm512_set1_ps(p);
                    let row = values.add(position * d + c * LANES);
                    for (j, sum) in sums.iter_mut().enumerate().take(block) {
                        *sum = _mm512_fmadd_ps(p, _mm512_loadu_ps(row.add(j * LANES)), *sum);
                    }
                }
                for (j, sum) in sums.iter().enumerate().take(block) {
                    let at = out.as_mut_ptr().add((c + j) * LANES);
                    _mm512_storeu_ps(at, _mm512_mul_ps(*sum, inverse));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    fn random(rng: &mut Rng, n: usize, scale: f64) -> Vec<f32> {
        (0..n).map(|_| (rng.normal() * scale) as f32).collect()
    }

    fn close(got: &[f32], want: &[f32], tolerance: f32) {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= tolerance * w.abs().max(1.0),
                "[{i}]: {g} vs {w}"
            );
        }
    }

    #[test]
    fn exp_matches_libm_over_the_range() {
        // The scalar version, and the others through one-element sums.
        let vector = |x: f32| softmax_terms(&[x], 1.0, 0.0, &mut [0.0]);
        let portable = |x: f32| portable_softmax_terms(&[x], 1.0, 0.0, &mut [0.0]);
        for x in (-2000..=1000).map(|i| i as f32 * 0.0891) {
            let want = x.exp();
            for got in [exp(x), vector(x), portable(x)] {
                if x < EXP_MIN {
                    assert_eq!(got, 0.0);
                } else if want.is_infinite() {
                    assert!(got.is_infinite(), "{x}");
                } else {
                    assert!((got - want).abs() <= 3e-7 * want, "{x}: {got} vs {want}");
                }
            }
        }
        for f in [exp, vector, portable] {
            assert!(f(f32::NAN).is_nan());
            assert_eq!(f(f32::NEG_INFINITY), 0.0);
            assert_eq!(f(f32::INFINITY), f32::INFINITY);
        }
    }

    #[test]
    fn greedy_matches_argmax_and_log_softmax() {
        let mut rng = Rng::new(3);
        for n in [1, 7, 16, 33, 1000] {
            let row = random(&mut rng, n, 4.0);
            let t = tch::Tensor::from_slice(&row);
            let want_token = t.argmax(0, false).int64_value(&[]) as usize;
            let want_lp = t
                .log_softmax(0, tch::Kind::Float)
                .double_value(&[want_token as i64]);
            let mut scratch = vec![0.0; n];
            let (token, lp) = greedy(&row, &mut scratch);
            assert_eq!(token, want_token);
            assert!((lp as f64 - want_lp).abs() < 1e-6, "{lp} vs {want_lp}");
            let portable = -portable_softmax_terms(&row, 1.0, row[token], &mut scratch).ln();
            assert!(
                (portable as f64 - want_lp).abs() < 1e-6,
                "{portable} vs {want_lp}"
            );
        }
        // Ties go to the first maximum, NaN counts as the maximum, in both versions.
        for row in [
            vec![1.0, 3.0, 3.0, -1.0],
            (0..40).map(|i| (i % 7) as f32).collect(),
        ] {
            assert_eq!(argmax(&row), portable_argmax(&row));
        }
        assert_eq!(greedy(&[1.0, 3.0, 3.0, -1.0], &mut [0.0; 4]).0, 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY; 3]), 0);
        assert_eq!(argmax(&[1.0, f32::NAN, 5.0]), 1);
    }

    #[test]
    fn silu_mul_matches_libtorch() {
        let mut rng = Rng::new(4);
        for width in [5, 16, 37] {
            let gate_up = random(&mut rng, 3 * 2 * width, 5.0);
            let mut out = vec![0.0; 3 * width];
            silu_mul(&gate_up, width, &mut out);
            let t = tch::Tensor::from_slice(&gate_up).view([3, 2 * width as i64]);
            let want =
                t.narrow(1, 0, width as i64).silu() * t.narrow(1, width as i64, width as i64);
            let want = Vec::<f32>::try_from(want.reshape([-1])).unwrap();
            close(&out, &want, 1e-6);
            for ((pair, out), want) in gate_up
                .chunks(2 * width)
                .zip(out.chunks_mut(width))
                .zip(want.chunks(width))
            {
                let (gate, up) = pair.split_at(width);
                portable_silu_mul(gate, up, out);
                close(out, want, 1e-6);
            }
        }
    }

    #[test]
    fn rms_norm_matches_libtorch() {
        let mut rng = Rng::new(5);
        let (x, w) = (random(&mut rng, 4 * 48, 2.0), random(&mut rng, 48, 1.0));
        let mut out = vec![0.0; x.len()];
        rms_norm(&x, &w, 1e-6, &mut out);
        let t = tch::Tensor::from_slice(&x).view([4, 48]);
        let variance = t.square().mean_dim(-1, true, tch::Kind::Float);
        let want = tch::Tensor::from_slice(&w) * (&t * (variance + 1e-6).rsqrt());
        close(
            &out,
            &Vec::<f32>::try_from(want.reshape([-1])).unwrap(),
            1e-6,
        );
    }

    /// Both attention versions against libtorch's `scaled_dot_product_attention`, with masked
    /// positions and head sizes the AVX-512 version takes (multiples of 16) and leaves (others).
    #[test]
    fn attention_matches_libtorch() {
        let mut rng = Rng::new(6);
        for (d, n) in [(64, 1), (64, 37), (16, 5), (128, 100), (24, 9)] {
            let (q, keys, values) = (
                random(&mut rng, d, 1.0),
                random(&mut rng, n * d, 1.0),
                random(&mut rng, n * d, 1.0),
            );
            // Mask every third position but the last.
            let mask: Vec<f32> = (0..n)
                .map(|s| {
                    if s % 3 == 1 && s + 1 < n {
                        f32::NEG_INFINITY
                    } else {
                        0.0
                    }
                })
                .collect();
            let scale = 1.0 / (d as f32).sqrt();
            let tensor = |v: &[f32], rows: usize| {
                tch::Tensor::from_slice(v).view([1, 1, rows as i64, d as i64])
            };
            let want = tch::Tensor::scaled_dot_product_attention(
                &tensor(&q, 1),
                &tensor(&keys, n),
                &tensor(&values, n),
                Some(tch::Tensor::from_slice(&mask).view([1, 1, 1, n as i64])),
                0.0,
                false,
                scale as f64,
                false,
            );
            let want = Vec::<f32>::try_from(want.reshape([-1])).unwrap();
            let mut scores = vec![0.0; n];
            let mut out = vec![0.0; d];
            attend_head(&q, (&keys, &values), &mask, scale, &mut scores, &mut out);
            close(&out, &want, 1e-5);
            portable_attend_head(&q, (&keys, &values), &mask, scale, &mut scores, &mut out);
            close(&out, &want, 1e-5);
        }
    }
}
