"""The tiny model and tokenizer built from code load through the ordinary HF paths."""

from __future__ import annotations

from pathlib import Path

from flywheel.tiny import arithmetic_rows, build_model


def test_tiny_llama_loads_and_runs(tmp_path: Path, tokenizer_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_model(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert 100_000 < sum(p.numel() for p in model.parameters()) < 2_000_000
    ids = torch.tensor([tok(arithmetic_rows(1)[0]["prompt"])["input_ids"]])
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert model.config.vocab_size >= len(tok)  # every token id the tokenizer emits has an embedding


def test_sizes_and_shapes(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from flywheel.tiny import build_checkpoint

    path = build_checkpoint(tmp_path / "qwen", arch="qwen2", size="small")
    assert AutoConfig.from_pretrained(path).model_type == "qwen2"
    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())
    assert 1_000_000 < n < 5_000_000
    assert (path / "tokenizer.json").exists()


def test_the_half_billion_preset_has_the_documented_size() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from flywheel.tiny import model_config

    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = AutoModelForCausalLM.from_config(model_config("llama", "0.5b"))
    assert sum(p.numel() for p in model.parameters()) == 491_832_320
