"""Every edge a user touches, as one table: each bad input (and the ones users try next), the exit
code and the message, run through the ``zkq`` command against a real ZooKeeper. Every message
is one line on stderr, without a traceback. README's exit-code table is checked against
zkqueue.errors.ExitCode and against the codes asserted here."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
from kazoo.security import make_digest_acl

from tests.conftest import ZKQ, _env, wait_for
from zkqueue import Client
from zkqueue.errors import ExitCode

ROOT = Path(__file__).resolve().parents[1]
ID = "0123456789abcdef"
Setup = Callable[[Client, Path, str], dict[str, str]]


def _bulk_file(client: Client, tmp: Path, root: str) -> dict[str, str]:
    path = tmp / "jobs.jsonl"
    path.write_text('{"prompt": "a"}\n')
    return {"{file}": str(path)}


def _detached(client: Client, tmp: Path, root: str) -> dict[str, str]:
    return {"{id}": client.submit("waits", detach=True).id}


def _cancelled(client: Client, tmp: Path, root: str) -> dict[str, str]:
    job = client.submit("x", detach=True)
    job.cancel()
    return {"{id}": job.id}


def _corrupt_result(client: Client, tmp: Path, root: str) -> dict[str, str]:
    client.ensure_queue("default")
    client.zk.create(client.layout.result("default", ID), b"not json {")
    return {"{id}": ID}


def _owned_root(client: Client, tmp: Path, root: str) -> dict[str, str]:
    client.zk.create(root, acl=[make_digest_acl("alice", "secret", all=True)])
    return {}


_HELD: list[socket.socket] = []


def _busy_port(client: Client, tmp: Path, root: str) -> dict[str, str]:
    """A port another listener holds for the rest of the session."""
    held = socket.create_server(("0.0.0.0", 0))
    _HELD.append(held)
    return {"{port}": str(held.getsockname()[1])}


def _served(client: Client, tmp: Path, root: str) -> dict[str, str]:
    """A registration that serves the default queue (no worker takes jobs)."""
    record = json.dumps({"id": "idle", "queue": "default"}).encode()
    client.zk.create(client.layout.worker("idle"), record, ephemeral=True, makepath=True)
    return {}


def _full_queue(client: Client, tmp: Path, root: str) -> dict[str, str]:
    client.set_max_pending("default", 1)
    client.submit("first", detach=True)
    return {}


class Case(NamedTuple):
    args: tuple[str, ...]
    code: int
    message: str
    stdin: bytes | None = None
    setup: Setup | None = None


U, NF, CFG = ExitCode.USAGE, ExitCode.NOT_FOUND, ExitCode.CONFIG
CASES: dict[str, Case] = {
    # -- the prompt ---------------------------------------------------------------------------
    "empty prompt": Case(("submit", ""), U, "prompt must not be empty"),
    "blank prompt": Case(("submit", "  \n"), U, "prompt must not be empty"),
    "argv not UTF-8": Case(("submit", "caf\udce9"), U, "prompt is not valid UTF-8"),
    "stdin not UTF-8": Case(("submit", "-"), U, "stdin is not valid UTF-8", b"caf\xe9\n"),
    "stdin empty": Case(("submit", "-"), U, "prompt must not be empty", b""),
    "bulk line not UTF-8": Case(
        ("submit", "--detach", "--file", "-"), U, "line 2: not valid UTF-8", b'"a"\n\xff\n'
    ),
    "bulk line not JSON": Case(("submit", "--detach", "--file", "-"), U, "line 1:", b"{oops\n"),
    # -- job options --------------------------------------------------------------------------
    "unknown priority": Case(("submit", "--priority", "urgent", "x"), U, "'urgent' is not one of"),
    "zero tokens": Case(("submit", "--max-new-tokens", "0", "x"), U, "max_new_tokens must be"),
    "tokens not a number": Case(("submit", "--max-new-tokens", "many", "x"), U, "not a valid"),
    "too many tokens": Case(("submit", "--max-new-tokens", "10000000", "x"), U, "between 1 and"),
    "temperature too high": Case(("submit", "--temperature", "500", "x"), U, "temperature must"),
    "top-p zero": Case(("submit", "--top-p", "0", "x"), U, "top_p must be above 0"),
    "zero max runtime": Case(("submit", "--max-runtime", "0", "x"), U, "range x>0"),
    "negative queue timeout": Case(("submit", "--queue-timeout", "-1", "x"), U, "range x>0"),
    "huge spec": Case(("submit", "-"), U, "the limit is 65536 bytes", b"x" * 70_000),
    # -- names --------------------------------------------------------------------------------
    "queue with slash": Case(("submit", "--queue", "a/b", "x"), U, "bad queue name 'a/b'"),
    "empty queue": Case(("submit", "--queue", "", "x"), U, "bad queue name ''"),
    "reserved job id": Case(("submit", "--job-id", "_mine", "x"), U, "for '--job-id'"),
    "queue starting with a dot": Case(("submit", "--queue", ".x", "x"), U, "not starting with '.'"),
    "queue with space": Case(("ls", "--queue", "my queue"), U, "bad queue name"),
    "queue dot-dot": Case(("dead", "--queue", ".."), U, "bad queue name '..'"),
    "bad job id": Case(("status", "bad id!"), U, "bad job id"),
    "job id with slash": Case(("cancel", "../x"), U, "bad job id"),
    "worker name with slash": Case(("worker", "--name", "a/b"), U, "bad worker name 'a/b'"),
    "worker queue bad": Case(("worker", "--queue", "a b"), U, "bad queue name"),
    "relative root": Case(("--root", "zkq", "stats"), CFG, "root must be an absolute"),
    "root slash": Case(("--root", "/", "stats"), CFG, "root must be an absolute"),
    "root double slash": Case(("--root", "/a//b", "stats"), CFG, "root must be an absolute"),
    "root trailing slash": Case(("--root", "/zkq/", "stats"), CFG, "root must be an absolute"),
    "root zookeeper": Case(("--root", "/zookeeper", "stats"), CFG, "reserved /zookeeper"),
    "root under zookeeper": Case(("--root", "/zookeeper/quota", "stats"), CFG, "reserved"),
    # -- timeouts and numbers -----------------------------------------------------------------
    "zero timeout": Case(("submit", "--timeout", "0", "x"), U, "range x>0"),
    "negative timeout": Case(("submit", "--timeout", "-3", "x"), U, "range x>0"),
    "timeout not a number": Case(("submit", "--timeout", "soon", "x"), U, "not a valid float"),
    "zero session timeout": Case(("--session-timeout", "0", "stats"), U, "above 0"),
    "zero connect timeout": Case(("--connect-timeout", "0", "stats"), U, "above 0"),
    "zero timeout after": Case(("stats", "--connect-timeout", "0"), U, "above 0"),
    "infinite timeout": Case(("--session-timeout", "inf", "stats"), U, "finite"),
    "relative root after": Case(("stats", "--root", "zkq"), CFG, "root must be an absolute"),
    "result zero timeout": Case(("result", ID, "--wait", "--timeout", "0"), U, "range x>0"),
    "ls limit zero": Case(("ls", "--limit", "0"), U, "range x>=1"),
    "top interval zero": Case(("top", "--interval", "0"), U, "range x>0"),
    "zero slots": Case(("worker", "--max-concurrency", "0"), U, "range x>=1"),
    "bad high width": Case(("worker", "--high-width", "some"), CFG, "high_width must be auto"),
    "zero lease": Case(("worker", "--lease", "0"), U, "range x>0"),
    "negative heartbeat": Case(("worker", "--heartbeat-interval", "-1"), U, "range x>0"),
    "zero max jobs": Case(("worker", "--max-jobs", "0"), U, "range x>=1"),
    "janitor interval zero": Case(("janitor", "--interval", "0"), U, "range x>0"),
    "metrics port zero": Case(("metrics", "--port", "0"), U, "range 1<=x<=65535"),
    "limit zero": Case(("queue-limit", "q", "--max-pending", "0"), U, "below 1"),
    "limit huge": Case(("queue-limit", "q", "--max-running", "9" * 20), U, "above 2147483647"),
    "limit not a number": Case(("queue-limit", "q", "--max-running", "x"), U, "or 'none'"),
    # -- flags that conflict or do not apply ---------------------------------------------------
    "detach with timeout": Case(("submit", "--detach", "--timeout", "5", "x"), U, "--detach"),
    "detach with stream": Case(("submit", "--detach", "--stream", "x"), U, "conflict"),
    "out without file": Case(("submit", "--out", "o.jsonl", "x"), U, "--out applies only"),
    "prompt and file": Case(("submit", "--file", "{file}", "x"), U, "not both", None, _bulk_file),
    "file with stream": Case(
        ("submit", "--file", "{file}", "--stream"), U, "do not apply to --file", None, _bulk_file
    ),
    "file with sampling": Case(
        ("submit", "--file", "{file}", "--temperature", "1"), U, "each line", None, _bulk_file
    ),
    "missing file": Case(("submit", "--file", "/nonexistent.jsonl"), U, "No such file"),
    "result timeout no wait": Case(("result", ID, "--timeout", "5"), U, "only with --wait"),
    "requeue nothing": Case(("requeue",), U, "give a job id or --all"),
    "requeue both": Case(("requeue", ID, "--all"), U, "give a job id or --all"),
    "limit none and value": Case(("queue-limit", "q", "none", "--max-pending", "3"), U, "not both"),
    "janitor json no once": Case(("janitor", "--json"), U, "only with --once"),
    "unknown command": Case(("frobnicate",), U, "No such command"),
    "unknown option": Case(("submit", "--priorty", "high", "x"), U, "No such option"),
    "unknown shell": Case(("completion", "tcsh"), U, "'tcsh' is not one of"),
    # -- things that are not there ------------------------------------------------------------
    "status of nothing": Case(("status", ID), NF, f"no job {ID}"),
    "result of nothing": Case(("result", ID), NF, f"no job {ID}"),
    "cancel nothing": Case(("cancel", ID, "--queue", "default"), NF, "no job"),
    "requeue nothing dead": Case(("requeue", ID), NF, f"no dead letter for job {ID}"),
    "delete no queue": Case(("queue", "delete", "nosuch"), NF, "no queue 'nosuch'"),
    "ls no queue": Case(("ls", "--queue", "nosuch"), NF, "no queue 'nosuch'"),
    "dead no queue": Case(("dead", "--queue", "nosuch"), NF, "no queue 'nosuch'"),
    "limits of no queue": Case(("queue-limit", "nosuch"), NF, "no queue 'nosuch'"),
    # -- the state of the queue ---------------------------------------------------------------
    "no worker required": Case(
        ("submit", "--require-worker", "x"), ExitCode.QUEUE_FULL, "no registered worker serves"
    ),
    "queue full": Case(
        ("submit", "--detach", "x"), ExitCode.QUEUE_FULL, "is full", None, _full_queue
    ),
    "delete busy queue": Case(
        ("queue", "delete", "default"), ExitCode.QUEUE_FULL, "--force", None, _detached
    ),
    "attached timeout": Case(
        ("submit", "--timeout", "0.5", "x"),
        ExitCode.TIMEOUT,
        "has no result after 0.5s; its attached request was withdrawn",
        None,
        _served,
    ),
    "no result yet": Case(
        ("result", "{id}"), ExitCode.TIMEOUT, "has no result yet", None, _detached
    ),
    "cancel twice": Case(
        ("cancel", "{id}"), ExitCode.JOB_FAILED, "already ended", None, _cancelled
    ),
    "corrupt result": Case(
        ("result", "{id}"), ExitCode.CORRUPT, "is not valid JSON", None, _corrupt_result
    ),
    # -- connection and security ---------------------------------------------------------------
    "unreachable": Case(
        ("--zk", "127.0.0.1:1", "--connect-timeout", "1", "stats"),
        ExitCode.UNAVAILABLE,
        "cannot reach ZooKeeper at 127.0.0.1:1 within 1s",
    ),
    "zk port not a number": Case(("--zk", "localhost:abc", "stats"), CFG, "bad ZooKeeper address"),
    "zk port out of range": Case(("--zk", "127.0.0.1:99999", "stats"), CFG, "out of range"),
    "zk empty": Case(("--zk", ",", "worker"), CFG, "write host:port"),
    "metrics address": Case(("metrics", "--addr", "999.1.1.1"), CFG, "cannot serve metrics"),
    "metrics port in use": Case(
        ("metrics", "--port", "{port}"), CFG, "Address already in use", None, _busy_port
    ),
    "serve port in use": Case(
        ("serve", "--port", "{port}"), CFG, "cannot listen on 127.0.0.1:", None, _busy_port
    ),
    "serve port out of range": Case(("serve", "--port", "70000"), U, "70000"),
    "serve negative drain": Case(("serve", "--drain-timeout", "-1"), U, "--drain-timeout"),
    "serve infinite drain": Case(("serve", "--drain-timeout", "inf"), U, "finite"),
    "serve nan timeout": Case(("serve", "--connect-timeout", "nan"), U, "finite"),
    "serve zero session timeout": Case(("serve", "--session-timeout", "0"), U, "--session-timeout"),
    "worker metrics port in use": Case(
        ("worker", "--metrics-port", "{port}"), CFG, "cannot serve metrics", None, _busy_port
    ),
    "worker stream address bad": Case(
        ("worker", "--stream-bind", "nonsense"), CFG, "--stream-bind must be HOST:PORT"
    ),
    "worker stream port in use": Case(
        ("worker", "--stream-bind", "127.0.0.1:{port}"),
        CFG,
        "cannot serve job streams",
        None,
        _busy_port,
    ),
    "auth without password": Case(("--auth", "alice", "stats"), CFG, "USER:PASSWORD"),
    "tls file missing": Case(("--tls-ca", "/nonexistent.pem", "stats"), CFG, "no such file"),
    "tls cert without key": Case(("--tls-cert", "/etc/hostname", "stats"), CFG, "go together"),
    "hf without model": Case(("worker", "--runner", "hf"), CFG, "needs --model"),
    "another identity": Case(
        ("--auth", "bob:pw", "submit", "--detach", "x"),
        ExitCode.DENIED,
        "denied access",
        None,
        _owned_root,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_user_error(name: str, zkq, client: Client, tmp_path: Path, root: str) -> None:
    case = CASES[name]
    subs = case.setup(client, tmp_path, root) if case.setup else {}
    args = list(case.args)
    for placeholder, value in subs.items():  # anywhere in an argument ("127.0.0.1:{port}")
        args = [a.replace(placeholder, value) for a in args]
    if "--zk" in args:  # the case names its own ensemble: put it before the fixture's
        out = zkq(*args[2:], zk=args[1], input=case.stdin or b"")
    else:
        out = zkq(*args, input=case.stdin if case.stdin is not None else b"")
    assert out.returncode == case.code, (args, out.stdout, out.stderr)
    assert case.message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 or name.startswith("bulk"), out.stderr


def test_bulk_file_reports_bad_lines_and_submits_the_rest(zkq, client: Client) -> None:
    data = (
        b'{"prompt": "one"}\n\xff\xfe\n{"prompt": ""}\n"caf\\udce9"\n{"prompt": "two"}\n'
        b'{"prompt": "open"\n{"prompt": "x", "colour": "red"}\n'
    )
    out = zkq("submit", "--detach", "--file", "-", input=data)
    assert out.returncode == ExitCode.USAGE, out.stderr
    refused = {
        2: "not valid UTF-8",
        3: "prompt must not be empty",
        4: "prompt is not valid UTF-8",
        6: "not valid JSON: Expecting ',' delimiter at column 18",
        7: "unknown field(s): colour (known: prompt, priority, queue, max_new_tokens,",
    }
    for line, why in refused.items():
        assert f"zkq: line {line}: {why}" in out.stderr
    records = [json.loads(x) for x in out.stdout.splitlines()]
    assert [r["line"] for r in records] == [1, 2, 3, 4, 5, 6, 7]
    statuses = [r.get("status") for r in records]
    assert statuses == [None, "invalid", "invalid", "invalid", None, "invalid", "invalid"]
    assert len(client.list()) == 2  # the good lines went through


def test_a_file_with_job_ids_can_be_submitted_twice(zkq, client: Client) -> None:
    data = b'{"prompt": "one", "job_id": "f.1"}\n{"prompt": "two", "job_id": "f.2"}\n'
    for _ in range(2):
        out = zkq("submit", "--detach", "--file", "-", input=data)
        assert out.returncode == 0, out.stderr
        assert [json.loads(x)["id"] for x in out.stdout.splitlines()] == ["f.1", "f.2"]
    assert sorted(row["id"] for row in client.list()) == ["f.1", "f.2"]


def test_python_api_refuses_text_that_is_not_utf8(client: Client) -> None:
    from zkqueue.errors import InvalidJob

    for bad in ("caf\udce9", {"prompt": "x", "stop": ["\udcff"]}):
        with pytest.raises(InvalidJob, match="not valid UTF-8"):
            if isinstance(bad, str):
                client.submit(bad)
            else:
                client.submit_many([bad])
    assert client.list() == []


@pytest.mark.parametrize(
    ("args", "stdin", "said"),
    [
        (["waits"], "", "job {id} was submitted, then withdrawn"),
        (
            ["--file", "-"],
            '{"prompt": "one"}\n{"prompt": "two"}\n',
            "2 of 2 job(s) were submitted, up to line 2; they were attached and are withdrawn",
        ),
    ],
)
def test_ctrl_c_says_what_was_submitted(
    args: list[str], stdin: str, said: str, hosts: str, root: str, client: Client
) -> None:
    # A test run started in the background by a non-interactive shell inherits SIGINT ignored,
    # and so would the command (as after nohup): give it the default disposition, as a terminal
    # does (a Python handler here is reset to the default in the child by exec).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [*ZKQ, "--zk", hosts, "--root", root, "submit", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**_env(), "PYTHONFAULTHANDLER": "1"},  # SIGABRT: every thread's stack on stderr
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    assert proc.stdin is not None
    proc.stdin.write(stdin)
    proc.stdin.close()
    rows = wait_for(lambda: len(client.list()) == len(stdin.splitlines() or [1]) and client.list())
    proc.send_signal(signal.SIGINT)
    assert proc.stderr is not None
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        proc.wait(10)
        pytest.fail(f"still running 30 s after Ctrl-C; its threads:\n{proc.stderr.read()}")
    err = proc.stderr.read()
    assert proc.returncode == ExitCode.INTERRUPTED, err
    assert said.format(id=rows[0]["id"]) in err and "Traceback" not in err, err
    wait_for(lambda: not client.list(), message="the attached requests withdrawn")


# -- README's exit codes -------------------------------------------------------------------

#: Codes other tests assert: the timeouts (tests/test_timeouts.py asserts 4 and 6 too), Ctrl-C,
#: a withdrawn request (tests/test_protocol.py), a stream cut by a killed worker
#: (tests/test_direct_stream.py).
ELSEWHERE = {
    ExitCode.OK,
    ExitCode.TIMEOUT,
    ExitCode.INTERRUPTED,
    ExitCode.WITHDRAWN,
    ExitCode.STREAM_INTERRUPTED,
}


def readme_exit_codes() -> dict[int, str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("### Exit codes", 1)[1].split("\n#", 1)[0]
    return {int(c): m for c, m in re.findall(r"^\| (\d+) \| (.+) \|$", section, re.MULTILINE)}


def test_readme_exit_codes_match_the_code_and_this_table() -> None:
    documented = readme_exit_codes()
    codes = {v for k, v in vars(ExitCode).items() if k.isupper()}
    assert set(documented) == codes
    asserted = {case.code for case in CASES.values()} | ELSEWHERE
    assert asserted <= codes
    assert codes - asserted == {ExitCode.INTERNAL}, "a documented code no test asserts"


def test_every_command_help_has_an_example() -> None:
    import click

    from zkqueue.cli.main import cli

    def commands(group: click.Group, path: str) -> list[tuple[str, click.Command]]:
        found = []
        for name, command in group.commands.items():
            found.append((f"{path} {name}", command))
            if isinstance(command, click.Group):
                found += commands(command, f"{path} {name}")
        return found

    def example(command: click.Command) -> bool:
        text = command.help or ""
        # A plugin whose package is not installed here stands in with a one-line hint.
        return text.startswith("(not installed") or "zkq " in text.split("xample")[-1]

    missing = [p for p, c in commands(cli, "zkq") if not example(c)]
    assert "Example" in (cli.help or "")
    assert missing == [], f"--help without an example: {missing}"
