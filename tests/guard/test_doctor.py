"""`ftrs doctor` without a GPU, and the bundle's freedom from secrets."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from ftrs.doctor import build_report, format_text
from ftrs.errors import DeviceLost
from ftrs.guard.bundle import redact, write_bundle
from ftrs.health.crash import write_crash_report
from ftrs.models.tiny import make_tiny

from .conftest import GPU


def test_doctor_without_gpu_says_so_and_reports_cpu_figures(empty_sysfs: Path,
                                                            tmp_path: Path) -> None:
    model = make_tiny("qwen3_moe", tmp_path / "m", seed=0)
    r = build_report(str(model), sysfs_root=empty_sysfs, home=tmp_path / "home")
    text = format_text(r)
    assert r["device"]["gpu"] is False and "no GPU found" in text
    assert r["link"]["speed_under_load"] is None  # no link was read: not "true"
    per_token = r["model"]["decode_bytes_per_token"]
    assert all(isinstance(b, int) for b in per_token.values()), per_token  # bytes, no noise
    assert r["bandwidth"]["h2d_backend"] == "host" and r["bandwidth"]["h2d_gbps"] > 0
    assert r["bandwidth"]["host_copy_gbps"] > 0
    assert r["memory"]["ram_total_bytes"] > 0
    fetch = r["model"]["fetch"]  # qwen3_moe tiny: 2 MoE layers, 8 experts of 3 x 48 x 64 fp32
    assert fetch["num_moe_layers"] == 2 and fetch["expert_bytes"] == 3 * 48 * 64 * 4
    assert r["model"]["recommendation"]["strategy"] == "resident"
    assert "prefill ceiling: 8192" in text
    # the KV cache per token: keys and values of every layer, fp32 on the CPU, or int8 values
    # and a 4-byte scale per kv head
    cfg = json.loads((model / "config.json").read_text())
    layers, kvh = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv = r["model"]["kv_cache"]
    assert kv["compute_dtype"] == "float32"
    assert kv["bytes_per_token"] == {"auto": 2 * layers * kvh * d * 4,
                                     "int8": 2 * layers * kvh * (d + 4)}
    assert kv["context_bytes"]["int8"] == kv["bytes_per_token"]["int8"] * cfg[
        "max_position_embeddings"]
    assert "with --kv-cache-dtype int8" in text
    ck = r["cpu_kernels"]  # each SIMD family timed on every type and batch
    simd = [f for f in ck["families"] if f != "portable"] or ["portable"]
    for per_batch in ck["timings_us"].values():
        assert set(per_batch) == {"n1", "n8"}
        assert all(set(row) == set(simd) and min(row.values()) > 0 for row in per_batch.values())
    assert ck["recommendation"]["setting"] in ("auto", *simd)
    assert f"recommended: --cpu-kernels {ck['recommendation']['setting']}" in text
    json.dumps(r, default=str)


def test_doctor_lists_drills_apart_from_losses(empty_sysfs: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    write_crash_report(home, DeviceLost("device_lost (injected at step 4)", evidence={
        "bdf": GPU, "injected": True, "fault_inject": "device_lost@step=4"}))
    write_crash_report(home, DeviceLost("GPU fell off the bus", evidence={"bdf": GPU}))
    r = build_report(None, sysfs_root=empty_sysfs, home=home, measure=False)
    assert [c["message"] for c in r["crash_reports"]] == ["GPU fell off the bus"]
    assert [c["message"] for c in r["drill_reports"]] == ["device_lost (injected at step 4)"]
    text = format_text(r)
    losses, _, drills = text.partition("fault drills: 1")
    assert "crash reports: 1" in losses and "injected" not in losses
    assert "DeviceLost drill: device_lost (injected at step 4)" in drills


SECRET_KEY = "sk-test-DoNotLeak0123456789"
ENV_SECRET = "env-secret-value-0xC0FFEE"


def test_bundle_has_no_secrets(empty_sysfs: Path, tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", ENV_SECRET)
    monkeypatch.setenv("FTRS_API_KEY", ENV_SECRET)
    home = tmp_path / "home"
    write_crash_report(home, DeviceLost("lost", evidence={
        "bdf": GPU, "cmdline": f"ftrs serve --api-key {SECRET_KEY}",
        "headers": {"authorization": f"Bearer {SECRET_KEY}"}}),
        flight_recorder=[{"step": 7, "chunk_tokens": 8192}])
    report = build_report(None, sysfs_root=empty_sysfs, home=home, measure=False)
    out = write_bundle(tmp_path / "b.tar.gz", report, format_text(report), home=home,
                       server_url="http://user:pw0rd@127.0.0.1:9/")
    with tarfile.open(out) as tar:
        names = tar.getnames()
        blobs = {n: tar.extractfile(n).read().decode() for n in names  # type: ignore[union-attr]
                 if tar.getmember(n).isfile()}
    assert any(n.startswith("ftrs-doctor/crash/") for n in names)
    assert any(n.startswith("ftrs-doctor/flight_recorder/") for n in names)
    assert "ftrs-doctor/report.json" in names and "ftrs-doctor/manifest.json" in names
    manifest = json.loads(blobs["ftrs-doctor/manifest.json"])
    assert any("metrics snapshot" in n for n in manifest["notes"])  # server gone: noted
    for name, text in blobs.items():
        for secret in (SECRET_KEY, ENV_SECRET, "pw0rd", "OPENAI_API_KEY", "FTRS_API_KEY"):
            assert secret not in text, (name, secret)


def test_redact_patterns() -> None:
    assert redact('{"api_key": "abc123xyz"}') == '{"api_key": "<redacted>"}'
    assert "hunter2" not in redact("--password hunter2 --port 1")
    assert redact("Authorization: Bearer abc.def") == "Authorization: <redacted>"
    assert redact("plain text 8192 tokens") == "plain text 8192 tokens"


def test_kv_figures_of_a_gguf_from_its_header(smollm_gguf: Path) -> None:
    """SmolLM2-135M: 30 layers, 3 kv heads of 64 channels, 8,192 positions; bf16 on a GPU."""
    from ftrs.doctor import kv_section

    kv = kv_section(str(smollm_gguf), "cuda")
    assert kv["compute_dtype"] == "bfloat16" and kv["context_tokens"] == 8192
    assert kv["bytes_per_token"] == {"auto": 2 * 30 * 3 * 64 * 2, "int8": 2 * 30 * 3 * (64 + 4)}


def test_no_measure_says_so_instead_of_none(empty_sysfs: Path, tmp_path: Path) -> None:
    r = build_report(None, sysfs_root=empty_sysfs, home=tmp_path / "home", measure=False)
    text = format_text(r)
    assert "bandwidth: not measured (--no-measure)" in text.splitlines()
    assert "None" not in text


def test_a_model_path_that_is_no_checkpoint_is_named_so(empty_sysfs: Path, tmp_path: Path) -> None:
    from ftrs.errors import ModelLoadError

    f = tmp_path / "notmodel.txt"
    f.write_text("not a model")
    with pytest.raises(ModelLoadError, match="neither a checkpoint directory nor a GGUF file"):
        build_report(str(f), sysfs_root=empty_sysfs, home=tmp_path / "home", measure=False)


def _cli_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    from ftrs.cli import main

    assert main(["doctor", "--no-measure", *argv]) == 2
    out = capsys.readouterr()
    err = out.err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("ftrs: error: doctor: "), err
    assert out.out == ""  # no report: a bundle that cannot be written is written first
    return err


def test_bundle_and_server_url_mistakes_are_one_line_before_the_report(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTRS_HOME", str(tmp_path / "home"))
    f = tmp_path / "file"
    f.write_text("")
    err = _cli_error(capsys, "--bundle", str(tmp_path))
    assert f"--bundle {tmp_path} is a directory" in err and str(tmp_path / "ftrs-doctor.tar.gz") in err
    assert f"{f} is a file" in _cli_error(capsys, "--bundle", str(f / "b.tar.gz"))
    assert "add --bundle PATH" in _cli_error(capsys, "--server-url", "http://127.0.0.1:9")
    assert not (tmp_path / "home").exists()  # refused before any report was made


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs procfs")
def test_an_unwritable_bundle_path_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTRS_HOME", str(tmp_path / "home"))
    err = _cli_error(capsys, "--bundle", "/proc/b.tar.gz")  # a directory no one writes in
    assert "cannot write --bundle /proc/b.tar.gz" in err


def test_a_bundle_in_a_missing_directory_is_refused_and_nothing_is_created(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTRS_HOME", str(tmp_path / "home"))
    missing = tmp_path / "no_such_dir" / "deeper"
    err = _cli_error(capsys, "--bundle", str(missing / "b.tar.gz"))
    assert f"the directory {missing} does not exist" in err and "create it first" in err
    assert not (tmp_path / "no_such_dir").exists() and not (tmp_path / "home").exists()


@pytest.mark.parametrize("as_json", [True, False])
def test_the_bundle_path_is_said_once_and_json_stays_json(
        as_json: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from ftrs.cli import main

    monkeypatch.setenv("FTRS_HOME", str(tmp_path / "home"))
    bundle = tmp_path / "x.tar.gz"
    with caplog.at_level("DEBUG", logger="ftrs"):
        assert main(["doctor", "--no-measure", *(["--json"] if as_json else []),
                     "--bundle", str(bundle)]) == 0
    out = capsys.readouterr()
    assert bundle.is_file()
    if as_json:
        report = json.loads(out.out)  # stdout is the JSON alone
        assert report["bundle"] == str(bundle) and "crash_reports" in report
    else:
        assert out.out.rstrip().endswith(f"bundle: {bundle}")
    said = out.out + out.err + "".join(r.getMessage() for r in caplog.records
                                       if r.levelno >= 20)  # what a terminal shows
    assert said.count(str(bundle)) == 1, said


def test_json_without_a_bundle_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from ftrs.cli import main

    monkeypatch.setenv("FTRS_HOME", str(tmp_path / "home"))
    assert main(["doctor", "--no-measure", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bundle"] is None
