"""``flywheel``: the launcher. Subcommands parse their flags before importing anything heavy."""

from __future__ import annotations

import sys

from flywheel.config import ConfigError, help_text, load_config, reference_markdown

USAGE = """usage: flywheel COMMAND [options]

commands:
  run RECIPE.yaml [--section.field VALUE ...]
        the whole loop on this machine: Redis, hub, reward service, vLLM generators, learner
  demo [--steps N] [--generators N] [--section.field VALUE ...]
        hub demo: private Redis + hub + simulated generators + reward worker + a consumer
  config [--markdown]
        print every config key with its type, default and meaning
  finish RUN_DIR [--at-step N | --cancel]          (a run of `flywheel run`)
  finish --redis.url URL --run.name NAME [--at-step N | --cancel]    (any other launch)
        end a running training early, as at train.total_steps (checkpoint, export, final
        evaluation): at step N, or as soon as every learner rank safely can; prints the step.
        --cancel forgets the request (to train a finished run on)
  keys DIR
        make CURVE keys for security.curve: server and client keypairs, DIR/authorized/ holding
        the client keys the hub and the learner accept (pass --security.keys_dir DIR)
"""


def _pop_int(argv: list[str], flag: str, default: int, minimum: int = 0) -> int:
    """``flag N`` taken out of ``argv``; a ConfigError naming the flag when N is missing or wrong."""
    if flag not in argv:
        return default
    i = argv.index(flag)
    text = argv[i + 1] if i + 1 < len(argv) else ""
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{flag} needs a whole number, got {text!r}") from None
    if value < minimum:
        raise ConfigError(f"{flag} must be at least {minimum}, got {value}")
    del argv[i : i + 2]
    return value


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "config":
        print(reference_markdown() if "--markdown" in rest else help_text("flywheel", "Config reference."))
        return 0
    if command == "run":
        from flywheel.config import service_config

        if rest and not rest[0].startswith("-"):
            rest = ["--config", rest[0], *rest[1:]]
        cfg = service_config("flywheel run", "Train end to end on this machine (see launch.* keys).", rest)
        if isinstance(cfg, int):
            return cfg
        from flywheel.launcher import run

        try:
            return run(cfg)
        except ValueError as err:
            print(f"flywheel run: {err}", file=sys.stderr)
            return 2
    if command == "keys":
        if rest in (["-h"], ["--help"]):
            print(USAGE)
            return 0
        if len(rest) != 1 or rest[0].startswith("-"):
            print(f"flywheel keys: one argument, the directory to make\n\n{USAGE}", file=sys.stderr)
            return 2
        from flywheel.netsec import create_keys

        try:
            keys = create_keys(rest[0])
        except (ValueError, OSError) as err:
            print(f"flywheel keys: {err}", file=sys.stderr)
            return 2
        print(f"CURVE keys in {keys}: pass --security.curve true --security.keys_dir {keys}")
        print("servers (hub, learner) need server.key_secret and authorized/; clients server.key and client.key_secret")
        return 0
    if command == "finish":
        return _finish(rest)
    if command == "demo":
        if "-h" in rest or "--help" in rest:
            print(USAGE)
            print(help_text("flywheel demo", "Overrides apply to the hub and reward worker."))
            return 0
        try:
            steps = _pop_int(rest, "--steps", 12, minimum=1)
            generators = _pop_int(rest, "--generators", 3, minimum=1)
            from flywheel.demo import run_demo

            return run_demo(rest, steps=steps, generators=generators)
        except ConfigError as err:
            print(f"flywheel demo: {err}", file=sys.stderr)
            return 2
    print(f"flywheel: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


def _finish(argv: list[str]) -> int:
    """``flywheel finish``: store the step the learner ends at, in the run's Redis."""
    from pathlib import Path

    if "-h" in argv or "--help" in argv:
        print(USAGE)
        return 0
    run_dir = Path(argv.pop(0)) if argv and not argv[0].startswith("-") else None
    cancel = "--cancel" in argv
    if cancel:
        argv.remove("--cancel")
    try:
        at_step = _pop_int(argv, "--at-step", 0)
    except ConfigError as err:
        print(f"flywheel finish: {err}", file=sys.stderr)
        return 2
    try:
        url = None
        if run_dir is not None:  # a local run: its resolved recipe and its private Redis
            argv = ["--config", str(run_dir / "config.yaml"), *argv]
            from flywheel.launcher import run_redis_url

            url = run_redis_url(run_dir)
        cfg = load_config(argv)
    except (OSError, ValueError, KeyError, IndexError) as err:
        where = f"{run_dir} is not the directory of a running `flywheel run`: " if run_dir else ""
        print(f"flywheel finish: {where}{err}", file=sys.stderr)
        return 2
    if (url or cfg.redis.url) is None:
        print("flywheel finish: give the RUN_DIR of a local run, or --redis.url and --run.name", file=sys.stderr)
        return 2
    import redis

    from flywheel.hub_client import cancel_finish, request_finish
    from flywheel.netsec import redis_client
    from flywheel.store import RunKeys

    try:
        client = redis_client(cfg.redis, url)
        if cancel:
            had = cancel_finish(client, cfg.run.name)
            print("finish request forgotten" if had else "no finish was requested")
            return 0
        keys = RunKeys(cfg.run.name)
        if not client.exists(keys.version, keys.settings):
            # a finish stored for no run would stop a later run under that name at its step 2
            names = sorted({k.decode().split("{", 1)[1].split("}", 1)[0] for k in client.scan_iter("fw:{*}:settings")})
            print(
                f"flywheel finish: no run {cfg.run.name!r} in this Redis (runs here: {', '.join(names) or 'none'}): "
                "check --run.name",
                file=sys.stderr,
            )
            return 2
        step = request_finish(client, cfg.run.name, at_step)
    except redis.RedisError as err:
        print(f"flywheel finish: the run's Redis did not answer: {err}", file=sys.stderr)
        return 1
    print(f"training ends at step {step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
