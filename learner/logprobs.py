"""Sampled-token log-probabilities and entropies straight from the last hidden states, chunk by chunk.

The plain path (``learner.batching.token_logprobs``) takes the model's logits: a [tokens, vocab]
bf16 tensor, upcast to fp32, log-softmaxed and kept for the backward. For a 32k-token micro-batch
and a 32k vocabulary that is 2 GB of bf16 logits plus several 4 GB fp32 copies (upcast,
log-softmax, its saved output, the entropy's softmax, the gradient), at every micro-batch.

``linear_logprobs_entropy`` folds the output projection into the computation, as Liger's fused
linear cross entropy does: per chunk of response positions, logits = h_chunk @ W.T (in the weight's
dtype, as ``lm_head`` computes them), then logsumexp, the target's logit and the entropy in fp32.
Only [tokens] vectors leave a chunk; the backward recomputes the chunk's logits (one more matmul
of 2 x hidden x vocab FLOPs per token) and turns them into the gradients of h and W. The
[tokens, vocab] logits never exist at once, and the prompt positions get no logits at all.

Numerics follow the plain path: logits in the weight's dtype, upcast to fp32; the log-probability
and the entropy under logits / temperature, the distribution the generator sampled from (what
``learner.batching.token_logprobs`` and ``entropy_at`` compute).
"""

from __future__ import annotations

from typing import Any

import torch

# fp32 elements of one chunk's [chunk, vocab] logits: 2^28 is 1 GiB, a few such buffers live at once
CHUNK_ELEMENTS = 1 << 28


def _stats(logits_CV: torch.Tensor, targets_C: torch.Tensor, temperature: float) -> tuple[torch.Tensor, ...]:
    """(log p(target), entropy, logsumexp), all under logits / T: the sampled distribution."""
    z = logits_CV.float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, -1)
    # entropy = lse - E_p[z] with p = softmax(z)
    ent = lse - (torch.exp(z - lse[:, None]) * z).sum(-1)
    return z.gather(1, targets_C[:, None])[:, 0] - lse, ent, lse


def _grad_logits(
    logits_CV: torch.Tensor,
    targets_C: torch.Tensor,
    temperature: float,
    lse_C: torch.Tensor,
    ent_C: torch.Tensor,
    g_lp_C: torch.Tensor | None,
    g_ent_C: torch.Tensor | None,
) -> torch.Tensor:
    """d(loss)/d(logits) of one chunk, in the logits' dtype. With z = logits / T and p = softmax(z):

    d lp / d logits = (onehot(target) - p) / T;  d ent / d logits = -p * (z - E_p[z]) / T.
    """
    z = logits_CV.float()
    if temperature != 1.0:
        z = z / temperature
    p = torch.exp(z - lse_C[:, None])
    g = torch.zeros_like(z)
    if g_lp_C is not None:
        g_lp = g_lp_C.float()[:, None]
        g = g - p * g_lp
        g = g.scatter_add(1, targets_C[:, None], g_lp)
    if g_ent_C is not None:
        mean_z = (lse_C - ent_C)[:, None]
        g = g - g_ent_C.float()[:, None] * p * (z - mean_z)
    if temperature != 1.0:
        g = g / temperature
    return g.to(logits_CV.dtype)


# The element-wise parts of a chunk, compiled on CUDA into a few fused kernels (each reads the
# chunk's bf16 logits once or twice instead of a dozen fp32 passes); eager elsewhere.
_COMPILED: dict[str, Any] = {}


def _kernels(device: torch.device, compiled: bool) -> tuple[Any, Any]:
    if not compiled or device.type != "cuda":
        return _stats, _grad_logits
    if not _COMPILED:
        _COMPILED["stats"] = torch.compile(_stats, dynamic=True)
        _COMPILED["grad"] = torch.compile(_grad_logits, dynamic=True)
    return _COMPILED["stats"], _COMPILED["grad"]


class _LinearLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden_NH: torch.Tensor,
        weight_VH: torch.Tensor,
        targets_N: torch.Tensor,
        temperature: float,
        chunk: int,
        compiled: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stats, _ = _kernels(hidden_NH.device, compiled)
        n = hidden_NH.shape[0]
        # log p(target), entropy, logsumexp: [N] each, under logits / T
        outs = [torch.empty(n, dtype=torch.float32, device=hidden_NH.device) for _ in range(3)]
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            logits = hidden_NH[s:e] @ weight_VH.T
            for o, v in zip(outs, stats(logits, targets_N[s:e], temperature), strict=True):
                o[s:e] = v
        lp, ent, lse = outs
        ctx.save_for_backward(hidden_NH, weight_VH, targets_N, ent, lse)
        ctx.temperature, ctx.chunk, ctx.compiled = temperature, chunk, compiled
        ctx.set_materialize_grads(False)  # an entropy used only as a metric sends no gradient
        return lp, ent

    @staticmethod
    def backward(ctx: Any, g_lp_N: torch.Tensor | None, g_ent_N: torch.Tensor | None) -> tuple[Any, ...]:
        hidden, weight, targets, ent, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_lp_N is None and g_ent_N is None) or not (need_h or need_w):
            return None, None, None, None, None, None
        _, grad_logits = _kernels(hidden.device, ctx.compiled)
        d_hidden = torch.empty_like(hidden) if need_h else None
        # the weight's gradient summed over chunks in fp32 (one matmul over all tokens accumulates
        # in fp32 inside the kernel; bf16 partial sums would round at every chunk)
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        n = hidden.shape[0]
        for s in range(0, n, ctx.chunk):
            e = min(n, s + ctx.chunk)
            h = hidden[s:e]
            g = grad_logits(
                h @ weight.T,  # recomputed: the forward kept no [chunk, vocab] tensor
                targets[s:e],
                ctx.temperature,
                lse[s:e],
                ent[s:e],
                None if g_lp_N is None else g_lp_N[s:e],
                None if g_ent_N is None else g_ent_N[s:e],
            )
            if d_hidden is not None:
                d_hidden[s:e] = g @ weight
            if d_weight is not None:
                d_weight += g.T @ h
        return d_hidden, None if d_weight is None else d_weight.to(weight.dtype), None, None, None, None


def linear_logprobs_entropy(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    temperature: float = 1.0,
    chunk: int | None = None,
    compiled: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and the entropy under (hidden @ weight.T) / temperature (the distribution the
    generator sampled from), one fp32 value per row of ``hidden_NH``, with gradients for ``hidden_NH`` and ``weight_VH``.

    ``chunk`` rows at a time (default: as many as keep one chunk's fp32 logits at
    ``CHUNK_ELEMENTS``). ``compiled`` fuses the element-wise work with ``torch.compile`` on CUDA.
    """
    if chunk is None:
        chunk = max(1, CHUNK_ELEMENTS // weight_VH.shape[0])
    if chunk <= 0:
        raise ValueError(f"chunk must be > 0, got {chunk}")
    lp, ent = _LinearLogprobEntropy.apply(hidden_NH, weight_VH, targets_N, float(temperature), chunk, compiled)
    return lp, ent
