"""The machine's ceiling for durable chunk streaming, measured beside the hub in ``hub_throughput``.

The same frames (one per generator step: 128 chunks of 16-64 tokens, 12 bytes a token for ids,
log-probabilities and versions) go over the same transports with none of the hub's work: each
generator sends prebuilt frames over a ZMQ DEALER; a relay on a ROUTER appends each frame to one
Redis list as an opaque value (MULTI/EXEC, AOF on, as the hub's write) and acks the frame's
number; a consumer pops frames. No validation, leases, duplicate checks, sample assembly, reward
or batch claims: what is left is what ZMQ and Redis cost on this machine. Each generator may
have as many chunks unacknowledged as the hub link allows (its flow-control window), so the
saturated latencies queue alike. The gap between it and the hub is the work the hub's contract
asks for: the hub's own, and also the generators' per-chunk encoding, the reward service and the
consumer's decoding, which the prebuilt opaque frames skip; a target this ceiling misses too is
one no hub can meet here.
"""

from __future__ import annotations

import multiprocessing as mp
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from flywheel.redis_server import RedisServer
from generators.hub_link import MAX_UNACKED_CHUNKS

BYTES_PER_TOKEN = 12  # int32 id, float32 log-probability, int32 version, as a Chunk carries
LIST = "raw-frames"


def _generator(port: int, index: int, tokens_per_s: float | None, seconds: float, warmup: float,
               chunks: int, chunk_tokens: tuple[int, int], results: Any) -> None:  # fmt: skip
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"raw%d" % index)
    sock.connect(f"tcp://127.0.0.1:{port}")
    rng = np.random.default_rng(index)
    sizes = rng.integers(chunk_tokens[0], chunk_tokens[1] + 1, size=chunks).astype(np.int32)
    frame_tokens = int(sizes.sum())
    body = sizes.tobytes() + rng.bytes(frame_tokens * BYTES_PER_TOKEN)
    sent_at: dict[int, float] = {}
    latency: list[float] = []
    window = max(1, MAX_UNACKED_CHUNKS // chunks)  # frames unacknowledged at most: the hub link's window
    seq = tokens = 0
    start = time.monotonic()
    while (now := time.monotonic()) - start < warmup + seconds:
        due = tokens_per_s is None or tokens / tokens_per_s <= now - start
        if due and len(sent_at) < window:
            sock.send(struct.pack("<q", seq) + body)
            sent_at[seq] = time.monotonic()
            seq, tokens = seq + 1, tokens + frame_tokens
            wait_ms = 0
        elif tokens_per_s is None or len(sent_at) >= window:
            wait_ms = 5
        else:
            wait_ms = max(0, min(5, int(1000 * (tokens / tokens_per_s - (now - start)))))
        if sock.poll(wait_ms):
            while True:
                try:
                    ack = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                t = time.monotonic()
                for (acked,) in struct.iter_unpack("<q", ack):
                    t_sent = sent_at.pop(acked, None)
                    if t_sent is not None and t - start >= warmup:
                        latency.append(t - t_sent)
    results.put(latency)


def _relay(redis_url: str, ports: Any) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.ROUTER)
    ports.put(sock.bind_to_random_port("tcp://127.0.0.1"))
    while True:
        if not sock.poll(5):
            continue
        acks: dict[bytes, list[bytes]] = {}
        pipe = client.pipeline(transaction=True)
        for _ in range(64):
            try:
                identity, frame = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            pipe.rpush(LIST, frame)
            acks.setdefault(identity, []).append(frame[:8])
        pipe.execute()  # durable (AOF) before any ack, as the hub
        for identity, seqs in acks.items():
            sock.send_multipart([identity, b"".join(seqs)])


def run_raw_frames(
    work: Path, generators: int, warmup: float, seconds: float, tokens_per_s: float | None,
    chunks: int, chunk_tokens: tuple[int, int],
) -> dict[str, float]:  # fmt: skip
    """One run; tokens/s at the consumer and send->ack latency after ``warmup`` for ``seconds``."""
    ctx = mp.get_context("spawn")
    redis_server = RedisServer(work / f"redis-raw-{time.monotonic_ns()}")
    ports, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_relay, args=(redis_server.url, ports), daemon=True)]
    try:
        procs[0].start()
        port = ports.get(timeout=60)
        share = None if tokens_per_s is None else tokens_per_s / generators
        for i in range(generators):
            args = (port, i, share, seconds, warmup, chunks, chunk_tokens, results)
            procs.append(ctx.Process(target=_generator, args=args, daemon=True))
            procs[-1].start()
        client = redis_server.client()
        start = time.monotonic()
        tokens, t0 = 0, 0.0
        while (now := time.monotonic()) - start < warmup + seconds:
            if not t0 and now - start >= warmup:
                t0, tokens = now, 0
            frames = client.lpop(LIST, 64)
            if not frames:
                time.sleep(0.001)
                continue
            tokens += sum((len(f) - 8 - 4 * chunks) // BYTES_PER_TOKEN for f in frames)
        elapsed = time.monotonic() - t0
        latency = np.concatenate([np.asarray(results.get(timeout=60)) for _ in range(generators)]) * 1000
        return {
            "consumer_tokens_per_s": tokens / elapsed,
            "ack_ms_p50": float(np.percentile(latency, 50)),
            "ack_ms_p99": float(np.percentile(latency, 99)),
        }
    finally:
        for p in procs:
            p.kill()
            p.join(timeout=10)
        redis_server.stop()
