"""The step's thread count follows the machine's load (``threads.py``)."""

from __future__ import annotations

import pytest
import torch

from workers.engines.reference.threads import LOAD_CHECK_SECONDS, ThreadPolicy


class Load:
    def __init__(self, value: float):
        self.value = value
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.value


@pytest.mark.parametrize(
    ("load", "current", "expected"),
    [
        (0.0, 2, 2),  # idle machine
        (2.0, 2, 2),  # only our own two threads busy
        (2.4, 2, 2),  # a little other work
        (3.0, 2, 1),  # another busy process: a core is taken
        (4.0, 1, 1),  # two other busy processes (--cpu-hog 2) while we run one thread
        (1.2, 1, 2),  # the others went away
    ],
)
def test_every_thread_only_while_other_work_leaves_a_core_for_each(load: float, current: int, expected: int) -> None:
    policy = ThreadPolicy(2, num_cores=2, load_average=Load(load), clock=lambda: 0.0)
    policy.current = current
    assert policy.threads() == expected


def test_the_load_is_read_at_most_once_a_check_interval() -> None:
    now = [0.0]
    load = Load(4.0)
    policy = ThreadPolicy(2, num_cores=2, load_average=load, clock=lambda: now[0])
    assert policy.threads() == 1
    load.value = 0.0
    now[0] = LOAD_CHECK_SECONDS / 2
    assert policy.threads() == 1 and load.reads == 1
    now[0] = LOAD_CHECK_SECONDS
    assert policy.threads() == 2 and load.reads == 2


def test_one_thread_configured_is_never_raised_or_read() -> None:
    load = Load(0.0)
    policy = ThreadPolicy(1, num_cores=8, load_average=load)
    assert policy.threads() == 1 and load.reads == 0


def test_a_step_on_fewer_threads_gives_the_count_back() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        policy = ThreadPolicy(2, num_cores=2, load_average=Load(8.0), clock=lambda: 0.0)
        with policy.step() as n:
            assert n == 1 and torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
