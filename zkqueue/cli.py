"""The ``zkq`` command: it only maps options onto library calls. Exit codes: errors.ExitCode."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any, TextIO

import click

from zkqueue import defaults
from zkqueue.client import Client
from zkqueue.connection import ConnectionSettings
from zkqueue.errors import ExitCode, JobTimeout, ZkqError
from zkqueue.job import Job
from zkqueue.logs import configure as configure_logging
from zkqueue.result import Result


class _Size(click.ParamType):
    """A byte size such as 512MiB or 2GB."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        from workers.kvcache import parse_size

        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except ZkqError as exc:
            self.fail(str(exc), param, ctx)


SIZE = _Size()
_CTX = {"auto_envvar_prefix": "ZKQ", "help_option_names": ["-h", "--help"]}


_CONNECTION = ("session_timeout", "connect_timeout", "auth", "tls_ca", "tls_cert", "tls_key")


def _client(ctx: click.Context) -> Client:
    o = ctx.obj
    return Client(o["zk"], o["root"], **{k: o[k] for k in _CONNECTION})


def _settings(ctx: click.Context) -> ConnectionSettings:
    o = ctx.obj
    return ConnectionSettings(hosts=o["zk"], **{k: o[k] for k in _CONNECTION})


def _emit(data: Any) -> None:
    click.echo(json.dumps(data, indent=None, sort_keys=False, default=str))


def _exit_for(record: Result) -> int:
    return ExitCode.OK if record.ok else ExitCode.JOB_FAILED


def handles_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Turn zkq errors into a one-line message on stderr and the documented exit code."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except ZkqError as exc:
            click.echo(f"zkq: {exc}", err=True)
            sys.exit(exc.exit_code)

    return wrapper


@click.group(context_settings=_CTX)
@click.option(
    "--zk",
    default=defaults.HOSTS,
    show_default=True,
    envvar="ZKQ_ZK",
    help="ZooKeeper connection string (host:port[,host:port...]).",
)
@click.option(
    "--root",
    default=defaults.ROOT,
    show_default=True,
    envvar="ZKQ_ROOT",
    help="Root znode of this zkq installation.",
)
@click.option(
    "--session-timeout",
    type=float,
    default=defaults.SESSION_TIMEOUT,
    show_default=True,
    envvar="ZKQ_SESSION_TIMEOUT",
    help="Session timeout, seconds.",
)
@click.option(
    "--connect-timeout",
    type=float,
    default=defaults.CONNECT_TIMEOUT,
    show_default=True,
    envvar="ZKQ_CONNECT_TIMEOUT",
    help="Give up reaching ZooKeeper after this many seconds.",
)
@click.option(
    "--auth",
    default=None,
    envvar="ZKQ_AUTH",
    metavar="USER:PASSWORD",
    help="Digest authentication; zkq's nodes are then readable and writable by this identity only.",
)
@click.option("--tls-ca", default=None, envvar="ZKQ_TLS_CA", help="CA file: connect with TLS.")
@click.option("--tls-cert", default=None, envvar="ZKQ_TLS_CERT", help="Client certificate (PEM).")
@click.option("--tls-key", default=None, envvar="ZKQ_TLS_KEY", help="Client key (PEM).")
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    envvar="ZKQ_LOG_FORMAT",
    help="json: one JSON object per line, for log aggregation.",
)
@click.option(
    "--log-level",
    default="WARNING",
    envvar="ZKQ_LOG_LEVEL",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
@click.pass_context
def cli(
    ctx: click.Context,
    zk: str,
    root: str,
    session_timeout: float,
    connect_timeout: float,
    log_level: str,
    log_format: str,
    **security: str | None,
) -> None:
    """zkq: a priority job queue for GPU inference on ZooKeeper.

    \b
    Examples:
      zkq worker --queue default --runner echo &
      zkq submit --priority high "Hello"
      zkq submit --detach --json "Summarize this" | jq -r .id
      zkq status ID; zkq result ID --wait --timeout 60
    """
    configure_logging(log_level, log_format)
    ctx.obj = {
        "zk": zk,
        "root": root,
        "session_timeout": session_timeout,
        "connect_timeout": connect_timeout,
        **security,
    }


@cli.command()
@click.argument("prompt", required=False, default="-")
@click.option(
    "--priority",
    type=click.Choice(defaults.PRIORITIES),
    default=defaults.PRIORITY,
    show_default=True,
)
@click.option("--queue", default=defaults.QUEUE, show_default=True)
@click.option(
    "--max-new-tokens",
    type=int,
    default=None,
    help=f"Tokens to generate (default {defaults.MAX_NEW_TOKENS}).",
)
@click.option("--detach", is_flag=True, help="Enqueue a persistent job and print its id.")
@click.option(
    "--timeout",
    type=float,
    default=None,
    help="Stop waiting after SECONDS; the request is withdrawn.",
)
@click.option("--temperature", type=float, default=None)
@click.option("--top-p", type=float, default=None)
@click.option("--seed", type=int, default=None)
@click.option("--max-runtime", type=float, default=None, help="Seconds the job may run.")
@click.option(
    "--queue-timeout",
    type=float,
    default=None,
    help="Seconds the job may wait to start before it expires.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@click.option("--stream", is_flag=True, help="Print the output while it is generated.")
@click.option(
    "--file",
    "file_",
    type=click.File("r"),
    default=None,
    help="Submit every line of a JSONL file (one job spec per line).",
)
@click.option(
    "--out",
    type=click.File("w"),
    default="-",
    help="With --file: write the results (JSONL, input order) here instead of stdout.",
)
@click.pass_context
@handles_errors
def submit(
    ctx: click.Context,
    prompt: str,
    priority: str,
    queue: str,
    max_new_tokens: int | None,
    detach: bool,
    timeout: float | None,
    as_json: bool,
    file_: TextIO | None,
    out: TextIO,
    stream: bool,
    **params: Any,
) -> None:
    """Submit PROMPT (or stdin with '-' or no PROMPT) and print the output.

    \b
    Examples:
      zkq submit --priority high "Translate: bonjour"
      echo "long prompt" | zkq submit --max-new-tokens 128 --json
      zkq submit --detach "batch job"        # prints the job id
      zkq submit --file prompts.jsonl --out results.jsonl
    """
    if file_ is not None:
        if prompt != "-":
            raise click.UsageError("give a PROMPT or --file, not both")
        options = {"priority": priority, "queue": queue, "max_new_tokens": max_new_tokens}
        sys.exit(_submit_file(ctx, file_, out, options, detach, timeout))
    text = sys.stdin.read() if prompt == "-" else prompt
    extra = {k: v for k, v in params.items() if v is not None}
    with _client(ctx) as client:
        job = client.submit(
            text,
            priority=priority,
            queue=queue,
            max_new_tokens=max_new_tokens,
            detach=detach,
            **({"stream": True} if stream else {}),
            **extra,
        )
        if detach:
            _emit({"id": job.id}) if as_json else click.echo(job.id)
            return
        if stream and not as_json:
            sys.exit(_print_stream(job, timeout))
        record = job.result(timeout=timeout)
    _print_result(record, as_json)
    sys.exit(_exit_for(record))


def _submit_file(
    ctx: click.Context,
    source: TextIO,
    out: TextIO,
    options: dict[str, Any],
    detach: bool,
    timeout: float | None,
) -> int:
    """Bulk submit; exit 0, or 2 if a line was refused, or 1 if a job did not succeed."""
    from rich.console import Console
    from rich.progress import Progress

    from zkqueue import bulk

    with _client(ctx) as client:
        lines = bulk.read_lines(source, limit=client.max_spec_bytes)
        for line in lines:
            if line.error is not None:
                click.echo(f"zkq: line {line.number}: {line.error}", err=True)
        good = sum(1 for line in lines if line.spec is not None)
        with Progress(console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task("submitting", total=good)
            bulk.submit_lines(
                client, lines, detach=detach, **options, progress=lambda n: bar.advance(task, n)
            )
            if detach:
                records = [
                    {"line": x.number, "id": x.job.id}
                    if x.job
                    else {"line": x.number, "status": "invalid", "error": x.error}
                    for x in lines
                ]
            else:
                bar.update(task, description="waiting for results", completed=0)
                records = []
                for record in bulk.results(lines, timeout):
                    records.append(record)
                    bar.advance(task, 1 if "id" in record else 0)
    for record in records:
        out.write(json.dumps(record, default=str) + "\n")
    out.flush()
    if any(r.get("status") == "invalid" for r in records):
        return ExitCode.USAGE
    if not detach and any(r.get("status") != "succeeded" for r in records):
        return ExitCode.JOB_FAILED
    return ExitCode.OK


def _print_stream(job: Job, timeout: float | None) -> int:
    for piece in job.stream(timeout=timeout):
        click.echo(piece, nl=False)
    click.echo()
    record = job.result()
    if not record.ok:
        click.echo(f"zkq: job {record.id} {record.status}: {record.error}", err=True)
    return _exit_for(record)


def _print_result(record: Result, as_json: bool) -> None:
    if as_json:
        _emit(record.to_dict())
    elif record.ok:
        click.echo(record.output)
    else:
        click.echo(f"zkq: job {record.id} {record.status}: {record.error}", err=True)


@cli.command()
@click.argument("job_id")
@click.option("--queue", default=None, help="Only look in this queue.")
@click.option("--wait", is_flag=True, help="Wait for the result.")
@click.option("--timeout", type=float, default=None, help="With --wait: give up after SECONDS.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@handles_errors
def result(
    ctx: click.Context,
    job_id: str,
    queue: str | None,
    wait: bool,
    timeout: float | None,
    as_json: bool,
) -> None:
    """Print a job's result (exit 4 when it has none yet)."""
    with _client(ctx) as client:
        job = client.job(job_id, queue)
        try:
            record = job.result(timeout=timeout if wait else 0.0)
        except JobTimeout:
            raise JobTimeout(f"job {job_id} has no result yet ({job.status()})") from None
    _print_result(record, as_json)
    sys.exit(_exit_for(record))


@cli.command()
@click.argument("job_id")
@click.option("--queue", default=None, help="Only look in this queue.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@handles_errors
def status(ctx: click.Context, job_id: str, queue: str | None, as_json: bool) -> None:
    """Print a job's state: pending (with its position), running, or its result status."""
    with _client(ctx) as client:
        info = client.job(job_id, queue).info()
    if as_json:
        _emit(info)
        return
    line = f"{info['state']}"
    if info.get("position") is not None:
        line += f" (position {info['position']})"
    if info.get("worker"):
        line += f" on {info['worker']}"
    click.echo(line)


@cli.command()
@click.argument("job_id")
@click.option("--queue", default=None, help="Only look in this queue.")
@click.pass_context
@handles_errors
def cancel(ctx: click.Context, job_id: str, queue: str | None) -> None:
    """Cancel a pending or running job (exit 1 if it had already ended)."""
    with _client(ctx) as client:
        if not client.job(job_id, queue).cancel():
            click.echo(f"zkq: job {job_id} had already ended", err=True)
            sys.exit(ExitCode.JOB_FAILED)
    click.echo(f"cancelled {job_id}")


@cli.command("ls")
@click.option("--queue", default=defaults.QUEUE, show_default=True)
@click.option("--limit", type=int, default=None, help="Show at most N jobs.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@handles_errors
def ls(ctx: click.Context, queue: str, limit: int | None, as_json: bool) -> None:
    """List pending and running jobs in dispatch order."""
    with _client(ctx) as client:
        rows = client.list(queue=queue, limit=limit)
    if as_json:
        _emit(rows)
        return
    for row in rows:
        where = row.get("worker") or f"#{row.get('position')}"
        click.echo(
            f"{row['id']}  {row['priority']:<6}  {row['state']:<7}  {where}  "
            f"attempts={row['attempts']}"
        )


@cli.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@handles_errors
def stats(ctx: click.Context, as_json: bool) -> None:
    """Depth per queue and priority, running jobs, idle slots and workers."""
    with _client(ctx) as client:
        data = client.stats()
    if as_json:
        _emit(data)
        return
    for name, q in data["queues"].items():
        depth = " ".join(f"{p}={n}" for p, n in q["depth"].items())
        click.echo(
            f"{name}: {depth}  pending={q['pending']} running={q['running']} "
            f"idle_workers={q['idle_workers']} results={q['results']} dead={q['dead']}"
        )
    click.echo(f"workers: {data['workers']}")


@cli.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@handles_errors
def workers(ctx: click.Context, as_json: bool) -> None:
    """Registered workers: queue, runner, slots, memory, running jobs."""
    with _client(ctx) as client:
        records = client.workers()
    if as_json:
        _emit(records)
        return
    for r in records:
        mem = r.get("memory") or {}
        mem_text = (
            f" mem free {mem.get('free', 0) / 2**20:.0f}/{mem.get('total', 0) / 2**20:.0f} MiB"
            if mem
            else ""
        )
        click.echo(
            f"{r['id']}  queue={r['queue']} {r['runner']} {r['state']} "
            f"slots {r['slots_busy']}/{r['slots_max']}{mem_text} "
            f"running={','.join(r['running']) or '-'}"
        )


@cli.command()
@click.option("--queue", default=defaults.QUEUE, show_default=True)
@click.option(
    "--runner",
    type=click.Choice(["echo", "hf"]),
    default="echo",
    show_default=True,
    help="echo (smoke tests, benchmarks) or hf (a transformers model; implied by --model).",
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
    "--max-runtime", type=float, default=None, help="Default max runtime per job, seconds."
)
@click.option(
    "--slow-after", type=float, default=30.0, show_default=True, help="Log jobs slower than this."
)
@click.option(
    "--echo-delay",
    type=float,
    default=defaults.ECHO_DELAY,
    show_default=True,
    help="Seconds the echo runner takes per batch.",
)
@click.option(
    "--max-concurrency",
    type=int,
    default=defaults.WORKER_SLOTS,
    show_default=True,
    help="Slots: jobs this worker runs at once.",
)
@click.option("--name", default=None, help="Worker id (default host-pid-random).")
@click.option("--max-jobs", type=int, default=None, help="Exit after claiming N jobs.")
@click.option("--burst", is_flag=True, help="Exit when the queue is empty.")
@click.option("--drain-timeout", type=float, default=defaults.DRAIN_TIMEOUT, show_default=True)
@click.option(
    "--heartbeat-interval", type=float, default=defaults.HEARTBEAT_INTERVAL, show_default=True
)
@click.option("--max-attempts", type=int, default=defaults.MAX_ATTEMPTS, show_default=True)
@click.option(
    "--lease",
    type=float,
    default=defaults.LEASE,
    show_default=True,
    help="Seconds a running job's claim lives without progress.",
)
@click.option(
    "--janitor/--no-janitor",
    default=True,
    show_default=True,
    help="Stand for the janitor election.",
)
@click.option(
    "--janitor-interval", type=float, default=defaults.JANITOR_INTERVAL, show_default=True
)
@click.option(
    "--result-ttl",
    type=float,
    default=defaults.RESULT_TTL,
    show_default=True,
    help="Seconds finished results are kept (by the janitor).",
)
@click.option("--metrics-port", type=int, default=None, help="Serve Prometheus metrics here.")
@click.option("--metrics-addr", default="0.0.0.0", show_default=True)
@click.option(
    "--config",
    type=click.Path(dir_okay=False),
    default=None,
    help="TOML file with worker settings: flags override it, it overrides ZKQ_* variables.",
)
@click.pass_context
@handles_errors
def worker(ctx: click.Context, **options: Any) -> None:
    """Run a worker daemon on a queue until SIGTERM (drain) or a second signal (release).

    \b
    Examples:
      zkq worker --queue default --runner echo --max-concurrency 4
      zkq worker --queue llama --model /srv/models/llama --max-concurrency 8 --vram-reserve 2GiB
    """
    from workers.config import apply_config
    from workers.daemon import WorkerOptions, run_worker

    config = options.pop("config")
    if config is not None:
        apply_config(ctx, options, config)
    sys.exit(run_worker(_settings(ctx), ctx.obj["root"], WorkerOptions(**options)))


@cli.command()
@click.option("--queue", default=None, help="Only this queue.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@handles_errors
def dead(ctx: click.Context, queue: str | None, as_json: bool) -> None:
    """List dead-lettered jobs with the reason (malformed entries, poison jobs)."""
    with _client(ctx) as client:
        letters = client.dead(queue)
    if as_json:
        _emit(letters)
        return
    for x in letters:
        click.echo(f"{x.get('id') or '-'}  {x['queue']}/{x['priority']}  {x['reason']}")


@cli.command()
@click.argument("job_id", required=False)
@click.option("--all", "all_", is_flag=True, help="Requeue every dead letter with a valid spec.")
@click.option("--queue", default=None, help="Only this queue.")
@click.pass_context
@handles_errors
def requeue(ctx: click.Context, job_id: str | None, all_: bool, queue: str | None) -> None:
    """Enqueue a dead-lettered job again (same id, attempts from zero).

    \b
    Examples:
      zkq requeue 8f3a2c1d9e4b7a60
      zkq requeue --all --queue llama
    """
    if bool(job_id) == all_:
        raise click.UsageError("give a job id or --all")
    with _client(ctx) as client:
        jobs = client.requeue(job_id, queue)
    for job in jobs:
        click.echo(f"requeued {job.id} ({job.queue}/{job.priority})")
    if all_ and not jobs:
        click.echo("nothing to requeue", err=True)


@cli.command("queue-limit")
@click.argument("queue")
@click.option(
    "--max-pending",
    type=int,
    default=None,
    help="Most jobs that may wait in QUEUE (omit for no limit).",
)
@click.pass_context
@handles_errors
def queue_limit(ctx: click.Context, queue: str, max_pending: int | None) -> None:
    """Set a queue's backpressure limit: beyond it submit fails fast (exit 5)."""
    with _client(ctx) as client:
        client.set_max_pending(queue, max_pending)
    click.echo(f"{queue}: max pending {max_pending or 'unlimited'}")


@cli.command()
@click.option("--interval", type=float, default=defaults.JANITOR_INTERVAL, show_default=True)
@click.option(
    "--result-ttl",
    type=float,
    default=defaults.RESULT_TTL,
    show_default=True,
    help="Seconds finished results are kept.",
)
@click.option("--once", is_flag=True, help="Run one pass now and exit.")
@click.pass_context
@handles_errors
def janitor(ctx: click.Context, interval: float, result_ttl: float, once: bool) -> None:
    """Run the janitor (expired leases, queue deadlines, old results) for deployments without
    workers running it; several may run, one is elected."""
    from workers.daemon import run_janitor

    sys.exit(
        run_janitor(
            _settings(ctx), ctx.obj["root"], interval=interval, result_ttl=result_ttl, once=once
        )
    )


@cli.command()
@click.option("--interval", type=float, default=2.0, show_default=True, help="Refresh, seconds.")
@click.option("--once", is_flag=True, help="Print one frame and exit (for pipes and scripts).")
@click.pass_context
@handles_errors
def top(ctx: click.Context, interval: float, once: bool) -> None:
    """Live view of queues, workers and recent results; q quits.

    \b
    Example:
      zkq --zk zk1:2181 top --interval 1
    """
    from zkqueue.top import run_top

    with _client(ctx) as client:
        run_top(client, interval=interval, once=once)


@cli.command()
@click.option("--port", type=int, default=9464, show_default=True)
@click.option("--addr", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.pass_context
@handles_errors
def metrics(ctx: click.Context, port: int, addr: str) -> None:
    """Serve cluster-wide Prometheus gauges read from ZooKeeper (depth per queue and priority,
    oldest pending age, workers per queue) until SIGTERM.

    \b
    Example:
      zkq metrics --port 9464 &   curl -s localhost:9464/metrics | grep zkq_queue_depth
    """
    from zkqueue.exporter import run_exporter

    with _client(ctx) as client:
        run_exporter(client, port, addr)


@cli.command()
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell: str) -> None:
    """Print the shell completion script.

    \b
    Example:
      zkq completion bash > /etc/bash_completion.d/zkq
      eval "$(zkq completion zsh)"
    """
    from click.shell_completion import get_completion_class

    cls = get_completion_class(shell)
    if cls is None:  # pragma: no cover - the choice above lists the supported shells
        raise click.UsageError(f"no completion for {shell}")
    click.echo(cls(cli, {}, "zkq", "_ZKQ_COMPLETE").source())


@cli.command("tiny-model")
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


def main() -> None:
    cli(prog_name="zkq")


if __name__ == "__main__":
    main()
