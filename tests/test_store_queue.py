"""The expert store's read queue: a thread waiting for a layer's reads is woken once, by the
last of them, and a task waited for alone is still answered as soon as it is done."""

import threading
import time

import pytest

from edge0_eval.engine import store


def _queue(pool, n):
    """n tasks on `pool`, each blocked until its event is set; (handles, events)."""
    gates = [threading.Event() for _ in range(n)]

    def task(i):
        if not gates[i].wait(10):
            raise TimeoutError("the test never released this task")
        return i

    return pool.submit_many([(store.PREFETCH, task, (i,)) for i in range(n)]), gates


def _release(gates, pause):
    def go():
        for g in gates:
            time.sleep(pause)
            g.set()

    threading.Thread(target=go, daemon=True).start()


@pytest.fixture
def pool():
    p = store._PriorityPool(4)
    yield p
    p.shutdown()


def test_waiting_for_a_layers_reads_wakes_once(pool, monkeypatch):
    waits = []
    wait = store._Group.wait

    def counted(self, timeout=None):
        waits.append(1)
        return wait(self, timeout)

    monkeypatch.setattr(store._Group, "wait", counted)
    handles, gates = _queue(pool, 4)
    _release(gates, 0.05)  # the tasks finish one by one while results() waits
    assert store.results(handles) == [0, 1, 2, 3]
    # Woken by each task it would wait 4 times; by the last one, once (a spurious wake-up
    # may add one).
    assert len(waits) <= 2, f"results() waited {len(waits)} times for 4 tasks"


def _within(seconds, fn):
    """fn() on another thread; its result, or its exception, within `seconds`."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still waiting after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_task_waited_for_alone_is_answered_when_it_is_done(pool):
    handles, gates = _queue(pool, 3)
    # Released while waited for; the others stay blocked, so their group is not done.
    _release(gates[:1], 0.05)
    assert _within(5, lambda: handles[0].result()) == 0
    _release(gates[1:2], 0.05)
    assert _within(5, lambda: store.results(handles[1:2])) == [1]  # part of a group
    assert not handles[2].done()
    gates[2].set()
    assert store.results(handles) == [0, 1, 2]


def test_a_cancelled_task_counts_as_done(pool):
    blocker, gates = _queue(pool, 4)  # the 4 I/O threads are busy
    handles, mine = _queue(pool, 2)  # queued behind them

    def later():
        time.sleep(0.05)  # while results() waits for the pair
        assert handles[1].cancel()
        for g in gates + mine:
            g.set()

    threading.Thread(target=later, daemon=True).start()
    with pytest.raises(store.CancelledError):
        _within(5, lambda: store.results(handles))
    assert handles[0].result(timeout=5) == 0
    assert store.results(blocker) == [0, 1, 2, 3]
