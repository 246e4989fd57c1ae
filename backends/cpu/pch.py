"""A precompiled header for the `c` target's builds: every kernel's C++ starts with TileLang's
`tl_templates/cpp/common.h`, about 70,000 lines once preprocessed (half.hpp pulls in iostream), so g++ spends ~1.1 s
of a kernel's ~1.2 s compile on that header. Built once (2 s) and passed as `-include`, it cuts the compile to ~0.2 s.

The precompiled file includes the header by its absolute path, so the kernel's own `#include` of the same file is
skipped (`#pragma once`). It is only an accelerator: g++ ignores a precompiled header that does not match the
compile (another compiler version or flags) and reads the text instead, with the same result. Only for g++ (clang
names its precompiled headers differently). The file lives in the system's temporary directory under a name that
hashes the compiler and the header's bytes (~45 MB), written by an atomic rename."""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

FLAGS = ("-std=c++17", "-fPIC")  # TileLang's flags for a CPU kernel that change what a header compiles to
HEADER = "tl_templates/cpp/common.h"


@functools.lru_cache(maxsize=1)
def include_flags() -> tuple[str, ...]:
    """("-include", <header>) for TileLang's CPU compiles, or () where no precompiled header could be made."""
    try:
        from tilelang.contrib.cc import get_cplus_compiler
        from tilelang.env import TILELANG_TEMPLATE_PATH

        compiler = get_cplus_compiler()
        if not compiler or not TILELANG_TEMPLATE_PATH or not (Path(TILELANG_TEMPLATE_PATH) / HEADER).is_file():
            return ()
        return build(compiler, Path(TILELANG_TEMPLATE_PATH) / HEADER, Path(tempfile.gettempdir()))
    except (ImportError, OSError, subprocess.SubprocessError):
        return ()


def build(compiler: str, header: Path, root: Path) -> tuple[str, ...]:
    """The precompiled `header` for `compiler` (made now unless it already is) -> the flags that use it; () for a
    compiler that is not g++ or a build that fails."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    if "Free Software Foundation" not in version:  # GCC's banner (clang's names neither)
        return ()
    digest = hashlib.sha256()
    for part in (compiler, version, *FLAGS, str(header.resolve())):
        digest.update(part.encode() + b"\0")
    for path in sorted(header.parent.iterdir()):  # common.h and what it includes beside it (half.hpp)
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    where = root / f"deepinfer-c-pch-{digest.hexdigest()[:20]}"
    text, made = where / "common.h", where / "common.h.gch"
    if not made.is_file():
        where.mkdir(parents=True, exist_ok=True)
        if not text.is_file():
            _publish(text, f'#include "{header.resolve()}"\n'.encode())
        partial = where / f".common.h.gch.{os.getpid()}"
        done = subprocess.run([compiler, *FLAGS, "-x", "c++-header", str(text), "-o", str(partial)],
                              capture_output=True, timeout=300)
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            return ()
        os.replace(partial, made)
    return ("-include", str(text))


def _publish(path: Path, data: bytes) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_bytes(data)
    os.replace(partial, path)
