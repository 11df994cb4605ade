"""Generation: the vLLM engine of a Flywheel generator against a plain HF ``generate`` loop, and
the weight sync against a raw broadcast of the same bytes, in one run.

Phases:
  A. HF ``generate`` in static batches (the baseline): sampling, log-probabilities from the
     scores, each batch runs until its longest request is done.
  B. The generator's vLLM engine (built by ``generators.engine.build_engine``, same engine
     arguments as the service) on the same requests, streamed as token deltas with
     log-probabilities, all submitted at once.
     Requests are realistic: response lengths drawn from a long-tailed distribution (lognormal:
     most short, a few 10x longer), n samples per prompt; useful tokens are counted on both
     sides (tokens past a request's own length are waste).
  C. Weight transfer between two processes over gloo: Flywheel's bucketed broadcast (pack,
     broadcast, unpack every bucket) over a sweep of bucket sizes that holds the default
     (``sync.bucket_mb``), against one raw broadcast of a flat tensor of the same bytes. The raw
     broadcast is timed beside every bucketed one and pooled into one baseline (two processes
     on two shared cores: one row's own raw median moved by 1.7x from row to row). The
     headline is the default's efficiency, what a run gets; the sweep shows the others.
  D. (full mode) The in-flight update latency of a running generator service: WeightsReady ->
     pause -> receive -> reload -> resume -> WeightsAck, measured by the learner's broadcaster.

    python bench/generation.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

console = Console(width=140)


# --------------------------------------------------------------------------- requests


def make_requests(tok_dir: Path, prompts: int, n: int, median: int, cap: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, response length) per sequence; n sequences per prompt."""
    from transformers import AutoTokenizer

    from flywheel.tiny import arithmetic_rows

    tok = AutoTokenizer.from_pretrained(tok_dir)
    rng = np.random.default_rng(seed)
    out = []
    for row in arithmetic_rows(prompts, seed):
        ids = tok(row["prompt"])["input_ids"]
        for _ in range(n):
            length = int(np.clip(rng.lognormal(np.log(median), 1.0), 4, cap))
            out.append((ids, length))
    return out


def length_stats(reqs: list[tuple[list[int], int]]) -> dict[str, float]:
    lengths = np.array([r[1] for r in reqs])
    return {
        "p50": float(np.median(lengths)),
        "p90": float(np.percentile(lengths, 90)),
        "max": float(lengths.max()),
        "mean": float(lengths.mean()),
    }


# --------------------------------------------------------------------------- A. HF generate


def run_hf(model_dir: Path, reqs: list[tuple[list[int], int]], batch: int, device: str = "cpu") -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    pad = model.config.pad_token_id

    def one_batch(part: list[tuple[list[int], int]]) -> int:
        width = max(len(p) for p, _ in part)
        ids = torch.full((len(part), width), pad, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(part):  # left padding, as decoder-only generation needs
            ids[i, width - len(p) :] = torch.tensor(p, device=device)
            mask[i, width - len(p) :] = 1
        longest = max(n for _, n in part)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                max_new_tokens=longest,
                min_new_tokens=longest,  # the same lengths as vLLM: no early EOS on either side
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=pad,
            )
            new = out.sequences[:, width:]
            scores = torch.stack(out.scores, 1)  # [B, T, V]
            logprobs = torch.log_softmax(scores.float(), -1).gather(2, new[..., None])[..., 0]
        assert logprobs.shape == new.shape
        logprobs.cpu()  # the caller wants them on the host, and this waits for the GPU
        return sum(n for _, n in part)  # useful tokens: each request's own length

    one_batch(reqs[: min(4, len(reqs))])  # warm-up
    start = time.perf_counter()
    useful = sum(one_batch(reqs[i : i + batch]) for i in range(0, len(reqs), batch))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": useful, "tokens_per_s": useful / seconds}


# --------------------------------------------------------------------------- B. vLLM engine


async def stream_request(engine: Any, i: int, prompt: list[int], length: int) -> int:
    """One request of exactly ``length`` sampled tokens, streamed with log-probabilities as the
    generator service consumes them; returns the tokens received."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        max_tokens=length,
        min_tokens=length,
        temperature=1.0,
        logprobs=0,
        output_kind=RequestOutputKind.DELTA,
        detokenize=False,
        seed=i,
    )
    got = 0
    lps: list[float] = []
    async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt), params, f"r{i}-{time.monotonic_ns()}"):
        c = out.outputs[0]
        lps.extend(c.logprobs[k][t].logprob for k, t in enumerate(c.token_ids))
        got += len(c.token_ids)
    assert len(lps) == got
    return got


async def _vllm(model_dir: Path, reqs: list[tuple[list[int], int]], enforce_eager: bool) -> dict[str, float]:
    from flywheel.config import GeneratorConfig
    from generators.engine import build_engine

    engine = build_engine(GeneratorConfig(model=str(model_dir), enforce_eager=enforce_eager, max_num_seqs=256))

    def one(i: int, prompt: list[int], length: int) -> Any:
        return stream_request(engine, i, prompt, length)

    try:
        await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(reqs[:8])))  # warm-up
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(reqs)))
        seconds = time.perf_counter() - start
    finally:
        engine.shutdown()
    tokens = sum(counts)
    assert tokens == sum(n for _, n in reqs), "vLLM returned fewer tokens than requested"
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


# --------------------------------------------------------------------------- C. weight transfer


def _sync_receiver(port: int, plans: list[bytes], flat_bytes: int, repeats: int) -> None:
    import torch

    from flywheel.weights import join_group, receive
    from flywheel.wire import Decoder, WeightsReady

    group = join_group("gloo", "127.0.0.1", port, 1, 2, 1, 120)
    flat = torch.empty(flat_bytes, dtype=torch.uint8)
    tiny = torch.empty(1, dtype=torch.uint8)
    for raw in plans:
        ready = Decoder(WeightsReady).decode(raw)
        assert isinstance(ready, WeightsReady)
        for _name, _t in receive(group, ready):  # warm-up, as the sender does
            pass
        group.broadcast(flat)
        for _ in range(repeats):
            group.broadcast(tiny)  # both sides start each timed transfer together
            group.broadcast(flat)  # raw baseline
            group.broadcast(tiny)
            for _name, _t in receive(group, ready):
                pass  # views of the received bucket; loading them is phase D's business
    group.close()


def run_sync(model_dir: Path, bucket_mbs: list[float], repeats: int) -> list[dict[str, float]]:
    import torch
    from transformers import AutoModelForCausalLM

    from flywheel.weights import host_store, join_group, plan_buckets, send
    from flywheel.wire import WeightsReady, encode

    tensors = dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict())
    plans = []
    for mb in bucket_mbs:
        buckets = plan_buckets(tensors.items(), int(mb * (1 << 20)))
        plans.append((mb, buckets))
    total = max(sum(b.nbytes for b in buckets) for _, buckets in plans)
    store = host_store("127.0.0.1", 120)
    raws = [
        encode(
            WeightsReady(
                version=1,
                buckets=b,
                transport="gloo",
                deadline=time.time() + 600,
                epoch=1,
                master_addr="127.0.0.1",
                master_port=store.port,
                world_size=2,
                ranks={"bench": 1},
            )
        )
        for _, b in plans
    ]
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_sync_receiver, args=(store.port, raws, total, repeats))
    proc.start()
    group = join_group("gloo", "127.0.0.1", store.port, 0, 2, 1, 120, store=store)
    flat = torch.zeros(total, dtype=torch.uint8)
    tiny = torch.zeros(1, dtype=torch.uint8)
    rows = []
    pooled_raw: list[float] = []
    for mb, buckets in plans:
        raw_s, bucketed_s = [], []
        send(group, buckets, tensors)  # warm-up: allocates (and faults in) the reusable buffers
        group.broadcast(flat)
        for _ in range(repeats):
            # a one-byte broadcast first: the timed transfer then starts with the receiver waiting
            # for it, whatever it was still doing after the last one (which otherwise fell into
            # the next row's time: the raw one's, after a bucketed receive)
            group.broadcast(tiny)
            t0 = time.perf_counter()
            group.broadcast(flat)
            raw_s.append(time.perf_counter() - t0)
            group.broadcast(tiny)
            t0 = time.perf_counter()
            send(group, buckets, tensors)
            bucketed_s.append(time.perf_counter() - t0)
        pooled_raw += raw_s
        nbytes = sum(b.nbytes for b in buckets)
        raw, bucketed = float(np.median(raw_s)), float(np.median(bucketed_s))
        rows.append(
            {
                "bucket_mb": mb,
                "buckets": len(buckets),
                "bytes": nbytes,
                "raw_s": raw,  # this row's own raw median (the efficiency uses the pooled one)
                "bucketed_s": bucketed,
                "bucketed_gb_s": nbytes / bucketed / 1e9,
            }
        )
    proc.join(timeout=120)
    group.close()
    baseline = float(np.median(pooled_raw))  # every row moves the same bytes: one baseline for all
    for r in rows:
        r["raw_pooled_s"] = baseline
        r["raw_gb_s"] = total / baseline / 1e9
        r["efficiency"] = (r["bytes"] / r["bucketed_s"]) / (total / baseline)
    return rows


# --------------------------------------------------------------------------- D. in-flight update


def run_inflight(work: Path, model_dir: Path, syncs: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    from flywheel.config import SyncConfig
    from flywheel.procs import Service, wait_for_state_file
    from flywheel.redis_server import RedisServer, free_port
    from flywheel.tiny import write_arithmetic_jsonl
    from learner.weight_sync import WeightBroadcaster

    data = write_arithmetic_jsonl(work / "prompts.jsonl", 500)
    redis_server = RedisServer(work / "redis")
    base = ["--redis.url", redis_server.url, "--data.path", str(data), "--data.tokenizer", str(model_dir)]
    base += ["--hub.metrics_port", "0", "--async.max_staleness", "1000", "--rollout.max_tokens", "128"]
    wb = WeightBroadcaster(SyncConfig(announce_port=free_port(), join_port=free_port(), timeout_s=60))
    env = {"PYTHONPATH": str(ROOT)}
    services = []
    try:
        hub = Service(
            "hub",
            "buffer",
            [*base, "--hub.generator_port", "0", "--hub.reward_port", "0", "--hub.state_file", str(work / "hub.json")],
            work,
            env,
        )
        services.append(hub)
        ports = wait_for_state_file(work / "hub.json", hub, 120)
        services.append(
            Service(
                "reward",
                "reward_service",
                [
                    *base,
                    "--reward.functions",
                    "length",
                    "--reward.hub_address",
                    f"tcp://127.0.0.1:{ports['reward_port']}",
                ],
                work,
                env,
            )
        )
        gen_args = [*base, "--generator.model", str(model_dir), "--generator.id", "bench"]
        gen_args += ["--generator.hub_address", f"tcp://127.0.0.1:{ports['generator_port']}"]
        gen_args += ["--sync.announce_port", str(wb.cfg.announce_port), "--sync.join_port", str(wb.cfg.join_port)]
        services.append(Service("generator", "generators", gen_args, work, env))
        if not wb.wait_for_members(1, 300):
            raise RuntimeError(f"generator never joined:\n{services[-1].tail()}")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        totals = []
        for v in range(1, syncs + 1):
            time.sleep(0.5)  # generation runs between syncs: each one lands mid-generation
            report = wb.sync(v, model.state_dict().items())
            if report.acked != ["bench"]:
                raise RuntimeError(f"sync {v} failed: {report}")
            totals.append(report.total_s)
        nbytes = report.nbytes
    finally:
        for svc in reversed(services):
            svc.stop()
        wb.close()
        redis_server.stop()
    return {"syncs": syncs, "bytes": nbytes, "p50_s": float(np.median(totals)), "max_s": float(np.max(totals))}


# --------------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick", action="store_true", help="under a minute: small model, few requests, eager vLLM, no in-flight phase"
    )
    p.add_argument(
        "--out", default=None, help="(default bench/results/generation.json; with --quick, generation_quick.json)"
    )
    args = p.parse_args()
    # a quick look never overwrites the recorded full run
    args.out = args.out or str(
        ROOT / "bench" / "results" / ("generation_quick.json" if args.quick else "generation.json")
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from flywheel.tiny import build_checkpoint

    size = "small" if args.quick else "medium"
    prompts, n, median, cap = (8, 4, 24, 240) if args.quick else (48, 4, 48, 480)
    hf_batch = 32
    work = Path(tempfile.mkdtemp(prefix="fw-bench-gen-"))
    model_dir = build_checkpoint(work / "model", size=size)
    reqs = make_requests(model_dir, prompts, n, median, cap, seed=0)
    console.print(f"[bold]model[/] {size}, {len(reqs)} sequences, response lengths {length_stats(reqs)}")

    hf = run_hf(model_dir, reqs, hf_batch)
    console.print(f"HF generate: {hf['tokens_per_s']:.0f} tokens/s")
    # quick: eager (no compile and graph capture, which take most of a minute on CPU)
    vllm = asyncio.run(_vllm(model_dir, reqs, enforce_eager=args.quick))
    console.print(f"vLLM engine: {vllm['tokens_per_s']:.0f} tokens/s")
    from flywheel.config import SyncConfig

    default_mb = SyncConfig().bucket_mb
    sweep = [1.0, 16.0] if args.quick else [0.25, 1.0, 4.0, 16.0, 64.0]
    sync_rows = run_sync(model_dir, [*sweep, default_mb], repeats=5 if not args.quick else 3)
    inflight = None if args.quick else run_inflight(work / "inflight", model_dir, syncs=10)

    ratio = vllm["tokens_per_s"] / hf["tokens_per_s"]
    at_default = next(r for r in sync_rows if r["bucket_mb"] == default_mb)
    best = max(sync_rows, key=lambda r: r["efficiency"])
    table = Table(title="Generation throughput (same requests, useful tokens)")
    for col in ("system", "tokens", "seconds", "tokens/s", "ratio"):
        table.add_column(col, justify="right")
    table.add_row(
        f"HF generate (batch {hf_batch})",
        str(hf["tokens"]),
        f"{hf['seconds']:.1f}",
        f"{hf['tokens_per_s']:.0f}",
        "1.00",
    )
    table.add_row(
        "Flywheel vLLM engine",
        str(vllm["tokens"]),
        f"{vllm['seconds']:.1f}",
        f"{vllm['tokens_per_s']:.0f}",
        f"{ratio:.2f}",
    )
    console.print(table)
    table = Table(title="Weight transfer over gloo, 2 processes (bucketed vs one raw flat broadcast)")
    for col in ("bucket MiB", "buckets", "MB", "raw GB/s (pooled)", "bucketed GB/s", "efficiency"):
        table.add_column(col, justify="right")
    for r in sync_rows:
        table.add_row(
            f"{r['bucket_mb']:g}" + (" (default)" if r is at_default else ""),
            str(r["buckets"]),
            f"{r['bytes'] / 1e6:.1f}",
            f"{r['raw_gb_s']:.2f}",
            f"{r['bucketed_gb_s']:.2f}",
            f"{r['efficiency']:.2f}",
        )
    console.print(table)
    if inflight:
        console.print(
            f"In-flight update of a running generator ({inflight['bytes'] / 1e6:.1f} MB, {inflight['syncs']} syncs): "
            f"p50 {inflight['p50_s'] * 1000:.0f} ms, max {inflight['max_s'] * 1000:.0f} ms (WeightsReady -> WeightsAck)"
        )
    result = {
        "headline": {
            "ratio_vllm_vs_hf": ratio,
            "weight_sync_efficiency": at_default["efficiency"],
        },
        "rows": {"throughput": {"hf": hf, "vllm": vllm}, "weight_sync": sync_rows, "inflight_update": inflight},
        "config": {
            "mode": "quick" if args.quick else "full",
            "model_size": size,
            "sequences": len(reqs),
            "samples_per_prompt": n,
            "lengths": length_stats(reqs),
            "hf_batch": hf_batch,
            "default_bucket_mb": default_mb,  # sync.bucket_mb: the headline's row
            "best_bucket_mb": best["bucket_mb"],
        },
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
    }
    gpu_result = ROOT / "bench" / "results" / "generation_gpu.json"
    if gpu_result.exists():  # measured on the H200 by bench/generation_gpu.py
        result["headline"]["gpu_ratio_vllm_vs_hf"] = json.loads(gpu_result.read_text())["headline"][
            "gpu_ratio_vllm_vs_hf"
        ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
