"""Reward service throughput: scores/s as the worker count grows, for a rule-based reward
(math-verify), a remote reward with network latency, and the tiny reward model behind
``flywheel-rm``, all in one run.

The service runs as a real process (``python -m reward_service``) with its worker pool. This
script stands where the hub stands: a ROUTER socket that speaks the hub's reward protocol
(RewardRegister credit, ScoreRequest out, Score back), keeping the service's credit full, so the
figure is the reward service's own rate, not the generators'. Ratios compare worker counts
within the same run.

    python bench/reward.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import zmq
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flywheel.procs import Service, wait_for_state_file  # noqa: E402
from flywheel.tiny import build_reward_model  # noqa: E402
from flywheel.wire import Decoder, RewardRegister, Score, ScoreBatch, ScoreRequest, encode, pack_i32  # noqa: E402

console = Console(width=140)
CAPACITY = 256
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
REMOTE_LATENCY_S = 0.02


def make_requests(tokenizer_dir: Path, n: int, seed: int = 0) -> list[ScoreRequest]:
    """Arithmetic prompts with right and wrong worked answers, as the hub would send them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        answer = a + b + rng.choice([0, 0, 1])
        prompt = f"What is {a} + {b}? Answer:"
        completion = f" Let me think step by step: {a} + {b} = {answer}. The answer is {answer}.</s>"
        out.append(
            ScoreRequest(
                group_id=i // 4,
                sample=i % 4,
                prompt_tokens=pack_i32(tok.encode(prompt)),
                response_tokens=pack_i32(tok.encode(completion)),
                finish_reason="stop",
                metadata={"answer": str(a + b)},
            )
        )
    return out


class HubSide:
    """The hub's end of the reward protocol, keeping the service's credit full."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.decoder = Decoder(RewardRegister | Score | ScoreBatch)

    def run(self, requests: list[ScoreRequest], timeout_s: float) -> tuple[float, int, int]:
        """Score every request once; return (seconds from first send to last score, scores, errors)."""
        identity, capacity = self._wait_register(timeout_s)
        todo, inflight, scored, errors = list(reversed(requests)), 0, 0, 0
        start = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        while scored < len(requests):
            while todo and inflight < capacity:
                self.sock.send_multipart([identity, encode(todo.pop())])
                inflight += 1
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {scored}/{len(requests)} scored within {timeout_s}s")
            if not self.sock.poll(1000):
                continue
            _, payload = self.sock.recv_multipart()
            msg = self.decoder.decode(payload)
            scores = msg.scores if isinstance(msg, ScoreBatch) else [msg] if isinstance(msg, Score) else []
            for score in scores:
                scored, inflight = scored + 1, inflight - 1
                errors += score.error is not None
        return time.perf_counter() - start, scored, errors

    def _wait_register(self, timeout_s: float) -> tuple[bytes, int]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.sock.poll(500):
                identity, payload = self.sock.recv_multipart()
                msg = self.decoder.decode(payload)
                if isinstance(msg, RewardRegister):
                    return identity, msg.capacity
        raise TimeoutError("the reward service never registered")

    def close(self) -> None:
        self.sock.close(linger=0)


class SlowEndpoint:
    """A remote reward endpoint with a fixed network-like latency per call (a sandbox, a judge)."""

    def __init__(self, latency_s: float) -> None:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                time.sleep(latency_s)
                payload = json.dumps({"rewards": [float("= " in c) for c in body["completions"]]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def measure(work: Path, name: str, functions: str, tok: Path, workers: int, requests: list[ScoreRequest]) -> dict:
    hub = HubSide()
    svc = Service(
        f"reward-{name}-{workers}",
        "reward_service",
        [
            "--reward.functions",
            functions,
            "--reward.tokenizer",
            str(tok),
            "--reward.workers",
            str(workers),
            "--reward.batch_size",
            "16",
            "--reward.capacity",
            str(CAPACITY),
            "--reward.hub_address",
            f"tcp://127.0.0.1:{hub.port}",
        ],
        work,
        env=ENV,
    )
    try:
        hub.run(requests[: CAPACITY // 2], timeout_s=180)  # warm-up: every worker started and imported
        seconds, scored, errors = hub.run(requests, timeout_s=600)
    finally:
        svc.stop()
        hub.close()
    row = {"reward": name, "workers": workers, "samples": scored, "seconds": seconds, "scores_per_s": scored / seconds}
    row["errors"] = errors
    return row


def headline(result: dict[str, Any]) -> dict[str, float]:
    """BENCHMARKS.md's keys."""
    return {k: result[k] for k in ("rule_scores_per_s", "rm_scores_per_s", "scaling_4_workers")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    p.add_argument("--out", default=None, help="(default bench/results/reward.json; with --quick, reward_quick.json)")
    args = p.parse_args()
    # a quick look never overwrites the recorded full run
    args.out = args.out or str(ROOT / "bench" / "results" / ("reward_quick.json" if args.quick else "reward.json"))
    n_rule, n_rm = (400, 200) if args.quick else (4000, 1500)
    worker_counts = [1, 2, 4] + ([8] if (os.cpu_count() or 1) >= 16 else [])

    work = Path(tempfile.mkdtemp(prefix="fw-bench-reward-"))
    rm_dir = build_reward_model(work / "rm", size="small")  # the tokenizer is saved with it
    rule_requests = make_requests(rm_dir, n_rule)
    rm_requests = make_requests(rm_dir, n_rm, seed=1)

    state = work / "rm.json"
    rm = Service(
        "rm",
        "reward_service.rm_server",
        ["--rm.model", str(rm_dir), "--rm.port", "0", "--rm.state_file", str(state), "--rm.max_batch", "64"],
        work,
        env=ENV,
    )
    endpoint = SlowEndpoint(REMOTE_LATENCY_S)
    rows = []
    try:
        rm_url = f"http://127.0.0.1:{wait_for_state_file(state, rm, timeout_s=120)['port']}/score"
        cases = [
            ("rule (math-verify)", "math", rule_requests),
            (
                f"remote ({REMOTE_LATENCY_S * 1000:.0f} ms latency)",
                f"[{{name: remote, kwargs: {{url: {endpoint.url}}}}}]",
                rm_requests,
            ),
            ("reward model (flywheel-rm)", f"[{{name: reward_model, kwargs: {{url: {rm_url}}}}}]", rm_requests),
        ]
        for name, functions, requests in cases:
            for w in worker_counts:
                row = measure(work, name, functions, rm_dir, w, requests)
                rows.append(row)
                console.print(f"{name:<30} workers {w}: {row['scores_per_s']:8.0f} scores/s ({row['errors']} errors)")
    finally:
        rm.stop()
        endpoint.close()

    def rate(name: str, w: int) -> float:
        return next(r["scores_per_s"] for r in rows if r["reward"] == name and r["workers"] == w)

    table = Table(title=f"Reward service throughput ({os.cpu_count()} cores)")
    for col in ("reward", "workers", "samples", "scores/s", "vs 1 worker", "errors"):
        table.add_column(col, justify="left" if col == "reward" else "right")
    for r in rows:
        ratio = r["scores_per_s"] / rate(r["reward"], 1)
        r["ratio_vs_1_worker"] = ratio
        table.add_row(
            r["reward"],
            str(r["workers"]),
            str(r["samples"]),
            f"{r['scores_per_s']:.0f}",
            f"{ratio:.2f}x",
            str(r["errors"]),
        )
    console.print(table)

    rule, remote_name, rm_name = (c[0] for c in cases)
    result = {
        "benchmark": "reward",
        "rule_scores_per_s": rate(rule, 1),
        "rule_scores_per_s_best": max(rate(rule, w) for w in worker_counts),
        "rm_scores_per_s": max(rate(rm_name, w) for w in worker_counts),
        "scaling_4_workers": rate(rule, 4) / rate(rule, 1),
        "scaling_4_workers_remote": rate(remote_name, 4) / rate(remote_name, 1),
        "scaling_4_workers_rm": rate(rm_name, 4) / rate(rm_name, 1),
        "cpu_cores": os.cpu_count(),
        "rows": rows,
        "machine": platform.platform(),
        "quick": args.quick,
    }
    result = {"benchmark": "reward", "headline": headline(result), **result}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
