"""The `ftrs` command: serve | generate | models | doctor | bench.

Every failure the user can cause ends in one clear line on stderr and the error's exit code,
not a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from ftrs.config import add_engine_arguments, engine_config_from_args
from ftrs.errors import ConfigError, FtrsError, InvalidRequest

log = logging.getLogger("ftrs")


def _cmd_generate(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from ftrs.llm import LLM
    from ftrs.sampling import SamplingParams

    config = engine_config_from_args(args)
    try:  # a bad flag is a usage error (exit 2), found before minutes of loading
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                seed=args.seed_sampling).validate()
        if args.raw and not args.prompt:
            raise InvalidRequest("prompt: empty (with --raw nothing is added to it)")
    except InvalidRequest as err:
        raise ConfigError(err.message, evidence=err.evidence) from None
    llm = LLM(progress=True, **asdict(config))
    prompt = args.prompt
    if not args.raw and llm.engine.tokenizer is not None and llm.tokenizer.chat_template:
        prompt = llm.chat_prompt([{"role": "user", "content": args.prompt}])
    params.validate(llm.engine.vocab_size)
    t0 = time.perf_counter()
    (out,) = llm.generate([prompt], params)
    elapsed = time.perf_counter() - t0
    print(out.text.strip())
    n = len(out.token_ids)
    print(f"[{n} tokens in {elapsed:.2f} s: {n / elapsed:.1f} tokens/s, finish: {out.finish_reason}]",
          file=sys.stderr)
    llm.close()
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    if args.models_cmd == "make-tiny":
        from ftrs.models.tiny import make_tiny

        print(make_tiny(args.arch, Path(args.out), seed=args.seed))
    elif args.models_cmd == "upcycle":
        from ftrs.models.upcycle import upcycle

        print(upcycle(Path(args.src), Path(args.dst), args.experts, args.top_k, seed=args.seed))
    elif args.models_cmd == "demo":
        from ftrs.models.demo import ensure_demo, ensure_demo_quant

        print(ensure_demo_quant(args.quant) if args.quant else ensure_demo())
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from ftrs.server.cli import run_serve

    return run_serve(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ftrs", description="Serve MoE models bigger than the GPU.")
    from ftrs import __version__

    p.add_argument("--version", action="version", version=f"ftrs {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="cmd", required=True)

    from ftrs.server.cli import add_serve_arguments

    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_serve_arguments(serve)
    serve.set_defaults(func=_cmd_serve)

    gen = sub.add_parser("generate", help="complete one prompt and print the answer")
    gen.add_argument("prompt", help="the prompt, in the chat template unless --raw")
    gen.add_argument("--model", default="demo",
                     help="model directory, GGUF file, or 'demo' (default: demo)")
    gen.add_argument("--max-tokens", type=int, default=64,
                     help="tokens to generate at most (default: 64)")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="sampling temperature; 0: greedy (default: 0.0)")
    gen.add_argument("--seed-sampling", type=int, default=None,
                     help="sampling seed; unset: drawn from --seed")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_engine_arguments(gen)
    gen.set_defaults(func=_cmd_generate)

    models = sub.add_parser("models", help="make, upcycle or build checkpoints")
    msub = models.add_subparsers(dest="models_cmd", required=True)
    tiny = msub.add_parser("make-tiny", help="a small random checkpoint for tests")
    tiny.add_argument("--arch", required=True, choices=["llama", "qwen3", "mixtral", "qwen3_moe"])
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--seed", type=int, default=0)
    up = msub.add_parser("upcycle", help="dense llama -> MoE with identical experts")
    up.add_argument("src")
    up.add_argument("dst")
    up.add_argument("--experts", type=int, default=8)
    up.add_argument("--top-k", type=int, default=2)
    up.add_argument("--seed", type=int, default=0)
    demo = msub.add_parser("demo", help="build the demo checkpoint (once) and print its path")
    demo.add_argument("--quant", choices=["q4_k_m", "q8_0"], default=None,
                      help="build the demo as a quantized GGUF file instead")
    models.set_defaults(func=_cmd_models)

    from ftrs import doctor
    from ftrs.guard import bench_strategy

    doc = sub.add_parser("doctor", help="report this host, link and model; recommend settings")
    doctor.add_arguments(doc)
    doc.set_defaults(func=doctor.run_cli)
    bench = sub.add_parser("bench", help="benchmarks that pick settings for this host")
    bsub = bench.add_subparsers(dest="bench_cmd", required=True)
    strat = bsub.add_parser("strategy", help="measure strategies and cache sizes, pick the "
                            "fastest, write a profile")
    bench_strategy.add_arguments(strat)
    strat.set_defaults(func=bench_strategy.run_cli)
    return p


def main(argv: list[str] | None = None) -> int:
    try:  # an option's type may raise a typed error too (`ftrs serve --port`)
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                            format="%(message)s", stream=sys.stderr)
        return int(args.func(args))
    except FtrsError as e:
        print(f"ftrs: error: {e.message}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
