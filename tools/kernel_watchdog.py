"""Run a Python script and name the kernel a stuck GPU is in: after every TileLang kernel launched outside a CUDA
graph capture, a CUDA event is recorded (op, kernel, variant); a thread polls them, and when the oldest kernel not
done has stayed not done for `--stall` seconds it prints that kernel, the last ones done before it and every Python
thread's stack, then exits with status 3. A script that keeps making progress is never stopped.

    python tools/kernel_watchdog.py [--stall 30] benchmarks/async_steps.py --batches 1 ...

Why: a host that waits on a device copy shows only that copy in its stack (`faulthandler`), not which kernel the
device is still in. The events cost a few microseconds a launch, so a timing run is not a measurement run. Kernels
replayed from a captured graph are not seen one by one (a stuck replay shows as a graph's first kernel never done,
or no kernel pending at all, with the stack at the replay's wait). Without CUDA the script runs unwatched."""

from __future__ import annotations

import argparse
import collections
import faulthandler
import os
import runpy
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


class Watch:
    """The launches not yet seen done (number, label, event) and the last few done, and the stall rule: `stalled(now)`
    gives the oldest launch not done once it has been not done for `stall` seconds (None otherwise)."""

    def __init__(self, stall: float):
        self.stall = stall
        self.launches: collections.deque = collections.deque()
        self.done: collections.deque = collections.deque(maxlen=5)
        self.count = 0
        self._first_seen: tuple[int, float] | None = None  # (launch number, when first seen not done)

    def record(self, label: str, event: Any) -> None:
        self.count += 1
        self.launches.append((self.count, label, event))

    def oldest_pending(self) -> tuple[int, str, Any] | None:
        """The oldest launch not done (those done before it are dropped: one thread appends, this one pops)."""
        while self.launches:
            launch = self.launches[0]
            if not launch[2].query():
                return launch
            self.done.append(self.launches.popleft())
        return None

    def stalled(self, now: float) -> tuple[int, str, Any] | None:
        pending = self.oldest_pending()
        if pending is None:
            self._first_seen = None
            return None
        if self._first_seen is None or self._first_seen[0] != pending[0]:
            self._first_seen = (pending[0], now)
            return None
        return pending if now - self._first_seen[1] >= self.stall else None

    def report(self, pending: tuple[int, str, Any]) -> str:
        done = [f"  done    #{n} {label}" for n, label, _ in self.done]
        after = [f"  queued  #{n} {label}" for n, label, _ in list(self.launches)[1:6]]
        return "\n".join([f"kernel_watchdog: kernel #{pending[0]} of {self.count} launched has not finished in "
                          f"{self.stall:.0f} s", *done, f"  STUCK   #{pending[0]} {pending[1]}", *after])


def install(watch: Watch) -> None:
    """Record an event after every TileLang kernel launch outside a capture (patches `Launcher.__call__`)."""
    import torch

    sys.path.insert(0, str(ROOT))
    from tilekernels.kernels import Launcher

    resolve = Launcher.__call__

    def launcher_call(self, op: str, kernel: str, variant: Any):
        fn = resolve(self, op, kernel, variant)

        def launch(*args, **kwargs):
            out = fn(*args, **kwargs)
            if not torch.cuda.is_current_stream_capturing():
                event = torch.cuda.Event()
                event.record()
                watch.record(f"{op}.{kernel} {variant}"[:300], event)
            return out
        return launch

    Launcher.__call__ = launcher_call


def poll(watch: Watch, every: float = 1.0) -> None:
    while True:
        time.sleep(every)
        pending = watch.stalled(time.monotonic())
        if pending is not None:
            print(watch.report(pending), file=sys.stderr, flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            os._exit(3)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stall", type=float, default=30.0, help="seconds a kernel may stay not done [30]")
    parser.add_argument("script", type=Path)
    parser.add_argument("args", nargs=argparse.REMAINDER)
    opts = parser.parse_args(argv)
    if not opts.script.is_file():
        parser.error(f"no script {opts.script}")
    if opts.stall <= 0:
        parser.error(f"--stall {opts.stall}: seconds, a number > 0")
    import torch

    if torch.cuda.is_available():
        watch = Watch(opts.stall)
        install(watch)
        threading.Thread(target=poll, args=(watch,), daemon=True, name="kernel_watchdog").start()
    else:
        print("kernel_watchdog: no CUDA device; the script runs unwatched", file=sys.stderr)
    sys.argv = [str(opts.script), *opts.args]
    sys.path.insert(0, str(opts.script.resolve().parent))
    runpy.run_path(str(opts.script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
