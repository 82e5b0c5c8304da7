"""HTTP errors in OpenAI's shape, and the one place zkq's errors and job outcomes become them.

    {"error": {"message": "...", "type": "invalid_request_error", "param": null, "code": "..."}}

The official clients turn the status into their own exceptions (400 BadRequestError, 401
AuthenticationError, 403 PermissionDeniedError, 404 NotFoundError, 429 RateLimitError, 5xx
InternalServerError).
"""

from __future__ import annotations

from typing import Any

from zkqueue.errors import (
    AccessDenied,
    InvalidJob,
    JobTimeout,
    JobWithdrawn,
    QueueFull,
    StreamInterrupted,
    ZkqConnectionError,
    ZkqError,
)
from zkqueue.protocol import result as results
from zkqueue.protocol.result import Result

INVALID = "invalid_request_error"
AUTH = "authentication_error"
PERMISSION = "permission_error"
NOT_FOUND = "not_found_error"
RATE_LIMIT = "rate_limit_error"
UNAVAILABLE = "service_unavailable"
TIMEOUT = "timeout"
SERVER = "server_error"


class ApiError(Exception):
    """An answer other than 200, with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.type, "param": self.param}
        return {"error": {**error, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, INVALID, code, param)


def from_zkq(exc: ZkqError, retry_after: int) -> ApiError:
    """The HTTP answer for an error the library raised."""
    if isinstance(exc, InvalidJob):
        return invalid(str(exc), code="invalid_job")
    if isinstance(exc, QueueFull):
        headers = {"Retry-After": str(retry_after)}
        return ApiError(429, str(exc), RATE_LIMIT, "queue_full", headers=headers)
    if isinstance(exc, JobTimeout):
        message = str(exc)  # an attached job's timeout already says it was withdrawn
        if "withdrawn" not in message:
            message += "; the request was withdrawn"
        return ApiError(504, message, TIMEOUT, "timeout")
    if isinstance(exc, ZkqConnectionError | AccessDenied):
        return ApiError(503, f"the queue is unavailable: {exc}", UNAVAILABLE, "zookeeper")
    if isinstance(exc, JobWithdrawn):
        return ApiError(503, str(exc), UNAVAILABLE, "withdrawn")
    if isinstance(exc, StreamInterrupted):  # the request is withdrawn as the answer ends
        message = f"{exc.stopped}; the request was withdrawn: send it again"
        return ApiError(502, message, SERVER, "stream_interrupted")
    return ApiError(500, f"internal error: {exc}", SERVER, "internal")


#: A job that ended without succeeding: (status, type, code) of the answer.
_OUTCOMES: dict[str, tuple[int, str, str]] = {
    results.REJECTED: (400, INVALID, "job_rejected"),
    results.EXPIRED: (503, UNAVAILABLE, "queue_timeout"),
    results.CANCELLED: (409, INVALID, "job_cancelled"),
    results.TIMEOUT: (500, SERVER, "max_runtime"),
    results.FAILED: (500, SERVER, "job_failed"),
    results.DEAD: (500, SERVER, "job_dead"),
}


def from_result(record: Result) -> ApiError:
    """The HTTP answer for a job that ended other than ``succeeded``."""
    status, kind, code = _OUTCOMES.get(record.status, (500, SERVER, "job_failed"))
    reason = record.error or record.status
    return ApiError(status, f"job {record.id} {record.status}: {reason}", kind, code)
