"""Every bench script that runs on the CPU in seconds runs here, end to end, on a tiny model with
its smallest arguments: a script the engine's API has moved under fails here, not on the day its
figures are wanted (bench/hybrid.py once died on its first strategy; generate.py once could not
import transformers' models because this folder's kernels.py shadowed the `kernels` package).
Figures are not checked, a tiny model's speed says nothing: each script's exit status and the
shape of the JSON it promises are. hybrid.py has its own test (tests/moe/test_bench_hybrid.py).

Not here: what needs the demo (quantized.py, kv_cache.py, gguf_open.py, quant_kernels.py
--demo), a server (serve.py, soak.py, abuse.py; serve.py's transformers side and its options
are imported below), a GPU (gpu_check.py beyond its no-GPU line) or minutes (mla.py:
transformers' DeepSeek-V2 at V2-Lite's widths)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def bench(script: str, *args: object, home: Path, tmpdir: Path | None = None) -> Any:
    """Run bench/`script` as `python bench/SCRIPT ARGS` runs it (its temporary files under
    `tmpdir` when given); its stdout's JSON."""
    # one OpenMP thread: on a shared 2-core host a second one mostly waits for its core
    env = dict(os.environ, FTRS_HOME=str(home), OMP_NUM_THREADS="1")
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    done = subprocess.run([sys.executable, str(BENCH / script), *map(str, args)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def deep_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny mixtral 12 layers deep with an 8192-token context: policies.py's 25 % cache must
    hold one layer's prefill experts (8; 3 layers give 6 slots), and stall.py's streams ask for
    2048 tokens beside the prompt."""
    from ftrs.models.tiny import tiny_config, tiny_tensors, tiny_tokenizer

    cfg = tiny_config("mixtral") | {"num_hidden_layers": 12, "max_position_embeddings": 8192}
    out = tmp_path_factory.mktemp("deep_moe")
    save_file(tiny_tensors(cfg, 1), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg))
    tiny_tokenizer(cfg["vocab_size"]).save(out)
    return out


def test_generate_times_ftrs_beside_transformers(tiny_models: dict[str, Path],
                                                 tmp_path: Path) -> None:
    # batch 2 alone: batch 1 adds the memory bound, two reads of 1 GiB
    out = bench("generate.py", "--model", tiny_models["mixtral"], "--batches", "2",
                "--max-tokens", "3", "--reps", "1", home=tmp_path)
    assert out["device"] == "cpu" and out["moe_strategy"] == "resident"
    assert out["profile_batch1"]["decode_step_ms"] > 0
    [row] = out["rows"]
    assert row["batch"] == 2 and row["new_tokens"] == 3
    assert row["ftrs_decode_tok_per_s"] > 0 and row["transformers_decode_tok_per_s"] > 0
    assert len(row["ftrs_runs"]) == len(row["transformers_runs"]) == 1
    assert re.fullmatch(r"[0-2]/2", row["greedy_equal"]), row


def test_serve_finds_the_kernels_package_transformers_imports_not_the_bench() -> None:
    """serve.py's transformers baseline imports a model class, which imports the `kernels`
    package when installed; started from bench/, `kernels` must not be bench/kernels.py."""
    code = ("import importlib.util, runpy, sys\n"
            f"sys.path.insert(0, {str(BENCH)!r})  # as `python bench/serve.py` starts\n"
            f"ns = runpy.run_path({str(BENCH / 'serve.py')!r}, run_name='bench_serve')\n"
            "assert callable(ns['hf_static_batches'])\n"
            "spec = importlib.util.find_spec('kernels')\n"
            "print(spec.origin if spec else None)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() != str(BENCH / "kernels.py")


def test_serve_options_given_win_over_quick_and_url_needs_the_model() -> None:
    code = ("import json, runpy, sys\n"
            f"sys.path.insert(0, {str(BENCH)!r})\n"
            f"parse = runpy.run_path({str(BENCH / 'serve.py')!r}, run_name='bench_serve')"
            "['parse_args']\n"
            "given, _ = parse(['--quick', '--concurrency', '2', '--num-requests', '3',\n"
            "                  '--prompt-len', '8,9', '--max-tokens', '3,4'])\n"
            "quick, _ = parse(['--quick'])\n"
            "full, _ = parse([])\n"
            "url, _ = parse(['--url', 'http://127.0.0.1:1', '--no-hf'])\n"
            "rows = [[a.concurrency, a.num_requests, a.prompt_len, a.max_tokens, a.model]\n"
            "        for a in (given, quick, full, url)]\n"
            "print(json.dumps(rows))\n"
            "parse(['--url', 'http://127.0.0.1:1'])  # transformers would load the demo\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 2, done.stderr[-3000:]  # argparse's error
    assert "--model" in done.stderr.splitlines()[-1], done.stderr[-3000:]
    given, quick, full, url = json.loads(done.stdout)
    assert given == ["2", 3, "8,9", "3,4", "demo"]
    assert quick == ["1,4", 8, "16,128", "16,32", "demo"]
    assert full == ["1,8,32", None, "16,1024", "16,256", "demo"]
    assert url[-1] == "demo"  # --no-hf: nothing loads it


def test_hybrid_host_step_times_each_variant(tmp_path: Path) -> None:
    out = bench("hybrid_host_step.py", "--layers", "2", "--steps", "8", "--rounds", "1",
                home=tmp_path)
    assert out["layers"] == 2
    for name in ("cpu", "split", "split_by_expert", "split_no_fill"):
        v = out[name]
        assert v["us_per_layer"] > 0 and len(v["quartiles_us"]) == 3, name
        device, fetched, cpu = v["device_fetched_cpu"]
        # 8 steps (5 warm-up, 3 timed) x 2 layers x top-2: each routed expert computed once
        assert device + cpu == 8 * 2 * 2 and fetched <= device, (name, v)
        assert len(v["fills_issued_used"]) == 2, name
    assert out["cpu"]["device_fetched_cpu"][0] == 0  # the "cpu" mode: every expert on the CPU


def test_kernels_times_every_reference_and_the_decode_step(tmp_path: Path) -> None:
    out = bench("kernels.py", "--reps", "2", "--ctx", "64", home=tmp_path)
    names = {row["kernel"] for row in out["rows"]}
    assert {"rms_norm+residual", "rotary", "fused_moe", "paged_attention_decode",
            "decode_step"} <= names, names
    steps = [row for row in out["rows"] if row["kernel"] == "decode_step"]
    assert [row["batch"] for row in steps] == [1, 8, 32]
    assert all(row["eager_ms"] > 0 for row in steps)


def test_monitor_probes_under_load_without_false_alarms(tiny_models: dict[str, Path],
                                                        tmp_path: Path) -> None:
    out = bench("monitor.py", "--model", tiny_models["mixtral"], "--device", "cpu",
                "--minutes", "0.03", "--clients", "2", "--max-tokens", "8", home=tmp_path,
                tmpdir=tmp_path)
    assert not list(tmp_path.glob("ftrs-bench-sysfs-*"))  # the fake tree is removed when done
    assert out["false_alarms"] == 0 and out["device_up_throughout"] is True
    assert out["steps"] > 0
    assert set(out["monitors"]) == {"real", "fake"}
    fake = out["monitors"]["fake"]
    assert fake["fast_samples"] > 0 and fake["faults"] == []  # its probe really read the tree


def test_offload_reports_decode_prefill_and_chunk_bytes(tiny_models: dict[str, Path],
                                                        tmp_path: Path) -> None:
    out = bench("offload.py", "--model", tiny_models["mixtral"], "--links", "0.5",
                "--max-tokens", "4", "--chunk", "16", "--decode-reps", "1", "--prefill-reps",
                "1", "--route-tokens", "32", home=tmp_path)
    assert out["links_gbps"] == [0.5] and out["experts_total"] == 3 * 8
    assert [(r["link_gbps"], r["prefetch"]) for r in out["decode"]] == [(0.5, True),
                                                                        (0.5, False)]
    for row in out["decode"]:
        assert row["decode_tokens"] == 3 and row["tok_per_s"] > 0, row  # the first: prefill's
        assert row["bound_tok_per_s"] > 0 and len(row["achieved_vs_bound_each"]) == 1, row
    assert [(r["prefetch"], r["chunk_tokens"]) for r in out["prefill"]] == [(True, 16),
                                                                            (False, 16)]
    assert all(r["bytes_moved"] > 0 for r in out["prefill"])
    chunks = out["chunk_bytes"]
    assert chunks["routed_tokens"] == 32
    assert [r["chunk_tokens"] for r in chunks["rows"]] == [1, 2, 4, 8, 16, 32]


def test_policies_replays_the_trace_and_serves_each_policy(deep_moe: Path,
                                                           tmp_path: Path) -> None:
    out = bench("policies.py", "--model", deep_moe, "--prompts", "2", "--max-tokens", "4",
                home=tmp_path)
    work = out["workload"]
    assert out["experts_total"] == 12 * 8 and work["prompts"] == 2
    # every prompt prefilled in full, in the recording and in each replay: no run is served
    # from pages an earlier one left in the prefix cache (each chat fills 2+ pages of 16)
    assert work["prompt_tokens"] >= 2 * 2 * 16, work
    assert work["tokens"] == work["prompt_tokens"] + 2 * 3, work
    for trace in ("all", "decode"):
        rows = out["hit_rate"][trace]
        assert [rows[r]["slots"] for r in ("25%", "50%", "75%")] == [24, 48, 72]
        for row in rows.values():
            for policy in ("lru", "lfru", "lrfu"):
                assert 0 <= row[policy] <= row["belady"], row  # MIN is the bound
    for policy in ("lru", "lfru", "lrfu"):
        run = out["engine"][policy]
        assert run["slots"] == 48
        assert run["decode"]["tokens"] == 2 * 3, run  # the first token comes from the prefill
        assert run["all"]["tokens"] == work["tokens"], (policy, run)


def test_quant_kernels_times_each_type_at_n_1_and_8(tmp_path: Path) -> None:
    out = bench("quant_kernels.py", "--rows", "256", "--cols", "512", "--working-set", "1",
                "--repeats", "1", "--types", "Q8_0,Q4_K", home=tmp_path)
    assert out["memcpy_gbps"] > 0 and out["numpy_fp32_n1"]["ms"] > 0
    for qtype, bytes_per_weight in (("Q8_0", 34 / 32), ("Q4_K", 144 / 256)):
        assert out[qtype]["bytes_per_weight"] == pytest.approx(bytes_per_weight, abs=1e-4)
        for n in ("n1", "n8"):
            assert {"ms", "gbps", "gflops", "vs_fp32_numpy", "of_memcpy"} <= set(out[qtype][n])


def test_speculative_drafts_give_the_tokens_plain_decoding_gives(
        tiny_models: dict[str, Path], tmp_path: Path) -> None:
    out = bench("speculative.py", "--model", tiny_models["mixtral"], "--ks", "4", "--tokens",
                "8", "--prompts", "1", "--rounds", "1", home=tmp_path)
    assert out["ks"] == [0, 4]
    for setting in ("resident", "offload"):
        for workload in ("repeat", "chat"):
            row = out["results"][setting][workload]
            assert row["k0"]["tok_per_s"] > 0
            assert row["k4"]["same_tokens"] is True, (setting, workload, row)
            assert row["k4"]["tokens_per_step"] >= 1 and "vs_off" in row["k4"]


def test_stall_bounds_each_target(deep_moe: Path, tmp_path: Path) -> None:
    out = bench("stall.py", "--model", deep_moe, "--targets", "0,0.01", "--budget", "64",
                "--prompt", "256", "--streams", "2", "--rounds", "1", home=tmp_path)
    assert out["prompt_tokens"] == 256 and set(out["targets"]) == {"0.0", "0.01"}
    for row in out["targets"].values():
        assert row["chunks"] >= 256 // 64, row  # the budget cuts the prompt
        assert row["stream_tokens"] > 0 and row["prompt_ttft_s"] > 0, row
        assert {"gap_max_s", "gap_p90_s", "prefill_tok_per_s", "ttft_vs_unbounded"} <= set(row)


def test_structured_times_masks_and_constrained_decode(tiny_models: dict[str, Path],
                                                       tmp_path: Path) -> None:
    # --quick's 12 tokens and 1 round lose to the options given
    out = bench("structured.py", "--model", tiny_models["mixtral"], "--quick", "--max-tokens",
                "6", "--reps", "2", "--batches", "2", home=tmp_path)
    assert out["max_tokens"] == 6 and out["reps"] == 2
    ll = out["engines"][0]
    assert ll["engine"] == "llguidance" and ll["tokens"] > 0
    assert {"mask", "consume", "batch8_fill_unpack", "batch8_apply"} <= set(ll)
    [row] = out["decode"]
    assert row["batch"] == 2
    assert row["unconstrained_tok_per_s"] > 0 and row["json_schema_tok_per_s"] > 0
    assert row["mask_fill_ms"] >= 0 and len(row["runs"]["json_schema"]) == 2
    assert row["runs"]["first"] == ["unconstrained", "json_schema"]  # each round the other
