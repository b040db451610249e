"""`ftrs doctor --bundle --server-url` with no server there: the bundle is written (exit 0) and
the terminal says the metrics snapshot failed, not only the bundle's manifest."""

from __future__ import annotations

import json
import logging
import socket
import tarfile
from pathlib import Path

import pytest

from ftrs.cli import main


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_failed_snapshot_is_a_warning_and_the_bundle_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FTRS_HOME", str(tmp_path / "home"))
    bundle = tmp_path / "out.tar.gz"
    url = f"http://127.0.0.1:{closed_port()}"
    with caplog.at_level(logging.WARNING, logger="ftrs"):
        assert main(["doctor", "--no-measure", "--bundle", str(bundle), "--server-url", url]) == 0
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"metrics snapshot from {url} failed" in r.getMessage() for r in warned), warned
    assert f"bundle: {bundle}" in capsys.readouterr().out
    with tarfile.open(bundle) as tar:
        f = tar.extractfile("ftrs-doctor/manifest.json")
        assert f is not None
        manifest = json.loads(f.read())
    assert "metrics.txt" not in manifest["members"]
    assert any("metrics snapshot" in n and "failed" in n for n in manifest["notes"])
