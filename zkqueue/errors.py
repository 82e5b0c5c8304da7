"""One exception root for zkq, layered by concern; each class carries its CLI exit code."""

from __future__ import annotations


class ExitCode:
    """Process exit codes of the ``zkq`` command (documented in README.md)."""

    OK = 0
    JOB_FAILED = 1
    USAGE = 2
    NOT_FOUND = 3
    TIMEOUT = 4
    QUEUE_FULL = 5
    UNAVAILABLE = 6
    CONFIG = 7
    DENIED = 8
    CORRUPT = 9
    WITHDRAWN = 10
    STREAM_INTERRUPTED = 11
    INTERNAL = 70
    INTERRUPTED = 130


class ZkqError(Exception):
    """Root of every error zkq raises on purpose."""

    exit_code = ExitCode.INTERNAL


class ConfigurationError(ZkqError):
    """A setting is wrong: a bad root path, a model directory that is not a model, a bad size."""

    exit_code = ExitCode.CONFIG


class InvalidJob(ZkqError):
    """A job spec was refused at the edge (unknown priority, empty prompt, bad number...)."""

    exit_code = ExitCode.USAGE


class SpecTooLarge(InvalidJob):
    """A job spec is larger than the documented limit; nothing was written."""


class ResultTooLarge(ZkqError):
    """A result record is larger than the documented limit."""

    exit_code = ExitCode.JOB_FAILED


class JobNotFound(ZkqError):
    """No pending, running or finished job has this id."""

    exit_code = ExitCode.NOT_FOUND


class JobTimeout(ZkqError):
    """The caller stopped waiting for a job."""

    exit_code = ExitCode.TIMEOUT


class QueueFull(ZkqError):
    """The queue holds its maximum number of pending jobs; try again later."""

    exit_code = ExitCode.QUEUE_FULL


class NoWorker(QueueFull):
    """No registered worker serves the queue (raised only when the caller asked for one)."""


class QueueBusy(ZkqError):
    """The queue still holds waiting or running jobs (delete it with force)."""

    exit_code = ExitCode.QUEUE_FULL


class ZkqConnectionError(ZkqError):
    """ZooKeeper could not be reached, or the session was lost while waiting. ``job_id`` names
    a job whose enqueue may have committed before the connection went. A batch cut short
    says which of its jobs were ``enqueued`` and which ``unsure`` (sent: they may or may not
    have been); the rest were not sent."""

    exit_code = ExitCode.UNAVAILABLE

    def __init__(
        self,
        message: str,
        job_id: str | None = None,
        enqueued: tuple[str, ...] = (),
        unsure: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.job_id = job_id
        self.enqueued = enqueued
        self.unsure = unsure


class AccessDenied(ZkqError):
    """ZooKeeper refused the operation: missing or wrong credentials (--auth)."""

    exit_code = ExitCode.DENIED


class CorruptRecord(ZkqError):
    """A node under the root holds data zkq cannot read (not JSON, a required field missing):
    another client wrote it. The message names the node."""

    exit_code = ExitCode.CORRUPT


class Interrupted(ZkqError):
    """The user pressed Ctrl-C; the message says what was and was not submitted."""

    exit_code = ExitCode.INTERRUPTED


class JobWithdrawn(ZkqError):
    """The job's entry is gone and no result was recorded: an attached request withdrawn (its
    caller gave up, or the caller's session expired). Nothing ran to completion: resubmitting is
    safe."""

    exit_code = ExitCode.WITHDRAWN


class StreamInterrupted(ZkqError):
    """A job's stream stopped part-way: the attempt that produced the text already handed out
    ended without a result (its worker died, or the job was preempted or released), so the
    rest of that text will not come. The job itself goes on (its retry writes a result,
    readable with ``result()``); the text handed out may differ from that result's."""

    exit_code = ExitCode.STREAM_INTERRUPTED

    def __init__(self, job_id: str, sent: int, why: str) -> None:
        #: The job, how many characters its caller was handed, and why the stream stopped.
        self.job_id, self.sent, self.why = job_id, sent, why
        goes_on = "the job goes on, and its result is what result() returns"
        super().__init__(f"{self.stopped}; {goes_on}")

    @property
    def stopped(self) -> str:
        """What happened, for a message that goes on to say what follows (a CLI or a gateway
        caller's request is withdrawn with it)."""
        return f"the stream of job {self.job_id} stopped after {self.sent} characters: {self.why}"

    def __reduce__(self) -> tuple[type[StreamInterrupted], tuple[str, int, str]]:
        return type(self), (self.job_id, self.sent, self.why)  # copy and pickle


class ProtocolMismatch(ConfigurationError):
    """The root was written by another version of the znode layout (``zkq migrate`` moves a
    version 1 root to version 2)."""
