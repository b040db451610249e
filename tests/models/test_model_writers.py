"""`ftrs models make-tiny` and `ftrs models upcycle`: where they may write, and one `ftrs: error:`
line (exit 2, the path untouched) where they may not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from cli_checks import one_error_line
from ftrs.cli import main
from ftrs.errors import ConfigError, ModelLoadError
from ftrs.models.tiny import make_tiny
from ftrs.models.upcycle import upcycle


def _listing(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(d.iterdir())}


@pytest.fixture
def dense(tmp_path: Path) -> Path:
    return make_tiny("llama", tmp_path / "dense", seed=0)


def test_make_tiny_refuses_a_regular_file_and_leaves_it(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "notmodel.txt"
    f.write_text("keep me")
    assert main(["models", "make-tiny", "--arch", "llama", "--out", str(f)]) == 2
    one_error_line(capsys, "--out", str(f), "is a file")
    assert f.read_text() == "keep me"


def test_make_tiny_says_which_out_cannot_be_created(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "file"
    f.write_text("")
    out = f / "sub"  # no directory can be made under a regular file
    assert main(["models", "make-tiny", "--arch", "llama", "--out", str(out)]) == 2
    one_error_line(capsys, "--out", str(out), "cannot create")


def test_upcycle_refuses_its_source_and_leaves_it_dense(dense: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    before = _listing(dense)
    alias = dense.parent / "alias"  # the same directory by another name
    alias.symlink_to(dense, target_is_directory=True)
    for dst in (dense, alias):
        assert main(["models", "upcycle", "--experts", "4", "--top-k", "2", str(dense),
                     str(dst)]) == 2
        one_error_line(capsys, "DST", "is SRC itself")
    assert _listing(dense) == before
    assert json.loads((dense / "config.json").read_text())["model_type"] == "llama"


def test_upcycle_refuses_a_directory_holding_another_model(dense: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    other = make_tiny("qwen3", tmp_path / "other", seed=1)
    before = _listing(other)
    assert main(["models", "upcycle", "--experts", "4", "--top-k", "2", str(dense),
                 str(other)]) == 2
    one_error_line(capsys, str(other), "is not empty", "config.json")
    assert _listing(other) == before


def test_upcycle_refuses_a_file_or_an_uncreatable_dst(dense: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "notmodel.txt"
    f.write_text("keep me")
    for dst, why in ((f, "is a file"), (f / "sub", "cannot create")):
        with pytest.raises(ConfigError, match="upcycle: DST"):
            upcycle(dense, dst, 4, 2)
        assert main(["models", "upcycle", "--experts", "4", "--top-k", "2", str(dense),
                     str(dst)]) == 2
        one_error_line(capsys, str(dst), why)
    assert f.read_text() == "keep me"


def test_upcycle_names_a_source_that_is_no_checkpoint(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "notmodel.txt"
    f.write_text("")
    assert main(["models", "upcycle", str(f), str(tmp_path / "out")]) == 3
    one_error_line(capsys, str(f), "not a GGUF")
    assert not (tmp_path / "out").exists()  # nothing made for a source that cannot be read


def test_upcycle_writes_into_a_new_or_empty_directory(dense: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for dst in (tmp_path / "empty", tmp_path / "new" / "moe"):
        upcycle(dense, dst, 4, 2)
        assert not (dst / "model.safetensors").exists()  # only the new shards: no stale dense file
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        shards = set(index["weight_map"].values())
        assert {p.name for p in dst.glob("*.safetensors")} == shards
        with safe_open(str(dst / shards.pop()), "pt") as sf:
            assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in sf.keys()
        assert json.loads((dst / "config.json").read_text())["num_local_experts"] == 4


def test_make_tiny_refuses_a_directory_holding_a_model(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # a sharded checkpoint there would be left beside the new model.safetensors: unloadable
    sharded = tmp_path / "sharded"
    upcycle(make_tiny("llama", tmp_path / "dense", seed=0), sharded, 4, 2)
    dense = tmp_path / "dense"
    for out in (dense, sharded):
        before = _listing(out)
        assert main(["models", "make-tiny", "--arch", "llama", "--out", str(out)]) == 2
        one_error_line(capsys, "--out", str(out), "is not empty (holds ",
                        "give a new or empty directory")
        assert _listing(out) == before
    with pytest.raises(ConfigError, match=r"make-tiny: --out .* is not empty"):
        make_tiny("qwen3", dense, seed=1)
    assert json.loads((dense / "config.json").read_text())["model_type"] == "llama"
    (tmp_path / "empty").mkdir()  # an empty directory is still fine
    assert (make_tiny("llama", tmp_path / "empty") / "model.safetensors").is_file()


def test_a_failing_upcycle_leaves_no_directory_behind(tiny_models: dict[str, Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "new" / "moe"
    assert main(["models", "upcycle", "--experts", "4", "--top-k", "2",
                 str(tiny_models["mixtral"]), str(dst)]) == 3
    one_error_line(capsys, str(tiny_models["mixtral"]), "dense llama model, got 'mixtral'")
    assert not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()  # a directory that was there stays, empty
    with pytest.raises(ModelLoadError, match="dense llama"):
        upcycle(tiny_models["qwen3"], tmp_path / "empty", 4, 2)
    assert _listing(tmp_path / "empty") == {}


def test_upcycle_names_a_config_that_does_not_parse(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "dense"
    src.mkdir()
    (src / "config.json").write_text("{bad")  # was a JSONDecodeError traceback
    assert main(["models", "upcycle", "--experts", "4", "--top-k", "2", str(src),
                 str(tmp_path / "out")]) == 3
    one_error_line(capsys, str(src / "config.json"), "cannot parse")
    assert not (tmp_path / "out").exists()


def test_upcycle_names_a_truncated_safetensors_file(dense: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "cut"
    src.mkdir()
    for f in dense.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4000])  # was a SafetensorError traceback
    assert main(["models", "upcycle", "--experts", "4", "--top-k", "2", str(src),
                 str(tmp_path / "out")]) == 3
    one_error_line(capsys, str(weights), "cannot read")
    assert not (tmp_path / "out").exists()


def _disk_full(*args: object, **kwargs: object) -> None:
    from safetensors import SafetensorError

    raise SafetensorError("Error while serializing: I/O error: No space left on device "
                          "(os error 28)")  # what save_file raises on a full disk


def test_a_full_disk_is_one_line_and_leaves_nothing(dense: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    import ftrs.models.tiny as tiny
    import ftrs.models.upcycle as up

    monkeypatch.setattr(tiny, "save_file", _disk_full)
    monkeypatch.setattr(up, "save_file", _disk_full)
    out = tmp_path / "t1"
    assert main(["models", "make-tiny", "--arch", "llama", "--out", str(out)]) == 2
    one_error_line(capsys, "make-tiny: cannot write into --out", str(out),
                    "No space left on device")
    assert not out.exists()
    dst = tmp_path / "u1"
    assert main(["models", "upcycle", str(dense), str(dst)]) == 2
    one_error_line(capsys, "upcycle: cannot write into DST", str(dst), "No space left on device")
    assert not dst.exists()


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 99999999999999999999999])
def test_a_seed_torch_cannot_take_is_one_line(dense: Path, tmp_path: Path, seed: int,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t"
    assert main(["models", "make-tiny", "--arch", "llama", "--out", str(out),
                 "--seed", str(seed)]) == 2
    one_error_line(capsys, f"make-tiny: --seed {seed} is out of range")
    dst = tmp_path / "u"
    assert main(["models", "upcycle", str(dense), str(dst), "--seed", str(seed)]) == 2
    one_error_line(capsys, f"upcycle: --seed {seed} is out of range")
    assert not out.exists() and not dst.exists()


def test_the_widest_seeds_still_work(tmp_path: Path) -> None:
    for i, seed in enumerate((2**64 - 1, -(2**63))):
        assert make_tiny("llama", tmp_path / str(i), seed=seed).is_dir()
