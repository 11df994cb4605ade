"""A tiny Llama-shaped model, its tokenizer and an arithmetic prompt set, built from code.

Nothing is downloaded: tests, the demo and benchmarks build these locally and save them with
``save_pretrained`` so they load through the same code path as any HF model directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flywheel.tasks import arithmetic_rows, write_jsonl

SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]


def write_arithmetic_jsonl(path: str | Path, n: int, seed: int = 0) -> Path:
    return write_jsonl(arithmetic_rows(n, seed), path)


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> Path:
    """Train a small byte-level BPE tokenizer on arithmetic text and save it HF-style."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [r["prompt"] + " " + r["answer"] for r in arithmetic_rows(2000)]
    corpus += ["The answer is 12. Let me think step by step: 7 + 5 = 12."] * 50
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    out = Path(out_dir)
    fast.save_pretrained(out)
    return out


SIZES = {
    # name: (hidden, layers, attention heads, kv heads, MLP width); vocab 512 -> parameter counts below
    "tiny": (128, 2, 4, 2, 256),  # ~0.4M
    "small": (256, 4, 4, 2, 512),  # ~2M
    "medium": (512, 8, 8, 4, 1024),  # ~19M
    "large": (768, 10, 12, 4, 1536),  # ~52M
    "0.5b": (1024, 24, 16, 8, 5632),  # 491,832,320 (the two-GPU loop benchmark)
    "1b": (2048, 16, 16, 8, 5632),  # ~0.9B with vocab 32000 (GPU measurements)
}


def model_config(
    arch: str = "llama", size: str = "tiny", vocab_size: int = 512, hidden: int | None = None, layers: int | None = None
) -> Any:
    """The HF config of a preset ``size`` (see SIZES); ``hidden`` / ``layers`` override it."""
    from transformers import LlamaConfig, Qwen2Config

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"unknown arch {arch!r}; choose llama or qwen2")
    h, n_layers, heads, kv_heads, mlp = SIZES[size]
    hidden = hidden or h
    return (LlamaConfig if arch == "llama" else Qwen2Config)(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=mlp * hidden // h,  # the preset's MLP width, scaled with a hidden override
        num_hidden_layers=layers or n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
    )


def build_model(
    out_dir: str | Path,
    vocab_size: int = 512,
    hidden: int | None = None,
    layers: int | None = None,
    seed: int = 0,
    arch: str = "llama",
    size: str = "tiny",
) -> Path:
    """A randomly initialised Llama- or Qwen2-shaped causal LM of a preset ``size`` (see SIZES);
    ``hidden`` / ``layers`` override the preset."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model_config(arch, size, vocab_size, hidden, layers)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


def build_reward_model(out_dir: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """A randomly initialised Llama sequence classifier with one output (a reward model) and
    the tokenizer, in one directory: what ``flywheel-rm`` serves."""
    import torch
    from transformers import LlamaForSequenceClassification

    config = model_config("llama", size)
    config.num_labels = 1
    torch.manual_seed(seed)
    out = Path(out_dir)
    build_tokenizer(out)
    LlamaForSequenceClassification(config).save_pretrained(out)
    return out


def build_checkpoint(
    out_dir: str | Path, arch: str = "llama", size: str = "tiny", seed: int = 0, vocab_size: int = 512
) -> Path:
    """Model and tokenizer in one directory, loadable by HF and vLLM like any hub checkpoint.

    A ``vocab_size`` above the tokenizer's 512 gives a realistic output layer (ids past 512 are
    never produced by the tokenizer, only sampled)."""
    out = Path(out_dir)
    build_tokenizer(out)
    build_model(out, vocab_size=vocab_size, arch=arch, size=size, seed=seed)
    return out
