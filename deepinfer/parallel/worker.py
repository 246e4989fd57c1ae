"""A rank worker: `python -m deepinfer.parallel.worker HOST PORT`, started by `deepinfer.parallel.pool.RankPool`
as its own process (never a multiprocessing spawn: the caller's `__main__` is not re-run, so a script without an
`if __name__ == "__main__":` guard can start ranks).

It reads the connection's key from stdin, connects back, sends its rank (RANK, set by the launcher with the other
torchrun variables), receives what to build, builds it, answers "ok" with its `describe()`, then answers each
call (method, args, kwargs) with ("ok", result), until it receives None. A failure is answered with ("error",
the exception when it is one of deepinfer's own, its text, its traceback's end) and ends the worker.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from multiprocessing.connection import Client

from deepinfer.errors import DeepInferError


def send(conn, obj) -> None:
    """Plain pickle both ways (a Connection's own send pickles tensors by sharing their memory through a helper
    process keyed by multiprocessing's process key, which these processes do not share)."""
    conn.send_bytes(pickle.dumps(obj))


def recv(conn):
    return pickle.loads(conn.recv_bytes())


def serve(conn, build, kwargs: dict) -> None:
    target = None
    try:
        target = build(**kwargs)
        send(conn, ("ok", target.describe() if hasattr(target, "describe") else None))
        while True:
            call = recv(conn)
            if call is None:
                break
            method, args, kw = call
            send(conn, ("ok", getattr(target, method)(*args, **kw)))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller, named
        tail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-6:])
        ours = exc if isinstance(exc, DeepInferError) else None
        try:
            send(conn, ("error", ours, f"{type(exc).__name__}: {exc}", tail))
        except Exception:  # noqa: BLE001 - an unpicklable error still reports its text
            send(conn, ("error", None, f"{type(exc).__name__}: {exc}", tail))
    finally:
        close = getattr(target, "close", None)
        if close is not None:
            close()


def main() -> None:
    host, port = sys.argv[1], int(sys.argv[2])
    key = bytes.fromhex(sys.stdin.readline().strip())
    with Client((host, port), authkey=key) as conn:
        send(conn, int(os.environ["RANK"]))
        build, kwargs = recv(conn)
        serve(conn, build, kwargs)


if __name__ == "__main__":
    main()
