"""zkq: a ZooKeeper-backed priority job queue for GPU inference."""

from __future__ import annotations

from zkqueue.errors import (
    ConfigurationError,
    InvalidJob,
    JobNotFound,
    JobTimeout,
    JobWithdrawn,
    QueueFull,
    ResultTooLarge,
    SpecTooLarge,
    ZkqConnectionError,
    ZkqError,
)
from zkqueue.producer.aio import AsyncClient, AsyncJob
from zkqueue.producer.client import Client
from zkqueue.producer.job import Job
from zkqueue.protocol.result import Result
from zkqueue.protocol.spec import JobSpec

__version__ = "0.1.0"
__all__ = [
    "AsyncClient",
    "AsyncJob",
    "Client",
    "ConfigurationError",
    "InvalidJob",
    "Job",
    "JobNotFound",
    "JobSpec",
    "JobTimeout",
    "JobWithdrawn",
    "QueueFull",
    "Result",
    "ResultTooLarge",
    "SpecTooLarge",
    "ZkqConnectionError",
    "ZkqError",
]
