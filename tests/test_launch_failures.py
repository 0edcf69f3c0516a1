"""Which worker the launcher names when a job fails: the one whose failure came first.

One failing rank brings the others down within the same second (its peers raise PeerDiedError, or
CommTimeoutError when it hangs; the agent SIGTERMs the rest; each records an error of its own), and the agent
may report any one of them. The headline names the originating failure, whatever order the files were written in.
These build the agent's real failure objects over error files whose write times are set explicitly,
so the ordering is asserted without racing real processes (the e2e tests cover the real thing).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from nxdt.launch.local import root_failure

T0 = 1_800_000_000.0


def _error_file(attempt: Path, local_rank: int, message: str, written: float) -> str:
    """An error file as torch elastic's @record writes it, last modified at ``written``."""
    path = attempt / str(local_rank) / "error.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {"message": {"message": message, "extraInfo": {"py_callstack": "Traceback ...", "timestamp": str(int(written))}}}
        )
    )
    os.utime(path, (written, written))
    return str(path)


def _reported(attempt: Path, local_rank: int, pid: int, exitcode: int) -> ChildFailedError:
    """What the agent raises when it saw only ``local_rank`` exit (forked workers: one failure)."""
    failure = ProcessFailure(
        local_rank=local_rank, pid=pid, exitcode=exitcode, error_file=str(attempt / str(local_rank) / "error.json")
    )
    return ChildFailedError("worker", {local_rank: failure})


def test_the_rank_that_failed_first_is_named_even_when_the_agent_reports_a_peer(tmp_path):
    _error_file(tmp_path, 1, "InjectedFault: injected fault at step 3 on rank 1", T0)
    _error_file(tmp_path, 0, "PeerDiedError: rank 1 (pid 42) exited while the others waited for it", T0 + 0.004)
    rank, pid, summary = root_failure(_reported(tmp_path, 0, pid=41, exitcode=1), single_host=True)
    assert (rank, summary) == (1, "InjectedFault: injected fault at step 3 on rank 1")
    assert pid is None  # the agent did not report that process: no pid is made up


def test_a_peer_stopped_by_the_agent_after_the_first_failure_is_not_named(tmp_path):
    # several nodes: rank 0 lost its peer on another host (rank numbers in messages are not local ranks); rank 1 then got the agent's SIGTERM and failed in a signal handler
    _error_file(tmp_path, 0, "PeerDiedError: lost the connection to rank(s) [2] on another host", T0)
    _error_file(tmp_path, 1, "RuntimeError: Connection closed by peer", T0 + 0.2)
    rank, pid, summary = root_failure(_reported(tmp_path, 1, pid=52, exitcode=1), single_host=False)
    assert rank == 0 and summary.startswith("PeerDiedError: lost the connection to rank(s) [2]")


def test_a_worker_killed_by_a_signal_is_named_before_the_peer_that_saw_it_die(tmp_path):
    # SIGKILL (or a crash) leaves no error file; the peer's PeerDiedError was written after the death
    peer = ProcessFailure(
        local_rank=0,
        pid=61,
        exitcode=1,
        error_file=_error_file(tmp_path, 0, "PeerDiedError: rank 1 (pid 62) exited while the others waited", T0),
    )
    killed = ProcessFailure(local_rank=1, pid=62, exitcode=-9, error_file=str(tmp_path / "1" / "error.json"))
    rank, pid, summary = root_failure(ChildFailedError("worker", {0: peer, 1: killed}), single_host=True)
    assert (rank, pid) == (1, 62) and "Signal 9" in summary and "SIGKILL" in summary


def test_a_worker_the_agent_stopped_with_sigterm_is_not_named(tmp_path):
    _error_file(tmp_path, 0, "ValueError: loss is nan at step 12", T0)
    stopped = ProcessFailure(local_rank=1, pid=72, exitcode=-15, error_file=str(tmp_path / "1" / "error.json"))
    first = ProcessFailure(local_rank=0, pid=71, exitcode=1, error_file=str(tmp_path / "0" / "error.json"))
    rank, _, summary = root_failure(ChildFailedError("worker", {1: stopped, 0: first}), single_host=True)
    assert (rank, summary) == (0, "ValueError: loss is nan at step 12")


def test_the_reported_failure_alone_keeps_its_pid_and_exit_code(tmp_path):
    rank, pid, summary = root_failure(_reported(tmp_path, 3, pid=73, exitcode=-9), single_host=True)
    assert (rank, pid) == (3, 73) and "Signal 9" in summary


TIMEOUT_ON_1 = "CommTimeoutError: nxdt.comm: group 'dp0' all_reduce (seq/step 9, stream 'default') timed out after 5s waiting for rank(s) [1]"


def test_a_peer_died_error_never_takes_the_blame_from_the_rank_it_names(tmp_path):
    # the kernel's file times are as coarse as its tick: the consequence may carry the same time as the cause, or appear earlier
    for delta in (0.0, -0.004):
        _error_file(tmp_path, 1, "InjectedFault: injected fault at step 3 on rank 1", T0)
        _error_file(
            tmp_path,
            0,
            "PeerDiedError: nxdt.comm: group 'dp0' all_reduce: rank 1 (pid 42) exited while the others waited",
            T0 + delta,
        )
        assert root_failure(_reported(tmp_path, 0, pid=41, exitcode=1), single_host=True)[::2] == (
            1,
            "InjectedFault: injected fault at step 3 on rank 1",
        )


def test_a_rank_that_stopped_responding_is_named_with_the_timeout_that_noticed_it(tmp_path):
    # SIGSTOPped and then killed by the rank that timed out (exit -9), hung and stopped by the agent (-15), or not reported
    for exitcode in (-9, -15, None):
        (tmp_path / "x").mkdir(exist_ok=True)
        attempt = tmp_path / "x" / str(exitcode)
        timed_out = ProcessFailure(local_rank=0, pid=81, exitcode=1, error_file=_error_file(attempt, 0, TIMEOUT_ON_1, T0))
        failures = {0: timed_out}
        if exitcode is not None:
            failures[1] = ProcessFailure(local_rank=1, pid=82, exitcode=exitcode, error_file=str(attempt / "1" / "error.json"))
        rank, pid, summary = root_failure(ChildFailedError("worker", failures), single_host=True)
        assert (rank, pid) == (1, 82 if exitcode else None)
        assert summary == f"stopped responding (rank 0: {TIMEOUT_ON_1})"


def test_a_stopped_rank_killed_by_its_peer_is_named_when_the_agent_reports_only_it(tmp_path):
    """Rank 1 SIGSTOPped, rank 0 timed out, recorded its error and SIGKILLed rank 1; the agent (forked workers: one
    failure) saw rank 1's exit first. Its failure names no error file (torch's "<N/A>"), so the attempt's directory
    comes from the agent's log dir: the headline read "Signal 9 (SIGKILL) received" (the full suite, idle host,
    1 run of 4)."""
    logs = tmp_path / "agent"
    attempt = logs / "run_abc" / "attempt_0"
    _error_file(attempt, 0, TIMEOUT_ON_1, T0)
    killed = ProcessFailure(local_rank=1, pid=82, exitcode=-9, error_file=str(attempt / "1" / "error.json"))
    assert killed.error_file == "<N/A>"  # what torch makes of a missing file
    exc = ChildFailedError("worker", {1: killed})
    rank, pid, summary = root_failure(exc, single_host=True, agent_logs=logs)
    assert (rank, pid, summary) == (1, 82, f"stopped responding (rank 0: {TIMEOUT_ON_1})")


def test_the_blame_follows_a_chain_of_waits_and_a_cycle_names_the_earliest(tmp_path):
    _error_file(tmp_path, 0, TIMEOUT_ON_1, T0)
    _error_file(tmp_path, 1, TIMEOUT_ON_1.replace("[1]", "[2]"), T0 + 1)
    _error_file(tmp_path, 2, "ValueError: bad batch", T0 + 2)
    assert root_failure(_reported(tmp_path, 0, pid=91, exitcode=1), single_host=True)[::2] == (2, "ValueError: bad batch")
    _error_file(tmp_path, 2, TIMEOUT_ON_1.replace("[1]", "[0]"), T0 + 2)  # 0 waits for 1, 1 for 2, 2 for 0: mismatched calls
    assert root_failure(_reported(tmp_path, 1, pid=92, exitcode=1), single_host=True)[::2] == (0, TIMEOUT_ON_1)
