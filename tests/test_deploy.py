"""The shipped deployment files and the GPU check script."""

from __future__ import annotations

import configparser
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zkqueue import defaults

ROOT = Path(__file__).resolve().parents[1]


def test_systemd_unit_template() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(ROOT / "deploy" / "zkq-worker@.service")
    service = unit["Service"]
    assert service["Type"] == "notify"
    assert service["EnvironmentFile"] == "-/etc/zkq/%i.env"
    assert "--config /etc/zkq/%i.toml" in service["ExecStart"]
    assert service["Restart"] == "on-failure"
    assert service["KillSignal"] == "SIGTERM"
    assert int(service["TimeoutStopSec"]) > defaults.DRAIN_TIMEOUT
    assert " worker" in service["ExecStart"]
    assert service["CacheDirectory"] == "zkq"  # the knee cache, writable under ProtectSystem


def test_example_toml_is_a_valid_worker_config() -> None:
    from click.testing import CliRunner

    from workers.config import read_config
    from zkqueue.cli import cli

    settings = read_config(ROOT / "deploy" / "example.toml")
    worker_options = {p.name for p in cli.commands["worker"].params}
    global_options = {p.name for p in cli.params}
    assert set(settings) <= worker_options | global_options
    assert CliRunner().invoke(cli, ["worker", "--help"]).exit_code == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_check_says_no_gpu_clearly() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "no CUDA GPU here" in out.stderr


def test_gpu_check_logic_on_a_small_cpu_configuration() -> None:
    args = [
        "--device",
        "cpu",
        "--allow-cpu",
        "--layers",
        "2",
        "--hidden",
        "256",
        "--jobs",
        "6",
        "--slots",
        "4",
        "--prompt-tokens",
        "48",
        "--max-new-tokens",
        "6",
        "--dtype",
        "float32",
        "--budget",
        "64MiB",
        "--reserve",
        "0",
        "--minutes",
        "2",
    ]
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), *args],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "6/6 jobs succeeded, out-of-memory: 0" in out.stdout


def test_gateway_unit_and_example_config() -> None:
    from gateway.config import load

    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.read(ROOT / "deploy" / "zkq-serve.service")
    service = unit["Service"]
    assert " serve --config /etc/zkq/serve.toml" in service["ExecStart"]
    assert service["KillSignal"] == "SIGTERM" and service["Restart"] == "on-failure"
    config = load(ROOT / "deploy" / "serve.toml")
    assert config.queue_for("llama-3-8b-instruct") == "llama"
    assert [k.priority for k in config.keys] == ["high", "low"]
    assert config.keys[1].max_pending == 500 and not config.keys[1].allows("high")


def test_upstream_worker_unit_is_bound_to_its_engine() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(ROOT / "deploy" / "zkq-upstream@.service")
    assert unit["Unit"]["BindsTo"] == "vllm@%i.service"
    assert "vllm@%i.service" in unit["Unit"]["After"].split()
    service = unit["Service"]
    assert service["Type"] == "notify"
    assert "--runner openai --config /etc/zkq/%i.toml" in service["ExecStart"]
    assert int(service["TimeoutStopSec"]) > defaults.DRAIN_TIMEOUT
    engine = configparser.ConfigParser(strict=False, interpolation=None)
    engine.read(ROOT / "deploy" / "vllm@.service")
    assert "--scheduling-policy priority" in engine["Service"]["ExecStart"]
