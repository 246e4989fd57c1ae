"""tools/kernel_watchdog.py: which launch a stuck device is in (the stall rule, on stand-in events), and the script
it wraps runs with its own arguments (here without CUDA: unwatched)."""

import sys

import pytest

from tools.kernel_watchdog import Watch, main


class Event:
    def __init__(self, done: bool):
        self.done = done

    def query(self) -> bool:
        return self.done


def test_the_oldest_launch_not_done_is_named_once_stalled_long_enough():
    watch = Watch(stall=5)
    events = [Event(True), Event(False), Event(False)]
    for i, e in enumerate(events):
        watch.record(f"op.kernel{i}", e)
    assert watch.stalled(100.0) is None  # first seen pending now
    assert watch.stalled(104.9) is None
    stuck = watch.stalled(105.0)
    assert stuck is not None and stuck[0] == 2 and stuck[1] == "op.kernel1"
    text = watch.report(stuck)
    assert "STUCK   #2 op.kernel1" in text and "done    #1 op.kernel0" in text and "queued  #3 op.kernel2" in text
    events[1].done = True  # progress: the clock starts again for the next launch
    assert watch.stalled(106.0) is None
    assert watch.stalled(110.9) is None
    assert watch.stalled(111.0)[0] == 3
    events[2].done = True
    assert watch.stalled(200.0) is None and not watch.launches


def test_the_script_runs_with_its_arguments(tmp_path, monkeypatch):
    out = tmp_path / "argv.txt"
    script = tmp_path / "script.py"
    script.write_text("import sys\nif __name__ == '__main__':\n"
                      f"    open({str(out)!r}, 'w').write(' '.join(sys.argv[1:]))\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    main(["--stall", "3", str(script), "--batches", "1,8"])
    assert out.read_text() == "--batches 1,8"


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing.py")])
    script = tmp_path / "s.py"
    script.write_text("")
    with pytest.raises(SystemExit):
        main(["--stall", "0", str(script)])
