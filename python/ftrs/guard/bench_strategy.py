"""`ftrs bench strategy`: measure a short real workload under each strategy and cache size, pick
the measured fastest, and store it as a profile for `--moe-strategy auto`.

The workload, per candidate (resident; offload and hybrid at each cache rate), on a freshly
loaded engine: one warm-up request (8 prompt tokens, 2 decoded), then one request of
`prompt_tokens` random prompt tokens (one prefill chunk) and `decode_tokens` greedy tokens
(EOS ignored). Prefill time is arrival to first token, decode time the rest. The score is the
total: the candidate with the smallest measured total is the pick. `--rounds N` runs the
candidates N times, each round starting one candidate later, and keeps each one's median run. Nothing is estimated from bandwidth ratios: a host whose
link or cache behaves unlike the model of it is measured as it is.

Profiles live in `$FTRS_HOME/profiles/<hash of key>.json`; the key is (device, host, model,
link), so a profile measured on another host, GPU, checkpoint or link never applies.

Input is checked once, before any candidate runs (`check_inputs`): the token counts (prompt
>= 1, decode >= 2: the first token is the prefill's, so decode is timed from the second; and
together within the model's context), the cache rates (in (0, 1]), every candidate's engine
options (`EngineConfig`: strategy, dtype), the device, the copy backend (built once through
the core's own parser, into the device as offload builds it), and the checkpoint (its config
or GGUF header read; a truncated GGUF is refused here). Each refusal is a typed `ftrs.errors`
error, one line from the CLI. A dense model is refused too: with no routed experts resident,
offload and hybrid run the same dense layers, so there is no expert strategy to pick (and
`--moe-strategy auto` has nothing to choose for it).

A candidate that fails at run time is one of two things:
- bad input (`INPUT_ERRORS`: ConfigError, InvalidRequest, ModelLoadError; something the
  checks above missed): the bench stops at once with that error and writes no profile, since
  the other candidates' rows were measured under the same wrong input;
- a limit of this host (out of memory, a KV pool too small for the prompt, a device fault, a
  bug): a row with `error` set to the exception's class and message. The pick is the fastest
  of the candidates that ran, and the profile says so: its `failed` maps each failed label to
  why, a note names them, and the table shows them. Resident running out of device memory is
  the usual case: the model does not fit, and that is worth knowing rather than hiding.
When every candidate fails, there is nothing to pick: an `FtrsError` naming each failure, no
profile.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import platform
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ftrs.config import option_help
from ftrs.errors import ConfigError, FtrsError, InvalidRequest, ModelLoadError
from ftrs.guard.link import cuda_index
from ftrs.guard.profile import profile_key, profile_path, write_profile

logger = logging.getLogger(__name__)

DEFAULT_CACHE_RATES = (0.25, 0.5, 1.0)
#: Strategies measured at each cache rate.
CACHED_STRATEGIES = ("offload", "hybrid")
#: Prompt and decoded tokens of the warm-up request each candidate runs first.
WARMUP_TOKENS = (8, 2)
#: Errors that say the input is wrong, not that a candidate cannot run on this host: the first
#: one stops the bench, and no profile is written (module doc).
INPUT_ERRORS: tuple[type[FtrsError], ...] = (ConfigError, InvalidRequest, ModelLoadError)
#: The prefill makes the first token, so decode is timed from the second: one decode token
#: would time no decode and leave the pick to the prefill alone.
MIN_DECODE_TOKENS = 2
DECODE_WHY = (" (the prefill makes the first token, so 1 would time no decode and the pick "
              "would rest on the prefill alone)")


@dataclass(frozen=True)
class Candidate:
    strategy: str
    cache_rate: float | None = None

    @property
    def label(self) -> str:
        return self.strategy if self.cache_rate is None else f"{self.strategy}@{self.cache_rate:g}"


@dataclass(frozen=True)
class BenchRow:
    label: str
    strategy: str
    cache_rate: float | None
    prefill_s: float
    decode_s: float
    total_s: float
    bytes_h2d: int = 0
    error: str | None = None


@dataclass
class StrategyBench:
    rows: list[BenchRow]
    pick: BenchRow
    key: dict[str, str]
    workload: dict[str, Any]
    profile_path: Path | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def failed(self) -> dict[str, str]:
        """Label -> why, for each candidate that could not run."""
        return {r.label: r.error for r in self.rows if r.error is not None}

    def to_dict(self) -> dict[str, Any]:
        def row(r: BenchRow) -> dict[str, Any]:  # a failed row's inf times: null (JSON has no inf)
            return {k: None if isinstance(v, float) and math.isinf(v) else v
                    for k, v in asdict(r).items()}

        path = {} if self.profile_path is None else {"profile_path": str(self.profile_path)}
        return {"key": self.key, "workload": self.workload, "rows": [row(r) for r in self.rows],
                "pick": asdict(self.pick), "failed": self.failed, "notes": self.notes} | path

    def format_table(self) -> str:
        lines = [f"{'candidate':<16}{'prefill s':>11}{'decode s':>10}{'total s':>10}{'H2D MB':>10}"]
        for r in self.rows:
            mark = "  <- pick" if r is self.pick else ""
            if r.error:
                lines.append(f"{r.label:<16}  failed: {r.error}")
                continue
            lines.append(f"{r.label:<16}{r.prefill_s:>11.3f}{r.decode_s:>10.3f}{r.total_s:>10.3f}"
                         f"{r.bytes_h2d / 1e6:>10.1f}{mark}")
        return "\n".join(lines)


Runner = Callable[[Candidate], BenchRow]
#: Said with every table measured on a CPU device.
CPU_DEVICE_NOTE = ("the device is the CPU: hybrid computes every expert in place from the host "
                   "pool, as resident does, and offload adds a copy into host memory; resident "
                   "and hybrid differ here by the host's noise and hybrid's counters only")


def candidates(cache_rates: Sequence[float] = DEFAULT_CACHE_RATES, resident: bool = True,
               strategies: Sequence[str] = CACHED_STRATEGIES) -> list[Candidate]:
    out = [Candidate("resident")] if resident else []
    return out + [Candidate(s, float(r)) for r in cache_rates for s in strategies]


def candidate_options(c: Candidate, *, prompt_tokens: int, copy_backend: str, device: str,
                      dtype: str) -> dict[str, Any]:
    """The engine options (`EngineConfig` fields) one candidate runs with."""
    opts: dict[str, Any] = {"moe_strategy": c.strategy, "device": device, "dtype": dtype,
                            "max_prefill_length": max(prompt_tokens, WARMUP_TOKENS[0])}
    if c.strategy in CACHED_STRATEGIES:
        opts |= {"moe_cache_rate": c.cache_rate, "copy_backend": copy_backend}
    return opts


def check_copy_backend(spec: str, device: str) -> None:
    """Refuse a copy backend that offload would refuse, before any candidate runs: resolved as
    offload resolves it (`backend_spec`), then parsed and built by the core itself, with a
    one-slot `TransferEngine` into the device (`ConfigError` on a bad spec)."""
    import torch

    from ftrs import _core
    from ftrs.config import EngineConfig
    from ftrs.engine.runtime import resolve_device
    from ftrs.moe.offload import backend_spec

    dev = resolve_device(device)
    try:
        backend = backend_spec(EngineConfig(device=device, copy_backend=spec), dev)
        pool = _core.ExpertPool(_core.ExpertLayout(1, 1, [256]), "float32")
        dst = torch.zeros(pool.layout.expert_bytes, dtype=torch.uint8, device=dev)
        _core.TransferEngine(pool, 1, dst, backend=backend).close()
    except ConfigError as e:
        raise ConfigError(f"bench strategy: --copy-backend {spec}: {e.message}",
                          evidence=e.evidence) from e


def check_inputs(model: str, cands: Sequence[Candidate], *, prompt_tokens: int,
                 decode_tokens: int, copy_backend: str, device: str, dtype: str,
                 engine: bool = True) -> None:
    """Every check of the module doc, cheapest first. `engine=False` (a custom runner, which
    runs its own way) keeps the flag checks and skips the device, copy backend and model."""
    from ftrs.config import EngineConfig
    from ftrs.engine.runtime import resolve_device

    if not cands:
        raise ConfigError("bench strategy: nothing to measure (no resident candidate and no "
                          "cache rate)")
    for flag, n, least in (("--prompt-tokens", prompt_tokens, 1),
                           ("--decode-tokens", decode_tokens, MIN_DECODE_TOKENS)):
        if isinstance(n, bool) or not isinstance(n, int) or n < least:
            raise ConfigError(f"bench strategy: {flag} must be an integer >= {least}, got {n!r}"
                              + (DECODE_WHY if least > 1 else ""))
    for c in cands:
        if c.cache_rate is None:
            continue
        if c.strategy not in CACHED_STRATEGIES:
            raise ConfigError(f"bench strategy: unknown strategy {c.strategy!r} (expected "
                              f"{' or '.join(CACHED_STRATEGIES)})")
        if not 0.0 < c.cache_rate <= 1.0:
            raise ConfigError(f"bench strategy: --cache-rates must each be in (0, 1] (the "
                              f"fraction of experts kept on the device), got {c.cache_rate:g}")
    for c in cands:
        EngineConfig.from_kwargs(model=model, **candidate_options(
            c, prompt_tokens=prompt_tokens, copy_backend=copy_backend, device=device,
            dtype=dtype))
    if not engine:
        return
    resolve_device(device)
    if any(c.cache_rate is not None for c in cands):
        check_copy_backend(copy_backend, device)
    from ftrs.guard.startup import model_spec

    spec = model_spec(model)
    if not spec.is_moe:
        raise ConfigError(f"bench strategy: {model} is a dense model ({spec.arch}, no routed "
                          "experts): resident, offload and hybrid run it alike, so there is no "
                          "expert strategy to measure or pick")
    longest = max(prompt_tokens + decode_tokens, sum(WARMUP_TOKENS))
    if longest > spec.max_position_embeddings:
        raise ConfigError(f"bench strategy: --prompt-tokens {prompt_tokens} + --decode-tokens "
                          f"{decode_tokens} exceed the model's context of "
                          f"{spec.max_position_embeddings} tokens")


def engine_runner(model: str, *, prompt_tokens: int, decode_tokens: int, copy_backend: str,
                  device: str, dtype: str, seed: int = 0) -> Runner:
    """The real workload of the module doc, one fresh engine per candidate."""
    import torch

    from ftrs.engine.protocol import GenerateRequest
    from ftrs.llm import LLM
    from ftrs.sampling import SamplingParams

    def run(c: Candidate) -> BenchRow:
        llm = LLM(model, **candidate_options(c, prompt_tokens=prompt_tokens,
                                             copy_backend=copy_backend, device=device,
                                             dtype=dtype))
        try:
            eng = llm.engine
            gen = torch.Generator().manual_seed(seed)
            warm_prompt, warm_decode = WARMUP_TOKENS
            warm = torch.randint(0, eng.vocab_size, (warm_prompt,), generator=gen).tolist()
            prompt = torch.randint(0, eng.vocab_size, (prompt_tokens,), generator=gen).tolist()
            _drive(eng, GenerateRequest("warm", warm, SamplingParams(
                max_tokens=warm_decode, temperature=0.0, ignore_eos=True)))
            before = _h2d(eng)
            first, total = _drive(eng, GenerateRequest("bench", prompt, SamplingParams(
                max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)))
            return BenchRow(c.label, c.strategy, c.cache_rate, first, total - first, total,
                            _h2d(eng) - before)
        finally:
            llm.close()

    return run


def _h2d(eng: Any) -> int:
    return int(eng.expert_stats().get("bytes_h2d", 0))


def _drive(eng: Any, req: Any) -> tuple[float, float]:
    """Run one request to completion; (seconds to first token, seconds in all)."""
    t0 = time.perf_counter()
    first: float | None = None
    eng.add_request(req)
    while True:
        events, _ = eng.step()
        for ev in events:
            if ev.request_id != req.request_id:
                continue
            if first is None and ev.new_token_ids:
                first = time.perf_counter() - t0
            if ev.finish_reason is not None:
                total = time.perf_counter() - t0
                return (first if first is not None else total), total


def device_name(device: str) -> str:
    try:
        import torch

        if device != "cpu" and torch.cuda.is_available():
            return str(torch.cuda.get_device_name(cuda_index(device)))
    except Exception:  # no driver: describe the CPU
        logger.debug("no CUDA device name", exc_info=True)
    return f"cpu:{platform.machine()}:{platform.processor() or 'unknown'}"


#: Bytes of a single-file checkpoint (GGUF) hashed for its id: the header, metadata and tensor
#: table lie at the start; the whole file may be tens of GB.
MODEL_ID_HEAD_BYTES = 8 << 20


def model_id(model: str) -> str:
    """The checkpoint's name plus a hash of its config.json, or of a single file's first
    `MODEL_ID_HEAD_BYTES` and its size (so a rebuilt model matches)."""
    from ftrs.errors import ModelLoadError
    from ftrs.models.load import resolve_model

    try:
        path = resolve_model(model)
    except ModelLoadError:
        return model
    h = hashlib.sha256()
    if path.is_dir():
        cfg = path / "config.json"
        h.update(cfg.read_bytes() if cfg.is_file() else b"")
    elif path.is_file():
        with path.open("rb") as f:
            h.update(f.read(MODEL_ID_HEAD_BYTES))
        h.update(str(path.stat().st_size).encode())
    return f"{path.name}:{h.hexdigest()[:12]}"


def link_id(copy_backend: str, link_desc: str | None = None) -> str:
    """The link part of a profile key: the simulated spec, else the probed PCIe link, else
    "host" (the CPU device, no link)."""
    if copy_backend.startswith("simulated"):
        return copy_backend
    if link_desc:
        return link_desc
    from ftrs.guard.link import probe_link

    link = probe_link(use_nvml=False)
    return "host" if link.device == "cpu" else f"pcie:Gen{link.gen_max} x{link.width_current}"


def run_strategy_bench(
    model: str, *, prompt_tokens: int = 256, decode_tokens: int = 16,
    cache_rates: Sequence[float] = DEFAULT_CACHE_RATES, copy_backend: str = "auto",
    device: str = "auto", dtype: str = "auto", resident: bool = True,
    home: Path | None = None, write: bool = True, link_desc: str | None = None,
    runner: Runner | None = None, strategies: Sequence[str] = CACHED_STRATEGIES,
    rounds: int = 1,
) -> StrategyBench:
    """Check the input, measure every candidate, pick the fastest measured total, write the
    profile (module doc: what is refused, what a failed candidate does). A custom `runner`
    runs candidates its own way: the flags are checked then, not the device, copy backend or
    checkpoint. `rounds` > 1 measures every candidate that many times, each round starting
    one candidate later (none always runs first, on the coldest host), and keeps each one's
    median run by total; a candidate that fails once is a failed row."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ConfigError(f"bench strategy: --rounds must be an integer >= 1, got {rounds!r}")
    cands = candidates(cache_rates, resident, strategies)
    check_inputs(model, cands, prompt_tokens=prompt_tokens, decode_tokens=decode_tokens,
                 copy_backend=copy_backend, device=device, dtype=dtype,
                 engine=runner is None)
    run = runner or engine_runner(model, prompt_tokens=prompt_tokens,
                                  decode_tokens=decode_tokens, copy_backend=copy_backend,
                                  device=device, dtype=dtype)
    runs: dict[str, list[BenchRow]] = {c.label: [] for c in cands}
    for r in range(rounds):
        for c in cands[r % len(cands):] + cands[:r % len(cands)]:
            if any(row.error is not None for row in runs[c.label]):
                continue  # failed in an earlier round: its row says why
            logger.info("bench strategy: %s%s", c.label,
                        f" (round {r + 1} of {rounds})" if rounds > 1 else "")
            runs[c.label].append(_measure(run, c))
    rows = [_median_run(runs[c.label]) for c in cands]
    ok = [r for r in rows if r.error is None]
    failed = [r for r in rows if r.error is not None]
    if not ok:
        raise FtrsError("bench strategy: every candidate failed, no profile written: "
                        + _failures(failed),
                        evidence={"failed": {r.label: r.error for r in failed}})
    pick = min(ok, key=lambda r: r.total_s)
    key = profile_key(device=device_name(device), host=socket.gethostname(),
                      model=model_id(model),
                      link=link_id(copy_backend, link_desc))
    workload = {"prompt_tokens": prompt_tokens, "decode_tokens": decode_tokens, "rounds": rounds,
                "copy_backend": copy_backend, "device": device, "dtype": dtype,
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    bench = StrategyBench(rows, pick, key, workload)
    if failed:
        bench.notes.append(f"failed: {_failures(failed)}; the pick is the fastest of the "
                           f"{len(ok)} candidate(s) that ran")
    if key["device"].startswith("cpu:") and any(r.strategy == "hybrid" for r in ok):
        bench.notes.append(CPU_DEVICE_NOTE)
    if write:
        bench.profile_path = profile_path(key, home)  # the file says where it is
        write_profile(bench.to_dict(), key, home)
        logger.info("bench strategy: picked %s (%.3f s); profile %s", pick.label, pick.total_s,
                    bench.profile_path)
    return bench


def _measure(run: Runner, c: Candidate) -> BenchRow:
    """One run of `c`; a failure that is not bad input becomes a row saying why."""
    try:
        return run(c)
    except INPUT_ERRORS:
        logger.warning("bench strategy: %s refused its input; no profile written", c.label)
        raise
    except Exception as e:  # a candidate that cannot run here is a row, not the end
        why = " ".join(f"{type(e).__name__}: {e}".split())  # one line, for the table
        logger.warning("bench strategy: %s failed: %s", c.label, why)
        return BenchRow(c.label, c.strategy, c.cache_rate, float("inf"), float("inf"),
                        float("inf"), error=why)


def _median_run(rows: Sequence[BenchRow]) -> BenchRow:
    """The failed run if one failed, else the run of median total (the lower of two)."""
    failed = [r for r in rows if r.error is not None]
    if failed:
        return failed[0]
    return sorted(rows, key=lambda r: r.total_s)[(len(rows) - 1) // 2]


def _failures(rows: Sequence[BenchRow]) -> str:
    """`a, b: why; c: why`: failed rows grouped by their error, in table order."""
    by_error: dict[str, list[str]] = {}
    for r in rows:
        by_error.setdefault(str(r.error), []).append(r.label)
    return "; ".join(f"{', '.join(labels)}: {why}" for why, labels in by_error.items())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="demo",
                        help="model directory, GGUF file, or 'demo' (default: demo)")
    parser.add_argument("--prompt-tokens", type=int, default=256,
                        help="prompt tokens of the measured request, one prefill (default: 256)")
    parser.add_argument("--decode-tokens", type=int, default=16,
                        help=f"tokens generated per candidate, >= {MIN_DECODE_TOKENS}: the first "
                             "comes from the prefill, the decode time is the rest (default: 16)")
    parser.add_argument("--cache-rates", type=float, nargs="+", default=list(DEFAULT_CACHE_RATES),
                        metavar="RATE", help="fractions of all experts cached, each in (0, 1], "
                        "measured for each of --strategies (default: "
                        f"{' '.join(f'{r:g}' for r in DEFAULT_CACHE_RATES)})")
    parser.add_argument("--copy-backend", default="auto",
                        help=option_help("copy_backend"))
    parser.add_argument("--device", default="auto", help=option_help("device"))
    parser.add_argument("--dtype", default="auto", help=option_help("dtype"))
    parser.add_argument("--strategies", nargs="+", default=list(CACHED_STRATEGIES),
                        choices=list(CACHED_STRATEGIES), help="measured at each cache rate")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every candidate this many times, each round starting one "
                             "candidate later, and keep each one's median run (default: 1)")
    parser.add_argument("--no-resident", action="store_true", help="skip the resident candidate")
    parser.add_argument("--no-write", action="store_true", help="do not write a profile")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run_cli(args: argparse.Namespace) -> int:
    """`ftrs bench strategy`: run, then print the table (or JSON) to stdout."""
    bench = run_strategy_bench(
        args.model, prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens,
        cache_rates=args.cache_rates, copy_backend=args.copy_backend, device=args.device,
        dtype=args.dtype, resident=not args.no_resident, write=not args.no_write,
        strategies=args.strategies, rounds=args.rounds)
    text = json.dumps(bench.to_dict(), indent=2) if args.json else (
        bench.format_table() + f"\npick: {bench.pick.label}"
        + "".join(f"\nnote: {n}" for n in bench.notes)
        + (f"\nprofile: {bench.profile_path}" if bench.profile_path else ""))
    print(text)  # the CLI's output
    return 0
