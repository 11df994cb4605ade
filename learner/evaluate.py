"""Greedy evaluation of a policy on the synthetic task: ``python -m learner.evaluate --model DIR
--out FILE.json [config flags]`` writes ``{"accuracy": ..., "format": ..., "n": ...}``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from flywheel.config import FlywheelConfig, pop_flags, service_config
from flywheel.tasks import arithmetic_correct, arithmetic_eval_rows


def evaluate(model_dir: str | Path, cfg: FlywheelConfig, batch_size: int = 128) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if cfg.task.name != "arithmetic":
        raise ValueError("evaluation needs a task: set task.name arithmetic")
    rows = arithmetic_eval_rows(cfg.task.eval_prompts, cfg.task.seed, cfg.task.max_operand)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    if tok.pad_token is None:  # (Llama 3, Mistral): padding is masked, any token does
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir).to(device).eval()
    hits = formatted = 0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i : i + batch_size]
        enc = tok([r["prompt"] for r in chunk], return_tensors="pt", padding=True).to(device)
        with torch.inference_mode():
            out = model.generate(
                **enc, max_new_tokens=min(cfg.rollout.max_tokens, 16), do_sample=False, pad_token_id=tok.pad_token_id
            )
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        for text, row in zip(texts, chunk, strict=True):
            hit, has_number = arithmetic_correct(text, row["answer"])
            hits += hit
            formatted += has_number
    return {"accuracy": hits / len(rows), "format": formatted / len(rows), "n": len(rows), "model": str(model_dir)}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    picked = pop_flags(args, "--model", "--out")
    if isinstance(picked, str):
        print(f"learner.evaluate: {picked}", file=sys.stderr)
        return 2
    cfg = service_config("learner.evaluate", "Greedy accuracy of a policy on the synthetic task.", args)
    if isinstance(cfg, int):
        return cfg
    result = evaluate(picked["--model"], cfg)
    Path(picked["--out"]).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
