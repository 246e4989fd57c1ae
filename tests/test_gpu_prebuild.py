"""tools/gpu_prebuild.py plans the kernels of its tags (built on the GPU host; here only the plan) and names the
accepted tags for an unknown one."""

from __future__ import annotations

import pytest

from deepinfer.compile.plan import kernel_plan
from deepinfer.tiny import tiny_config
from tools.gpu_prebuild import items_for


def test_default_is_the_embedded_models_plan_in_both_modes():
    items = items_for("default")
    cfg = tiny_config()
    assert set(items) == set(kernel_plan(cfg, "bfloat16")) | set(kernel_plan(cfg, "bfloat16", invariant=True))


def test_an_unknown_tag_names_the_accepted_ones():
    with pytest.raises(ValueError, match="unknown tag 'tiny1'.*default, tiny, tinyq"):
        items_for("tiny1")
