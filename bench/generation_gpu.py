"""Generation on a GPU (the H200): the generator's vLLM engine (CUDA build) against HF ``generate``
on a ~0.9B Llama-shaped model, realistic lengths, log-probabilities on; then the in-flight update
latency of the real generator service (``GeneratorService``) while requests are running.

The same phases as ``bench/generation.py`` A and B, plus:
  D'. A ``GeneratorService`` runs on the engine (with no hub: it takes no leases; the benchmark
      keeps the engine busy with its own requests) and the learner's ``WeightBroadcaster``
      syncs new weights into it: WeightsReady -> pause -> receive -> reload -> resume ->
      WeightsAck. On one GPU the learner and the generator cannot form an NCCL group (NCCL
      refuses two ranks on one device), so the transfer goes over gloo through host memory.

    python bench/generation_gpu.py            # on the GPU machine; writes bench/results/generation_gpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from generation import console, length_stats, make_requests, run_hf, stream_request  # noqa: E402


async def vllm_phase(model_dir: Path, reqs: list[tuple[list[int], int]], syncs: int) -> dict[str, object]:
    import torch
    from transformers import AutoModelForCausalLM

    from flywheel.config import FlywheelConfig
    from flywheel.redis_server import free_port
    from generators.engine import build_engine, engine_max_model_len
    from generators.hub_link import HubLink
    from generators.service import GeneratorService
    from generators.sync_link import SyncLink
    from learner.weight_sync import WeightBroadcaster

    # Two GPUs: the learner side on GPU 1 broadcasts over NCCL to the vLLM worker on GPU 0. One GPU:
    # NCCL refuses two ranks on one device, so the bytes go over gloo through host memory.
    two_gpus = torch.cuda.device_count() >= 2
    transport, learner_device = ("nccl", "cuda:1") if two_gpus else ("gloo", "cpu")
    cfg = FlywheelConfig.model_validate(
        {
            "generator": {"model": str(model_dir), "max_num_seqs": 256, "gpu_memory_utilization": 0.6},
            "sync": {"announce_port": free_port(), "join_port": free_port(), "transport": transport, "timeout_s": 300},
        }
    )
    engine = build_engine(cfg.generator)

    def one(i: int, prompt: list[int], length: int) -> Any:
        return stream_request(engine, i, prompt, length)

    await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(reqs[:16])))  # warm-up
    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(reqs)))
    seconds = time.perf_counter() - start
    tokens = sum(counts)
    throughput = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}
    console.print(f"vLLM engine: {throughput['tokens_per_s']:.0f} tokens/s")

    # D'. in-flight updates through the real service code
    wb = WeightBroadcaster(cfg.sync, device=learner_device)
    link = HubLink(f"tcp://127.0.0.1:{free_port()}", "bench", str(model_dir), 1)  # no hub: no leases
    sync = SyncLink("127.0.0.1", cfg.sync.announce_port, cfg.sync.join_port, "bench", 1)
    service = GeneratorService(cfg, engine, link, sync, "bench", engine_max_model_len(engine))
    service_task = asyncio.create_task(service.run())  # kept referenced while it runs
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    tensors = {n: t.to(learner_device) for n, t in model.state_dict().items()}
    stop = threading.Event()
    reports = []

    def learner() -> None:
        if not wb.wait_for_members(1, 120):
            raise RuntimeError("the generator service never joined")
        for v in range(1, syncs + 1):
            time.sleep(1.0)
            reports.append(wb.sync(v, tensors.items()))
        stop.set()

    busy = [asyncio.create_task(one(10_000 + i, reqs[i % len(reqs)][0], 2000)) for i in range(64)]
    await asyncio.to_thread(learner)
    totals = [r.total_s for r in reports]
    inflight = {
        "syncs": syncs,
        "acked": sum(1 for r in reports if r.acked),
        "bytes": reports[-1].nbytes if reports else 0,
        "transport": "nccl, GPU 1 -> GPU 0" if two_gpus else "gloo (host memory; one GPU)",
        "p50_s": float(np.median(totals)),
        "max_s": float(np.max(totals)),
        "broadcast_p50_s": float(np.median([r.broadcast_s for r in reports])),
        "service_update_p50_s": float(np.median([u.seconds for u in service.updates])) if service.updates else None,
    }
    for task in busy:
        task.cancel()
    service.drain()
    # no waiting for the service to stop or the engine to shut down: that can hang past the device's
    # time limit; the caller exits the process once the results are written
    assert not service_task.done() or service_task.exception() is None
    return {"throughput": throughput, "inflight": inflight}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "generation_gpu.json"))
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--syncs", type=int, default=5)
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from flywheel.tiny import build_checkpoint

    work = Path(tempfile.mkdtemp(prefix="fw-bench-gen-gpu-"))
    model_dir = build_checkpoint(work / "model", size="1b", vocab_size=32000)
    reqs = make_requests(model_dir, args.prompts, 4, 64, 640, seed=0)
    console.print(f"[bold]model[/] ~0.9B, {len(reqs)} sequences, response lengths {length_stats(reqs)}")
    hf = run_hf(model_dir, reqs, 64, device="cuda")
    import torch

    torch.cuda.empty_cache()  # hand the memory back: vLLM (another process) sizes its KV cache by what is free
    console.print(f"HF generate: {hf['tokens_per_s']:.0f} tokens/s")
    res = asyncio.run(vllm_phase(model_dir, reqs, args.syncs))
    vllm, inflight = res["throughput"], res["inflight"]
    assert isinstance(vllm, dict) and isinstance(inflight, dict)
    ratio = vllm["tokens_per_s"] / hf["tokens_per_s"]
    console.print(f"ratio vLLM/HF: {ratio:.2f}; in-flight update {inflight}")
    import torch

    result = {
        "headline": {"gpu_ratio_vllm_vs_hf": ratio},
        "rows": {"hf": hf, "vllm": vllm, "inflight_update": inflight},
        "config": {
            "model": "llama 0.9B (hidden 2048, 16 layers, vocab 32000)",
            "sequences": len(reqs),
            "samples_per_prompt": 4,
            "lengths": length_stats(reqs),
            "hf_batch": 64,
            "dtype": "bfloat16",
        },
        "machine": {
            "gpu": torch.cuda.get_device_name(0),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {args.out}")
    sys.stdout.flush()
    os._exit(0)  # engine shutdown can hang past the device's time limit


if __name__ == "__main__":
    main()
