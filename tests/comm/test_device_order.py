"""The device order of nxdt's stream threads (nxdt.comm.stream.DeviceOrder; CUDA's in nxdt.comm.cuda_streams).

Which thread calls which hook, in which order, around which op: the plumbing a GPU's streams and events hang on,
checked here with a recording order on CPU work (tests/gpu/device_checks.py checks the CUDA order on a GPU)."""

from __future__ import annotations

import threading

import pytest
import torch

from nxdt.comm.stream import Stream


class RecordingOrder:
    """A DeviceOrder that logs (hook, op name, thread name) and whether a hook ran inside its ``running`` block."""

    inside = threading.local()

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def _add(self, hook: str) -> None:
        self.log.append((hook, self.name, threading.current_thread().name, getattr(RecordingOrder.inside, "op", None)))

    def issued(self) -> None:
        self._add("issued")

    def running(self):
        order = self

        class Block:
            def __enter__(self):
                order._add("enter")
                RecordingOrder.inside.op = order.name

            def __exit__(self, *exc):
                order._add("exit")
                RecordingOrder.inside.op = None
                return False

        return Block()

    def waited(self) -> None:
        self._add("waited")

    def inline(self) -> None:
        self._add("inline")


def op(name: str, log: list, gate: threading.Event | None = None):
    def run() -> None:
        if gate is not None:
            gate.wait(10)
        log.append(("op", name, threading.current_thread().name, getattr(RecordingOrder.inside, "op", None)))

    return run


@pytest.fixture
def stream():
    s = Stream("x")
    yield s
    s.close()


def test_a_queued_op_marks_inputs_where_issued_runs_inside_its_block_and_hands_results_to_the_waiter(stream):
    log: list = []
    main = threading.current_thread().name
    work = stream.submit(op("a", log), "a", async_op=True, order=RecordingOrder("a", log))
    work.wait()
    assert log == [
        ("issued", "a", main, None),  # in the submitting thread, before the op can run
        ("enter", "a", "nxdt-stream-x", None),
        ("op", "a", "nxdt-stream-x", "a"),  # on the stream's thread, inside the block (its device queue)
        ("exit", "a", "nxdt-stream-x", "a"),
        ("waited", "a", main, None),  # the waiter's device work follows the results
    ]
    work.wait()  # waiting again hands the results on again: harmless, and what a second waiter needs
    assert log[-1] == ("waited", "a", main, None)


def test_an_after_op_is_waited_for_inside_the_dependent_ops_block(stream):
    """The token chain on a device: the dependent op's device queue waits for its predecessor, not the host's."""
    log: list = []
    other = Stream("y")
    try:
        gate = threading.Event()
        first = other.submit(op("a", log, gate), "a", async_op=True, order=RecordingOrder("a", log))
        second = stream.submit(op("b", log), "b", async_op=True, after=[first], order=RecordingOrder("b", log))
        gate.set()
        second.wait()
    finally:
        other.close()
    hooks = [(h, n, where) for h, n, _, where in log]
    assert hooks.index(("waited", "a", "b")) > hooks.index(("enter", "b", None))  # inside b's block
    assert hooks.index(("waited", "a", "b")) < hooks.index(("op", "b", "b"))
    assert hooks.index(("op", "a", "a")) < hooks.index(("waited", "a", "b"))


def test_a_blocking_op_inline_follows_the_queue_and_a_queued_one_is_waited_for(stream):
    log: list = []
    main = threading.current_thread().name
    stream.submit(op("a", log), "a", async_op=False, order=RecordingOrder("a", log))
    assert log == [("inline", "a", main, None), ("op", "a", main, None)]  # idle stream: here, after the queue
    log.clear()
    gate = threading.Event()
    busy = stream.submit(op("b", log, gate), "b", async_op=True, order=RecordingOrder("b", log))
    blocker = threading.Thread(target=lambda: stream.submit(op("c", log), "c", async_op=False, order=RecordingOrder("c", log)))
    blocker.start()  # queued behind b: its caller waits for it, device results included
    gate.set()
    blocker.join(10)
    busy.wait()
    names = [(h, n) for h, n, _, _ in log]
    assert names.index(("issued", "c")) < names.index(("op", "c")) < names.index(("waited", "c"))
    assert ("inline", "c") not in names
    assert next(t for h, n, t, _ in log if (h, n) == ("waited", "c")) == blocker.name


def test_an_op_that_fails_leaves_its_block_and_the_waiter_gets_the_error_not_the_results(stream):
    log: list = []

    def boom() -> None:
        raise RuntimeError("peer lost")

    work = stream.submit(boom, "a", async_op=True, order=RecordingOrder("a", log))
    with pytest.raises(RuntimeError, match="peer lost"):
        work.wait()
    assert [h for h, *_ in log] == ["issued", "enter", "exit"]


def test_host_tensors_take_no_device_order():
    from nxdt.comm.cuda_streams import device_order

    assert device_order(Stream("z"), [torch.ones(2)]) is None
