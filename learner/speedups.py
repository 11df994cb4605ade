"""GPU speed-ups for the policy model that leave its numbers alone (measured by ``bench/learner.py``).

- ``flash_attention_2`` without the flash-attn package: PyTorch ships the FlashAttention-2
  variable-length kernels itself (``torch.nn.attention.varlen``). ``varlen_attention`` runs packed
  rows through them (one row, sequences delimited by cumulative lengths the trainer passes in, so
  no host sync and no [L, L] mask); flex attention's block-sparse kernels ran at about 130-170
  TFLOP/s on an H200 here, a third of the step's non-matmul time.
- ``compile_regions``: torch.compile of each decoder layer (attention left out as a graph break)
  or, where the attention cannot be left out, of its norms and MLP. The eager layer spends as long
  in element-wise kernels as in its matmuls' (RMSNorm in fp32, rotary embeddings, SwiGLU, residual
  adds: a dozen memory passes each); compiled, each region is a few fused kernels.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

VARLEN_NAME = "flywheel_varlen_fa2"


def varlen_available() -> bool:
    """PyTorch's bundled FlashAttention-2 varlen kernels are usable (CUDA, torch >= 2.9)."""
    if not torch.cuda.is_available():
        return False
    try:
        from torch.nn.attention import varlen  # noqa: F401
    except ImportError:
        return False
    return True


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def register_varlen() -> str:
    """Register ``varlen_attention`` with transformers under ``VARLEN_NAME`` (no mask function:
    transformers then builds no mask at all) and return the name to load models with."""
    from transformers import AttentionInterface

    # A graph break in compiled layers (the kernel runs as it is). Applied here rather than as a
    # decorator: that would import torch's compiler with this module, 1.5 s of every learner start.
    AttentionInterface.register(VARLEN_NAME, torch.compiler.disable(varlen_attention))
    return VARLEN_NAME


def _varlen_call() -> Any:
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal: dict[str, Any] = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    return varlen_attn, causal, "enable_gqa" in params


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention over the sequences packed in one row: [1, heads, L, dim] in (transformers'
    layout), [1, L, heads, dim] out. Sequence boundaries from ``cu_seq_lens_q`` / ``max_length_q``
    (what transformers' flash-attention kwargs carry), else from restarts of ``position_ids``."""
    if dropout:
        raise ValueError("attention dropout is not supported by the varlen kernels")
    b, heads, length, dim = query.shape
    if b != 1:
        raise ValueError("flash_attention_2 through PyTorch's varlen kernels takes packed micro-batches only")
    cu, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu is None or longest is None:
        starts = torch.nonzero(kwargs["position_ids"][0] == 0).flatten()
        cu = torch.cat([starts, starts.new_tensor([length])]).to(torch.int32)
        longest = int((cu[1:] - cu[:-1]).max())  # a host sync; the trainer passes both instead
    fn, causal, has_gqa = _varlen_call()
    q = query.transpose(1, 2).reshape(length, heads, dim)
    k = key.transpose(1, 2).reshape(length, key.shape[1], dim)
    v = value.transpose(1, 2).reshape(length, value.shape[1], dim)
    extra: dict[str, Any] = {}
    if k.shape[1] != heads:
        if has_gqa:
            extra["enable_gqa"] = True
        else:
            k = k.repeat_interleave(heads // k.shape[1], dim=1)
            v = v.repeat_interleave(heads // v.shape[1], dim=1)
    out = fn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, longest, longest, scale=scaling, **causal, **extra)
    return out.view(1, length, heads, dim), None


def compile_regions(model: torch.nn.Module, whole_layers: bool) -> int:
    """Compile (dynamic shapes: micro-batch lengths vary) the forward of every decoder layer when
    ``whole_layers``, else of every RMSNorm and MLP module. Only ``forward`` is replaced, on the
    instances: hooks, state-dict names and the CPU path stay as they are. Returns how many."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    targets: list[torch.nn.Module] = []
    if whole_layers and layers is not None:
        targets = list(layers)
        norm = getattr(model.model, "norm", None)
        if isinstance(norm, torch.nn.Module):
            targets.append(norm)
    else:
        targets = [m for m in model.modules() if type(m).__name__.endswith(("RMSNorm", "MLP"))]
    for m in targets:
        m.forward = torch.compile(m.forward, dynamic=True)
    return len(targets)
