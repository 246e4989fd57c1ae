"""A kernel-build worker: `python -m codegen.worker`, started by `codegen.driver.build_all` as its own process.

It never imports the caller's `__main__` (unlike multiprocessing's spawn), so a user script without an
`if __name__ == "__main__":` guard is not re-run. Protocol, one JSON object per line:

  stdin  <- {"id": N, "target": NAME, "cache_dir": DIR, "make_request": "module:function", "item": B64}
  stdout -> {"id": N, "result": B64}             (B64: base64 of a pickle; the result is a driver.Result)
         -> {"id": N, "error": B64, "traceback": TEXT}   (an unexpected exception, re-raised by the parent)

Only protocol lines reach the real stdout: at start-up fd 1 is pointed at stderr (TileLang and compilers
print there), and the protocol is written to a private duplicate of the original stdout. The worker exits
when stdin closes. An item that kills the process (os._exit, SystemExit, a crash) is reported by the parent.
"""

from __future__ import annotations

import base64
import importlib
import json
import os
import pickle
import sys
import traceback
from typing import Any, Callable


def encode(obj: Any) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode("ascii")


def decode(text: str) -> Any:
    return pickle.loads(base64.b64decode(text))


def resolve(spec: str) -> Callable[..., Any]:
    """'package.module:qualified.name' -> the object."""
    module, _, qualname = spec.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _protocol_stream():
    """A private text stream on the original stdout; fd 1 (and sys.stdout) then go to stderr."""
    sys.stdout.flush()
    proto = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto


def main() -> int:
    proto = _protocol_stream()
    from codegen.driver import build_one

    requesters: dict[str, Callable[..., Any]] = {}
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        try:
            spec = msg["make_request"]
            if spec not in requesters:
                requesters[spec] = resolve(spec)
            result = build_one(msg["target"], msg["cache_dir"], requesters[spec], decode(msg["item"]))
            reply = {"id": msg["id"], "result": encode(result)}
        except Exception as exc:  # noqa: BLE001 - handed to the parent, which re-raises it
            tb = traceback.format_exc()
            try:
                payload = encode(exc)
                decode(payload)
            except Exception:  # noqa: BLE001 - an exception that does not survive pickling
                payload = encode(RuntimeError(f"{type(exc).__name__}: {exc}"))
            reply = {"id": msg["id"], "error": payload, "traceback": tb}
        proto.write(json.dumps(reply) + "\n")
        proto.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
