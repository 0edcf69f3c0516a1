"""Rank 0's output tee (``nxdt.launch.worker._redirect_output``): everything the worker printed reaches its log and the
console, and ending the tee does not wait for a subprocess that inherited the worker's stdout (W&B's service, ClearML's
monitor outlive the worker's last line: every launch with a tracker sat out the tee's 2 s join timeout)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

from nxdt.launch.worker import _redirect_output


def _worker(log: Path, console: int) -> int:
    """In a forked child: tee to ``console``, print, start a subprocess holding stdout, end the tee. Exit code 0: the tee
    thread had ended when ``end()`` returned; 1: it was still waiting for the subprocess."""
    os.dup2(console, 1)
    end = _redirect_output(log, tee_to_console=True)
    os.write(1, b"step 5/5 loss 4.99\n")  # fd 1 itself: pytest's capture replaced sys.stdout
    os.write(2, b"nxdt: checkpoint saved\n")
    holder = subprocess.Popen(["sleep", "60"])  # inherits fds 1 and 2, the tee pipe's write end, as W&B's service does
    try:
        end()
        return 0 if not any(t.name == "nxdt-tee" and t.is_alive() for t in threading.enumerate()) else 1
    finally:
        holder.kill()
        holder.wait()


def test_the_tee_copies_everything_and_ends_while_a_subprocess_holds_the_worker_stdout(tmp_path):
    log = tmp_path / "rank0.log"
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the forked child)
        code = 3
        try:
            os.close(read_end)
            code = _worker(log, write_end)
        finally:
            os._exit(code)
    os.close(write_end)
    started = time.monotonic()
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    took = time.monotonic() - started
    with os.fdopen(read_end, "rb") as fh:
        console = fh.read()
    assert status == 0, "the tee was still waiting for the subprocess when the worker ended its output"
    assert log.read_bytes() == console == b"step 5/5 loss 4.99\nnxdt: checkpoint saved\n"
    assert took < 60  # the parent never waited for the sleeping subprocess either
