"""The openai runner in front of vLLM on a CUDA GPU (``scripts/gpu_check.py --upstream vllm``).

Writes a small random-weight Llama model (head size 64, which vLLM's attention kernels take, and
the tiny model's tokenizer), starts ``vllm serve`` on it with ``--scheduling-policy priority``,
a ZooKeeper and one ``zkq worker --upstream URL --upstream-priority``, then checks:

1. outputs: greedy answers through zkq equal the same requests sent straight to vLLM;
2. the gate reads vLLM's metrics: the worker's registration shows ``engine: vllm``;
3. priority with the engine saturated: low jobs queued first, then high ones: every high job
   starts before every low job that had not started when they came;
4. a cancel mid-stream: ``vllm:num_requests_running`` falls to 0 within a second;
5. vLLM killed with SIGKILL with jobs in flight and started again: every job ends succeeded.

It prints one JSON object with each check's figures and ``ok``; exit code 0 when all pass, 1
when one fails, 2 when there is no CUDA GPU or no vLLM.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from transformers import LlamaForCausalLM

from workers.tinymodel import build_tokenizer, model_config
from zkqueue import Client
from zkqueue.testing import ZkCluster, free_port

ROOT = Path(__file__).resolve().parents[1]
QUEUE = "vllm-check"


def write_model(path: Path) -> Path:
    tokenizer = build_tokenizer()
    config = model_config(
        tokenizer,
        hidden_size=256,
        intermediate_size=512,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model: Any = LlamaForCausalLM(config)
    model = model.to(torch.float16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class Vllm:
    def __init__(self, model: Path, log: Path) -> None:
        self.model, self.log, self.port = str(model), log, free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout: float = 900.0) -> None:
        command = [_vllm(), "serve", self.model, "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["--scheduling-policy", "priority", "--max-model-len", "2048"]
        command += ["--gpu-memory-utilization", "0.3", "--dtype", "float16"]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited; see {self.log}")
            try:
                if httpx.get(self.url.removesuffix("/v1") + "/health", timeout=2).is_success:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1)
        raise TimeoutError(f"vllm serve not healthy in {timeout:g}s; see {self.log}")

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(60)

    def running(self) -> float:
        text = httpx.get(self.url.removesuffix("/v1") + "/metrics", timeout=2).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:num_requests_running")
        )

    def complete(self, prompt: str, max_tokens: int) -> str:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        reply = httpx.post(self.url + "/completions", json=body, timeout=120)
        reply.raise_for_status()
        return str(reply.json()["choices"][0]["text"])


def _vllm() -> str:
    found = shutil.which("vllm") or str(Path(sys.executable).with_name("vllm"))
    return found


def check_outputs(client: Client, server: Vllm) -> dict[str, Any]:
    prompts = ["The quick brown fox", "A priority queue hands", "ZooKeeper keeps the state"]
    through = [client.submit(p, queue=QUEUE, max_new_tokens=24) for p in prompts]
    got = [job.result(timeout=120).output for job in through]
    direct = [server.complete(p, 24) for p in prompts]
    return {"ok": got == direct, "through_zkq": got, "direct": direct}


def check_metrics_gate(client: Client) -> dict[str, Any]:
    engines = [w.get("engine") or {} for w in client.workers() if w.get("queue") == QUEUE]
    return {"ok": any(e.get("engine") == "vllm" for e in engines), "engine": engines}


def check_priority(client: Client) -> dict[str, Any]:
    lows = client.submit_many(["A low job " * 8] * 600, queue=QUEUE, priority="low",
                              max_new_tokens=256)  # fmt: skip
    time.sleep(3)
    came = time.time()
    highs = client.submit_many(["An urgent job"] * 5, queue=QUEUE, priority="high",
                               max_new_tokens=256)  # fmt: skip
    high = [j.result(timeout=600) for j in highs]
    low = [j.result(timeout=1800) for j in lows]
    later = [r for r in low if (r.started_at or 0) > came]
    last_high = max(r.started_at or 0 for r in high)
    ok = all(r.ok for r in high + low) and all(last_high < (r.started_at or 0) for r in later)
    waits = sorted(float(r.finished_at or 0) - float(r.submitted_at or 0) for r in high)
    return {"ok": ok, "high_latency_s": waits, "lows_started_after_highs": len(later)}


def check_cancel(client: Client, server: Vllm) -> dict[str, Any]:
    job = client.submit("Keep talking " * 4, queue=QUEUE, max_new_tokens=1500)
    deadline = time.monotonic() + 60
    while server.running() < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    job.cancel()
    cancelled = time.monotonic()
    while server.running() > 0 and time.monotonic() - cancelled < 5:
        time.sleep(0.02)
    took = time.monotonic() - cancelled
    return {"ok": took <= 1.0, "aborted_within_s": round(took, 3)}


def check_kill(client: Client, server: Vllm) -> dict[str, Any]:
    jobs = client.submit_many(["Keep going " * 3] * 32, queue=QUEUE, max_new_tokens=1000)
    deadline = time.monotonic() + 60
    while server.running() < 16 and time.monotonic() < deadline:
        time.sleep(0.05)
    server.signal(signal.SIGKILL)
    time.sleep(5)
    server.start()
    results = [j.result(timeout=1800) for j in jobs]
    statuses = [r.status for r in results]
    return {"ok": statuses == ["succeeded"] * len(jobs), "statuses": sorted(set(statuses))}


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check --upstream: no CUDA GPU here", file=sys.stderr)
        return 2
    if shutil.which("vllm") is None and not Path(sys.executable).with_name("vllm").exists():
        print("gpu_check --upstream: vLLM is not installed (pip install vllm)", file=sys.stderr)
        return 2
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="zkq-vllm-") as tmp:
        server = Vllm(write_model(Path(tmp) / "model"), Path(tmp) / "vllm.log")
        server.start()
        cluster = ZkCluster(1).start()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        command = [sys.executable, "-m", "zkqueue.cli", "--zk", cluster.hosts, "worker"]
        command += ["--queue", QUEUE, "--upstream", server.url, "--upstream-priority"]
        with open(Path(tmp) / "worker.log", "wb") as log:
            worker = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            with Client(cluster.hosts) as client:
                checks = {
                    "outputs": lambda: check_outputs(client, server),
                    "metrics_gate": lambda: check_metrics_gate(client),
                    "priority": lambda: check_priority(client),
                    "cancel": lambda: check_cancel(client, server),
                    "kill_and_restart": lambda: check_kill(client, server),
                }
                for name, check in checks.items():
                    try:
                        report[name] = check()
                    except Exception as exc:  # one failed check must not hide the others
                        report[name] = {"ok": False, "error": repr(exc)}
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(120)
            server.signal(signal.SIGTERM)
            cluster.stop()
    report["ok"] = all(r.get("ok") for r in report.values() if isinstance(r, dict))
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
