"""zkq's benchmarks, one module per suite; ``python -m scripts.bench`` runs them (see
BENCHMARKS.md).

    __main__.py        the command line: suites, output folder, results.json and results.md
    core.py            run configuration, the shared ZooKeeper (and Redis), agent processes
    agents.py          an agent process: commands from the harness over a pipe
    services.py        what an agent runs: a zkq worker, a LockingQueue consumer, a Redis worker
    wire.py            round trips, multi ops and watch notifications counted per process; timers
    scenarios.py       warm-up, raw ZooKeeper rates, latency, depth, producer bulk
    dispatch.py        dispatch throughput: zkq against LockingQueue, and the Redis baseline
    herd.py            notifications and sessions woken per new job
    model.py           the model worker on continuous batching: continuous.py in a subprocess
    continuous.py      continuous batching through the worker against the engine alone (torch)
    redis_baseline.py  a local redis-server and a reliable priority queue on it
    profile.py         pyinstrument profiles of the worker and the producers
    targets.py         repetitions grouped into medians, targets met or missed
    report.py          results.md
    plots.py           the PNG plots (matplotlib)
"""
