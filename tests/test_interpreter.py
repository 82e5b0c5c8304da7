"""The switch interval of zkq's long-lived processes: lowered once, never raised."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from zkqueue.plumbing.interpreter import SWITCH_INTERVAL, prompt_handoffs


@pytest.fixture
def interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


@pytest.mark.usefixtures("interval")
def test_the_default_interval_is_lowered() -> None:
    sys.setswitchinterval(0.005)  # Python's default
    prompt_handoffs()
    assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL)
    assert SWITCH_INTERVAL < 0.005


@pytest.mark.usefixtures("interval")
def test_a_shorter_interval_set_by_the_process_is_kept() -> None:
    sys.setswitchinterval(SWITCH_INTERVAL / 5)
    prompt_handoffs()
    assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL / 5)
