"""The content-addressed artifact cache: one directory per (target, op.kernel, key), published atomically.

An entry is built in a staging directory next to its final place and renamed into place; `meta.json`,
written last, lists every file with its SHA-256, so a truncated or edited entry is detected on load and
rebuilt. A per-entry file lock with a re-check after acquiring it makes concurrent builds of one entry
safe: one process builds, the others find it built.

Beside the entries, `index/` maps a request's source key (computed without tracing its body) to the key of the
entry its trace gave, so that a warm start loads kernels without re-tracing them (`Compiler.load`). A record is
a small JSON file, replaced atomically; an unreadable one is a miss (the load traces, as without an index).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator

log = logging.getLogger("deepinfer.codegen")

META = "meta.json"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def entry_files(entry: Path) -> dict[str, str]:
    return {str(p.relative_to(entry)): sha256_file(p) for p in sorted(entry.rglob("*")) if p.is_file() and p.name != META}


def read_meta(entry: Path) -> dict | None:
    """The entry's metadata if the entry is complete and intact, else None."""
    try:
        meta = json.loads((entry / META).read_text())
    except (OSError, ValueError):
        return None
    files = meta.get("files", {})
    for rel, digest in files.items():
        path = entry / rel
        if not path.is_file() or sha256_file(path) != digest:
            log.warning("cache entry %s is corrupted (%s changed or missing): rebuilding it", entry, rel)
            return None
    return meta


@contextlib.contextmanager
def locked(entry: Path) -> Iterator[None]:
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.with_name(entry.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def staging(entry: Path) -> Iterator[Path]:
    """A fresh directory beside `entry`; removed unless `publish` moved it into place."""
    tmp = entry.with_name(f".{entry.name}.staging-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def publish(tmp: Path, entry: Path, meta: dict) -> None:
    """Write meta.json (with file hashes) into the staging dir, then rename it into place atomically."""
    meta = {**meta, "files": entry_files(tmp)}
    with open(tmp / META, "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    if entry.exists():  # a corrupted entry being replaced
        shutil.rmtree(entry)
    os.rename(tmp, entry)


def read_record(path: Path) -> dict | None:
    """An index record (a JSON object), or None when it is missing or unreadable."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def write_record(path: Path, record: dict) -> bool:
    """Write an index record atomically (a concurrent reader sees the old file or the whole new one); False when
    the cache is not writable (the next start traces again, nothing else changes)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(record, sort_keys=True))
        os.replace(tmp, path)
    except OSError as exc:
        log.debug("cannot write the kernel index record %s: %s", path, exc)
        with contextlib.suppress(OSError):
            tmp.unlink()
        return False
    return True


def keep_failure(tmp: Path, failures: Path) -> Path:
    """Move a failed build's staging dir (with its tool logs) where the report can point at it."""
    failures.mkdir(parents=True, exist_ok=True)
    dest = failures / tmp.name.lstrip(".").split(".staging-")[0]
    if dest.exists():
        shutil.rmtree(dest)
    shutil.move(str(tmp), dest)
    return dest
