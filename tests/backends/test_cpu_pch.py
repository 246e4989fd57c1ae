"""backends/cpu/pch.py: TileLang's CPU header precompiled once, used by a kernel's compile (g++ reports it), the
kernel's own include of the header then skipped, and nothing used for a compiler that is not g++."""

import shutil
import subprocess
from pathlib import Path

import pytest

from backends.cpu.pch import HEADER, build

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (the c target's compiler)")


@pytest.fixture(scope="module")
def header():
    from tilelang.env import TILELANG_TEMPLATE_PATH

    return Path(TILELANG_TEMPLATE_PATH) / HEADER


def test_a_kernel_compile_reads_the_precompiled_header(header, tmp_path):
    flags = build("g++", header, tmp_path)
    assert flags[0] == "-include" and (tmp_path / flags[1]).with_suffix(".h.gch").is_file()
    made = (tmp_path / flags[1]).with_suffix(".h.gch")
    stamp = made.stat().st_mtime_ns
    assert build("g++", header, tmp_path) == flags and made.stat().st_mtime_ns == stamp  # made once
    src = tmp_path / "k.cpp"
    src.write_text("#include <tl_templates/cpp/common.h>\nextern \"C\" float twice(float x) { return 2 * x; }\n")
    done = subprocess.run(["g++", "-std=c++17", "-fPIC", "-shared", str(src), f"-I{header.parents[2]}", *flags, "-H",
                           "-o", str(tmp_path / "k.so")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    shown = done.stderr.splitlines()
    assert shown[0].startswith("! ") and shown[0].endswith(".gch")  # the precompiled header, used
    assert not any("common.h" in line and not line.endswith(".gch") for line in shown)  # the text not read again


def test_another_compiler_gets_no_flags(header, tmp_path):
    fake = tmp_path / "clang++"
    fake.write_text("#!/bin/sh\necho 'clang version 18.1.0'\n")
    fake.chmod(0o755)
    assert build(str(fake), header, tmp_path) == ()
    assert not list(tmp_path.glob("deepinfer-c-pch-*"))
