"""deepinfer's own launcher: one worker process per rank on this host (no torchrun needed), each building the
`LLM` of its rank, driven from the process that made the pool.

Workers are `python -m deepinfer.parallel.worker` processes (the caller's script is not re-run) that connect back
over a local socket with a one-time key. Every call goes to every rank (each takes its data-parallel share of the
requests and all of them return the whole result, in input order); the caller gets rank 0's. A rank that raises
ends the call: its error comes back (a deepinfer error as itself, prefixed with the rank; anything else as
`RankError` naming the rank, with its traceback's end) and every worker is stopped. A rank that dies is reported
with its exit code. A rank that stops answering makes the others' collectives time out (DEEPINFER_DIST_TIMEOUT),
which ends the call the same way.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection, Listener, wait
from typing import Any

from deepinfer.errors import DeepInferError
from deepinfer.parallel.config import ParallelConfig
from deepinfer.parallel.worker import recv, send

CONNECT_TIMEOUT = 120.0  # seconds a worker may take to start and connect back (imports)


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


class RankPool:
    """`world` worker processes, rank i building `build(**kwargs)` (a picklable, module-level callable)."""

    def __init__(self, parallel: ParallelConfig, build: Any, kwargs: dict):
        key = secrets.token_bytes(32)
        port, world = free_port(), parallel.world
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # the caller's imports
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        # a backlog for every rank: with multiprocessing's default of 1, ranks connecting at once overflow the accept
        # queue, and a connection whose last handshake packet the kernel drops there hangs (the worker waits for the
        # key's challenge on a socket the listener never accepts: 2 starts in 3 hung at 8 ranks on 2 cores)
        with Listener(("127.0.0.1", 0), authkey=key, backlog=world) as listener:
            host, listen_port = listener.address
            for rank in range(world):
                proc = subprocess.Popen([sys.executable, "-m", "deepinfer.parallel.worker", host, str(listen_port)],
                                        stdin=subprocess.PIPE, env={**env, **rank_environ(rank, world, port)})
                proc.stdin.write(key.hex().encode() + b"\n")
                proc.stdin.close()
                self.procs.append(proc)
            self.conns = self._accept(listener, world)
        for conn in self.conns:
            send(conn, (build, kwargs))
        self.ready = self._replies()  # each rank's `describe()`

    def _accept(self, listener: Listener, world: int) -> list[Connection]:
        """Every worker's connection, in rank order; a worker that exits first is reported at once."""
        listener._listener._socket.settimeout(1.0)  # noqa: SLF001 - Listener.accept() takes no timeout
        deadline = time.monotonic() + CONNECT_TIMEOUT
        by_rank: dict[int, Connection] = {}
        while len(by_rank) < world:
            try:
                conn = listener.accept()
            except (OSError, EOFError):
                dead = [(r, p.returncode) for r, p in enumerate(self.procs) if p.poll() is not None]
                if dead or time.monotonic() > deadline:
                    self.close(force=True)
                    raise RankError(f"rank {dead[0][0]} exited with code {dead[0][1]} while starting" if dead
                                    else f"a rank did not connect within {CONNECT_TIMEOUT:.0f} s") from None
                continue
            by_rank[recv(conn)] = conn
        return [by_rank[r] for r in range(world)]

    def call(self, method: str, *args, **kwargs) -> Any:
        """`method(*args, **kwargs)` on every rank; rank 0's result."""
        for conn in self.conns:
            send(conn, (method, args, kwargs))
        return self._replies()[0]

    def _replies(self) -> list[Any]:
        """One reply from every rank; the first error (or death) stops every worker and raises."""
        replies: dict[int, Any] = {}
        waiting = {conn: rank for rank, conn in enumerate(self.conns)}
        while waiting:
            for conn in wait(list(waiting), timeout=1.0):
                rank = waiting.pop(conn)
                try:
                    reply = recv(conn)
                except EOFError:
                    self._fail(RankError(f"rank {rank} exited with code {self._exit(rank)} before answering"))
                if reply[0] == "error":
                    _, exc, message, tail = reply
                    self._fail(exc if exc is not None else RankError(f"rank {rank} failed: {message}\n{tail}"), rank)
                replies[rank] = reply[1]
            for conn, rank in list(waiting.items()):
                if self.procs[rank].poll() is not None and not conn.poll():  # dead, nothing left to read
                    self._fail(RankError(f"rank {rank} exited with code {self.procs[rank].returncode} before "
                                         "answering"))
        return [replies[r] for r in range(len(self.conns))]

    def _exit(self, rank: int) -> int | None:
        try:
            return self.procs[rank].wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None

    def _fail(self, exc: BaseException, rank: int | None = None) -> None:
        self.close(force=True)
        if rank is not None and isinstance(exc, DeepInferError) and not isinstance(exc, RankError):
            exc.args = (f"rank {rank}: {exc}",) + exc.args[1:]
        raise exc

    def close(self, force: bool = False) -> None:
        """Stop every worker (asked first; `force`: terminated at once)."""
        for conn, proc in zip(self.conns, self.procs):
            if not force and proc.poll() is None:
                try:
                    send(conn, None)
                except (OSError, BrokenPipeError):
                    pass
        for proc in self.procs:
            if force and proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []
