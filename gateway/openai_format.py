"""OpenAI's request and response bodies: what a request may ask, and how answers look.

A request field is either supported (mapped onto the job), or accepted only with its neutral
value (``n: 1``, ``presence_penalty: 0``...), or refused with a 400 that names it: nothing is
silently ignored. ``user`` is metadata and accepted as is. ``min_tokens`` and ``ignore_eos`` are
accepted as in vLLM's server (job fields ``min_new_tokens`` and ``ignore_eos``).

A request's priority may come in the body, two ways (``X-Priority`` wins over both, and vLLM's
field over OpenAI's): OpenAI's ``service_tier`` (``TIERS``: ``priority`` is high, ``default``
normal, ``flex`` low; ``auto`` leaves the key's default) and vLLM's integer ``priority`` (lower
runs first: below 0 is high, 0 normal, above 0 low). The gateway caps either at the key's
``max_priority`` and, where ``service_tier`` was asked, says in the answer the tier it used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.errors import invalid
from zkqueue import defaults
from zkqueue.protocol.result import Result

CHAT = "chat.completion"
TEXT = "text_completion"

_COMMON = {
    "model",
    "stream",
    "stream_options",
    "user",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "service_tier",
    "priority",
}
#: OpenAI's service tiers and the priorities they ask for (``auto``: the key's default).
TIERS = {"priority": "high", "default": "normal", "flex": "low", "auto": None}
#: The tier an answer names for the priority a job ran at.
TIER_OF = {"high": "priority", "normal": "default", "low": "flex"}
_SUPPORTED = {
    CHAT: _COMMON | {"messages", "max_tokens", "max_completion_tokens", "min_tokens", "ignore_eos"},
    TEXT: _COMMON | {"prompt", "max_tokens", "min_tokens", "ignore_eos"},
}
#: Fields zkq does not implement, accepted only with the value that means "not used".
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "store": (None, False),
    "metadata": (None, {}),
}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True)
class JobRequest:
    """A validated completion request, as the job it becomes."""

    kind: str
    model: str
    max_tokens: int
    prompt: str = ""
    messages: list[dict[str, str]] | None = None
    #: Job parameters (temperature, top_p, seed, stop, min_new_tokens, ignore_eos).
    params: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    #: The priority the body asked for (``service_tier`` or ``priority``), None: the default.
    asked_priority: str | None = None
    #: Whether the body named a service tier: then the answer names the one the job ran at.
    names_tier: bool = False
    #: That tier (set by the gateway once it has chosen the priority).
    tier: str | None = None
    #: OpenAI's ``user`` (an end user's id): the tenant where the key lets callers name one.
    user: str | None = None

    @property
    def text(self) -> str:
        """The prompt, or the chat's contents (what the token rate limit estimates from)."""
        if self.messages is None:
            return self.prompt
        return "".join(str(m.get("content", "")) for m in self.messages)

    def job_args(self) -> dict[str, Any]:
        """Keyword arguments of ``AsyncClient.submit`` (priority and queue apart)."""
        args = dict(self.params, max_new_tokens=self.max_tokens, stream=self.stream)
        if self.messages is not None:
            args["messages"] = self.messages
        return args


def parse(kind: str, body: Any, default_max_tokens: int) -> JobRequest:
    """Check a request body; raise a 400 ApiError naming the first bad field."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    _refuse_unsupported(kind, body)
    model = body.get("model")
    if model is None or model == "":
        raise invalid("model is required", "model")
    if not isinstance(model, str):
        raise invalid("model must be a string (a model's name)", "model")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise invalid("stream must be true or false", "stream")
    return JobRequest(
        kind=kind,
        model=model,
        max_tokens=_max_tokens(body, default_max_tokens),
        prompt=_prompt(body) if kind == TEXT else "",
        messages=_messages(body.get("messages")) if kind == CHAT else None,
        params=_params(body),
        stream=stream,
        include_usage=_include_usage(body.get("stream_options"), stream),
        asked_priority=_asked_priority(body),
        names_tier=body.get("service_tier") is not None,
        user=body["user"] if isinstance(body.get("user"), str) and body["user"] else None,
    )


def _asked_priority(body: dict[str, Any]) -> str | None:
    """The priority the body asks for: vLLM's ``priority``, else OpenAI's ``service_tier``."""
    value = body.get("priority")
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid("priority must be an integer (lower runs first)", "priority")
        return "high" if value < 0 else "normal" if value == 0 else "low"
    tier = body.get("service_tier")
    if tier is None:
        return None
    if tier not in TIERS:
        raise invalid(f"service_tier must be one of {', '.join(TIERS)}", "service_tier")
    return TIERS[tier]


def _refuse_unsupported(kind: str, body: dict[str, Any]) -> None:
    for name, value in body.items():
        if name in _SUPPORTED[kind]:
            continue
        if name not in _NEUTRAL:
            raise invalid(f"unknown field {name!r}", name, "unknown_field")
        if not any(_same(value, v) for v in _NEUTRAL[name]):
            raise invalid(f"{name}={value!r} is not supported by zkq", name, "unsupported_field")


def _same(value: Any, neutral: Any) -> bool:
    """Equal, without taking true for 1 or false for 0."""
    return bool(value == neutral) and isinstance(value, bool) == isinstance(neutral, bool)


def _max_tokens(body: dict[str, Any], default: int) -> int:
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    value = body.get(name)
    if value is None:
        return default
    limit = defaults.MAX_NEW_TOKENS_LIMIT
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise invalid(f"{name} must be an integer from 1 to {limit}", name)
    return value


def _prompt(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]  # a batch of one
    if not isinstance(prompt, str):
        raise invalid(
            "prompt must be a string (batches and token lists are not supported)", "prompt"
        )
    return prompt


def _messages(raw: Any) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise invalid("messages must be a non-empty list", "messages")
    return [_message(i, m) for i, m in enumerate(raw)]


#: Message fields a client may send with a null value (an SDK's ``message.model_dump()`` of an
#: earlier answer has them): ignored then; any other value asks for tools, which we lack.
_NULL_ONLY = frozenset(
    {"tool_calls", "function_call", "tool_call_id", "refusal", "audio", "annotations"}
)


def _message(index: int, raw: Any) -> dict[str, str]:
    where = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise invalid(f"{where} must be an object with role and content", where)
    for key in sorted(set(raw) - {"role", "content", "name"}):
        if key not in _NULL_ONLY:
            raise invalid(f"{where}.{key} is not a message field", f"{where}.{key}")
        if raw[key] is not None:
            raise invalid(f"{where}.{key} is not supported (tools are not)", f"{where}.{key}")
    if not isinstance(raw.get("name", ""), str):
        raise invalid(f"{where}.name must be a string", f"{where}.name")
    role = _ROLES.get(raw.get("role"))  # type: ignore[arg-type]
    if role is None:
        raise invalid(f"{where}.role must be one of {', '.join(_ROLES)}", f"{where}.role")
    content = raw.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise invalid(f"{where}.content: only text parts are supported", f"{where}.content")
        content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
        raise invalid(f"{where}.content must be a string", f"{where}.content")
    return {"role": role, "content": content}


def _params(body: dict[str, Any]) -> dict[str, Any]:
    params = {
        k: body[k] for k in ("temperature", "top_p", "seed", "stop") if body.get(k) is not None
    }
    if body.get("min_tokens") is not None:
        params["min_new_tokens"] = body["min_tokens"]
    if body.get("ignore_eos"):
        params["ignore_eos"] = body["ignore_eos"]
    return params


def _include_usage(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream or not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise invalid("stream_options takes only include_usage, with stream", "stream_options")
    return bool(options.get("include_usage"))


# -- answers ---------------------------------------------------------------------------------


def response_id(request: JobRequest, job_id: str) -> str:
    """The answer's id carries the job id (also in the X-Zkq-Job header)."""
    return f"{'chatcmpl' if request.kind == CHAT else 'cmpl'}-{job_id}"


def finish_reason(record: Result, max_tokens: int) -> str:
    """The runner's ``finish_reason`` when it reports one, else ``length`` when the output
    reached max_tokens, else ``stop``."""
    reported = record.extra.get("finish_reason")
    if reported in ("stop", "length"):
        return str(reported)
    tokens = record.extra.get("output_tokens")
    return "length" if isinstance(tokens, int) and tokens >= max_tokens else "stop"


def usage(record: Result) -> dict[str, int]:
    prompt = _count(record.extra.get("prompt_tokens"))
    completion = _count(record.extra.get("output_tokens"))
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def used_tokens(record: Result) -> int | None:
    """Prompt and completion tokens of a finished job; None when it reported neither."""
    extra = record.extra
    if "prompt_tokens" not in extra and "output_tokens" not in extra:
        return None
    return usage(record)["total_tokens"]


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def completion(request: JobRequest, job_id: str, record: Result, created: int) -> dict[str, Any]:
    """A whole answer: ``chat.completion`` or ``text_completion``."""
    reason = finish_reason(record, request.max_tokens)
    if request.kind == CHAT:
        message = {"role": "assistant", "content": record.output}
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None}
    else:
        choice = {"index": 0, "text": record.output, "logprobs": None}
    return {
        "id": response_id(request, job_id),
        "object": request.kind,
        "created": created,
        "model": request.model,
        "choices": [{**choice, "finish_reason": reason}],
        "usage": usage(record),
        **_tier(request),
    }


def _tier(request: JobRequest) -> dict[str, str]:
    return {"service_tier": request.tier} if request.tier is not None else {}


def chunk(
    request: JobRequest,
    job_id: str,
    created: int,
    text: str | None = None,
    finish: str | None = None,
    first: bool = False,
) -> dict[str, Any]:
    """One streamed piece: ``chat.completion.chunk`` (a delta) or ``text_completion``."""
    if request.kind == CHAT:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None}
        kind = "chat.completion.chunk"
    else:
        choice, kind = {"index": 0, "text": text or "", "logprobs": None}, TEXT
    return {
        "id": response_id(request, job_id),
        "object": kind,
        "created": created,
        "model": request.model,
        "choices": [{**choice, "finish_reason": finish}],
        **_tier(request),
    }


def usage_chunk(request: JobRequest, job_id: str, created: int, record: Result) -> dict[str, Any]:
    """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
    body = chunk(request, job_id, created)
    return {**body, "choices": [], "usage": usage(record)}
