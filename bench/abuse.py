"""Abuse run: hostile inputs against `ftrs serve` (its own on loopback, or `--url`); 0 5xx, 0 engine deaths.

Starts one server (`--model`, default demo; API key from `--api-key`, else `$FTRS_API_KEY`, else
a fixed one, passed through `$FTRS_API_KEY` so that path is exercised too), or with `--url`
uses a running one, which it neither starts nor stops (key from `--api-key`, else
`$FTRS_API_KEY`, else none; the served model is the first id of `GET /v1/models` unless `--model`
names it). Then:

1. a hand-written set of bad inputs (`abuse_cases.py`: out-of-range and mistyped sampling
   fields, lone surrogates everywhere, unsupported fields, malformed and oversized bodies, deep
   nesting, auth probes, odd paths; for `/v1/messages` also malformed content blocks, tool
   histories that do not add up and `x-api-key`) and a few valid controls, each with the
   statuses it may get; against a server without a key the auth probes expect 200, not 401, and
   the output says so (`auth_probes`);
2. schemathesis on `/openapi.json`: positive and negative cases per operation, `model` fixed to
   the served one and `max_tokens` clamped so generation stays short (skipped, and said so,
   when schemathesis is not installed: the `bench` extra).

After every request `/health` is read: an engine death shows as a non-ok status or a new engine
pid. Bounded in time (`--budget-s`) and count (`--examples` per operation and mode). Prints JSON:
per-status counts, 5xx (must be 0), engine deaths (must be 0), cases whose status was not an
expected one, and schemathesis conformance findings (informative).

    python bench/abuse.py                 # starts a demo server, ~3 minutes
    python bench/abuse.py --examples 10   # quicker
    python bench/abuse.py --url http://127.0.0.1:8000 --api-key K   # a server already running
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from abuse_cases import MAX_GEN_TOKENS, Case, auth_headers, bad_inputs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import serverproc  # noqa: E402  (the tests' loopback server harness)

SELF_STARTED_KEY = "abuse-key"  # the key of a server this script starts, when none is given


@dataclass
class Tally:
    statuses: Counter[int] = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    transport_errors: list[str] = field(default_factory=list)
    engine_deaths: int = 0
    requests: int = 0
    slowest: list[tuple[float, str]] = field(default_factory=list)

    def timed(self, name: str, seconds: float) -> None:
        self.slowest = sorted([*self.slowest, (seconds, name)], reverse=True)[:5]


def _send(client: httpx.Client, case: Case, key: str | None) -> httpx.Response:
    headers = auth_headers(key) if case.headers is None else case.headers
    if isinstance(case.body, bytes):
        return client.request(case.method, case.path, content=case.body, headers=headers)
    if case.body is None:
        return client.request(case.method, case.path, headers=headers)
    data = json.dumps(case.body).encode()  # ASCII escapes: a lone surrogate travels as \\udc80
    return client.request(case.method, case.path, content=data,
                          headers={**headers, "content-type": "application/json"})


class Watch:
    """Reads /health after each request; a non-ok status or a new engine pid is a death."""

    def __init__(self, client: httpx.Client) -> None:
        self.client = client
        self.pid = self._health().get("engine_pid")

    def _health(self) -> dict[str, Any]:
        return dict(self.client.get("/health").json())

    def deaths(self) -> int:
        body = self._health()
        if body.get("status") != "ok" or body.get("engine_pid") != self.pid:
            self.pid = body.get("engine_pid")
            deadline = time.monotonic() + 120  # wait for a restart, if the server does one
            while body.get("status") != "ok" and time.monotonic() < deadline:
                time.sleep(0.5)
                body = self._health()
            self.pid = body.get("engine_pid")
            return 1
        return 0


def run_cases(client: httpx.Client, cases: list[Case], key: str | None, watch: Watch, tally: Tally,
              deadline: float) -> None:
    for case in cases:
        if time.monotonic() > deadline:
            break
        tally.requests += 1
        t0 = time.monotonic()
        try:
            r = _send(client, case, key)
        except httpx.HTTPError as exc:
            tally.transport_errors.append(f"{case.name}: {type(exc).__name__}")
            continue
        finally:
            tally.timed(case.name, time.monotonic() - t0)
        tally.statuses[r.status_code] += 1
        if r.status_code >= 500:
            tally.server_errors.append(f"{case.name}: {r.status_code} {r.text[:200]}")
        if r.status_code not in case.expect:
            tally.unexpected.append(f"{case.name}: got {r.status_code}, expected {case.expect}: {r.text[:160]}")
        tally.engine_deaths += watch.deaths()


def run_schemathesis(base: str, model: str, key: str | None, examples: int, watch: Watch,
                     tally: Tally, deadline: float) -> dict[str, Any]:
    try:
        import hypothesis
        import hypothesis.errors
        import schemathesis
        from hypothesis import HealthCheck, Phase, settings
        from schemathesis.core.result import Ok
    except ImportError as exc:
        return {"skipped": f"{exc.name or exc} not installed (schemathesis and hypothesis come "
                           "with the bench extra: pip install -e '.[bench]')"}

    auth = auth_headers(key)
    doc = httpx.get(base + "/openapi.json", headers=auth, timeout=10).json()
    schema = schemathesis.openapi.from_dict(doc)
    findings: Counter[str] = Counter()
    per_op: dict[str, int] = {}

    def fix(case: Any) -> None:
        if isinstance(case.body, dict):
            if "model" in case.body:
                case.body["model"] = model
            for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
                v = case.body.get(key)
                if isinstance(v, int) and not isinstance(v, bool) and MAX_GEN_TOKENS < v < 100_000:
                    case.body[key] = MAX_GEN_TOKENS
            if "max_tokens" not in case.body and "messages" in case.body:
                case.body["max_tokens"] = MAX_GEN_TOKENS
            if "max_output_tokens" not in case.body and "input" in case.body:  # /v1/responses
                case.body["max_output_tokens"] = MAX_GEN_TOKENS
        if case.path_parameters and "model_id" in case.path_parameters and hash(str(case.path_parameters)) % 2:
            case.path_parameters["model_id"] = model

    def make_probe(op: Any, mode: Any, label: str) -> Any:
        @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), derandomize=True)
        @hypothesis.given(op.as_strategy(generation_mode=mode))
        def probe(case: Any) -> None:
            if time.monotonic() > deadline:
                return
            fix(case)
            tally.requests += 1
            per_op[label] += 1
            t0 = time.monotonic()
            try:
                response = case.call(base_url=base, headers=auth, timeout=60)
            except Exception as exc:  # transport failures are reported, not raised
                tally.transport_errors.append(f"{label}: {type(exc).__name__}: {str(exc)[:120]}")
                return
            finally:
                tally.timed(label, time.monotonic() - t0)
            tally.statuses[response.status_code] += 1
            if response.status_code >= 500:
                tally.server_errors.append(f"{label}: {response.status_code} {response.text[:200]} "
                                           f"body={str(case.body)[:200]}")
            try:
                case.validate_response(response)
            except BaseException as exc:  # conformance findings (a group): informative, not the gate
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                for sub in getattr(exc, "exceptions", [exc]):
                    findings[f"{label}: {getattr(sub, 'title', None) or str(sub).splitlines()[0][:100]}"] += 1
            tally.engine_deaths += watch.deaths()

        return probe

    for result in schema.get_all_operations():
        if not isinstance(result, Ok):
            findings[f"schema error: {result}"[:120]] += 1
            continue
        op = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            label = f"{op.label} {mode.value}"
            per_op[label] = 0
            try:
                make_probe(op, mode, label)()
            except hypothesis.errors.Unsatisfiable:  # no negative case exists (no inputs at all)
                pass
    return {"cases_per_operation": per_op, "conformance_findings": dict(findings.most_common(12))}


def served_model(client: httpx.Client, key: str | None) -> str:
    """The model a server lists first in `GET /v1/models`."""
    r = client.get("/v1/models", headers=auth_headers(key))
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


def healthy(client: httpx.Client) -> bool:
    try:
        return bool(client.get("/health").json().get("status") == "ok")
    except (httpx.HTTPError, ValueError):
        return False


def attack(client: httpx.Client, model: str, key: str | None, examples: int,
           budget_s: float) -> tuple[Tally, dict[str, Any]]:
    """Both phases against the server behind `client`; the tally and the per-phase summaries."""
    tally = Tally()
    watch = Watch(client)
    # the refusals first: they are quick, generations are slow on a busy CPU
    cases = sorted(bad_inputs(model, key), key=lambda c: 200 in c.expect)
    run_cases(client, cases, key, watch, tally, time.monotonic() + budget_s)
    hand: dict[str, Any] = {"cases": len(cases), "sent": tally.requests,
                            "statuses": dict(sorted(tally.statuses.items()))}
    if key is None:
        probes = sum(c.auth_probe for c in cases)
        hand["auth_probes"] = (f"no API key given: the {probes} auth-probe cases expect 200, not "
                               "401 (a server without a key admits everyone)")
    fuzz = run_schemathesis(str(client.base_url).rstrip("/"), model, key, examples, watch, tally,
                            time.monotonic() + budget_s)
    return tally, {"hand_written": hand, "schemathesis": fuzz}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server to attack (none is started or stopped)")
    p.add_argument("--api-key", metavar="KEY", help="its API key (default: $FTRS_API_KEY; with --url and neither, "
                                     f"none is sent; without --url, {SELF_STARTED_KEY!r})")
    p.add_argument("--model", help="without --url: what to serve (default: demo); with --url: the "
                                    "name to request (default: the first id of GET /v1/models)")
    p.add_argument("--examples", type=int, default=40, help="schemathesis cases per operation and mode")
    p.add_argument("--budget-s", type=float, default=120.0,
                   help="seconds each phase (hand-written, schemathesis) may send for")
    p.add_argument("--server-args", default="--device cpu",
                   help="extra `ftrs serve` options (without --url)")
    args = p.parse_args(argv)

    key: str | None = args.api_key if args.api_key is not None else os.environ.get("FTRS_API_KEY")
    key = key or None  # an empty key is no key
    start = time.monotonic()
    if args.url:
        with httpx.Client(base_url=args.url.rstrip("/"), timeout=60) as client:
            model = args.model or served_model(client, key)
            tally, phases = attack(client, model, key, args.examples, args.budget_s)
            alive = healthy(client)  # not ours to poll: /health alone says
        served = args.url
    else:
        key = key or SELF_STARTED_KEY
        os.environ["FTRS_API_KEY"] = key  # the server reads the key from the environment
        log = Path(tempfile.gettempdir()) / f"ftrs-abuse-{os.getpid()}.log"
        server = serverproc.ServerProcess(["--model", args.model or "demo", *args.server_args.split()],
                                          log=log)
        try:
            server.wait("ok", timeout=300)
            with httpx.Client(base_url=server.url, timeout=60) as client:
                model = served_model(client, key)
                tally, phases = attack(client, model, key, args.examples, args.budget_s)
                alive = server.proc.poll() is None and healthy(client)
        finally:
            server.stop()
        served = f"self-started at {server.url} (log {log})"
    out = {
        "server": served,
        "model": model,
        "api_key": key is not None,
        "requests": tally.requests,
        "status_counts": {str(k): v for k, v in sorted(tally.statuses.items())},
        "server_errors_5xx": len(tally.server_errors),
        "engine_deaths": tally.engine_deaths,
        "server_alive_at_end": alive,
        "hand_written": phases["hand_written"],
        "unexpected_status": tally.unexpected[:30],
        "unexpected_status_count": len(tally.unexpected),
        "transport_errors": tally.transport_errors[:10],
        "server_error_samples": tally.server_errors[:10],
        "schemathesis": phases["schemathesis"],
        "slowest_s": [[round(t, 2), name] for t, name in tally.slowest],
        "wall_s": round(time.monotonic() - start, 1),
    }
    print(json.dumps(out, indent=2))
    return 0 if not tally.server_errors and not tally.engine_deaths and alive else 1


if __name__ == "__main__":
    sys.exit(main())
