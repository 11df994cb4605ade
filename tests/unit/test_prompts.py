"""Prompt sources: JSONL, parquet, HF datasets directory; epochs, seeded shuffle, chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from buffer.prompts import PromptSource, load_rows, prompt_text
from flywheel.config import DataConfig
from flywheel.tiny import arithmetic_rows

ROWS = arithmetic_rows(20, seed=3)


@pytest.fixture
def sources(tmp_path: Path) -> dict[str, Path]:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    hf = tmp_path / "hf"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(hf))
    return {"jsonl": jsonl, "parquet": parquet, "hf_disk": hf}


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "hf_disk"])
def test_every_format_reads_the_same_rows(sources: dict[str, Path], fmt: str, tokenizer_dir: Path) -> None:
    cfg = DataConfig(path=str(sources[fmt]), tokenizer=str(tokenizer_dir))
    rows = load_rows(cfg)
    assert rows == ROWS


def test_seeded_shuffle_per_epoch(sources: dict[str, Path], tokenizer_dir: Path) -> None:
    cfg = DataConfig(path=str(sources["jsonl"]), tokenizer=str(tokenizer_dir), seed=5, epochs=2)
    a, b = PromptSource.from_config(cfg), PromptSource.from_config(cfg)
    assert a.order(0).tolist() == b.order(0).tolist()  # same seed, same order: resumable
    assert sorted(a.order(0).tolist()) == list(range(20))
    assert a.order(0).tolist() != a.order(1).tolist()  # a new permutation each epoch
    assert a.exhausted(2) and not a.exhausted(1)
    plain = PromptSource.from_config(
        DataConfig(path=str(sources["jsonl"]), tokenizer=str(tokenizer_dir), shuffle=False)
    )
    assert plain.order(0).tolist() == list(range(20))


def test_the_text_rewards_read_is_the_prompt_or_a_chats_last_user_message() -> None:
    assert prompt_text("What is 2 + 2?") == "What is 2 + 2?"
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 1 + 1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "And 2 + 2?"},
    ]
    assert prompt_text(chat) == "And 2 + 2?"
    assert prompt_text([{"role": "system", "content": "x"}]) == json.dumps([{"role": "system", "content": "x"}])


def test_tokenize_chat_template_truncation_metadata(sources: dict[str, Path], tokenizer_dir: Path) -> None:
    base = PromptSource.from_config(DataConfig(path=str(sources["jsonl"]), tokenizer=str(tokenizer_dir)))
    p = base.prompt(0, 0)
    assert p.metadata == {"answer": ROWS[0]["answer"]}
    assert base.tokenizer.decode(p.tokens.tolist()) == ROWS[0]["prompt"]
    chat = PromptSource.from_config(
        DataConfig(path=str(sources["jsonl"]), tokenizer=str(tokenizer_dir), apply_chat_template=True)
    )
    text = chat.tokenizer.decode(chat.prompt(0, 0).tokens.tolist())
    assert text.startswith("<s>user: " + ROWS[0]["prompt"]) and text.endswith("assistant:")
    assert chat.prompt(0, 0).text == base.prompt(0, 0).text == ROWS[0]["prompt"]  # what rewards read
    cut = PromptSource.from_config(
        DataConfig(
            path=str(sources["jsonl"]),
            tokenizer=str(tokenizer_dir),
            max_prompt_tokens=3,
            overlong_prompts="truncate_left",
        )
    )
    assert len(cut.prompt(0, 0).tokens) == 3 and cut.truncated == 1  # type: ignore[union-attr]
    # by default an over-long prompt is skipped, not cut (that would lose its BOS and the chat header)
    skipping = PromptSource.from_config(
        DataConfig(path=str(sources["jsonl"]), tokenizer=str(tokenizer_dir), max_prompt_tokens=3)
    )
    assert skipping.prompt(0, 0) is None and skipping.prompt(0, 1) is None and skipping.skipped == 1


def test_each_prompt_is_tokenized_once_and_the_cache_is_bounded(
    sources: dict[str, Path], tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import buffer.prompts

    src = PromptSource.from_config(DataConfig(path=str(sources["jsonl"]), tokenizer=str(tokenizer_dir)))
    calls: list[int] = []
    tokenize = src._tokenize
    monkeypatch.setattr(src, "_tokenize", lambda row: calls.append(1) or tokenize(row))
    monkeypatch.setattr(buffer.prompts, "PROMPT_CACHE", 4)
    first = src.prompt(3, 0)
    again = src.prompt(3, 1)  # another epoch, or a re-queue: the same ids, not tokenized again
    assert again.tokens is first.tokens and len(calls) == 1 and again.epoch == 1
    with pytest.raises(ValueError):
        first.tokens[0] = 0  # shared by every group of the prompt: read-only
    for i in range(10):
        src.prompt(i, 0)
    assert len(src._ids) <= 4
    assert src.prompt(0, 0).tokens.tolist() == tokenize(src.rows[0]).tolist()


def test_bad_sources_say_what_to_fix(tmp_path: Path, tokenizer_dir: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x"}\n')
    with pytest.raises(ValueError, match="data.input_key 'prompt'"):
        load_rows(DataConfig(path=str(bad), tokenizer=str(tokenizer_dir)))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": \n')
    with pytest.raises(ValueError, match="broken.jsonl:1: not valid JSON"):
        load_rows(DataConfig(path=str(broken), tokenizer=str(tokenizer_dir)))
    with pytest.raises(ValueError, match="does not exist"):
        load_rows(DataConfig(path=str(tmp_path / "none.jsonl"), tokenizer=str(tokenizer_dir)))


def test_the_tokenizer_is_autotokenizer_s_without_importing_torch(tokenizer_dir: Path, tmp_path: Path) -> None:
    """The hub loads the class tokenizer_config.json names (no torch import: seconds of every hub
    start); it tokenizes exactly as AutoTokenizer's choice, and a directory that names no class
    still loads, through AutoTokenizer."""
    import shutil
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from buffer.prompts import load_tokenizer

    reference, ours = AutoTokenizer.from_pretrained(tokenizer_dir), load_tokenizer(str(tokenizer_dir))
    assert type(ours) is type(reference)
    for text in ("What is 3 + 4?", "", "  spaces\tand\nnewlines  "):
        assert ours(text, add_special_tokens=True)["input_ids"] == reference(text, add_special_tokens=True)["input_ids"]
    chat = [{"role": "user", "content": "What is 3 + 4?"}]
    ids = [
        t.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)["input_ids"] for t in (ours, reference)
    ]
    assert ids[0] == ids[1] and ids[0]

    code = f"import sys; from buffer.prompts import load_tokenizer; load_tokenizer({str(tokenizer_dir)!r}); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr

    unnamed = tmp_path / "unnamed"
    shutil.copytree(tokenizer_dir, unnamed)
    conf = json.loads((unnamed / "tokenizer_config.json").read_text())
    del conf["tokenizer_class"]
    (unnamed / "tokenizer_config.json").write_text(json.dumps(conf))
    assert load_tokenizer(str(unnamed))("What is 3 + 4?")["input_ids"] == reference("What is 3 + 4?")["input_ids"]


def test_a_row_the_chat_template_refuses_is_skipped_and_counted_not_raised(tmp_path: Path, tokenizer_dir: Path) -> None:
    """A chat template that raises on a row (Mistral's and Gemma's refuse a system message) stopped
    the hub at that row, and at the same row after every restart. Now the row is skipped, counted
    and logged, and the next rows go on; a null prompt is refused when the data loads."""
    from buffer.prompts import load_tokenizer

    tok = load_tokenizer(str(tokenizer_dir))
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    strict = tmp_path / "strict_tokenizer"
    tok.save_pretrained(strict)
    rows = [
        {"prompt": [{"role": "user", "content": "What is 1 + 1?"}]},
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]},
        {"prompt": [{"role": "user", "content": "What is 3 + 3?"}]},
    ]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = PromptSource.from_config(DataConfig(path=str(data), tokenizer=str(strict), apply_chat_template=True))
    assert src.prompt(0, 0) is not None
    assert src.prompt(1, 0) is None and src.prompt(1, 1) is None  # skipped, in every epoch
    assert src.unusable == 1 and src.skipped == 0
    assert src.prompt(2, 0) is not None

    nulls = tmp_path / "nulls.jsonl"
    nulls.write_text('{"prompt": "What is 1 + 1?"}\n{"prompt": null}\n')
    with pytest.raises(ValueError, match="1 of 2 rows lack data.input_key 'prompt' or hold null there"):
        load_rows(DataConfig(path=str(nulls), tokenizer=str(tokenizer_dir)))


def test_metadata_msgpack_cannot_hold_is_kept_as_text() -> None:
    """A math answer past 64 bits (25!), a parquet decimal or date: the hub raised at that row
    (msgpack's OverflowError, json's TypeError), outside any handler, and at the same row after
    every restart, until the launcher gave up. Now they are kept as their text."""
    import datetime
    import decimal

    import msgspec
    import numpy as np

    from buffer.prompts import _scalar

    values = {
        "big": 15511210043330985984000000,
        "decimal": decimal.Decimal("1.50"),
        "date": datetime.date(2026, 12, 3),
        "nested": {"a": [1, decimal.Decimal("2")]},
        "np": np.int64(7),
        "small": -3,
        "none": None,
    }
    kept = {k: _scalar(v) for k, v in values.items()}
    assert kept == {
        "big": "15511210043330985984000000",
        "decimal": "1.50",
        "date": "2026-12-03",
        "nested": '{"a": [1, "2"]}',
        "np": 7,
        "small": -3,
        "none": None,
    }
    msgspec.msgpack.encode(kept)  # as the hub stores it
