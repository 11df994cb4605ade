"""Fuzzing every socket the services open, longer than CI does (tests/fuzz runs the same floods).

Per socket: messages sent (all of them ones the receiver must refuse), rejections counted by
reason against those the corpus oracle expected, frames ZMQ itself dropped (over MAXMSGSIZE),
crashes (must be 0) and messages per second. Servers run as real processes (the hub on a real
Redis, the reward-model server); clients run here against a hostile peer socket.

    python bench/fuzz.py [--messages 1000000] [--http-requests 100000] [--examples 3000] [--seed 0]
    python bench/fuzz.py --quick   # every socket, 2,000 messages each: the code path, under a minute
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flywheel.redis_server import RedisServer  # noqa: E402
from flywheel.tiny import build_tokenizer, write_arithmetic_jsonl  # noqa: E402
from tests.conftest import Cluster  # noqa: E402
from tests.fuzz import drive  # noqa: E402
from tests.fuzz.corpus import hypothesis_seeds  # noqa: E402
from tests.fuzz.drive import FuzzResult  # noqa: E402

console = Console(width=160)


def headline(sockets: list[dict[str, Any]]) -> dict[str, int]:
    """BENCHMARKS.md's keys: ``inputs`` is what the least-fuzzed socket received (every socket
    got at least that many), ``crashes`` the sum over all of them."""
    return {
        "inputs": min(s["messages"] for s in sockets),
        "inputs_total": sum(s["messages"] for s in sockets),
        "crashes": sum(s["crashes"] for s in sockets),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=None, help="messages per ZMQ socket (1,000,000; quick 2,000)")
    ap.add_argument("--http-requests", type=int, default=None, help="requests per HTTP endpoint (100,000; quick 200)")
    ap.add_argument(
        "--examples", type=int, default=None, help="hypothesis examples in the seed corpus (3,000; quick 100)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="few messages per socket: the code path, under a minute")
    ap.add_argument("--out", type=Path, default=None, help="(default bench/results/fuzz.json; quick: fuzz_quick.json)")
    ap.add_argument(
        "--only",
        nargs="*",
        default=[],
        help="run only the sockets whose name has one of these; others keep their entry in --out",
    )
    args = ap.parse_args()
    for name, full, quick in (("messages", 1_000_000, 2_000), ("http_requests", 100_000, 200), ("examples", 3000, 100)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    # a quick look never overwrites the recorded full run
    args.out = args.out or ROOT / "bench" / "results" / ("fuzz_quick.json" if args.quick else "fuzz.json")

    work = Path(tempfile.mkdtemp(prefix="flywheel-fuzz-"))
    t0 = time.perf_counter()
    seeds = hypothesis_seeds(args.examples, seed=args.seed)
    corpus_s = time.perf_counter() - t0
    console.print(f"seed corpus: {len(seeds)} hypothesis examples in {corpus_s:.1f}s")
    tokenizer = build_tokenizer(work / "tokenizer")
    prompts = write_arithmetic_jsonl(work / "prompts.jsonl", 64)
    n, h = args.messages, args.http_requests

    # The hub's sockets are flooded one after the other on one hub, which must then still serve
    # (new generators, acks, scores) and have lost nothing it had acknowledged.
    hub: list[tuple[drive.HubRun, Cluster, RedisServer]] = []

    def on_hub(fn: Callable[[drive.HubRun], FuzzResult]) -> Callable[[], FuzzResult]:
        def run() -> FuzzResult:
            if not hub:
                tmp = Path(tempfile.mkdtemp(dir=work, prefix="hub"))
                redis = RedisServer(tmp / "redis")
                cluster = Cluster(tmp, redis, tokenizer, prompts)
                hub.append((drive.HubRun(cluster), cluster, redis))
            return fn(hub[0][0])

        return run

    def rng(i: int) -> random.Random:
        return random.Random(args.seed * 1000 + i)

    targets: list[tuple[str, Callable[[], FuzzResult]]] = [
        ("hub generator ROUTER", on_hub(lambda hub: drive.fuzz_hub_generator_port(hub, seeds, n, rng(1)))),
        ("hub reward ROUTER", on_hub(lambda hub: drive.fuzz_hub_reward_port(hub, seeds, n, rng(2)))),
        ("hub /metrics HTTP", on_hub(lambda hub: drive.fuzz_hub_metrics(hub, h, rng(3)))),
        ("generator DEALER -> hub", lambda: drive.fuzz_hub_link(seeds, n, rng(4))),
        ("generator SUB <- learner", lambda: drive.fuzz_sync_announce(seeds, n, rng(5))),
        ("generator DEALER -> learner", lambda: drive.fuzz_sync_join(seeds, n, rng(6))),
        ("reward service DEALER -> hub", lambda: drive.fuzz_reward_service(seeds, n, rng(7))),
        ("learner ROUTER (joins, acks)", lambda: drive.fuzz_learner_join(seeds, n, rng(8))),
        ("learner PUB (announcements)", lambda: drive.fuzz_learner_announce(seeds, n, rng(9))),
        ("reward-model server HTTP", lambda: drive.fuzz_rm_server(work, seeds, h, rng(10))),
    ]
    results = []
    for name, run in [(name, run) for name, run in targets if not args.only or any(o in name for o in args.only)]:
        console.print(f"[bold]{name}[/bold] ...")
        started = time.perf_counter()
        try:
            result = run()
            ok = result.counted == result.expected or (
                not result.expected - result.counted
                and result.counted.total() - result.expected.total() <= result.undelivered_bound
            )
        except AssertionError as err:  # a check after the flood failed (the target still runs)
            result = FuzzResult(name, note=f"check failed: {err}"[:2000])
            traceback.print_exc()
            ok = False
        except Exception as err:  # an exception out of the code under test: a crash
            result = FuzzResult(name, crashes=1, note=f"{type(err).__name__}: {err}"[:2000])
            traceback.print_exc()
            ok = False
        result.socket = name
        results.append((result, ok, time.perf_counter() - started))
        console.print(f"  {result.messages} messages, {result.rate:,.0f}/s, counted as expected: {ok}")
    hub_serves = None
    if hub:
        run_, cluster, redis = hub[0]
        try:
            run_.still_serves()
            hub_serves = True
        except Exception:
            traceback.print_exc()
            hub_serves = False
        finally:
            cluster.stop()
            redis.stop()
        console.print(f"the hub still serves and lost nothing it had acknowledged: {hub_serves}")

    table = Table(title=f"fuzz: {n:,} messages per ZMQ socket, {h:,} requests per HTTP endpoint")
    for col in (
        "socket",
        "messages",
        "rejections counted (by reason)",
        "as expected",
        "ZMQ dropped",
        "crashes",
        "msg/s",
    ):
        table.add_column(col, justify="left" if col.startswith(("socket", "rej")) else "right")
    for r, ok, _ in results:
        reasons = ", ".join(f"{k} {v:,}" for k, v in r.counted.most_common()) or "-"
        table.add_row(
            r.socket,
            f"{r.messages:,}",
            reasons,
            "yes" if ok else "NO",
            str(r.transport_dropped),
            str(r.crashes),
            f"{r.rate:,.0f}",
        )
    console.print(table)
    console.print("Torch's TCP store (the weight broadcast's rendezvous) is torch.distributed's, not ours: not fuzzed.")
    sockets = [{**r.as_dict(), "as_expected": ok, "wall_s": round(w, 1)} for r, ok, w in results]
    if args.only and args.out.exists():  # keep the other sockets' entries from the last full run
        ran = {s["socket"] for s in sockets}
        sockets = [
            s if s["socket"] not in ran else next(x for x in sockets if x["socket"] == s["socket"])
            for s in json.loads(args.out.read_text())["sockets"]
        ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "bench": "fuzz",
                "headline": headline(sockets),
                "messages_per_zmq_socket": n,
                "requests_per_http_endpoint": h,
                "hypothesis_examples": len(seeds),
                "seed_corpus_s": round(corpus_s, 1),
                "hub_still_serves": hub_serves,
                "sockets": sockets,
                "machine": {
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "platform": platform.platform(),
                    "load_avg_at_end": os.getloadavg()[0],
                },
            },
            indent=2,
        )
        + "\n"
    )
    console.print(f"wrote {args.out}")
    return 0 if all(ok and r.crashes == 0 for r, ok, _ in results) and hub_serves is not False else 1


if __name__ == "__main__":
    sys.exit(main())
