"""The config tree: recipes, dotted overrides, clear errors, and a fast --help."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flywheel.config import ConfigError, FlywheelConfig, load_config, parse_overrides, reference_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_validate() -> None:
    cfg = load_config([])
    assert isinstance(cfg, FlywheelConfig)
    assert cfg.async_.max_staleness == 1


def test_dotted_overrides_parse_yaml_scalars() -> None:
    cfg = load_config(
        [
            "--async.max_staleness",
            "4",
            "--async.requeue_stale=false",
            "--data.metadata_keys",
            "[a, b]",
            "--rollout.temperature",
            "0.5",
        ]
    )
    assert cfg.async_.max_staleness == 4
    assert cfg.async_.requeue_stale is False
    assert cfg.data.metadata_keys == ["a", "b"]
    assert cfg.rollout.temperature == 0.5


def test_recipe_then_overrides(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("async:\n  max_staleness: 3\n  groups_per_step: 5\nrun:\n  name: exp1\n")
    cfg = load_config(["--config", str(recipe), "--async.groups_per_step", "7"])
    assert (cfg.async_.max_staleness, cfg.async_.groups_per_step, cfg.run.name) == (3, 7, "exp1")


def test_unknown_key_suggests_the_nearest(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key `async.max_stalenes`; did you mean `async.max_staleness`"):
        load_config(["--async.max_stalenes", "2"])
    recipe = tmp_path / "r.yaml"
    recipe.write_text("hub:\n  lease_timeout: 3\n")
    with pytest.raises(ConfigError, match="hub.lease_timeout"):
        load_config(["--config", str(recipe)])


def test_bounds_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"`async.max_staleness`: Input should be greater than or equal to 0"):
        load_config(["--async.max_staleness", "-1"])
    with pytest.raises(ConfigError, match="run.name"):
        load_config(["--run.name", "has space"])


def test_cross_field_rule() -> None:
    with pytest.raises(ConfigError, match="data.tokenizer is required"):
        load_config(["--data.path", "x.jsonl"])


def test_weights_synced_less_often_than_the_bound_allows_are_refused() -> None:
    # η = 0 with a sync every 2 steps: after step 1 no generator holds weights new enough to lease
    with pytest.raises(ConfigError, match=r"async.sync_every 2 is more than async.max_staleness \+ 1 \(1\)"):
        load_config(["--async.max_staleness", "0", "--async.sync_every", "2"])
    assert load_config(["--async.max_staleness", "3", "--async.sync_every", "4"]).async_.sync_every == 4


def test_prompts_that_leave_no_room_to_answer_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"data.max_prompt_tokens 1024 leaves no room .* at most 768"):
        load_config(["--generator.max_model_len", "1024"])
    assert load_config(["--generator.max_model_len", "1024", "--data.max_prompt_tokens", "768"])


def test_a_batch_that_does_not_split_over_the_learner_ranks_is_refused() -> None:
    # each rank claims groups_per_step // ranks: 3 ranks of 1 group at 4 a step left one a step
    # to age in the queue; 4 ranks at 2 a step claimed more than admission grants: a stall
    with pytest.raises(
        ConfigError, match=r"groups_per_step 4 does not split over 3 learner ranks .*--async.groups_per_step 3"
    ):
        load_config(["--launch.learner_procs", "3", "--async.groups_per_step", "4"])
    with pytest.raises(ConfigError, match=r"groups_per_step 2 does not split over 4 .*--async.groups_per_step 4"):
        load_config(["--launch.learner_procs", "4", "--async.groups_per_step", "2"])
    assert load_config(["--launch.learner_procs", "4", "--async.groups_per_step", "8"])
    from flywheel.config import check_batch_split

    with pytest.raises(ConfigError, match=r"over 3 learner ranks \(WORLD_SIZE\)"):
        check_batch_split(4, 3)


def test_a_temperature_vllm_would_raise_is_refused() -> None:
    # vLLM samples at 0.01 below it: the learner's log-probabilities would be at another temperature
    with pytest.raises(ConfigError, match=r"rollout.temperature.*Use 0 \(greedy\) or at least 0.01"):
        load_config(["--rollout.temperature", "0.005"])
    assert load_config(["--rollout.temperature", "0"]) and load_config(["--rollout.temperature", "0.01"])


def test_a_generated_task_with_a_chat_template_is_refused() -> None:
    # RL would sample chat-formatted prompts while the warm start and the evaluation use raw text
    with pytest.raises(ConfigError, match="task.name arithmetic writes raw-text prompts"):
        load_config(["--task.name", "arithmetic", "--data.apply_chat_template", "true"])


def test_a_kl_term_with_no_gradient_is_refused() -> None:
    # k1 in the loss: its gradient is the score function, 0 in expectation
    with pytest.raises(ConfigError, match=r"algo.kl.estimator k1 in the loss penalises nothing"):
        load_config(["--algo.kl.coef", "0.1", "--algo.kl.estimator", "k1"])
    assert load_config(["--algo.kl.coef", "0.1", "--algo.kl.estimator", "k1", "--algo.kl.in_reward", "true"])
    assert load_config(["--algo.kl.estimator", "k1"])  # no KL at all (coef 0)


@pytest.mark.parametrize("flag", [("--rollout.top_p", "0.9"), ("--rollout.top_k", "20")])
def test_truncated_sampling_is_refused_for_training_rollouts(flag: tuple[str, str]) -> None:
    # the generators' log-probabilities would be over the nucleus, the learner's over the vocabulary
    with pytest.raises(ConfigError, match=r"Keep --rollout.top_p 1 and --rollout.top_k -1"):
        load_config(list(flag))
    assert load_config(["--rollout.top_k", "0"]).rollout.top_k == 0  # 0 is off, as in vLLM


def test_bad_flags() -> None:
    with pytest.raises(ConfigError, match="needs a value"):
        parse_overrides(["--async.max_staleness"])
    with pytest.raises(ConfigError, match="unexpected argument"):
        parse_overrides(["max_staleness", "3"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(["--config", "/nonexistent.yaml"])


@pytest.mark.parametrize("recipe", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_loads(recipe: Path) -> None:
    load_config(["--config", str(recipe)])


def test_reference_lists_every_field_with_a_description() -> None:
    table = reference_markdown()
    for key in ("async.max_staleness", "hub.lease_timeout_s", "data.n_samples_per_prompt", "redis.url"):
        assert f"`{key}`" in table
    assert "|  |" not in table  # no field without a description


@pytest.mark.parametrize("module", ["buffer", "reward_service", "flywheel.cli"])
def test_help_answers_without_importing_torch(module: str) -> None:
    code = (
        f"import sys, runpy; sys.argv = ['x', '--help']\n"
        f"try:\n    runpy.run_module('{module}', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import before config'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "usage" in out.stdout


def test_readme_config_reference_is_current() -> None:
    readme = (ROOT / "README.md").read_text()
    begin = readme.index("<!-- config:begin")
    body = readme[readme.index("\n", begin) + 1 : readme.index("<!-- config:end -->")].strip()
    assert body == reference_markdown(), "README config reference is stale: paste `flywheel config --markdown`"


def test_hub_start_errors_say_what_to_fix(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "buffer", *args], capture_output=True, text=True, timeout=120, cwd=ROOT
        )

    out = run("--data.path", "x.jsonl", "--data.tokenizer", "t")
    assert out.returncode == 2 and "redis.url is required" in out.stderr
    out = run(
        "--redis.url",
        "redis://127.0.0.1:1/0",
        "--redis.connect_timeout_s",
        "0.5",
        "--data.path",
        "x.jsonl",
        "--data.tokenizer",
        "t",
    )
    assert out.returncode == 2 and "cannot reach Redis at redis://127.0.0.1:1/0" in out.stderr
    out = run("--async.max_staleness", "-3")
    assert out.returncode == 2 and "`async.max_staleness`" in out.stderr


def test_reward_functions_take_names_lists_and_specs_and_reject_garbage() -> None:
    assert [f.name for f in load_config(["--reward.functions", "arithmetic"]).reward.functions] == ["arithmetic"]
    fns = load_config(["--reward.functions", "[math, {name: 'pkg.mod:fn', weight: 0.5, kwargs: {k: 1}}]"])
    assert [(f.name, f.weight, f.kwargs) for f in fns.reward.functions] == [
        ("math", 1.0, {}),
        ("pkg.mod:fn", 0.5, {"k": 1}),
    ]
    for bad, hint in [
        ("[]", "at least one function"),
        ("'os.system(1)'", "neither a built-in name nor an import path"),
        ("[{name: math, wieght: 2}]", "wieght"),
        ("[{weight: 2}]", "reward.functions.0.name"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(hint)):
            load_config(["--reward.functions", bad])
    with pytest.raises(ConfigError, match="reward.on_error"):
        load_config(["--reward.on_error", "ignore"])
    with pytest.raises(ConfigError, match="finite"):
        load_config(["--reward.error_reward", ".nan"])


def test_mistakes_a_run_found_a_minute_in_are_refused_at_once() -> None:
    """An unknown built-in reward was refused by the reward service after the warm start and the
    generator's load (64 s); one sample per prompt under a group estimator by the learner (74 s)."""
    with pytest.raises(ConfigError, match="unknown built-in reward function 'arithmetc': did you mean 'arithmetic'"):
        load_config(["--reward.functions", "[arithmetc]"])
    load_config(["--reward.functions", "[my_pkg.rewards:score]"])  # a user function: the reward service imports it
    with pytest.raises(ConfigError, match="grpo compares the samples of a prompt") as refused:
        load_config(["--data.n_samples_per_prompt", "1"])
    assert "(got {" not in str(refused.value)  # a check across fields does not dump the whole config
    load_config(["--data.n_samples_per_prompt", "1", "--algo.advantage.estimator", "reinforce_pp"])


def test_a_misspelled_section_or_list_entry_key_gets_the_right_hint(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("asynch:\n  max_staleness: 4\nreward:\n  functions:\n    - {name: math, wieght: 2}\n")
    with pytest.raises(ConfigError) as refused:
        load_config(["--config", str(recipe)])
    assert "unknown key `asynch`; did you mean `async`?" in str(refused.value)  # (was: `sync.host`)
    assert "unknown key `reward.functions.0.wieght`; did you mean `reward.functions.0.weight`?" in str(refused.value)


def test_two_sockets_on_one_port_are_refused() -> None:
    with pytest.raises(ConfigError, match="hub.reward_port and hub.generator_port are both 5571 on 127.0.0.1"):
        load_config(["--hub.generator_port", "5571", "--hub.reward_port", "5571"])
    with pytest.raises(ConfigError, match="sync.join_port and sync.announce_port are both 6000"):
        load_config(["--sync.announce_port", "6000", "--sync.join_port", "6000"])
    load_config(["--hub.generator_port", "0", "--hub.reward_port", "0"])  # free ports, each its own
    load_config(["--hub.reward_port", "5557", "--hub.host", "10.0.0.2"])  # another host than the learner's
    load_config(["--hub.host", "0.0.0.0", "--sync.host", "0.0.0.0", "--hub.reward_port", "5557"])  # two machines


def test_string_flags_stay_strings_and_bad_yaml_names_where(tmp_path: Path) -> None:
    """`--run.name on` was the bool True, `--generator.id 007` the int 7; a recipe with a tab, or a
    flag with an open bracket, ended in a ScannerError traceback naming "<unicode string>"."""
    cfg = load_config(["--run.name", "on", "--generator.id", "007", "--redis.url", "null"])
    assert (cfg.run.name, cfg.generator.id, cfg.redis.url) == ("on", "007", None)
    with pytest.raises(ConfigError, match=r"--reward.functions '\[math' is not a value YAML can read"):
        load_config(["--reward.functions", "[math"])
    recipe = tmp_path / "tabs.yaml"
    recipe.write_text("async:\n\tmax_staleness: 4\n")
    with pytest.raises(ConfigError, match=f"recipe '{recipe}' is not valid YAML at line 2, column 1"):
        load_config(["--config", str(recipe)])


def test_none_is_null_and_yaml_booleans_are_words_where_the_field_takes_words(tmp_path: Path) -> None:
    """`--train.checkpoint_dir None` was the string "None" (checkpoints went to ./None), and
    `redis.appendfsync no`, a documented value, was refused as the boolean False, from a flag
    and from a recipe alike (YAML 1.1 reads no, off, yes, on as booleans)."""
    cfg = load_config(["--train.checkpoint_dir", "None", "--data.tokenizer", "~", "--redis.appendfsync", "no"])
    assert (cfg.train.checkpoint_dir, cfg.data.tokenizer, cfg.redis.appendfsync) == (None, None, "no")
    recipe = tmp_path / "fsync.yaml"
    recipe.write_text("redis:\n  appendfsync: no\n")
    assert load_config(["--config", str(recipe)]).redis.appendfsync == "no"
    with pytest.raises(ConfigError, match="appendfsync"):  # a boolean a string field does not take
        load_config(["--redis.appendfsync", "off"])


def test_gspo_with_a_length_weighted_aggregation_is_refused() -> None:
    """ratio_level sequence with token_mean weighed each sequence's gradient by its length, which
    GSPO's length normalisation is there to prevent."""
    gspo = ["--algo.off_policy.correction", "none", "--algo.loss.ratio_level", "sequence"]
    with pytest.raises(ConfigError, match="add --algo.loss.aggregation seq_mean_token_mean"):
        load_config(gspo)
    flags = [*gspo, "--algo.loss.aggregation", "seq_mean_token_mean"]
    assert load_config(flags).algo.loss.ratio_level == "sequence"


@pytest.mark.parametrize("correction", ["decoupled", "tis"])
@pytest.mark.parametrize(
    "setting", [["--algo.loss.clip_high", "0.28"], ["--algo.loss.dual_clip", "3"], ["--algo.loss.clip_low", "0.1"]]
)
def test_clip_settings_are_refused_where_nothing_is_clipped(correction: str, setting: list[str]) -> None:
    """One update a step: under decoupled the ratio to the proximal policy is 1, and tis has no
    clip; clip-higher or a dual clip there did nothing, in silence (the shipped grpo.yaml set one)."""
    with pytest.raises(ConfigError, match=f"does nothing under algo.off_policy.correction {correction}"):
        load_config(["--algo.off_policy.correction", correction, *setting])
    assert load_config(["--algo.off_policy.correction", "none", *setting]).algo.off_policy.correction == "none"
    gspo = ["--algo.loss.ratio_level", "sequence", "--algo.loss.aggregation", "seq_mean_token_mean"]
    with pytest.raises(
        ConfigError, match="ratio_level sequence does nothing under algo.off_policy.correction decoupled"
    ):
        load_config(gspo)
    assert load_config([*gspo, "--algo.off_policy.correction", "tis"]).algo.loss.ratio_level == "sequence"  # its weight


def test_a_boolean_is_not_a_number(tmp_path: Path) -> None:
    """`--async.max_staleness true` ran at 1 (pydantic's lax mode reads True as 1)."""
    with pytest.raises(ConfigError, match=r"`async.max_staleness`: .*a number is wanted here, not the boolean true"):
        load_config(["--async.max_staleness", "true"])
    recipe = tmp_path / "lr.yaml"
    recipe.write_text("train:\n  lr: false\n")
    with pytest.raises(ConfigError, match=r"`train.lr`: .*not the boolean false"):
        load_config(["--config", str(recipe)])
    assert load_config(["--async.requeue_stale", "true"]).async_.requeue_stale is True  # a bool stays a bool


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["demo", "--steps", "x"], "--steps needs a whole number, got 'x'"),  # was a ValueError traceback
        (["demo", "--steps"], "--steps needs a whole number, got ''"),  # was an IndexError traceback
        (["demo", "--generators", "-1"], "--generators must be at least 1"),  # hung
        (["finish", "/tmp", "--at-step", "x"], "--at-step needs a whole number"),  # blamed the directory
    ],
)
def test_the_cli_names_a_bad_number(argv: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    from flywheel.cli import main

    assert main(argv) == 2
    assert said in capsys.readouterr().err


def test_flywheel_keys_help_is_help(capsys: pytest.CaptureFixture[str]) -> None:
    from flywheel.cli import main

    assert main(["keys", "--help"]) == 0 and "keys DIR" in capsys.readouterr().out


def test_settings_that_cannot_all_hold_are_refused() -> None:
    with pytest.raises(ConfigError, match="launch.generators 5 is outside autoscale"):
        load_config(["--autoscale.enabled", "true", "--autoscale.max_generators", "2", "--launch.generators", "5"])
    with pytest.raises(ConfigError, match="train.warmup_steps 100 >= train.total_steps 50"):
        load_config(["--train.warmup_steps", "100", "--train.total_steps", "50"])
    load_config(["--autoscale.enabled", "true", "--launch.generators", "2"])
    with pytest.raises(ConfigError, match="launch.generators 0 starts no generator"):
        load_config(["--launch.generators", "0"])
    load_config(["--launch.generators", "0", "--launch.services", "[redis, hub, reward, learner]"])


def test_an_autoscaler_with_no_fleet_of_its_own_or_a_fleet_with_two_owners_is_refused() -> None:
    on = ["--autoscale.enabled", "true"]
    with pytest.raises(ConfigError, match="has no 'generator': add it, or scale a fleet run elsewhere"):
        load_config([*on, "--launch.services", "[redis, hub, learner]"])
    command = [*on, "--autoscale.backend", "command", "--autoscale.command", "true {replicas}"]
    with pytest.raises(ConfigError, match="two owners of one fleet"):
        load_config(command)  # the launcher starts generators as well (launch.services' default)
    assert load_config([*command, "--launch.services", "[learner]"]).autoscale.backend == "command"
    with pytest.raises(ConfigError, match="autoscale.blocked_frac"):
        load_config([*on, "--autoscale.blocked_frac", "0"])  # every interval "blocked": it only shrinks


def test_a_score_timeout_under_twice_the_reward_calls_deadline_is_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    from buffer.__main__ import _warn_if_scores_sent_again_early

    assert not _warn_if_scores_sent_again_early(FlywheelConfig())  # the defaults: 60 s against 30 s
    with caplog.at_level(logging.WARNING, logger="buffer"):
        cfg = FlywheelConfig.model_validate({"reward": {"timeout_s": 120}})
        assert _warn_if_scores_sent_again_early(cfg)
    assert "raise --hub.score_timeout_s to 240" in caplog.text
