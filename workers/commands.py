"""The daemon's commands, added to ``zkq`` through the ``zkq.commands`` entry points: ``worker``,
``janitor`` and ``tiny-model``."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import click
from click.core import ParameterSource

from zkqueue import defaults
from zkqueue.cli.common import COUNT, SECONDS, SIZE, checked, connection_settings, handles_errors
from zkqueue.protocol.layout import check_queue, check_worker_name

#: The stored-results bounds, shared by ``zkq worker`` and ``zkq janitor``.
_MAX_RESULTS = click.option(
    "--max-results",
    type=COUNT,
    default=defaults.MAX_RESULTS,
    show_default=True,
    help="Results a queue keeps at most (the oldest are expired first).",
)
_MAX_RESULT_BYTES = click.option(
    "--max-result-bytes",
    type=SIZE,
    default=defaults.MAX_RESULT_STORE_BYTES,
    help="Bytes of result records a queue keeps at most [default: 256MiB].",
)


@click.command()
@click.option("--queue", default=defaults.QUEUE, show_default=True, callback=checked(check_queue))
@click.option(
    "--runner",
    type=click.Choice(["echo", "hf", "openai"]),
    default="echo",
    show_default=True,
    help="echo (smoke tests, benchmarks), hf (a transformers model in process; implied by "
    "--model) or openai (an OpenAI-compatible inference server; implied by --upstream).",
)
@click.option("--model", default=None, help="Local model directory (transformers causal LM).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda:N.")
@click.option(
    "--dtype",
    type=click.Choice(["auto", "float16", "bfloat16", "float32"]),
    default="auto",
    show_default=True,
)
@click.option(
    "--vram-budget",
    type=SIZE,
    default=None,
    help="Act as if the device had SIZE (e.g. 512MiB), weights included; for CPU hosts.",
)
@click.option(
    "--vram-reserve", type=SIZE, default=0, help="Keep SIZE of device memory free always."
)
@click.option(
    "--max-runtime", type=SECONDS, default=None, help="Default max runtime per job, seconds."
)
@click.option(
    "--greedy-only",
    is_flag=True,
    help="A greedy-only engine: faster steps; sampled jobs then run one at a time.",
)
@click.option(
    "--upstream",
    default=None,
    metavar="URL",
    help="The openai runner's server: its OpenAI base URL, e.g. http://127.0.0.1:8000/v1.",
)
@click.option(
    "--upstream-model", default=None, help="The server's model to use [default: its only one]."
)
@click.option(
    "--upstream-api-key",
    default=None,
    envvar="ZKQ_UPSTREAM_API_KEY",
    help="Bearer key for the server [env: ZKQ_UPSTREAM_API_KEY].",
)
@click.option(
    "--upstream-priority/--no-upstream-priority",
    default=False,
    show_default=True,
    help="Send each job's priority as vLLM's priority field (high -1, normal 0, low 1; for "
    "vllm serve --scheduling-policy priority).",
)
@click.option(
    "--upstream-max-waiting",
    type=click.IntRange(min=0),
    default=defaults.UPSTREAM_MAX_WAITING,
    show_default=True,
    help="Claim only while the server's waiting queue holds at most N (from its /metrics).",
)
@click.option(
    "--upstream-max-kv-use",
    type=click.FloatRange(0, 1, min_open=True),
    default=defaults.UPSTREAM_MAX_KV_USE,
    show_default=True,
    help="Claim only while the server's KV-cache use is below this (from its /metrics).",
)
@click.option(
    "--upstream-timeout",
    type=SECONDS,
    default=defaults.UPSTREAM_TIMEOUT,
    show_default=True,
    help="Seconds without a byte from the server before a request counts as its failure.",
)
@click.option(
    "--slow-after", type=SECONDS, default=30.0, show_default=True, help="Log jobs slower than this."
)
@click.option(
    "--echo-delay",
    type=click.FloatRange(min=0),
    default=defaults.ECHO_DELAY,
    show_default=True,
    help="Seconds the echo runner takes per batch.",
)
@click.option(
    "--max-concurrency",
    type=COUNT,
    default=None,
    help="Slots: jobs this worker holds at once [default: 1 for echo; for a model, its "
    "engine's throughput knee, measured at start (or cached), within what its KV cache admits "
    "and 256].",
)
@click.option(
    "--calibrate/--no-calibrate",
    default=True,
    show_default=True,
    help="Measure a model worker's knee at start (cached per model and device); --no-calibrate: "
    "16 slots on the CPU, 64 on a GPU.",
)
@click.option("--recalibrate", is_flag=True, help="Measure the knee again, ignoring the cache.")
@click.option(
    "--calibration-cache",
    type=click.Path(file_okay=False),
    default=None,
    help="Directory of the knee cache [default: $CACHE_DIRECTORY, else $XDG_CACHE_HOME/zkq, "
    "else ~/.cache/zkq].",
)
@click.option(
    "--name",
    default=None,
    callback=checked(check_worker_name),
    help="Worker id (default host-pid-random).",
)
@click.option("--max-jobs", type=COUNT, default=None, help="Exit after claiming N jobs.")
@click.option("--burst", is_flag=True, help="Exit when the queue is empty.")
@click.option(
    "--drain-timeout",
    type=click.FloatRange(min=0),
    default=defaults.DRAIN_TIMEOUT,
    show_default=True,
)
@click.option(
    "--heartbeat-interval", type=SECONDS, default=defaults.HEARTBEAT_INTERVAL, show_default=True
)
@click.option("--max-attempts", type=COUNT, default=defaults.MAX_ATTEMPTS, show_default=True)
@click.option(
    "--lease",
    type=SECONDS,
    default=defaults.LEASE,
    show_default=True,
    help="Seconds a running job's claim lives without progress.",
)
@click.option(
    "--preempt/--no-preempt",
    default=defaults.PREEMPT,
    show_default=True,
    help="With every slot busy, give the newest lower-priority job back for a more urgent one.",
)
@click.option(
    "--preempt-protect",
    type=SECONDS,
    default=defaults.PREEMPT_PROTECT,
    show_default=True,
    help="Seconds a preempted job is safe from another preemption.",
)
@click.option(
    "--preempt-per-minute",
    type=COUNT,
    default=defaults.PREEMPT_PER_MINUTE,
    show_default=True,
    help="Preemptions this worker makes in any minute at most.",
)
@click.option(
    "--high-width",
    default="auto",
    show_default=True,
    metavar="auto|off|N",
    help="Jobs held at most while a high-priority job runs: lower ones that end are not "
    "replaced beyond it, so the urgent job's steps stay short (auto: from the calibration).",
)
@click.option(
    "--stream/--no-stream",
    default=True,
    show_default=True,
    help="Serve streaming jobs' tokens to their readers directly, as they are generated "
    "(off: through the jobs' claims in ZooKeeper, about 4 times a second).",
)
@click.option(
    "--stream-bind",
    default="0.0.0.0:0",
    show_default=True,
    metavar="HOST:PORT",
    help="Where the stream server listens (port 0: any free port).",
)
@click.option(
    "--stream-advertise",
    default=None,
    metavar="HOST[:PORT]",
    help="The address readers use to reach the stream server [default: the address this host "
    "reaches ZooKeeper from].",
)
@click.option(
    "--janitor/--no-janitor",
    default=True,
    show_default=True,
    help="Stand for the janitor election.",
)
@click.option(
    "--janitor-interval", type=SECONDS, default=defaults.JANITOR_INTERVAL, show_default=True
)
@click.option(
    "--result-ttl",
    type=SECONDS,
    default=defaults.RESULT_TTL,
    show_default=True,
    help="Seconds finished results are kept (by the janitor).",
)
@_MAX_RESULTS
@_MAX_RESULT_BYTES
@click.option(
    "--metrics-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Serve Prometheus metrics here.",
)
@click.option("--metrics-addr", default="0.0.0.0", show_default=True)
@click.option(
    "--config",
    type=click.Path(dir_okay=False),
    default=None,
    help="TOML file with worker settings: flags override it, it overrides ZKQ_* variables.",
)
@click.option(
    "-q", "--quiet", is_flag=True, help="Log warnings and errors only (the default is info)."
)
@click.pass_context
@handles_errors
def worker(ctx: click.Context, quiet: bool, **options: Any) -> None:
    """Run a worker daemon on a queue until SIGTERM (drain) or a second signal (release).

    \b
    Examples:
      zkq worker --queue default --runner echo --max-concurrency 4
      zkq worker --queue llama --model /srv/models/llama --max-concurrency 8 --vram-reserve 2GiB
      zkq worker --queue llama --upstream http://127.0.0.1:8000/v1 --upstream-priority
    """
    from workers.config import apply_config
    from workers.daemon import run_worker
    from workers.options import WorkerOptions

    _worker_log_level(ctx, quiet)
    config = options.pop("config")
    if config is not None:
        apply_config(ctx, options, config)
    settings = connection_settings(ctx)
    opts = WorkerOptions(root=ctx.obj["root"], **options)
    if settings.tls_cert and settings.tls_key:  # streams use the ensemble's TLS, if it has it
        opts.stream_tls = (settings.tls_cert, settings.tls_key)
    sys.exit(run_worker(settings, opts))


def _worker_log_level(ctx: click.Context, quiet: bool) -> None:
    """A daemon says what it does: info unless --quiet or --log-level/ZKQ_LOG_LEVEL said."""
    if quiet:
        logging.getLogger().setLevel(logging.WARNING)
    elif ctx.find_root().get_parameter_source("log_level") == ParameterSource.DEFAULT:
        logging.getLogger().setLevel(logging.INFO)


@click.command()
@click.option("--interval", type=SECONDS, default=defaults.JANITOR_INTERVAL, show_default=True)
@click.option(
    "--result-ttl",
    type=SECONDS,
    default=defaults.RESULT_TTL,
    show_default=True,
    help="Seconds finished results are kept.",
)
@_MAX_RESULTS
@_MAX_RESULT_BYTES
@click.option("--once", is_flag=True, help="Run one pass now, print what it did, and exit.")
@click.option("--json", "as_json", is_flag=True, help="With --once: print the pass as JSON.")
@click.pass_context
@handles_errors
def janitor(
    ctx: click.Context,
    interval: float,
    result_ttl: float,
    max_results: int,
    max_result_bytes: int,
    once: bool,
    as_json: bool,
) -> None:
    """Run the janitor (expired leases, queue deadlines, old results) for deployments without
    workers running it; several may run, one is elected.

    \b
    Examples:
      zkq janitor --once                 # one pass now, with a summary
      zkq janitor --interval 5 &         # the elected janitor until SIGTERM
    """
    from workers.daemon import janitor_pass, run_janitor
    from zkqueue.operations.expiry import ExpiryLimits

    if as_json and not once:
        raise click.UsageError("--json applies only with --once")
    settings, root = connection_settings(ctx), ctx.obj["root"]
    limits = ExpiryLimits(max_results=max_results, max_bytes=max_result_bytes)
    if once:
        report = janitor_pass(settings, root, result_ttl=result_ttl, limits=limits)
        click.echo(json.dumps(report) if as_json else _janitor_summary(report))
        return
    _worker_log_level(ctx, quiet=False)
    sys.exit(run_janitor(settings, root, interval=interval, result_ttl=result_ttl, limits=limits))


def _janitor_summary(report: dict[str, Any]) -> str:
    def ids(jobs: list[str]) -> str:
        return f": {', '.join(jobs[:5])}{' ...' if len(jobs) > 5 else ''}" if jobs else ""

    return "\n".join(
        [
            f"reclaimed {len(report['reclaimed'])} lapsed lease(s){ids(report['reclaimed'])}",
            f"expired {len(report['expired'])} job(s) past their queue timeout"
            f"{ids(report['expired'])}",
            f"removed {report['results_removed']} result(s) older than the retention",
            f"removed {len(report['lanes_removed'])} tenant lane(s) left empty"
            f"{ids(report['lanes_removed'])}",
        ]
    )


@click.command("tiny-model")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--seed", type=int, default=0, show_default=True)
@handles_errors
def tiny_model(directory: str, seed: int) -> None:
    """Write a small random-weight causal LM (config, safetensors, BPE tokenizer) to DIRECTORY.

    \b
    Example:
      zkq tiny-model /tmp/tiny && zkq worker --model /tmp/tiny
    """
    from workers.tinymodel import write_tiny_model

    click.echo(str(write_tiny_model(directory, seed=seed)))
