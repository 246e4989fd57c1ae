"""Engine defaults the CLI, the Python API and the scheduler share (torch-free: `deepinfer.cli` imports it)."""

# Prompt tokens per prefill step: on the H200 the V4-Flash slice prefills 16K tokens at 81K tok/s in steps of 2,048,
# 98K in steps of 4,096 (107K / 112K in 8,192 / 16,384; BENCHMARKS.md), while a step's activations stay well inside
# the 2 GiB `options.cache_spec` keeps free for them.
MAX_PREFILL_TOKENS = 4096
