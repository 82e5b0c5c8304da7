from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zkqueue import defaults
from zkqueue.errors import InvalidJob, SpecTooLarge
from zkqueue.protocol.spec import JobSpec, build_spec


def test_round_trip() -> None:
    spec = JobSpec(prompt="héllo", max_new_tokens=7, temperature=0.5, seed=3)
    assert JobSpec.from_bytes(spec.to_bytes()) == spec


def test_minimal_hand_written_spec_is_accepted() -> None:
    assert JobSpec.from_bytes(b'{"prompt": "hi"}') == JobSpec(prompt="hi")


@pytest.mark.parametrize(
    "raw, message",
    [
        (b'{"prompt": ""}', "prompt must not be empty"),
        (b'{"prompt": "   "}', "prompt must not be empty"),
        (b'{"prompt": 5}', "prompt must be a string"),
        (b"{}", "no prompt"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"prompt": "x", "max_new_tokens": 0}', "max_new_tokens must be between"),
        (b'{"prompt": "x", "max_new_tokens": 1e3}', "max_new_tokens must be an integer"),
        (b'{"prompt": "x", "max_new_tokens": true}', "max_new_tokens must be an integer"),
        (b'{"prompt": "x", "max_new_tokens": 99999999999999999999}', "max_new_tokens must be"),
        (b'{"prompt": "x", "temperature": NaN}', "not valid JSON"),
        (b'{"prompt": "x", "top_p": 0}', "top_p must be above"),
        (b'{"prompt": "x", "colour": "red"}', "unknown field"),
        (b'{"prompt": "x", "v": 2}', "unsupported spec version"),
        (b"\xff\xfe", "not UTF-8"),
        (b'{"prompt": "x"', "not valid JSON"),
    ],
)
def test_bad_specs_say_why(raw: bytes, message: str) -> None:
    with pytest.raises(InvalidJob, match=message):
        JobSpec.from_bytes(raw)


def test_oversize_spec_is_refused_before_writing() -> None:
    spec = build_spec("x" * (defaults.MAX_SPEC_BYTES + 1), None, {})
    with pytest.raises(SpecTooLarge, match="limit is 65536 bytes"):
        spec.to_bytes()


def test_unknown_parameters_are_named() -> None:
    with pytest.raises(InvalidJob, match=r"unknown job parameter.*temprature"):
        build_spec("x", None, {"temprature": 0.3})


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_parse_or_raise_invalid_job(data: bytes) -> None:
    with contextlib.suppress(InvalidJob):
        JobSpec.from_bytes(data)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(
            [
                "prompt",
                "max_new_tokens",
                "temperature",
                "top_p",
                "seed",
                "max_runtime",
                "queue_timeout",
                "v",
                "x",
            ]
        ),
        json_values,
    )
)
def test_arbitrary_json_objects_parse_or_raise_invalid_job(raw: dict[str, object]) -> None:
    try:
        spec = JobSpec.from_bytes(json.dumps(raw).encode())
    except InvalidJob:
        return
    assert spec.prompt.strip()
    assert 1 <= spec.max_new_tokens <= defaults.MAX_NEW_TOKENS_LIMIT
