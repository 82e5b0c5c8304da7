"""The openai runner's dispatch gate on each engine's metrics, as its documentation shows them."""

from __future__ import annotations

import time

import pytest

from workers.runners.gate import EngineFigures, Gate, GateState, parse_metrics

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 9.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} {waiting}
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} {kv}
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.1
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 8128.0
# HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_sum{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:iteration_tokens_total_bucket{le="1.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:iteration_tokens_total_bucket{le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:iteration_tokens_total_count{model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
"""

#: vLLM before the V1 engine named its cache gauge gpu_cache_usage_perc.
VLLM_OLD = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="facebook/opt-125m"} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="facebook/opt-125m"} 0.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="facebook/opt-125m"} 0.95
"""

SGLANG = """\
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.128902e+06
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} {kv}
# HELP sglang:num_running_reqs The number of running requests
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 162.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} {waiting}
"""

TGI = """\
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 8
# TYPE tgi_queue_size gauge
tgi_queue_size {waiting}
# TYPE tgi_request_count counter
tgi_request_count 1204
# TYPE tgi_batch_current_max_tokens gauge
tgi_batch_current_max_tokens 16000
"""

#: transformers serve has no /metrics; a server may publish unrelated ones (a Go runtime's).
UNRELATED = """\
# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 12.5
"""


def fill(text: str, waiting: float = 0, kv: float = 0.2) -> str:
    return text.replace("{waiting}", str(waiting)).replace("{kv}", str(kv))


def test_each_engines_figures_are_read() -> None:
    assert parse_metrics(fill(VLLM, waiting=3, kv=0.42)) == EngineFigures("vllm", 3, 21, 0.42)
    assert parse_metrics(VLLM_OLD) == EngineFigures("vllm", 0, 4, 0.95)
    assert parse_metrics(fill(SGLANG, 5, 0.28)) == EngineFigures("sglang", 5, 162, 0.28)
    assert parse_metrics(fill(TGI, 2)) == EngineFigures("tgi", 2, 8, None)
    assert parse_metrics(UNRELATED) is None
    assert parse_metrics("") is None


@pytest.mark.parametrize("engine", [VLLM, SGLANG, TGI])
@pytest.mark.parametrize(
    ("waiting", "kv", "state"),
    [
        (0, 0.2, GateState.OPEN),
        (1, 0.2, GateState.BUSY),  # the server queues: the backlog belongs in zkq's queue
        (0, 0.9, GateState.BUSY),  # its cache is nearly full (TGI publishes no cache use)
        (0, 0.89, GateState.OPEN),
    ],
)
def test_the_gate_opens_only_while_the_server_has_room(
    engine: str, waiting: int, kv: float, state: GateState
) -> None:
    gate = Gate()
    gate.healthy()
    gate.reading(parse_metrics(fill(engine, waiting, kv)))
    expected = GateState.OPEN if engine is TGI and waiting == 0 else state
    assert gate.state == expected


def test_thresholds_are_settings() -> None:
    gate = Gate(max_waiting=4, max_kv_use=0.5)
    gate.healthy()
    gate.reading(parse_metrics(fill(VLLM, waiting=4, kv=0.3)))
    assert gate.state == GateState.OPEN
    gate.reading(parse_metrics(fill(VLLM, waiting=4, kv=0.5)))
    assert gate.state == GateState.BUSY
    gate.reading(parse_metrics(fill(VLLM, waiting=5, kv=0.1)))
    assert gate.state == GateState.BUSY


def test_each_reading_lets_the_worker_claim_a_bounded_number_of_jobs() -> None:
    """16 jobs a reading, or half what the server runs: a server that fills up between two
    readings takes few jobs into its own queue. A reading asked for before the last claims
    does not count them, so it does not renew the allowance."""
    woken: list[str] = []
    gate = Gate()
    gate.on_change = lambda: woken.append(gate.state.value)
    gate.healthy()
    asked = time.monotonic()
    gate.reading(parse_metrics(fill(SGLANG)), asked)  # 162 running: 81 a reading
    assert gate.room() == 81
    gate.claimed(60)
    assert gate.room() == 21
    gate.reading(parse_metrics(fill(SGLANG)), asked)  # asked before the claims
    assert gate.room() == 21
    gate.claimed(21)
    assert (gate.room(), gate.state) == (0, GateState.BUSY)
    assert not gate.server_busy  # full by the allowance, not by the server's own figures
    gate.reading(parse_metrics(fill(TGI)))  # 8 running: 16 a reading
    assert (gate.room(), gate.state) == (16, GateState.OPEN)
    assert woken[-2:] == ["busy", "open"]


def test_a_failed_reading_shuts_the_gate_until_one_succeeds() -> None:
    gate = Gate()
    gate.healthy()
    gate.reading(parse_metrics(fill(VLLM)))
    gate.stale()
    assert (gate.state, gate.room(), gate.server_busy) == (GateState.BUSY, 0, True)
    gate.reading(parse_metrics(fill(VLLM)))
    assert gate.state == GateState.OPEN


def test_without_metrics_slots_alone_gate() -> None:
    gate = Gate()
    gate.healthy()
    gate.reading(None)
    gate.claimed(16)
    gate.stale()  # nothing to go stale
    assert (gate.state, gate.room()) == (GateState.OPEN, None)
    assert gate.record() == {"gate": "open"}


def test_down_until_healthy_whatever_the_figures_say() -> None:
    woken: list[str] = []
    gate = Gate()
    gate.on_change = lambda: woken.append(gate.state.value)
    assert gate.state == GateState.DOWN  # never claims before the first health check
    assert gate.room() == 0
    gate.healthy()
    assert gate.down("connection refused") is True
    assert gate.down("connection refused") is False  # one outage, counted once
    assert woken == ["open", "down"]  # a shut gate wakes the worker too: it leaves the line
    gate.reading(parse_metrics(fill(VLLM)))
    assert gate.state == GateState.DOWN
    assert gate.record()["down"] == "connection refused"
    gate.healthy()
    assert gate.state == GateState.OPEN
    assert gate.downs == 1
    assert gate.record() == {
        "gate": "open",
        "engine": "vllm",
        "waiting": 0,
        "running": 21,
        "kv_use": 0.2,
    }


def test_a_jobs_fields_map_onto_its_request() -> None:
    from workers.runners.upstream import request_for
    from zkqueue.protocol.spec import JobSpec

    path, body = request_for(JobSpec("Hi", max_new_tokens=7), "m")
    assert path == "/completions"
    assert body == {
        "model": "m",
        "stream": True,
        "max_tokens": 7,
        "prompt": "Hi",
        "stream_options": {"include_usage": True},
        "temperature": 0.0,  # greedy
    }
    spec = JobSpec(
        "",
        messages=({"role": "user", "content": "Hi"},),
        temperature=0.7,
        top_p=0.9,
        seed=3,
        stop=("\n",),
        min_new_tokens=2,
        ignore_eos=True,
    )
    path, body = request_for(spec, "m", priority="high")
    assert path == "/chat/completions"
    assert body["messages"] == [{"role": "user", "content": "Hi"}]
    assert "prompt" not in body
    assert (body["temperature"], body["top_p"], body["seed"]) == (0.7, 0.9, 3)
    assert (body["stop"], body["min_tokens"], body["ignore_eos"]) == (["\n"], 2, True)
    assert body["priority"] == -1  # vLLM: lower runs first
    assert request_for(JobSpec("x", top_p=0.5), "m", "low")[1]["temperature"] == 1.0
    assert request_for(JobSpec("x"), "m", "low")[1]["priority"] == 1
