"""`benchmarks/startup.py`'s summary: a "warm" run that had to compile kernels is not a warm start (the
seventeenth session's first call ran its warm runs on an empty cache, and the median counted the 46-kernel build)."""

from __future__ import annotations

from benchmarks.startup import first_token_figures


def run(name: str, first_token_s: float | None, compiled: int) -> dict:
    return {"run": name, "first_token_s": first_token_s, "kernels_compiled": compiled}


def test_a_warm_run_that_compiled_kernels_is_left_out_of_the_warm_figures():
    out = first_token_figures([run("warm1", 45.6, 46), run("warm2", 4.6, 0), run("warm3", 5.0, 0)])
    assert out == {"cold_first_token_s": None, "warm_first_token_s": 4.6, "warm_median_first_token_s": 4.8}


def test_the_cold_run_counts_as_cold_whatever_it_compiled_and_no_warm_run_gives_none():
    out = first_token_figures([run("cold", 48.0, 46), run("warm1", 30.0, 3), run("warm2", None, 0)])
    assert out == {"cold_first_token_s": 48.0, "warm_first_token_s": None, "warm_median_first_token_s": None}
