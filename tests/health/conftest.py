from __future__ import annotations

from pathlib import Path

import pytest

from .fakes import FakeNvml, FakeSysfs, build_sysfs


@pytest.fixture
def sysfs(tmp_path: Path) -> FakeSysfs:
    return build_sysfs(tmp_path / "sys")


@pytest.fixture
def fake_nvml() -> FakeNvml:
    return FakeNvml()
