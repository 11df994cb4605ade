"""Weight sync between two GPUs over NCCL: Flywheel's bucketed broadcast (``flywheel.weights``:
pack, broadcast, unpack every bucket, double-buffered) from a learner on GPU 0 to a receiver on
GPU 1, against one raw NCCL broadcast of a flat buffer of the same bytes, in the same run.

Parameter sets have the shapes of Qwen2.5-0.5B, -1.5B and -7B (bf16), generated on the GPU.

    python bench/weight_sync_gpu.py          # needs 2 GPUs; writes bench/results/weight_sync_gpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

MODELS = {
    # name: hidden, layers, intermediate, kv heads, head dim, vocab, tied embeddings
    "0.5B": (896, 24, 4864, 2, 64, 151936, True),
    "1.5B": (1536, 28, 8960, 2, 128, 151936, True),
    "7B": (3584, 28, 18944, 4, 128, 152064, False),
}
DEFAULT_BUCKET_MB = 256  # sync.bucket_mb's default (flywheel.config.SyncConfig, not imported: torch-only host)
BUCKETS_MB = [64, DEFAULT_BUCKET_MB, 512, 1024]


def shapes(name: str) -> list[tuple[str, tuple[int, ...]]]:
    h, layers, inter, kv, hd, vocab, tied = MODELS[name]
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.q_proj.bias", (h,)),
            (p + "self_attn.k_proj.weight", (kv * hd, h)),
            (p + "self_attn.k_proj.bias", (kv * hd,)),
            (p + "self_attn.v_proj.weight", (kv * hd, h)),
            (p + "self_attn.v_proj.bias", (kv * hd,)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    out.append(("model.norm.weight", (h,)))
    if not tied:
        out.append(("lm_head.weight", (vocab, h)))
    return out


def worker(rank: int, port: int, repeats: int, queue: mp.Queue) -> None:  # type: ignore[type-arg]
    from flywheel.weights import host_store, join_group, plan_buckets, receive, send
    from flywheel.wire import BucketLayout, WeightsReady

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    store = host_store("127.0.0.1", 300) if rank == 0 else None
    if rank == 0:
        queue.put(store.port)  # type: ignore[union-attr]
        port = store.port  # type: ignore[union-attr]
    group = join_group("nccl", "127.0.0.1", port, rank, 2, 1, 300, store=store, device=dev)
    results = []
    token = torch.zeros(1, device=dev)
    for name in MODELS:
        named = [(n, torch.empty(s, dtype=torch.bfloat16, device=dev)) for n, s in shapes(name)]
        tensors = dict(named)
        if rank == 0:
            for t in tensors.values():
                t.normal_()
        total = sum(t.numel() * 2 for t in tensors.values())
        flat = torch.empty(total, dtype=torch.uint8, device=dev)

        def timed(fn: Callable[..., None], *fn_args: object) -> float:
            group.broadcast(token)  # both ranks start together
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(*fn_args)
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        def raw(buf: torch.Tensor) -> None:
            group.broadcast(buf)

        def bucketed(buckets: list[BucketLayout], tensors: dict[str, torch.Tensor], ready: WeightsReady) -> None:
            if rank == 0:
                send(group, buckets, tensors)
            else:
                for _name, _t in receive(group, ready):
                    pass

        raw(flat)  # warm-up (NCCL communicator set-up)
        raw_s = sorted(timed(raw, flat) for _ in range(repeats))[repeats // 2]
        for mb in BUCKETS_MB:
            buckets = plan_buckets(named, mb << 20)
            ready = WeightsReady(
                version=1, buckets=buckets, transport="nccl", deadline=time.time() + 600, epoch=1,
                master_addr="127.0.0.1", master_port=port, world_size=2, ranks={"bench": 1},
            )  # fmt: skip
            bucketed(buckets, tensors, ready)  # warm-up: buffers
            b_s = sorted(timed(bucketed, buckets, tensors, ready) for _ in range(repeats))[repeats // 2]
            if rank == 0:
                results.append(
                    {
                        "model": name,
                        "params": sum(t.numel() for t in tensors.values()),
                        "bytes": total,
                        "bucket_mb": mb,
                        "buckets": len(buckets),
                        "raw_s": raw_s,
                        "bucketed_s": b_s,
                        "raw_gb_s": total / raw_s / 1e9,
                        "bucketed_gb_s": total / b_s / 1e9,
                        "efficiency": raw_s / b_s,
                    }
                )
                print(results[-1], flush=True)
        del named, tensors, flat
        torch.cuda.empty_cache()
    if rank == 0:
        queue.put(results)
    group.close()


FAR = 4102444800.0  # the ipc syncs' deadline: far off (each wait is bounded by the group's op timeout)


def worker_ipc(rank: int, port: int, repeats: int, queue: mp.Queue) -> None:  # type: ignore[type-arg]
    """Both ranks on GPU 0 (``--transport ipc``): Flywheel's bucketed ipc sync (pack into two
    shared buffers, the receiver copies each bucket out) against the floor of moving the bytes
    between two processes on one GPU, one copy of a flat buffer through one IPC handle."""
    from flywheel.weights import host_store, join_group, plan_buckets, receive, send
    from flywheel.weights_ipc import _open, _share, sync_prefix
    from flywheel.wire import WeightsReady

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    store = host_store("127.0.0.1", 300) if rank == 0 else None
    if rank == 0:
        queue.put(store.port)  # type: ignore[union-attr]
        port = store.port  # type: ignore[union-attr]
    group = join_group("ipc", "127.0.0.1", port, rank, 2, 1, 300, store=store, device=dev)
    kv = group.ipc_store
    steps = [0]

    def barrier() -> None:
        steps[0] += 1
        kv.add(f"bench/{steps[0]}", 1)
        while kv.add(f"bench/{steps[0]}", 0) < 2:
            time.sleep(0.0001)

    def timed(fn: Callable[..., None], *fn_args: object) -> float:
        barrier()  # both ranks start together; the second waits for the receiver's last copy
        t0 = time.perf_counter()
        fn(*fn_args)
        torch.cuda.synchronize()
        barrier()
        return time.perf_counter() - t0

    def raw(src: torch.Tensor | None, flat: torch.Tensor) -> None:
        if src is not None:  # the receiver: one copy out of rank 0's buffer
            flat.copy_(src)

    def one(buckets: list[Any], tensors: dict[str, torch.Tensor]) -> None:
        syncs[0] += 1
        ready = WeightsReady(
            version=syncs[0], buckets=buckets, transport="ipc", deadline=FAR, epoch=1,
            master_addr="127.0.0.1", master_port=port, world_size=2, ranks={"bench": 1},
        )  # fmt: skip
        group.deadline = FAR
        if rank == 0:
            group.sync_prefix = sync_prefix(ready.version, FAR)
            send(group, buckets, tensors)
        else:
            for _name, _t in receive(group, ready):
                pass

    results = []
    syncs = [0]
    for name in MODELS:
        named = [(n, torch.empty(s, dtype=torch.bfloat16, device=dev)) for n, s in shapes(name)]
        tensors = dict(named)
        for t in tensors.values():
            t.normal_()
        total = sum(t.numel() * 2 for t in tensors.values())
        flat = torch.empty(total, dtype=torch.uint8, device=dev)
        if rank == 0:
            kv.set(f"raw/{name}", _share(flat))
        src = _open(kv.get(f"raw/{name}"), dev) if rank == 1 else None
        raw(src, flat)
        raw_s = sorted(timed(raw, src, flat) for _ in range(repeats))[repeats // 2]
        for mb in BUCKETS_MB:
            buckets = plan_buckets(named, mb << 20)
            one(buckets, tensors)  # warm-up: buffers, the handles opened
            b_s = sorted(timed(one, buckets, tensors) for _ in range(repeats))[repeats // 2]
            if rank == 0:
                results.append(
                    {
                        "model": name,
                        "params": sum(t.numel() for t in tensors.values()),
                        "bytes": total,
                        "bucket_mb": mb,
                        "buckets": len(buckets),
                        "raw_s": raw_s,
                        "bucketed_s": b_s,
                        "raw_gb_s": total / raw_s / 1e9,
                        "bucketed_gb_s": total / b_s / 1e9,
                        "efficiency": raw_s / b_s,
                    }
                )
                print(results[-1], flush=True)
        barrier()  # the receiver has dropped nothing it still reads
        del named, tensors, flat, src
        torch.cuda.empty_cache()
    if rank == 0:
        queue.put(results)
    barrier()


def headline(rows: list[dict[str, Any]], transport: str = "nccl") -> dict[str, float]:
    """What a run gets: the default bucket size's rows (the sweep shows the others)."""
    at_default = {m: next(r for r in rows if r["model"] == m and r["bucket_mb"] == DEFAULT_BUCKET_MB) for m in MODELS}
    return {
        f"{transport}_efficiency": min(r["efficiency"] for r in at_default.values()),
        "sync_7b_s": at_default["7B"]["bucketed_s"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "weight_sync_gpu.json"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--from-results", action="store_true", help="run nothing: the headline again from --out's rows")
    p.add_argument(
        "--transport",
        choices=["nccl", "ipc"],
        default="nccl",
        help="nccl: GPU 0 to GPU 1; ipc: two processes on GPU 0 (the learner and a generator sharing it)",
    )
    args = p.parse_args()
    if args.transport == "ipc" and args.out == p.get_default("out"):
        args.out = str(ROOT / "bench" / "results" / "weight_sync_gpu_ipc.json")
    if args.from_results:
        result = json.loads(Path(args.out).read_text())
        result["headline"] = headline(result["rows"], result["config"]["transport"])
        result["config"]["default_bucket_mb"] = DEFAULT_BUCKET_MB
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result["headline"]))
        return 0
    gpus = 1 if args.transport == "ipc" else 2
    if torch.cuda.device_count() < gpus:
        print(f"needs {gpus} GPU(s)", file=sys.stderr)
        return 2
    target = worker_ipc if args.transport == "ipc" else worker
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    r0 = ctx.Process(target=target, args=(0, 0, args.repeats, queue))
    r0.start()
    port = queue.get(timeout=120)
    r1 = ctx.Process(target=target, args=(1, port, args.repeats, queue))
    r1.start()
    rows = queue.get(timeout=1200)
    r0.join(60)
    r1.join(60)
    result = {
        "headline": headline(rows, args.transport),
        "rows": rows,
        "config": {
            "transport": args.transport,
            "dtype": "bfloat16",
            "repeats": args.repeats,
            "buckets_mb": BUCKETS_MB,
            "default_bucket_mb": DEFAULT_BUCKET_MB,
        },
        "machine": {"gpus": [torch.cuda.get_device_name(i) for i in range(gpus)], "platform": platform.platform()},
    }
    print(f"{'model':>6} {'bucket MB':>9} {'buckets':>7} {'GB':>6} {'raw GB/s':>9} {'bucketed GB/s':>13} {'eff':>5}")
    for r in rows:
        print(
            f"{r['model']:>6} {r['bucket_mb']:>9} {r['buckets']:>7} {r['bytes'] / 1e9:>6.2f} "
            f"{r['raw_gb_s']:>9.1f} {r['bucketed_gb_s']:>13.1f} {r['efficiency']:>5.2f}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["headline"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
