"""Stands in for the suite's serial tests: one core busy in the main process for BUSY seconds."""
import os
import time


def test_busy():
    end = time.time() + float(os.environ.get("BUSY", "300"))
    n = 0
    while time.time() < end:
        n += sum(i * i for i in range(1000))
    assert n
