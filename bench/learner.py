"""Learner step throughput: the real ``learner.trainer.Trainer`` (DeepSpeed ZeRO-2) on synthetic
batches shaped like RL rollouts (groups of samples with long-tailed response lengths), packed and
unpacked (padded) micro-batches in the same run.

On CPU (``--quick`` or default) it reports tokens/s; on a GPU (``--gpu``) a ~0.9B Llama in bf16
and the model FLOPs utilisation: 6 x parameters x trained tokens per second over the GPU's peak
(989 TFLOP/s dense bf16 for an H200). The batch source is synthetic so the figure is the learner's
own (no hub wait); the off-policy correction is ``none`` for the MFU rows (no proximal forward)
and ``decoupled`` in one more row, whose extra no-grad forward is not counted as useful work.

    python bench/learner.py [--quick] [--gpu]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

H200_PEAK_BF16 = 989e12


def synthetic_batch(groups: int, n: int, prompt_len: int, median: int, cap: int, vocab: int, seed: int):  # type: ignore[no-untyped-def]
    from flywheel.hub_client import Batch, RolloutGroup, RolloutSample

    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = rng.integers(4, min(vocab, 512), prompt_len).astype(np.int32)
        samples = []
        for _ in range(n):
            length = int(np.clip(rng.lognormal(np.log(median), 1.0), 8, cap))
            samples.append(
                RolloutSample(
                    tokens=rng.integers(4, vocab, length).astype(np.int32),
                    logprobs=-rng.exponential(1.0, length).astype(np.float32),
                    versions=np.zeros(length, np.int32),
                    finish_reason="stop",
                    reward=float(rng.integers(0, 2)),
                    reward_breakdown={},
                    reward_error=None,
                )
            )
        out.append(RolloutGroup(g, 0, 0, g, prompt, {}, samples))
    return Batch(0, out, 0, 0.0, [0] * groups)


def measure(
    model_dir: Path,
    packing: bool,
    correction: str,
    gpu: bool,
    batch_args: dict,  # type: ignore[type-arg]
    steps: int,
    attn: str = "sdpa",
    checkpointing: bool = False,
) -> dict[str, float]:
    from flywheel.config import load_config
    from flywheel.redis_server import free_port
    from learner.trainer import Trainer

    cfg = load_config(
        [
            "--redis.url", "redis://127.0.0.1:1/0",  # never contacted: batches are synthetic
            "--train.model", str(model_dir), "--train.micro_batch_tokens", str(batch_args["budget"]),
            "--train.packing", str(packing).lower(), "--algo.off_policy.correction", correction,
            "--train.attn_implementation", attn,
            "--train.gradient_checkpointing", str(checkpointing).lower(), "--ds.zero_stage", "2",
            "--sync.announce_port", str(free_port()), "--sync.join_port", str(free_port()), "--wandb.mode", "disabled",
        ]
    )  # fmt: skip
    trainer = Trainer(cfg, 0, 1)
    params = sum(p.numel() for p in trainer.engine.module.parameters())
    batches = [
        synthetic_batch(batch_args["groups"], 8, 64, batch_args["median"], batch_args["cap"], batch_args["vocab"], s)
        for s in range(steps + 1)
    ]
    trainer.train_step(batches[0])  # warm-up
    import torch

    if gpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    tokens = 0
    for b in batches[1:]:
        stats = trainer.train_step(b)
        assert stats is not None
        tokens += sum(len(g.prompt_tokens) + len(s.tokens) for g in b.groups for s in g.samples)
    if gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    trainer.close()
    del trainer
    if gpu:
        torch.cuda.empty_cache()
    tps = tokens / seconds
    row = {
        "packing": packing,
        "attn": attn,
        "correction": correction,
        "checkpointing": checkpointing,
        "micro_batch_tokens": batch_args["budget"],
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tps,
        "params": params,
    }
    if gpu:
        row["mfu"] = 6 * params * tps / H200_PEAK_BF16
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--gpu", action="store_true", help="~0.9B model in bf16 on the GPU, with MFU")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from flywheel.redis_server import free_port
    from flywheel.tiny import build_checkpoint

    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"})
    os.environ["MASTER_PORT"] = str(free_port())
    import torch

    if not args.gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if args.gpu else "gloo")
    work = Path(tempfile.mkdtemp(prefix="fw-bench-learner-"))
    if args.gpu:
        model_dir = build_checkpoint(work / "model", size="1b", vocab_size=32000)
        batch_args = {"groups": 16, "median": 512, "cap": 4096, "vocab": 32000, "budget": 16384}
        steps = 3
    else:
        model_dir = build_checkpoint(work / "model", size="tiny" if args.quick else "small")
        batch_args = {"groups": 4, "median": 48, "cap": 400, "vocab": 512, "budget": 4096}
        steps = 2 if args.quick else 4
    if args.gpu:
        # MFU over the knobs that move it: activation checkpointing (recomputes the forward: a
        # third more compute that is not counted as useful) and the micro-batch token budget.
        big = {**batch_args, "budget": 2 * batch_args["budget"]}
        rows = [
            measure(model_dir, True, "none", True, big, steps, "flex_attention"),
            measure(model_dir, True, "none", True, batch_args, steps, "flex_attention"),
            measure(model_dir, False, "none", True, batch_args, steps, "sdpa"),
            measure(model_dir, True, "none", True, batch_args, steps, "flex_attention", checkpointing=True),
            measure(model_dir, True, "decoupled", True, big, steps, "flex_attention"),
            measure(model_dir, True, "none", True, batch_args, steps, "sdpa"),
        ]
        packed, padded = rows[1], rows[2]
    else:
        rows = [
            measure(model_dir, True, "none", False, batch_args, steps, "sdpa"),
            measure(model_dir, False, "none", False, batch_args, steps, "sdpa"),
            measure(model_dir, True, "decoupled", False, batch_args, steps, "sdpa"),
        ]
        packed, padded = rows[0], rows[1]
    print(
        f"{'attn':>15} {'packing':>8} {'correction':>10} {'ckpt':>5} {'budget':>6} {'tokens':>8} {'s':>7} {'tokens/s':>9} {'MFU':>6}"
    )
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if "mfu" in r else "-"
        print(
            f"{r['attn']:>15} {r['packing']!s:>8} {r['correction']:>10} {r['checkpointing']!s:>5} {r['micro_batch_tokens']:>6} "
            f"{r['tokens']:>8} {r['seconds']:>7.2f} {r['tokens_per_s']:>9.0f} {mfu:>6}"
        )
    headline = {"packing_speedup": packed["tokens_per_s"] / padded["tokens_per_s"]}
    if args.gpu:
        headline["gpu_mfu"] = max(r["mfu"] for r in rows if r["packing"] and r["correction"] == "none")
    else:
        headline["cpu_tokens_per_s"] = packed["tokens_per_s"]
    result = {
        "headline": headline,
        "rows": rows,
        "config": {"mode": "gpu" if args.gpu else ("quick" if args.quick else "full"), **batch_args, "steps": steps, "zero_stage": 2,
                   "dtype": "bf16" if args.gpu else "fp32"},
        "machine": {"platform": platform.platform(), "gpu": torch.cuda.get_device_name(0) if args.gpu else None, "cpus": os.cpu_count()},
    }  # fmt: skip
    out = Path(args.out or ROOT / "bench" / "results" / ("learner_gpu.json" if args.gpu else "learner.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(headline))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
