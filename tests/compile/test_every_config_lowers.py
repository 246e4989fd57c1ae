"""Any valid V4 shape compiles on every target: every kernel of the plans of the embedded default model, the
TINY test configs and two odd-width configs (widths that are multiples of no tile) lowers for sm90, sm100,
ascend and c, in the target's default dtype. (Numerics: tests/tilekernels run the odd shapes on the c target.)
Ascend lowers about ten times slower than the others (2 of this test's 3.5 minutes on CI's two cores), so its
set, and the c target's (whose kernels the tiny models also run in tests/tilekernels), leave out the TINY
configs and the second odd config: the default model's widths are whole tiles, ODD_A's are ragged against
every tile, and the TINY configs' sub-tile widths (16-64) and ODD_B's other ragged widths are edges of the
kinds those two already take (the sm90 and sm100 sets add TINY_A: sub-tile widths; TINY_B, ODD_B and the default
model, whose widths are whole tiles as TINY_A's are, were dropped there too, for the CPU suite's time). Ascend's set
is ODD_A's alone, with one GEMM shape per kind of ragged edge (`ASCEND_GEMMS`): whole
tiles are what tests/tilekernels/test_lowering.py lowers every kernel at (V4-Flash widths, Ascend included).
The c target's set is ODD_A's alone too: the default model's float32 plan on c is built whole (lowered and
compiled, every kernel or the script fails) by tests/codegen/test_workers.py's script without a main guard.
The kernels of all the targets are handed to one pair of worker processes (started once for the session:
tests/conftest.py's `ahead`) one at a time, Ascend's and the slowest kinds first (Ascend lowers sparse attention's
split kernel in ~15 s, most others in a few), so that neither worker idles between targets or at the end."""

from __future__ import annotations

import re

import pytest

import backends
from backends import tl
from deepinfer.compile.plan import kernel_plan
from deepinfer.config import ModelConfig
from tests.helpers import ODD_A, TINY_A
from tilekernels.kernels import request

pytestmark = pytest.mark.full  # opt-in: `pytest -m full` (README.md, Run the tests)


def plans(dtype: str, target: str) -> list[tuple]:
    """The kernels of every config's plan, or of fewer configs for the slow targets (see above)."""
    items: dict[tuple, None] = {}
    if target == "ascend":
        cfgs = [ModelConfig.from_dict(ODD_A)]
    elif target == "c":  # the default model's plan: built on c by tests/codegen/test_workers.py (see above)
        cfgs = [ModelConfig.from_dict(ODD_A)]
    else:  # TINY_B's and ODD_B's edges are kinds TINY_A and ODD_A already take, the default model's whole tiles
        cfgs = [ModelConfig.from_dict(raw) for raw in (TINY_A, ODD_A)]  # those TINY_A takes (module docstring)
    for cfg in cfgs:
        items.update(dict.fromkeys(kernel_plan(cfg, dtype)))
        if target in ("sm90", "sm100"):  # and the --batch-invariant variants (sm100 never ran them either)
            items.update(dict.fromkeys(kernel_plan(cfg, dtype, invariant=True)))
    if target == "ascend":  # ODD_A's 12 ragged GEMM shapes: one of each kind of edge against Ascend's tiles
        items = {it: None for it in items if it[:2] != ("linear", "gemm") or (it[2].n, it[2].k) in ASCEND_GEMMS}
        # the top-k kernel has no width of the model in it (only k's slots): tests/tilekernels/test_lowering.py
        # lowers it for Ascend at V4-Flash's k, ~100 s on one CI core, once is enough
        items = {it: None for it in items if it[0] != "indexer_topk"}
    return list(items)


# ODD_A's GEMM shapes Ascend lowers (both tiles, decode and prefill): an N of a few columns, a sub-tile N, a ragged
# multi-tile N with a ragged K, the odd K of 18, the grouped output projection (its other shapes take the same edges)
ASCEND_GEMMS = {(3, 48), (48, 48), (301, 48), (144, 20), (48, 18), (12, 72)}


# The kernels that lower slowest (on Ascend most of all), handed out first: a worker takes the next kernel as it
# finishes one, so that the last to finish is a quick one
SLOW = {kernel: rank for rank, kernel in enumerate([("sparse_attention", "split"), ("indexer_scores", "indexer_scores"),
                                                    ("linear", "gemm"), ("hc_pre", "hc_pre_finish"),
                                                    ("hc_pre", "hc_pre_split"), ("sparse_attention", "combine")])}


def lower_all(name: str, items: list[tuple]) -> list[str]:
    """Lower `items` for target `name`; the failures, each with TileLang's last message line."""
    target, failed = backends.get(name), []
    for op, kernel, variant in items:
        try:
            source = tl.lower_source(request(op, kernel, variant).build(target), target)
            assert source.strip()
            # kernels.md trap 2: a 2-D launch emits blockIdx.y, which the NPU does not have (wrong code, no error)
            assert target.traits.launch != "persistent" or not re.search(r"blockIdx\.[yz]|threadIdx\.[yz]", source), \
                "a 2-D launch leaked into a persistent-launch target's source"
        except Exception as exc:  # collect every failure, not just the first
            failed.append(f"{op}.{kernel}[{variant}]: {str(exc).strip().splitlines()[-1][:200]}")
    return failed


def queue_ahead(ahead, items: list) -> tuple:
    """Every selected target's kernels (`items`: the selected tests), queued at the session's start by
    tests/conftest.py's `ahead` (two worker processes: lowering is single-threaded, CI's two cores) one kernel at
    a time, Ascend's first and each target's slowest kinds first, so that neither worker idles at the end (and
    before this module, they lower on the core the tests before it leave idle). Returns the selected targets
    and, for each kernel, its target and the future of its failures."""
    names = list(dict.fromkeys(item.callspec.params["name"] for item in items if hasattr(item, "callspec")))
    work = sorted(((name, item) for name in names for item in plans(backends.get(name).default_dtype, name)),
                  key=lambda w: (w[0] != "ascend", SLOW.get(w[1][:2], len(SLOW))))
    return names, [(name, ahead.submit(lower_all, name, [item])) for name, item in work]


@pytest.fixture(scope="module")
def failures(ahead, request) -> dict[str, list[str]]:
    """The failures of each selected target (`queue_ahead`'s work, once done), for its test to report."""
    names, lowered = ahead.of(request.module)
    found: dict[str, list[str]] = {name: [] for name in names}
    for name, part in lowered:
        found[name].extend(part.result())
    return found


@pytest.mark.parametrize("name", backends.COMPILE_TARGETS)
def test_every_planned_kernel_lowers(name, failures):
    failed = failures[name]
    assert not failed, f"{len(failed)} kernel(s) do not lower for {name}:\n" + "\n".join(failed)
