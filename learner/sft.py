"""The supervised warm start of ``flywheel run``: ``python -m learner.sft --sft.output_dir DIR
[config flags]`` trains ``train.model`` on the task's prompts and saves the result (model and
tokenizer) for the generators and the learner to start from.

With ``sft.format_only`` (the default) the completions are random answers in the right format
(" 7</s>"): the policy learns how to answer, not what, and RL has the task left to learn.
"""

from __future__ import annotations

import json
import logging
import random
import sys
import time
from pathlib import Path

from flywheel.config import FlywheelConfig, pop_flags, service_config
from flywheel.logs import setup_logging
from flywheel.tasks import answer_range, arithmetic_rows

log = logging.getLogger("sft")


def warm_start(
    cfg: FlywheelConfig, output_dir: str | Path, rows: list[dict[str, str]] | None = None
) -> dict[str, float]:
    """``rows`` ({"prompt", "answer"}) replace the arithmetic task's prompts (another synthetic task;
    a format-only warm start then draws its random answers from theirs)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if cfg.train.model is None or cfg.task.name != "arithmetic":
        raise ValueError("sft needs train.model and task.name arithmetic")
    torch.manual_seed(cfg.run.seed)
    rng = random.Random(cfg.run.seed)
    tok = AutoTokenizer.from_pretrained(cfg.train.model)
    model = AutoModelForCausalLM.from_pretrained(cfg.train.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device).train()
    if rows is None:
        rows = arithmetic_rows(cfg.task.prompts, cfg.task.seed, cfg.task.max_operand)
        answers = answer_range(cfg.task.max_operand)
    else:
        answers = sorted({r["answer"] for r in rows})
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft.lr)
    start, losses = time.monotonic(), []
    for step in range(cfg.sft.steps):
        batch = rng.sample(rows, min(cfg.sft.batch_size, len(rows)))
        ids, labels = [], []
        for row in batch:
            answer = rng.choice(answers) if cfg.sft.format_only else row["answer"]
            prompt = tok(row["prompt"])["input_ids"]
            completion = tok(" " + answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids.append(prompt + completion)
            labels.append([-100] * len(prompt) + completion)  # loss on the completion only
        width = max(len(x) for x in ids)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id  # (Llama 3 has none)
        input_ids = torch.tensor([x + [pad] * (width - len(x)) for x in ids], device=device)
        label_t = torch.tensor([x + [-100] * (width - len(x)) for x in labels], device=device)
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids], device=device)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=label_t).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == cfg.sft.steps - 1:
            log.info("sft step %d/%d loss %.3f", step + 1, cfg.sft.steps, loss.item())
    out = Path(output_dir)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return {"steps": cfg.sft.steps, "final_loss": losses[-1] if losses else 0.0, "seconds": time.monotonic() - start}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    picked = pop_flags(args, "--out")
    if isinstance(picked, str):
        print(f"learner.sft: {picked}", file=sys.stderr)
        return 2
    out = picked["--out"]
    cfg = service_config("learner.sft", "Supervised warm start on the task's format.", args)
    if isinstance(cfg, int):
        return cfg
    setup_logging("sft", cfg.run.log_level)
    stats = warm_start(cfg, out)
    from learner.evaluate import evaluate

    result = {"sft": stats, "eval": evaluate(out, cfg)}
    (Path(out) / "warm_start.json").write_text(json.dumps(result, indent=2) + "\n")
    log.info("warm start done: %s", json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
