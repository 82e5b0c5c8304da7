"""The gateway's settings: defaults, model pools and API keys, from a TOML file.

[gateway]
timeout = 600          # seconds a request may wait for its job (504 after; X-Zkq-Timeout)
max_tokens = 64        # max_tokens when a request gives none
retry_after = 1        # seconds, in the Retry-After header of a 429

[models]               # model name -> queue; a model not listed uses the queue of its name
"llama-3-8b" = "llama"

[[keys]]               # with any key configured, every request needs a valid one
key = "sk-team-a"
name = "team-a"        # shown in logs and metrics instead of the key
priority = "high"      # the default priority of its requests
max_priority = "high"  # the highest it may ask for with X-Priority (default: priority)
max_pending = 100      # refuse (429) while its queue has this many jobs waiting
max_in_flight = 20     # refuse (429) beyond this many open requests on one gateway process
requests_per_minute = 600   # rate limits, per gateway process (429 with Retry-After beyond;
tokens_per_minute = 200000  # tokens: prompt and completion; see gateway/ratelimits.py)
tenant = "team-a"      # the tenant its jobs belong to (fair share; default: the default tenant)
tenant_override = false  # true: a request may name its tenant with X-Zkq-Tenant or "user"
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zkqueue import defaults
from zkqueue.errors import ConfigurationError, InvalidJob
from zkqueue.protocol.layout import check_priority, check_queue, check_tenant

#: Seconds a request waits for its job when neither the config nor the request says.
TIMEOUT = 600.0
RETRY_AFTER = 1


@dataclass(frozen=True)
class ApiKey:
    """One caller: its secret, a name to log, its priorities and its limits."""

    key: str = field(repr=False)
    name: str
    priority: str = defaults.PRIORITY
    max_priority: str = defaults.PRIORITY
    max_pending: int | None = None
    max_in_flight: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    #: The tenant its jobs belong to (None: the default tenant).
    tenant: str | None = None
    #: Whether a request may name its own tenant (X-Zkq-Tenant, else OpenAI's ``user``).
    tenant_override: bool = False

    def allows(self, priority: str) -> bool:
        """Whether this key may submit at ``priority`` (not above its max_priority)."""
        rank = defaults.PRIORITIES.index
        return rank(priority) >= rank(self.max_priority)


@dataclass(frozen=True)
class GatewayConfig:
    """Everything ``zkq serve`` reads from its config file (all optional)."""

    timeout: float = TIMEOUT
    max_tokens: int = defaults.MAX_NEW_TOKENS
    retry_after: int = RETRY_AFTER
    models: dict[str, str] = field(default_factory=dict)
    keys: tuple[ApiKey, ...] = ()

    def queue_for(self, model: str) -> str:
        """The queue of a model pool: the mapped one, else the queue named like the model."""
        return self.models.get(model, model)

    def key(self, secret: str | None) -> ApiKey | None:
        return next((k for k in self.keys if secret is not None and k.key == secret), None)


def load(path: str | Path | None) -> GatewayConfig:
    """Read and check a config file (None: the defaults). Errors name the file and the field."""
    if path is None:
        return GatewayConfig()
    try:
        raw = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigurationError(f"cannot read gateway config {path}: {exc}") from None
    try:
        return parse(raw)
    except (InvalidJob, TypeError, ValueError) as exc:
        raise ConfigurationError(f"gateway config {path}: {exc}") from None


def parse(raw: dict[str, Any]) -> GatewayConfig:
    unknown = set(raw) - {"gateway", "models", "keys"}
    if unknown:
        raise ValueError(f"unknown section(s): {', '.join(sorted(unknown))}")
    section = dict(raw.get("gateway", {}))
    _only(section, {"timeout", "max_tokens", "retry_after"}, "[gateway]")
    models = {str(m): check_queue(q) for m, q in raw.get("models", {}).items()}
    keys = tuple(_key(i, dict(k)) for i, k in enumerate(raw.get("keys", [])))
    if len({k.key for k in keys}) != len(keys):
        raise ValueError("the same key appears twice in [[keys]]")
    if len({k.name for k in keys}) != len(keys):  # names label metrics and rate limits
        raise ValueError("two [[keys]] have the same name")
    config = GatewayConfig(
        timeout=_positive(section.get("timeout", TIMEOUT), "timeout"),
        max_tokens=int(_positive(section.get("max_tokens", defaults.MAX_NEW_TOKENS), "max_tokens")),
        retry_after=int(section.get("retry_after", RETRY_AFTER)),
        models=models,
        keys=keys,
    )
    return config


def _key(index: int, raw: dict[str, Any]) -> ApiKey:
    where = f"[[keys]] #{index + 1}"
    _only(
        raw,
        {"key", "name", "priority", "max_priority", "tenant", "tenant_override", *_LIMITS},
        where,
    )
    secret = raw.get("key")
    if not isinstance(secret, str) or len(secret) < 8:
        raise ValueError(f"{where}: key must be a string of at least 8 characters")
    priority = check_priority(raw.get("priority", defaults.PRIORITY))
    tenant = raw.get("tenant")
    if tenant is not None:
        check_tenant(tenant) if isinstance(tenant, str) else check_tenant(repr(tenant))
    override = raw.get("tenant_override", False)
    if not isinstance(override, bool):
        raise ValueError(f"{where}: tenant_override must be true or false")
    limits = {n: raw.get(n) for n in _LIMITS}
    for name, value in limits.items():
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{where}: {name} must be a positive integer")
    return ApiKey(
        key=secret,
        name=str(raw.get("name", f"key-{index + 1}")),
        priority=priority,
        max_priority=check_priority(raw.get("max_priority", priority)),
        tenant=tenant,
        tenant_override=override,
        **limits,
    )


#: A key's limits: positive integers, each optional.
_LIMITS = ("max_pending", "max_in_flight", "requests_per_minute", "tokens_per_minute")


def _only(raw: dict[str, Any], known: set[str], where: str) -> None:
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")


def _positive(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"{name} must be a positive number")
    return float(value)
