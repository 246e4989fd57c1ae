"""tools/no_dependent_launch.py: the script it runs sees the NVIDIA targets without dependent launch (other targets
as they were), with its own arguments, and builds in this process."""

import os
import subprocess
import sys
from pathlib import Path

from tools.no_dependent_launch import serial

ROOT = Path(__file__).resolve().parents[1]


def test_builds_are_made_serial_however_jobs_is_passed():
    calls = []

    def build_all(target_name, items, make_request, cache_dir, jobs=1, on_result=None):
        calls.append((target_name, items, jobs, on_result))
        return "done"

    build = serial(build_all)
    assert build("sm90", [1], "r", "/c", 8, print) == "done"
    assert build("sm90", [2], "r", "/c", jobs=16) == "done"
    assert build("sm90", [3], "r", "/c") == "done"
    assert calls == [("sm90", [1], 1, print), ("sm90", [2], 1, None), ("sm90", [3], 1, None)]


def test_the_script_sees_the_targets_without_dependent_launch(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        "import sys\n"
        "import backends, backends.cpu, codegen.driver\n"
        "if __name__ == '__main__':\n"
        "    print(backends.get('sm90').traits.dependent_launch, backends.get('sm100').traits.dependent_launch,\n"
        "          backends.get('c') is backends.cpu.C, hasattr(codegen.driver.build_all, '__wrapped__'),\n"
        "          ' '.join(sys.argv[1:]))\n")
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "no_dependent_launch.py"), str(script), "--x", "1"],
                         capture_output=True, text=True, cwd=tmp_path, check=True)
    assert out.stdout.split() == ["False", "False", "True", "True", "--x", "1"]
    unpatched = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT, check=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert unpatched.stdout.split()[:4] == ["True", "True", "True", "False"]


def test_a_missing_script_is_refused(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "no_dependent_launch.py"), str(tmp_path / "no.py")],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "no script" in out.stderr
