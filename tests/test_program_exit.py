"""How the ``nxdt`` program ends (nxdt.cli._end_the_program): with the status its command returned, its buffered
output written and every exit handler registered meanwhile run, then — where no exit handler was registered before
the program started — without tearing its imports down object by object (0.3 s of `nxdt train`'s wall time). A
handler registered before it (coverage.py's, a site hook's) still runs, and a command that raises ends as Python ends it.

Each case is a fresh interpreter running nxdt.cli's ``main()`` as the ``nxdt`` script does (``sys.exit(main())``),
with a probe command added to its table: cheap (no torch), and each effect is observable from outside. ``python -S``
(no site hooks: this host's site-packages holds a ``.pth`` that registers an exit handler at start-up) with the
test's own ``sys.path`` gives the interpreter a user's shell would start."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

PROGRAM = textwrap.dedent(
    """
    import atexit, sys
    first = sys.argv[1] == "--handler-first"
    if first:
        sys.argv.pop(1)
        atexit.register(sys.stdout.write, "a handler registered before the program ran\\n")
    assert atexit._ncallbacks() == int(first), "python -S registered an exit handler of its own"
    import nxdt.cli as cli

    class Teardown:
        def __del__(self):  # runs when the interpreter clears this module at its teardown (checked: it does there)
            sys.stderr.write("torn down\\n")

    kept = Teardown()

    def probe(args):
        atexit.register(sys.stdout.write, "a handler the command registered ran\\n")
        sys.stdout.write("x" * 100_000 + "\\n")  # block-buffered into a pipe: written at exit
        if args[0] == "raise":
            raise RuntimeError("the probe failed")
        return int(args[0])

    cli.COMMANDS["probe"] = probe
    sys.argv = ["nxdt", "probe", *sys.argv[1:]]
    sys.exit(cli.main())
    """
)
OUTPUT = ["x" * 100_000, "a handler the command registered ran"]


def program(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    cmd = [sys.executable, "-S", "-c", PROGRAM, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("status", [0, 2, 3])
def test_the_program_exits_with_its_status_its_output_and_its_handlers_without_teardown(status):
    done = program(str(status))
    assert done.returncode == status, done.stderr
    assert done.stdout.splitlines() == OUTPUT, done.stdout[-200:]
    assert "torn down" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_handler_registered_before_the_program_still_runs():
    done = program("--handler-first", "3")
    assert done.returncode == 3, done.stderr
    assert done.stdout.splitlines() == [*OUTPUT, "a handler registered before the program ran"], done.stdout[-200:]
    assert "Traceback" not in done.stderr, done.stderr


def test_a_command_that_raises_ends_as_python_ends_it():
    done = program("raise")
    assert done.returncode == 1
    assert done.stderr.startswith("Traceback") and done.stderr.endswith("RuntimeError: the probe failed\n"), done.stderr
    assert done.stdout.splitlines() == OUTPUT, done.stdout[-200:]


def test_a_caller_of_main_keeps_its_process():
    """``main(argv)`` (a caller's own process: tests, notebooks) returns its status and registers nothing."""
    code = "import atexit, nxdt.cli as c; n = atexit._ncallbacks(); s = c.main(['nosuch']); print(s, atexit._ncallbacks() - n)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.split() == ["2", "0"], (done.stdout, done.stderr)
