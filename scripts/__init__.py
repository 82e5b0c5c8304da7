"""zkq's entry points beside the library: the demo, the benchmarks (``python -m scripts.bench``)
and the chaos run (``python -m scripts.chaos``). Run them from the repository root."""
