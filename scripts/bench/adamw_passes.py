"""The AdamW lever of issue 14 measured on PyTorch's kernels (those libtorch runs for
verl-actor's optimizer): the optimizer's update as it was (checked out of place, then
recomputed out of place and copied in: a dozen fresh tensors per parameter and pass) against as it
is (checked in reused buffers, then applied in place: no fresh tensor per parameter), with torch.optim.AdamW (what TRL runs) for reference, on the parameters of the bench's
Qwen2 (hidden 256, 4 layers, vocab 512). Repetitions alternate; medians. Both verl-core variants
are checked to give bit-identical results.

usage: python adamw_passes.py [threads] [reps]
"""

import statistics
import sys
import time

import torch

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 21
torch.set_num_threads(threads)
torch.manual_seed(0)
h, inter, layers, vocab, kv = 256, 768, 4, 512, 128
shapes = [(vocab, h), (vocab, h), (h,)]
for _ in range(layers):
    shapes += [(h, h), (h,), (kv, h), (kv,), (kv, h), (kv,), (h, h)]
    shapes += [(inter, h), (inter, h), (h, inter), (h,), (h,)]
params = [torch.randn(s) * 0.02 for s in shapes]
grads = [torch.randn(s) * 1e-3 for s in shapes]
lr, b1, b2, eps, wd = 1e-6, 0.9, 0.999, 1e-8, 0.01


def constants(step):
    return 1 - lr * wd, (1 - b2**step) ** 0.5, lr / (1 - b1**step)


def out_of_place(p, m, v, g, step):
    decay, bc2, step_size = constants(step)
    new_p = p * decay
    m2 = m.lerp(g, 1 - b1)
    v2 = v * b2 + g.square() * (1 - b2)
    denom = v2.sqrt() / bc2 + eps
    new_p.addcdiv_(m2 * -step_size, denom)
    return new_p, m2, v2


def before(state, step):
    ok = all(all(t.isfinite().all().item() for t in out_of_place(*s, g, step)) for s, g in zip(state, grads))
    if ok:
        for s, g in zip(state, grads):
            for target, value in zip(s, out_of_place(*s, g, step)):
                target.copy_(value)


def in_place(p, m, v, g, step, sq, denom, scaled):
    """The same update in place, its three temporaries written into given buffers."""
    decay, bc2, step_size = constants(step)
    p.mul_(decay)
    m.lerp_(g, 1 - b1)
    torch.mul(g, g, out=sq)
    v.mul_(b2).add_(sq.mul_(1 - b2))
    torch.sqrt(v, out=denom)
    denom.div_(bc2).add_(eps)
    torch.mul(m, -step_size, out=scaled)
    p.addcdiv_(scaled, denom)


largest = max(p.numel() for p in params)


def after(state, step):
    # Six buffers per step, as long as the largest parameter (as verl-actor's `Scratch`).
    scratch = [torch.empty(largest) for _ in range(6)]
    sums = []
    for s, g in zip(state, grads):
        views = [b[: g.numel()].view(g.shape) for b in scratch]
        for view, t in zip(views, s):
            view.copy_(t)
        in_place(*views[:3], g, step, *views[3:])
        # 0 × x is NaN exactly when x is not finite.
        sums += [view.mul_(0.0).sum() for view in views[:3]]
    if not torch.stack(sums).isnan().any().item():
        for s, g in zip(state, grads):
            in_place(*s, g, step, *[b[: g.numel()].view(g.shape) for b in scratch[:3]])


def fresh():
    return [(p.clone(), torch.zeros_like(p), torch.zeros_like(p)) for p in params]


states = {"before": fresh(), "after": fresh()}
torch_params = [torch.nn.Parameter(p.clone()) for p in params]
for p, g in zip(torch_params, grads):
    p.grad = g.clone()
optim = torch.optim.AdamW(torch_params, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, foreach=False)
times = {"before": [], "after": [], "torch.optim.AdamW": []}
for step in range(1, reps + 2):
    for name, fn in (("before", before), ("after", after)):
        t = time.perf_counter()
        fn(states[name], step)
        if step > 1:
            times[name].append(time.perf_counter() - t)
    t = time.perf_counter()
    optim.step()
    if step > 1:
        times["torch.optim.AdamW"].append(time.perf_counter() - t)
same = all(
    torch.equal(a, b)
    for other in ("after",)
    for sa, sb in zip(states["before"], states[other])
    for a, b in zip(sa, sb)
)
n = sum(p.numel() for p in params)
print(f"AdamW on {n} parameters, {threads} threads, {reps} alternating reps; before == after bit for bit: {same}")
for name, ts in times.items():
    print(f"{name:>18}: median {statistics.median(ts) * 1e3:.2f} ms")
