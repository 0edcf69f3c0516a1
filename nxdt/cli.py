"""The ``nxdt`` command: ``train``, ``plan``, ``comm-test``, ``sweep-report``.

Bad input is one line on stderr with exit code 2, before any worker starts.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

USAGE = """usage: nxdt <command> [args]

commands:
  train [-m] [overrides...]   compose + validate the config, plan, launch the workers, train
                              (-m / --multirun: one complete run per combination of key=a,b,... values)
  plan [--json] [overrides]   print the plan (rank layout and groups) without starting anything
  comm-test [options] OPS     nccom-test-style benchmark of nxdt's collectives (see nxdt comm-test --help)
  sweep-report DIR            table and loss plot of a multirun directory

`nxdt train --help` lists every config group and key with its documentation.
"""


class UsageError(Exception):
    pass


def _fail(message: str) -> int:
    print(message, file=sys.stderr)
    return 2


def train_help() -> str:
    from nxdt.config import available_options, field_docs

    lines = ["usage: nxdt train [-m] [group=option ...] [key=value ...]", "", "config groups:"]
    for group in ("model", "data", "instance"):
        lines.append(f"  {group}: {', '.join(available_options(group))}")
    lines += ["", "keys (default) — description:"]
    for key, default, doc in field_docs():
        lines.append(f"  {key} ({default}) — {doc}")
    lines += ["", "examples:", "  nxdt train model=llama_tiny data=synthetic trainer.devices=4",
              "  nxdt train -m trainer.devices=1,2 trainer.max_steps=20"]
    return "\n".join(lines)


def _split_flags(argv: list[str], flags: set[str]) -> tuple[set[str], list[str]]:
    found = {a for a in argv if a in flags}
    rest = [a for a in argv if a not in flags]
    for a in rest:
        if a.startswith("-"):
            raise UsageError(f"nxdt: unknown option {a!r}; overrides are key=value (see --help)")
        if "=" not in a:
            raise UsageError(f"nxdt: argument {a!r} is not a key=value override (see --help)")
    return found, rest


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """Hydra's basic-sweeper expansion: key=a,b → one override list per combination."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    batches = BasicSweeper.split_arguments(parsed, None)
    return [list(job) for batch in batches for job in batch]


def cmd_train(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(train_help())
        return 0
    flags, overrides = _split_flags(argv, {"-m", "--multirun"})
    from nxdt.config import ConfigError, compose_config
    from nxdt.launch.local import LaunchFailed, LaunchInterrupted, launch_local
    from nxdt.launch.rundir import choose_run_dir, write_run_dir
    from nxdt.config.validate import check_trainable
    from nxdt.planner import plan

    try:
        jobs = expand_sweep(overrides) if flags else [overrides]
        configs = [compose_config(job) for job in jobs]  # every job is validated before the first starts
        for cfg in configs:
            check_trainable(cfg)
    except ConfigError as exc:
        return _fail(str(exc))
    except Exception as exc:  # Hydra's override grammar errors
        return _fail(f"config error: {str(exc).splitlines()[0]}")
    sweep_dir = None
    if flags:
        first = configs[0]
        sweep_dir = Path(first.exp_manager.exp_dir).expanduser().resolve() / "multirun" / first.name / time.strftime("%Y-%m-%d_%H-%M-%S")
    status = 0
    for num, (job, cfg) in enumerate(zip(jobs, configs)):
        if sweep_dir is not None:
            cfg.exp_manager.explicit_log_dir = str(sweep_dir / str(num))
        run_dir = choose_run_dir(cfg)
        the_plan = plan(cfg)
        write_run_dir(run_dir, cfg, the_plan)
        (run_dir / "overrides.txt").write_text("\n".join(job) + "\n")
        label = f"[job {num}: {' '.join(job)}] " if sweep_dir is not None else ""
        print(f"nxdt: {label}run directory {run_dir} ({the_plan.world_size} ranks)", flush=True)
        try:
            launch_local(run_dir, the_plan, console_tty=sys.stdout.isatty())
        except LaunchFailed as exc:
            print(str(exc), file=sys.stderr)
            status = 1
            if sweep_dir is None:
                break
        except LaunchInterrupted as exc:
            print(str(exc), file=sys.stderr)
            return 130
    return status


def cmd_plan(argv: list[str]) -> int:
    flags, overrides = _split_flags(argv, {"--json"})
    from nxdt.config import ConfigError, compose_config
    from nxdt.planner import plan

    try:
        the_plan = plan(compose_config(overrides))
    except ConfigError as exc:
        return _fail(str(exc))
    print(the_plan.to_json() if flags else the_plan.summary())
    return 0


def cmd_comm_test(argv: list[str]) -> int:
    from nxdt.comm.bench import main as bench_main

    return bench_main(argv)


def cmd_sweep_report(argv: list[str]) -> int:
    if len(argv) != 1:
        raise UsageError("usage: nxdt sweep-report DIR")
    from nxdt.launch.sweep_report import SweepReportError, report

    try:
        return report(Path(argv[0]))
    except SweepReportError as exc:
        return _fail(str(exc))


COMMANDS = {"train": cmd_train, "plan": cmd_plan, "comm-test": cmd_comm_test, "sweep-report": cmd_sweep_report}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    if command is None:
        return _fail(f"nxdt: unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)}")
    try:
        return command(argv[1:])
    except UsageError as exc:
        return _fail(str(exc))


if __name__ == "__main__":
    sys.exit(main())
