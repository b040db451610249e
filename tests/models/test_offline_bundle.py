"""`scripts/offline-bundle.sh` builds ftrs's extension with the host's Python it is given
(PYTHON), not with whatever `python3` is here, also when maturin is not on PATH. Run with stub
interpreters on PATH that log their arguments: nothing is downloaded or built."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "offline-bundle.sh"


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def test_without_maturin_the_extension_is_built_by_the_given_python(tmp_path: Path) -> None:
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    path = f"{bin_dir}:/usr/bin:/bin"
    if shutil.which("maturin", path=path):
        pytest.skip("maturin on the system PATH: the script takes its branch")
    # python3 here: pip download and pip wheel logged only, the rest (tomllib) run for real
    _stub(bin_dir / "python3", f'echo "python3 $*" >> {log}\n'
          'case "$1 $2 $3" in "-m pip download"|"-m pip wheel") exit 0;; esac\n'
          f'exec {sys.executable} "$@"\n')
    # the host's Python: says it is 3.12 and logs the rest
    _stub(bin_dir / "hostpy", f'echo "hostpy $*" >> {log}\n'
          'case "$1" in -c) echo 3.12;; esac\n')
    env = {**os.environ, "PATH": path}
    r = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out"), "hostpy"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    calls = log.read_text().splitlines()
    assert any(c.startswith("hostpy -m pip wheel") for c in calls), calls
    assert not any(c.startswith("python3 -m pip wheel") for c in calls), calls
    assert any(c.startswith("python3 -m pip download") and "--python-version 3.12" in c
               for c in calls), calls
