"""deepinfer's own launcher: one worker process per rank on this host (no torchrun needed), each building the
`LLM` of its rank, driven from the process that made the pool.

Every call goes to every rank (each takes its data-parallel share of the requests and all of them return the
whole result, in input order); the caller gets rank 0's. A rank that raises ends the call: its error comes back
(a deepinfer error as itself, anything else as `RankError` naming the rank, with its traceback's end) and every
worker is stopped. A rank that dies without a word is reported by its exit code. A rank that stops answering
makes the others' collectives time out (DEEPINFER_DIST_TIMEOUT), which ends the call the same way.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any

from deepinfer.errors import DeepInferError
from deepinfer.parallel.config import ParallelConfig


class RankError(DeepInferError, RuntimeError):
    """A rank of a parallel run failed; the message names the rank and its error."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environ(rank: int, world: int, port: int) -> dict[str, str]:
    """What a launcher sets for each rank (torchrun's names; one host)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def _serve(rank: int, environ: dict[str, str], build: Any, kwargs: dict, conn: Connection) -> None:
    """A worker: build this rank's object with `build(**kwargs)`, report ready, then run calls until told to stop."""
    os.environ.update(environ)
    target = None
    try:
        target = build(**kwargs)
        conn.send(("ok", target.describe() if hasattr(target, "describe") else None))
        while True:
            call = conn.recv()
            if call is None:
                break
            method, args, kw = call
            conn.send(("ok", getattr(target, method)(*args, **kw)))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller, named
        tail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-6:])
        try:
            conn.send(("error", exc if isinstance(exc, DeepInferError) else None, f"{type(exc).__name__}: {exc}", tail))
        except Exception:  # noqa: BLE001 - an unpicklable error still reports its text
            conn.send(("error", None, f"{type(exc).__name__}: {exc}", tail))
    finally:
        close = getattr(target, "close", None)
        if close is not None:
            close()
        conn.close()


class RankPool:
    """`world` worker processes, rank i building `build(**kwargs)` (a picklable, module-level callable)."""

    def __init__(self, parallel: ParallelConfig, build: Any, kwargs: dict):
        ctx = mp.get_context("spawn")  # a fresh interpreter per rank: no inherited device or thread state
        port, world = free_port(), parallel.world
        self.conns: list[Connection] = []
        self.procs = []
        for rank in range(world):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, rank_environ(rank, world, port), build, kwargs, theirs),
                               name=f"deepinfer-rank-{rank}", daemon=True)
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)
        self.ready = self._replies()  # each rank's `describe()`

    def call(self, method: str, *args, **kwargs) -> Any:
        """`method(*args, **kwargs)` on every rank; rank 0's result."""
        for conn in self.conns:
            conn.send((method, args, kwargs))
        return self._replies()[0]

    def _replies(self) -> list[Any]:
        """One reply from every rank; the first error (or death) stops every worker and raises."""
        replies: dict[int, Any] = {}
        waiting = {conn: rank for rank, conn in enumerate(self.conns)}
        while waiting:
            deaths = {self.procs[rank].sentinel: rank for rank in waiting.values()}
            ready = wait(list(waiting) + list(deaths))
            for conn in [r for r in ready if r in waiting]:
                rank = waiting.pop(conn)
                try:
                    reply = conn.recv()
                except EOFError:
                    self.procs[rank].join(5)
                    self._fail(RankError(f"rank {rank} exited with code {self.procs[rank].exitcode} before answering"))
                if reply[0] == "error":
                    _, exc, message, tail = reply
                    self._fail(exc if exc is not None else RankError(f"rank {rank} failed: {message}\n{tail}"), rank)
                replies[rank] = reply[1]
            for sentinel in [r for r in ready if r in deaths]:
                rank = deaths[sentinel]
                if rank in waiting.values() and not self.conns[rank].poll():  # dead, and nothing left to read
                    self._fail(RankError(f"rank {rank} exited with code {self.procs[rank].exitcode} before answering"))
        return [replies[r] for r in range(len(self.conns))]

    def _fail(self, exc: BaseException, rank: int | None = None) -> None:
        self.close(force=True)
        if rank is not None and isinstance(exc, DeepInferError) and not isinstance(exc, RankError):
            exc.args = (f"rank {rank}: {exc}",) + exc.args[1:]
        raise exc

    def close(self, force: bool = False) -> None:
        """Stop every worker (asked first; `force`: terminated at once)."""
        for conn, proc in zip(self.conns, self.procs):
            if not force and proc.is_alive():
                try:
                    conn.send(None)
                except (OSError, BrokenPipeError):
                    pass
        for proc in self.procs:
            if force:
                proc.terminate()
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []
