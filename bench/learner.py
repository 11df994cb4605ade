"""Learner step throughput: the real ``learner.trainer.Trainer`` (DeepSpeed ZeRO-2) on synthetic
batches shaped like RL rollouts (groups of samples with long-tailed response lengths), packed and
unpacked (padded) micro-batches in the same run.

On CPU (``--quick`` or default) it reports tokens/s; on a GPU (``--gpu``) a ~0.9B Llama in bf16
and the model FLOPs utilisation: the model's FLOPs per second over the GPU's peak (989 TFLOP/s
dense bf16 for an H200). The FLOPs of a step are ``model_flops``: 6 x the parameters that
multiply (not the input embedding, a lookup) x trained tokens, plus causal attention's
6 x layers x hidden x the sum of each sequence's length squared (``--from-results`` recounts a
recorded run's rows so; they were 6 x every parameter x tokens before, about 1% higher here). The batch source is synthetic so the figure is the learner's
own (no hub wait); the off-policy correction is ``none`` for the MFU rows (no proximal forward)
and ``decoupled`` in one more row, whose extra no-grad forward is not counted as useful work.
On the GPU the first row is the old path (full-vocabulary fp32 log-softmax, eager layers, flex
attention), measured in the same run as the default path (``learner/logprobs.py``,
``learner/speedups.py``) so their ratio holds on any machine.

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
from typing import Any

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


def model_flops(config: Any, params: int, batches: list[Any]) -> float:
    """Useful FLOPs of training on ``batches`` (forward and backward; recomputation is not useful):
    6 x multiplying parameters x tokens, plus causal attention (QK^T and AV over each sequence's
    earlier positions) 6 x layers x hidden x sum(T^2), every sample its own sequence."""
    embed = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size  # a lookup
    tokens = lengths_sq = 0
    for b in batches:
        for g in b.groups:
            for smp in g.samples:
                t = len(g.prompt_tokens) + len(smp.tokens)
                tokens, lengths_sq = tokens + t, lengths_sq + t * t
    dense = 6 * (params - embed) * tokens
    attention = 6 * config.num_hidden_layers * config.hidden_size * lengths_sq
    return float(dense + attention)


def measure(
    model_dir: Path,
    packing: bool,
    correction: str,
    gpu: bool,
    batch_args: dict,  # type: ignore[type-arg]
    steps: int,
    attn: str = "sdpa",
    checkpointing: bool = False,
    fused: bool = True,
    compiled: bool = True,
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
    if not fused:  # the plain path: full [tokens, vocab] logits, fp32 log-softmax (the baseline)
        trainer.fused_logprobs = trainer.compile_loss = False
    if not compiled:  # eager decoder layers (the baseline)
        trainer.compile_regions = False
    params = sum(p.numel() for p in trainer.engine.module.parameters())
    model_config = trainer.engine.module.config
    import torch
    from torch._dynamo.utils import counters

    def batch(seed: int):  # a hub Batch
        a = batch_args
        return synthetic_batch(a["groups"], 8, 64, a["median"], a["cap"], a["vocab"], seed)

    # Warm-up until compilation settles (GPU: the compiled regions meet new micro-batch lengths and
    # recompile a few times over the first steps of a process; timing must not include that).
    for warm in range(6 if gpu else 1):
        before = counters["stats"]["unique_graphs"]
        trainer.train_step(batch(1000 + warm))
        if warm >= 1 and counters["stats"]["unique_graphs"] == before:
            break
    batches = [batch(s) for s in range(steps)]
    graphs = counters["stats"]["unique_graphs"]
    if gpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    tokens = 0
    for b in batches:
        stats = trainer.train_step(b)
        assert stats is not None
        tokens += sum(len(g.prompt_tokens) + len(s.tokens) for g in b.groups for s in g.samples)
    if gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if gpu:
        row_peak = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    fused_used, compiled_used = trainer.fused_logprobs, trainer.compile_regions
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
        "fused_logprobs": fused_used,
        "compiled_layers": compiled_used,
        "micro_batch_tokens": batch_args["budget"],
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tps,
        "params": params,
        "warmup_steps": warm + 1,
        "graphs_compiled_while_timed": counters["stats"]["unique_graphs"] - graphs,  # 0: no compile in the timing
    }
    if gpu:
        row["mfu"] = model_flops(model_config, params, batches) / seconds / H200_PEAK_BF16
        row["peak_memory_gib"] = row_peak
    return row


def gpu_headline(rows: list[dict[str, Any]]) -> dict[str, float]:
    return {
        "gpu_mfu": max(r["mfu"] for r in rows if r["packing"] and r["correction"] == "none"),
        "gpu_mfu_old_path": rows[0]["mfu"],
    }


def recount(path: Path) -> int:
    """A recorded GPU run's MFU, counted again by ``model_flops``: its batches are rebuilt from
    their seeds (checked against the recorded token count) and its times are kept."""
    from flywheel.tiny import model_config

    result = json.loads(path.read_text())
    c = result["config"]
    config = model_config("llama", "1b", vocab_size=c["vocab"])  # what --gpu trains
    batches = [synthetic_batch(c["groups"], 8, 64, c["median"], c["cap"], c["vocab"], s) for s in range(c["steps"])]
    for r in result["rows"]:
        tokens = sum(len(g.prompt_tokens) + len(smp.tokens) for b in batches for g in b.groups for smp in g.samples)
        assert tokens == r["tokens"], f"rebuilt batches hold {tokens} tokens, the row {r['tokens']}"
        if "mfu" in r:
            r.setdefault("mfu_6n", r["mfu"])  # the earlier count: 6 x every parameter x tokens
            r["mfu"] = model_flops(config, r["params"], batches) / r["seconds"] / H200_PEAK_BF16
    result["headline"].update(gpu_headline(result["rows"]))
    result["mfu_count"] = "model_flops (bench/learner.py); mfu_6n: 6 x every parameter x tokens, the earlier count"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["headline"]))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="under a minute: the tiny model, packed and padded, 2 steps")
    p.add_argument("--gpu", action="store_true", help="~0.9B model in bf16 on the GPU, with MFU")
    p.add_argument("--out", default=None)
    p.add_argument(
        "--from-results",
        default=None,
        help="run nothing: recount the MFU of a recorded --gpu run's rows with model_flops (same batches, same times)",
    )
    args = p.parse_args()
    if args.from_results:
        return recount(Path(args.from_results))
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
        # The old path first (flex attention, eager layers, full-vocabulary fp32 log-softmax): the
        # same-run baseline. Then the default path (fused log-probabilities, compiled layers) over
        # the knobs that move MFU: the attention kernel (flash_attention_2 runs PyTorch's FA2
        # varlen kernels here, flash-attn not being installed), the micro-batch token budget and
        # activation checkpointing (recomputes the forward: compute not counted as useful).
        b32 = {**batch_args, "budget": 32768}
        b48 = {**batch_args, "budget": 49152}
        fa2 = "flash_attention_2"
        rows = [
            measure(model_dir, True, "none", True, b32, steps, "flex_attention", fused=False, compiled=False),
            measure(model_dir, True, "none", True, b48, steps, fa2),
            measure(model_dir, True, "none", True, b32, steps, fa2),
            measure(model_dir, True, "none", True, batch_args, steps, fa2),
            measure(model_dir, True, "none", True, b32, steps, "flex_attention"),
            measure(model_dir, True, "none", True, b32, steps, fa2, checkpointing=True),
            measure(model_dir, True, "decoupled", True, b48, steps, fa2),
            measure(model_dir, False, "none", True, batch_args, steps, "sdpa"),
        ]
        packed, padded = rows[3], rows[7]
    else:
        rows = [
            measure(model_dir, True, "none", False, batch_args, steps, "sdpa"),
            measure(model_dir, False, "none", False, batch_args, steps, "sdpa"),
        ]
        if not args.quick:  # quick (under a minute): packed and padded only
            rows.append(measure(model_dir, True, "decoupled", False, batch_args, steps, "sdpa"))
        packed, padded = rows[0], rows[1]
    print(
        f"{'attn':>17} {'packing':>8} {'fused':>6} {'compiled':>8} {'correction':>10} {'ckpt':>5} {'budget':>6} {'tokens':>8} {'s':>7} {'tokens/s':>9} {'MFU':>6}"
    )
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if "mfu" in r else "-"
        print(
            f"{r['attn']:>17} {r['packing']!s:>8} {r['fused_logprobs']!s:>6} {r['compiled_layers']!s:>8} {r['correction']:>10} {r['checkpointing']!s:>5} {r['micro_batch_tokens']:>6} "
            f"{r['tokens']:>8} {r['seconds']:>7.2f} {r['tokens_per_s']:>9.0f} {mfu:>6}"
        )
    headline = {"packing_speedup": packed["tokens_per_s"] / padded["tokens_per_s"]}
    if args.gpu:
        headline.update(gpu_headline(rows))
    else:
        headline["cpu_tokens_per_s"] = packed["tokens_per_s"]
    result = {
        "headline": headline,
        "rows": rows,
        "config": {"mode": "gpu" if args.gpu else ("quick" if args.quick else "full"), **batch_args, "steps": steps, "zero_stage": 2,
                   "dtype": "bf16" if args.gpu else "fp32"},
        "machine": {"platform": platform.platform(), "gpu": torch.cuda.get_device_name(0) if args.gpu else None, "cpus": os.cpu_count()},
        "mfu_count": "model_flops (bench/learner.py)",
    }  # fmt: skip
    name = "learner_gpu" if args.gpu else "learner"
    out = Path(
        args.out or ROOT / "bench" / "results" / f"{name}{'_quick' if args.quick else ''}.json"
    )  # quick: never the record
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(headline))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
