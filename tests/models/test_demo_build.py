"""Building the demo checkpoint (`models/demo.py`) from a tiny llama GGUF in place of SmolLM2:
concurrent builders, what crashed builds leave, a full disk, gguf's log lines."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import gguf
import pytest
from safetensors import SafetensorError

import ftrs.models.gguf_write as gguf_write
import ftrs.models.upcycle as upcycle_mod
from cli_checks import one_error_line
from ftrs.cli import main
from ftrs.errors import ConfigError
from ftrs.models import demo
from ftrs.models.gguf_loader import open_gguf
from ftrs.models.gguf_write import keep_f32, write_gguf
from ftrs.models.tiny import tiny_config, tiny_tensors, tiny_tokenizer


@pytest.fixture
def models_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`$FTRS_HOME/models` in tmp_path, the demo built from a tiny dense llama GGUF."""
    cfg = tiny_config("llama")
    src = tmp_path / "tiny-llama.gguf"
    write_gguf(src, cfg, tiny_tensors(cfg, 0), keep_f32,
               tokenizer=tiny_tokenizer(cfg["vocab_size"]), dequantized=False)
    monkeypatch.setenv("FTRS_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(demo, "demo_gguf", lambda: src)
    return tmp_path / "home" / "models"


def _whole_listing(out: Path) -> set[str]:
    """The files of a finished demo directory; fails on a shard its index names but lacks."""
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert (out / ".complete").is_file() and (out / "config.json").is_file()
    for name in shards:
        assert (out / name).is_file(), name
    return {p.name for p in out.iterdir()}


def _together(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> None:
    """`owner.name` waits until two threads call it: both builders are past their start."""
    real: Callable[..., Any] = getattr(owner, name)
    barrier = threading.Barrier(2, timeout=60)

    def both(*args: Any, **kwargs: Any) -> Any:
        barrier.wait()
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, both)


def _twice(build: Callable[[], Path]) -> list[Path]:
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda _: build(), range(2)))


def _temporaries(models: Path) -> list[str]:
    return sorted(p.name for p in models.iterdir() if ".building" in p.name
                  or p.name.endswith(".part"))


def test_two_builders_at_once_leave_one_whole_demo(models_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _together(monkeypatch, demo, "upcycle")  # both write their shards at the same time
    a, b = _twice(demo.ensure_demo)
    assert a == b == models_dir / demo.DEMO_NAME
    files = _whole_listing(a)
    assert _temporaries(models_dir) == []
    monkeypatch.setattr(demo, "upcycle", lambda *a, **k: pytest.fail("built again"))
    assert _whole_listing(demo.ensure_demo()) == files  # trusted as it is


def test_two_quant_builders_at_once_leave_one_whole_file(models_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # both files are open, their headers written, before either writes its tensors
    _together(monkeypatch, gguf.GGUFWriter, "write_tensors_to_file")
    a, b = _twice(lambda: demo.ensure_demo_quant("q8_0"))
    assert a == b == models_dir / f"{demo.DEMO_NAME}.Q8_0.gguf"
    assert _temporaries(models_dir) == []
    ck = open_gguf(a)  # whole: every tensor's bytes where the header says
    assert ck.config["num_local_experts"] == demo.EXPERTS


def test_what_a_crashed_build_left_is_removed(models_dir: Path) -> None:
    out = models_dir / demo.DEMO_NAME
    for name in (f"{demo.DEMO_NAME}.building-0badc0de", f"{demo.DEMO_NAME}.building"):
        (models_dir / name).mkdir(parents=True)
        (models_dir / name / "model-00001-of-00003.safetensors").write_bytes(b"half")
    (models_dir / f"{demo.DEMO_NAME}.Q8_0.gguf.part").write_bytes(b"half")
    out.mkdir()  # what an earlier version's race left: marked, a shard missing
    (out / ".complete").write_text("")
    (out / "config.json").write_text("{}")
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "model-00001-of-00001.safetensors"}}))
    assert demo.ensure_demo() == out
    assert "model-00001-of-00001.safetensors" in _whole_listing(out)
    assert _temporaries(models_dir) == [f"{demo.DEMO_NAME}.Q8_0.gguf.part"]  # another target's
    demo.ensure_demo_quant("q8_0")
    assert _temporaries(models_dir) == []


def test_a_running_build_keeps_its_directory(models_dir: Path) -> None:
    models_dir.mkdir(parents=True)
    live = models_dir / f"{demo.DEMO_NAME}.building-live0000"
    live.mkdir()
    with open(models_dir / f"{demo.DEMO_NAME}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)  # as another process's build holds it
        out = demo.ensure_demo()
    _whole_listing(out)
    assert _temporaries(models_dir) == [live.name]



def _disk_full_safetensors(*args: Any, **kwargs: Any) -> None:
    raise SafetensorError("Error while serializing: I/O error: No space left on device "
                          "(os error 28)")


def test_a_full_disk_building_the_demo_is_one_line(models_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(upcycle_mod, "save_file", _disk_full_safetensors)
    assert main(["models", "demo"]) == 2
    one_error_line(capsys, "No space left on device")
    assert sorted(p.name for p in models_dir.iterdir()) == [f"{demo.DEMO_NAME}.lock"]


def test_a_full_disk_building_the_quant_demo_is_one_line(models_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    def disk_full(path: Path, *args: Any, **kwargs: Any) -> None:
        Path(path).write_bytes(b"GGUF" + bytes(100))  # what fitted
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gguf_write, "write_gguf", disk_full)
    assert main(["models", "demo", "--quant", "q8_0"]) == 2
    one_error_line(capsys, "No space left on device", str(models_dir))
    assert sorted(p.name for p in models_dir.iterdir()) == [f"{demo.DEMO_NAME}.Q8_0.gguf.lock"]


def test_ftrs_home_that_is_a_file_is_one_line(tmp_path: Path, models_dir: Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "home-file"
    home.write_text("")
    monkeypatch.setenv("FTRS_HOME", str(home))
    assert main(["models", "demo", "--quant", "q8_0"]) == 2
    one_error_line(capsys, str(home / "models"), "cannot create")
    with pytest.raises(ConfigError, match="cannot create"):
        demo.ensure_demo()


def test_the_quant_demo_leaves_out_gguf_writer_chatter(models_dir: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        demo.ensure_demo_quant("q8_0")
    assert [r.getMessage() for r in caplog.records if r.name.startswith("gguf")] == []
    assert any(r.name == demo.__name__ for r in caplog.records)  # its own line stays
