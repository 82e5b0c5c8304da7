from __future__ import annotations

import pytest

from zkqueue.errors import ConfigurationError, InvalidJob
from zkqueue.layout import EntryName, Layout, check_priority, check_queue, line_order


def test_entry_names_parse_and_order_as_numbers() -> None:
    names = ["abc-0000000010", "abc-0000000009", "def-0000000100"]
    ordered = sorted((EntryName.parse(n) for n in names), key=lambda e: e.order)
    assert [e.name for e in ordered] == ["abc-0000000009", "abc-0000000010", "def-0000000100"]


def test_wrapped_sequence_sorts_after_the_largest_positive() -> None:
    # ZooKeeper's counter is a signed 32-bit int: after 2147483647 comes -2147483648.
    top = EntryName.parse("a-2147483647")
    wrapped = EntryName.parse("b--2147483648")
    small_negative = EntryName.parse("c--000000005")
    assert wrapped.seq == -(2**31)
    assert top.order < wrapped.order < small_negative.order
    assert wrapped.name == "b--2147483648"
    assert small_negative.name == "c--000000005"


@pytest.mark.parametrize(
    "name",
    ["noseq", "abc-12", "abc-00000000012", "a b-0000000001", "-0000000001", "abc-000000001x"],
)
def test_malformed_entry_names_are_refused(name: str) -> None:
    with pytest.raises(InvalidJob):
        EntryName.parse(name)


def test_paths_are_built_under_the_root() -> None:
    lay = Layout("/zkq")
    assert lay.entry("q", "high", "x-0000000001") == "/zkq/queues/q/pending/high/x-0000000001"
    assert lay.claim("q", "x-0000000001") == "/zkq/queues/q/claims/x-0000000001"
    assert lay.result("q", "x") == "/zkq/queues/q/results/x"
    assert lay.worker("w1") == "/zkq/workers/w1"
    assert line_order("w-0000000042") == 42


@pytest.mark.parametrize("root", ["zkq", "/zkq/", "//zkq", ""])
def test_bad_roots_are_refused(root: str) -> None:
    with pytest.raises(ConfigurationError):
        Layout(root)


def test_queue_and_priority_checks() -> None:
    assert check_queue("llama-70b.v2") == "llama-70b.v2"
    for bad in ["", "a/b", "..", "x" * 65]:
        with pytest.raises(InvalidJob):
            check_queue(bad)
    with pytest.raises(InvalidJob, match="unknown priority 'urgent'"):
        check_priority("urgent")
