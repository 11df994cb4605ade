"""What the learner broadcasts is what the model's checkpoint holds: the names and shapes vLLM loads."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from learner.trainer import checkpoint_layout


def test_a_mixture_of_experts_is_sent_as_its_checkpoint_holds_it(tmp_path: Path) -> None:
    """transformers fuses a Mixtral layer's experts into one tensor in memory
    (``experts.gate_up_proj``); vLLM knows only the checkpoint's per-expert names, and its load
    failed on the first one."""
    config = MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    model = MixtralForCausalLM(config)
    in_memory = {n: p.data for n, p in model.named_parameters()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in in_memory
    sent = checkpoint_layout(model, in_memory)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as saved:
        assert sorted(sent) == sorted(saved.keys())
        for name in sent:
            assert torch.equal(sent[name].contiguous(), saved.get_tensor(name)), name


def test_a_dense_model_is_sent_as_it_is() -> None:
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    weights = {n: p.data for n, p in model.named_parameters()}
    assert checkpoint_layout(model, weights) is weights
