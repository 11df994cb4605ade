"""Prompt source: JSONL, parquet or a local HF ``datasets`` directory, tokenized on demand.

The order of an epoch is a permutation seeded by (data.seed, epoch), so the only state worth
persisting is (epoch, cursor) — the hub keeps it in Redis and resumes exactly after a restart.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flywheel.config import DataConfig

log = logging.getLogger(__name__)

PROMPT_CACHE = 200_000  # tokenized prompts kept (about 100 MB at 128 tokens each)

Metadata = dict[str, str | int | float | bool | None]


@dataclass
class Prompt:
    index: int  # row in the source
    epoch: int
    tokens: np.ndarray  # int32
    metadata: Metadata
    # The prompt as the dataset gave it, for the reward functions (``prompt_text``): decoding the
    # tokens would give the chat template's text with its markers cut out.
    text: str = ""


def _detect_format(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if path.is_dir():
        return "hf_disk"
    if path.suffix in (".jsonl", ".json"):
        return "jsonl"
    if path.suffix == ".parquet":
        return "parquet"
    raise ValueError(
        f"data.path {str(path)!r}: cannot tell its format from the suffix; set data.format to jsonl, parquet or hf_disk"
    )


def load_rows(cfg: DataConfig) -> list[dict[str, Any]]:
    """Read the source into rows holding only the input key and metadata keys."""
    assert cfg.path is not None
    path = Path(cfg.path)
    if not path.exists():
        raise ValueError(f"data.path {str(path)!r} does not exist")
    fmt = _detect_format(path, cfg.format)
    keep = [cfg.input_key, *cfg.metadata_keys]
    if fmt == "jsonl":
        rows = []
        with path.open() as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
                    rows.append({k: row[k] for k in keep if k in row})
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        cols = [k for k in keep if k in table.column_names]
        rows = table.select(cols).to_pylist()
    else:
        import datasets

        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            split = "train" if "train" in ds else next(iter(ds))
            log.info("data.path is a DatasetDict; using split %r", split)
            ds = ds[split]
        cols = [k for k in keep if k in ds.column_names]
        rows = ds.select_columns(cols).to_list()
    # a null (parquet, datasets) would train as the prompt "None", or fail a chat template
    missing = sum(1 for r in rows if r.get(cfg.input_key) is None)
    if not rows:
        raise ValueError(f"data.path {str(path)!r} holds no rows")
    if missing:
        raise ValueError(
            f"{missing} of {len(rows)} rows lack data.input_key {cfg.input_key!r} or hold null there; set "
            "--data.input_key to the prompt field, or drop those rows"
        )
    return rows


class PromptSource:
    """Yields tokenized prompts in seeded epoch order from a persisted (epoch, cursor)."""

    def __init__(self, cfg: DataConfig, rows: list[dict[str, Any]], tokenizer: Any) -> None:
        self.cfg = cfg
        self.rows = rows
        self.tokenizer = tokenizer
        self.truncated = 0
        self.skipped = 0  # rows found over data.max_prompt_tokens (data.overlong_prompts skip), once each
        self.unusable = 0  # rows the tokenizer (or its chat template) failed on, once each
        self._skip: set[int] = set()  # rows of either kind: never issued
        # Tokenized prompts by row: every epoch and every re-queue of a prompt reuses them
        # (tokenizing was 2-4% of the hub's loop). Bounded, oldest out first.
        self._ids: dict[int, np.ndarray] = {}
        self._order_epoch = -1
        self._order: np.ndarray = np.arange(0)

    @classmethod
    def from_config(cls, cfg: DataConfig) -> PromptSource:
        assert cfg.tokenizer is not None
        return cls(cfg, load_rows(cfg), load_tokenizer(cfg.tokenizer))

    def __len__(self) -> int:
        return len(self.rows)

    def order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            idx = np.arange(len(self.rows))
            if self.cfg.shuffle:
                np.random.default_rng([self.cfg.seed, epoch]).shuffle(idx)
            self._order, self._order_epoch = idx, epoch
        return self._order

    def exhausted(self, epoch: int) -> bool:
        return epoch >= self.cfg.epochs

    def index_at(self, epoch: int, cursor: int) -> int:
        return int(self.order(epoch)[cursor])

    def prompt(self, index: int, epoch: int) -> Prompt | None:
        """The row's prompt, or None for one to skip: over ``max_prompt_tokens``, or one the
        tokenizer fails on. Raising instead would stop the hub at the same row after every
        restart (the cursor's advance is written with the turn the error cut short)."""
        if index in self._skip:
            return None
        row = self.rows[index]
        ids = self._ids.get(index)
        if ids is None:
            try:
                tokenized = self._tokenize(row)
            except Exception as err:  # noqa: BLE001 - the tokenizer's own code (a chat template's raise_exception)
                self._skip.add(index)
                self.unusable += 1
                if self.unusable <= 10 or self.unusable % 1000 == 0:
                    log.error(
                        "prompt row %d: the tokenizer failed on it (%s: %s): skipped (%d so far); check the row, "
                        "data.input_key and data.apply_chat_template",
                        index,
                        type(err).__name__,
                        err,
                        self.unusable,
                    )
                return None
            if tokenized is None:
                self._skip.add(index)
                self.skipped += 1
                if self.skipped <= 10 or self.skipped % 1000 == 0:
                    log.warning(
                        "prompt row %d is over data.max_prompt_tokens %d: skipped (%d so far; data.overlong_prompts)",
                        index,
                        self.cfg.max_prompt_tokens,
                        self.skipped,
                    )
                return None
            ids = self._ids[index] = tokenized
            if len(self._ids) > PROMPT_CACHE:
                del self._ids[next(iter(self._ids))]
        meta: Metadata = {k: _scalar(row[k]) for k in self.cfg.metadata_keys if k in row}
        return Prompt(index, epoch, ids, meta, prompt_text(row[self.cfg.input_key]))

    def _tokenize(self, row: dict[str, Any]) -> np.ndarray | None:
        text = row[self.cfg.input_key]
        if self.cfg.apply_chat_template:
            messages = text if isinstance(text, list) else [{"role": "user", "content": text}]
            ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
            if hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = self.tokenizer(str(text), add_special_tokens=True)["input_ids"]
        if len(ids) > self.cfg.max_prompt_tokens:
            if self.cfg.overlong_prompts == "skip":
                return None
            self.truncated += 1
            ids = ids[-self.cfg.max_prompt_tokens :]
        out = np.asarray(ids, dtype=np.int32)
        out.flags.writeable = False  # shared by every group of this prompt
        return out


def prompt_text(value: Any) -> str:
    """The prompt as the reward functions read it: a string as it is; of a list of chat messages,
    the last user message's content (what a reward model's own chat template wraps)."""
    if isinstance(value, list):
        users = [m for m in value if isinstance(m, dict) and m.get("role") == "user"]
        content = users[-1].get("content") if users else None
        return content if isinstance(content, str) else json.dumps(value)
    return str(value)


def load_tokenizer(path: str) -> Any:
    """The tokenizer ``AutoTokenizer.from_pretrained(path)`` would load, without its import of
    torch (through the model configuration classes): 4-5 s of a hub's start, or of its restart.

    A local directory whose ``tokenizer_config.json`` names a ``tokenizer_class`` that transformers
    has gets that class directly, which is what AutoTokenizer does with it. Anything else (a hub
    name, no class named, custom code under ``auto_map``) goes through AutoTokenizer."""
    import transformers  # heavy: only once the config is parsed

    try:
        conf = json.loads((Path(path) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        conf = {}
    name = conf.get("tokenizer_class") if isinstance(conf, dict) else None
    if isinstance(name, str) and "auto_map" not in conf:
        tokenizer_class = getattr(transformers, name, None)
        if tokenizer_class is not None:
            return tokenizer_class.from_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)


def _scalar(value: Any) -> str | int | float | bool | None:
    """A metadata value as the hub stores it (msgpack) and the reward functions get it: scalars as
    they are, anything else as its JSON text. What msgpack or JSON cannot hold (a parquet decimal
    or date, an integer past 64 bits: a factorial's answer) as its text, not a crash: raised
    here, it stopped the hub at that row, and at the same row after every restart."""
    if isinstance(value, np.generic):  # a numpy scalar (a parquet or HF datasets column)
        value = value.item()
    if value is None or isinstance(value, str | float | bool):
        return value
    if isinstance(value, int):
        return value if -(1 << 63) <= value < (1 << 64) else str(value)
    if isinstance(value, list | tuple | dict):
        return json.dumps(value, default=str)
    return str(value)
