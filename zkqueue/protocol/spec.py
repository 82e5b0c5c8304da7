"""The job spec: the JSON stored in a pending entry. One place validates and (de)serializes it.

Validation happens at the edges: producers refuse a bad spec before writing anything, and workers
refuse an entry written by any other client (it is dead-lettered with the reason, never
crashes them).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from zkqueue import defaults
from zkqueue.errors import InvalidJob, SpecTooLarge

SPEC_VERSION = 1
#: Fields a caller may pass as ``**params`` to ``Client.submit``.
PARAMS = (
    "temperature",
    "top_p",
    "seed",
    "max_runtime",
    "queue_timeout",
    "stream",
    "min_new_tokens",
    "ignore_eos",
    "stop",
    "messages",
)
#: Fields only a worker writes: how often the job was given back for a more urgent one.
PREEMPTION_FIELDS = ("preemptions", "preempted_at")
_FIELDS = ("v", "prompt", "max_new_tokens", *PARAMS, *PREEMPTION_FIELDS)
#: At most this many stop strings, each at most this many characters.
MAX_STOP = 4
MAX_STOP_CHARS = 256
#: Characters per token in zkq's estimates before a job runs (OpenAI's rule of thumb: neither
#: the gateway nor the head of the line has the model's tokenizer).
CHARS_PER_TOKEN = 4
#: Chat roles a job's ``messages`` may use.
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class JobSpec:
    """What to run. The job's id, queue and priority live in its znode path, not here."""

    #: The text to continue. Empty when the job is a chat (``messages``).
    prompt: str
    max_new_tokens: int = defaults.MAX_NEW_TOKENS
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    #: Seconds the job may run once started before it ends with status ``timeout``.
    max_runtime: float | None = None
    #: Seconds the job may wait in the queue before it ends with status ``expired``.
    queue_timeout: float | None = None
    #: Publish the output while it is generated (in the claim node, a few times a second).
    stream: bool = False
    #: Generate at least this many tokens (end-of-sequence is ignored until then).
    min_new_tokens: int | None = None
    #: Never stop at end-of-sequence: generate exactly ``max_new_tokens`` (benchmarks).
    ignore_eos: bool = False
    #: Stop when the output contains one of these strings (the string is not part of the output).
    stop: tuple[str, ...] | None = None
    #: A chat: ``({"role": "system"|"user"|"assistant", "content": str}, ...)``; the worker renders
    #: it with the tokenizer's chat template (or ``render_plain`` where it has none).
    messages: tuple[dict[str, str], ...] | None = None
    #: Times a worker gave this job back to the queue for a more urgent one (written by that
    #: worker in the give-back, never by producers). A preemption moves the entry's version
    #: twice (its claim and the give-back), and neither counts as an attempt: see ``attempts``.
    preemptions: int = 0
    #: When the job was last preempted (unix seconds): workers leave a recently preempted job
    #: alone for a while, so a job cannot be bounced between priorities without end.
    preempted_at: float | None = None

    def __post_init__(self) -> None:
        if self.messages is not None:
            object.__setattr__(self, "messages", _check_messages(self.messages))
            if self.prompt != "":
                raise InvalidJob("a job has either a prompt or messages, not both")
        else:
            _check_str("prompt", self.prompt)
        if self.stop is not None:
            object.__setattr__(self, "stop", _check_stop(self.stop))
        _check_int("max_new_tokens", self.max_new_tokens, 1, defaults.MAX_NEW_TOKENS_LIMIT)
        _check_opt_float("temperature", self.temperature, 0.0, 100.0)
        _check_opt_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if not isinstance(self.stream, bool):
            raise InvalidJob(f"stream must be true or false, not {self.stream!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, 2**63 - 1)
        _check_opt_float("max_runtime", self.max_runtime, 0.0, 7 * 86400.0, low_open=True)
        _check_opt_float("queue_timeout", self.queue_timeout, 0.0, 30 * 86400.0, low_open=True)
        if self.min_new_tokens is not None:
            _check_int("min_new_tokens", self.min_new_tokens, 0, self.max_new_tokens)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidJob(f"ignore_eos must be true or false, not {self.ignore_eos!r}")
        _check_int("preemptions", self.preemptions, 0, 2**31 - 1)
        _check_opt_float("preempted_at", self.preempted_at, 0.0, 1e11)

    def attempts(self, version: int) -> int:
        """Claims of the job that count against ``max_attempts``, from its entry's version (one
        per claim, two per preemption: the preempted claim and the give-back)."""
        return max(0, version - 2 * self.preemptions)

    def preempted(self, now: float) -> JobSpec:
        """This spec as the give-back of a preemption at ``now`` writes it."""
        return replace(self, preemptions=self.preemptions + 1, preempted_at=now)

    @property
    def text(self) -> str:
        """The prompt, or a chat's messages in the plain format (``render_plain``)."""
        return self.prompt if self.messages is None else render_plain(self.messages)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "v": SPEC_VERSION,
            "prompt": self.prompt,
            "max_new_tokens": self.max_new_tokens,
        }
        for name in PARAMS:
            value = getattr(self, name)
            if value is not None and value is not False:
                out[name] = list(value) if isinstance(value, tuple) else value
        if self.messages is not None:
            del out["prompt"]
        if self.preemptions:
            out.update(preemptions=self.preemptions, preempted_at=self.preempted_at)
        return out

    def to_bytes(self, limit: int = defaults.MAX_SPEC_BYTES) -> bytes:
        """Serialize; refuse (before anything is written) a spec over ``limit`` bytes."""
        data = json.dumps(self.to_dict(), ensure_ascii=False, separators=(",", ":")).encode()
        if len(data) > limit:
            raise SpecTooLarge(f"job spec is {len(data)} bytes; the limit is {limit} bytes")
        return data

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> JobSpec:
        if not isinstance(raw, Mapping):
            raise InvalidJob(f"job spec must be a JSON object, not {type(raw).__name__}")
        unknown = sorted(set(raw) - set(_FIELDS))
        if unknown:
            raise InvalidJob(f"unknown field(s) in job spec: {', '.join(map(str, unknown))}")
        if "v" in raw and raw["v"] != SPEC_VERSION:
            raise InvalidJob(
                f"unsupported spec version {raw['v']!r} (this zkq reads {SPEC_VERSION})"
            )
        if "prompt" not in raw and "messages" not in raw:
            raise InvalidJob("job spec has no prompt (nor messages)")
        fields = {k: v for k, v in raw.items() if k != "v"}
        fields.setdefault("prompt", "")
        for name in ("stop", "messages"):
            if isinstance(fields.get(name), list):
                fields[name] = tuple(fields[name])
        return cls(**fields)

    @classmethod
    def from_bytes(cls, data: bytes | None, limit: int = defaults.MAX_SPEC_BYTES) -> JobSpec:
        """Parse an entry's data as written by any client; raise InvalidJob with the reason."""
        data = data or b""  # a node created without data (by zkCli.sh) reads as None
        if len(data) > limit:
            raise SpecTooLarge(f"job spec is {len(data)} bytes; the limit is {limit} bytes")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidJob(f"job spec is not UTF-8: {exc}") from None
        try:
            raw = json.loads(text, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:
            raise InvalidJob(f"job spec is not valid JSON: {exc}") from None
        return cls.from_dict(raw)


def build_spec(prompt: str, max_new_tokens: int | None, params: Mapping[str, Any]) -> JobSpec:
    """Make a spec from producer arguments, refusing unknown parameters by name."""
    unknown = sorted(set(params) - set(PARAMS))
    if unknown:
        raise InvalidJob(
            f"unknown job parameter(s): {', '.join(unknown)} (known: {', '.join(PARAMS)})"
        )
    mnt = defaults.MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens
    fields = dict(params)
    for name in ("stop", "messages"):
        if isinstance(fields.get(name), list):
            fields[name] = tuple(fields[name])
    return JobSpec(prompt=prompt, max_new_tokens=mnt, **fields)


def render_plain(messages: tuple[dict[str, str], ...]) -> str:
    """A chat as plain text, for tokenizers without a chat template: one ``role: content`` line
    per message, then ``assistant:`` for the reply to follow."""
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join([*lines, "assistant:"])


def _check_messages(value: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list | tuple) or not value:
        raise InvalidJob("messages must be a non-empty list of {role, content} objects")
    checked = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping) or set(message) != {"role", "content"}:
            raise InvalidJob(f"messages[{i}] must be an object with exactly role and content")
        if message["role"] not in ROLES:
            raise InvalidJob(f"messages[{i}].role must be one of {', '.join(ROLES)}")
        if not isinstance(message["content"], str):
            raise InvalidJob(f"messages[{i}].content must be a string")
        check_utf8(f"messages[{i}].content", message["content"])
        checked.append({"role": message["role"], "content": message["content"]})
    return tuple(checked)


def _check_stop(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, list | tuple) or not 1 <= len(value) <= MAX_STOP:
        raise InvalidJob(f"stop must be a string or a list of 1 to {MAX_STOP} strings")
    for s in value:
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS:
            raise InvalidJob(f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
        check_utf8("stop", s)
    return tuple(value)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid number")


def _check_str(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise InvalidJob(f"{name} must be a string, not {type(value).__name__}")
    if not value.strip():
        raise InvalidJob(f"{name} must not be empty")
    check_utf8(name, value)


def check_utf8(name: str, value: str) -> None:
    """Refuse text that cannot be written as UTF-8: bytes that were not UTF-8 reach Python as
    lone surrogates (argv, ``surrogateescape``) or arrive as JSON escapes such as ``\\udcff``."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidJob(
            f"{name} is not valid UTF-8 (bad character at position {exc.start})"
        ) from None


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidJob(f"{name} must be an integer, not {value!r}")
    if not low <= value <= high:
        raise InvalidJob(f"{name} must be between {low} and {high}, not {value}")


def _check_opt_float(
    name: str, value: Any, low: float, high: float, low_open: bool = False
) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidJob(f"{name} must be a number, not {value!r}")
    if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
        bound = f"{'above' if low_open else 'at least'} {low} and at most {high}"
        raise InvalidJob(f"{name} must be {bound}, not {value}")


@dataclass(frozen=True)
class Submission:
    """A validated job ready to enqueue: where it goes and the bytes of its spec."""

    queue: str
    priority: str
    data: bytes
    #: The id the submitter chose (None: zkq generates one).
    job_id: str | None = None
    #: The tenant the mapping named (None: the submitter's).
    tenant: str | None = None


def parse_submission(
    raw: str | Mapping[str, Any],
    *,
    priority: str = defaults.PRIORITY,
    queue: str = defaults.QUEUE,
    max_new_tokens: int | None = None,
    limit: int = defaults.MAX_SPEC_BYTES,
) -> Submission:
    """Validate one job given as a prompt or as a mapping with ``prompt`` and optional
    ``priority``, ``queue``, ``tenant``, ``max_new_tokens`` and job parameters (a line of a
    JSONL file)."""
    from zkqueue.protocol.layout import check_new_job_id, check_priority, check_queue, check_tenant

    if not isinstance(raw, str | Mapping):
        raise InvalidJob(f"a job must be a prompt or a JSON object, not {type(raw).__name__}")
    fields: dict[str, Any] = {"prompt": raw} if isinstance(raw, str) else dict(raw)
    prio = check_priority(fields.pop("priority", priority))
    target = check_queue(fields.pop("queue", queue))
    job_id = fields.pop("job_id", None)
    if job_id is not None:
        check_new_job_id(job_id)
    tenant = fields.pop("tenant", None)
    if tenant is not None:
        check_tenant(tenant)
    prompt = fields.pop("prompt", None)
    if prompt is None and "messages" not in fields:
        raise InvalidJob("no prompt")
    prompt = "" if prompt is None else prompt
    mnt = fields.pop("max_new_tokens", max_new_tokens)
    unknown = sorted(set(fields) - set(PARAMS))
    if unknown:
        named = ("prompt", "priority", "queue", "max_new_tokens", "job_id", "tenant")
        known = ", ".join((*named, *PARAMS))
        raise InvalidJob(f"unknown field(s): {', '.join(map(str, unknown))} (known: {known})")
    data = build_spec(prompt, mnt, fields).to_bytes(limit)
    return Submission(target, prio, data, job_id, tenant)


def estimate_tokens(text: str, max_new_tokens: int) -> int:
    """The tokens a job may cost, known before it runs: its text's characters / 4 plus the
    tokens it may generate (fair share charges it; the gateway's token rate limits take it)."""
    return math.ceil(len(text) / CHARS_PER_TOKEN) + max_new_tokens
