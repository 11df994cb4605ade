"""The packed-row attention wrapper of ``learner.speedups`` (PyTorch's FlashAttention-2 varlen
kernels on a GPU): its layout and sequence-boundary plumbing, checked on the CPU with a reference
kernel in place of the CUDA one, through a real transformers Llama."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from learner import speedups


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):  # type: ignore[no-untyped-def]
    """Causal attention of each sequence on its own: what the varlen kernel computes."""
    assert window_size == (-1, 0), "the wrapper asks for causal attention"
    assert max_q == max(int(b - a) for a, b in zip(cu_q[:-1], cu_q[1:], strict=True))
    out = torch.empty_like(q)
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))  # [heads, len, dim]
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=enable_gqa
        ).transpose(0, 1)
    return out


@pytest.mark.parametrize("pass_boundaries", [True, False])
def test_packed_rows_match_per_sequence_sdpa(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pass_boundaries: bool
) -> None:
    from transformers import AutoModelForCausalLM

    from flywheel.tiny import build_checkpoint

    monkeypatch.setattr(speedups, "_varlen_call", lambda: (reference_varlen, {"window_size": (-1, 0)}, True))
    path = build_checkpoint(tmp_path / "m", size="tiny")
    name = speedups.register_varlen()
    packed = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name).eval()
    plain = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    lengths = [5, 9, 3]
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(4, 500, (n,), generator=g) for n in lengths]
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    kwargs: dict[str, Any] = {}
    if pass_boundaries:
        cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
        kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 9, "max_length_k": 9}
    with torch.no_grad():
        got = packed(input_ids=ids, position_ids=pos, **kwargs).logits[0]
        want = torch.cat([plain(input_ids=s[None]).logits[0] for s in seqs])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
