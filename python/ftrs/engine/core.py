"""EngineCore: load a model, then `step()` — schedule, run the decoder once, sample, report.

The loop is the one of the small, readable engines: `schedule() -> run() -> postprocess()`.
It is used in-process by `ftrs.LLM` and inside the engine process by the server.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent import futures
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ftrs.config import EngineConfig
from ftrs.engine import budget, fetch, probes
from ftrs.engine.batch import build_batch
from ftrs.engine.chunking import PrefillChunker
from ftrs.engine.grammar import GrammarCache, MaskFiller, advance
from ftrs.engine.protocol import GenerateRequest, StepStats, TokenEvent
from ftrs.engine.runtime import Runtime
from ftrs.engine.sampler import sample
from ftrs.engine.spec import NgramDrafter, StepCost, commit_step
from ftrs.errors import ConfigError, ContextLengthExceeded, DeviceError, FtrsError, InvalidRequest
from ftrs.kvcache.pages import PagePool
from ftrs.kvcache.state import StateSlots
from ftrs.layers.moe import Router
from ftrs.models.arch import ArchSpec
from ftrs.models.decoder import layer_router
from ftrs.models.experts import HostExperts
from ftrs.moe.base import MoEStrategy
from ftrs.scheduler.scheduler import Scheduler
from ftrs.scheduler.sequence import Sequence

if TYPE_CHECKING:
    from ftrs.kernels import Kernels

log = logging.getLogger(__name__)


class MoEParts(NamedTuple):
    """What it takes to build another MoE strategy over the loaded model (`EngineCore.moe_parts`)."""

    spec: ArchSpec
    experts: HostExperts
    routers: dict[int, Router]  # MoE layer -> its router (weight and biases: `layers.moe`)
    device: torch.device
    kernels: Kernels | None = None  # the engine's: a GPU strategy built without them runs torch


class EngineCore:
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        if config.torch_threads is not None:  # before the first op sizes torch's thread pool
            torch.set_num_threads(config.torch_threads)
        self.rt = Runtime(config, progress=progress)
        self.spec = self.rt.spec
        self.tokenizer = self.rt.loaded.tokenizer
        self.model_name = config.model
        self.vocab_size = self.spec.vocab_size
        # What one request can use: the model's context, capped by the KV pool.
        self.max_model_len = min(self.rt.max_model_len, self.rt.num_pages * config.page_size)
        self.pool = PagePool(self.rt.num_pages, config.page_size)
        self.has_states = self.spec.has_linear_attention
        if self.has_states:
            log.info("prefix cache off: %s has linear attention layers, whose state at a cached "
                     "prefix is not kept", self.spec.arch)
        self.scheduler = Scheduler(
            self.pool, config.max_prefill_length, config.max_running_requests,
            prefix_cache=config.prefix_cache and not self.has_states,
            states=StateSlots(self.rt.state_slots) if self.has_states else None)
        self._seqs: dict[str, Sequence] = {}
        self._prompt_logits: dict[str, dict[int, torch.Tensor]] = {}  # `probes.prompt_logits`
        self._step = 0
        self._step_ids: list[str] | None = None  # the requests of the step running (or last run)
        self._seed_gen = torch.Generator().manual_seed(config.seed)
        eos = set(self.spec.eos_token_ids)
        if self.tokenizer is not None:
            eos |= self.tokenizer.eos_token_ids
        self.eos_token_ids = frozenset(eos)
        # structured output (engine/grammar.py): compiled grammars, one matcher per request
        self._grammars = GrammarCache(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._matchers: dict[str, Any] = {}
        self._masks: MaskFiller | None = None
        # requests whose grammar is compiling on the compile worker; scheduled once it is done
        self._compiling: dict[str, tuple[Sequence, futures.Future[Any]]] = {}
        self._compiler: futures.ThreadPoolExecutor | None = None
        # n-gram speculative decoding (engine/spec.py); never over linear attention's state.
        # What decode steps cost is the engine's, kept whatever the draft limit
        self._step_cost = StepCost()
        self._chunker = PrefillChunker(config.decode_stall_target)  # prompt tokens beside decodes
        self._drafter = (NgramDrafter(config.speculative_ngram, self.max_model_len, self._step_cost)
                         if config.speculative_ngram and not self.has_states else None)
        if config.speculative_ngram and self.has_states:
            log.info("speculative decoding off: %s has linear attention layers, whose state "
                     "cannot step back over a rejected draft", self.spec.arch)

    # --- requests ---------------------------------------------------------------------------

    def add_request(self, req: GenerateRequest) -> None:
        if req.request_id in self._seqs or req.request_id in self._compiling:
            raise InvalidRequest(f"duplicate request id {req.request_id!r}")
        params = req.params.validate(self.vocab_size)
        prompt = list(req.prompt_token_ids)
        if not prompt:
            raise InvalidRequest("prompt: must contain at least one token",
                                 evidence={"param": "prompt"})
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in prompt):
            raise InvalidRequest(f"prompt: token ids must be in [0, {self.vocab_size})",
                                 evidence={"param": "prompt"})
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {self.max_model_len} tokens; the request "
                f"asks for {len(prompt)} prompt + {params.max_tokens} completion tokens",
                evidence={"prompt_tokens": len(prompt), "max_tokens": params.max_tokens})
        seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._seed_gen))
        seq = Sequence(req.request_id, prompt, len(prompt), params,
                       None if params.greedy else seed, req.arrival_time)
        if params.structured is not None and not self._grammars.cached(params.structured):
            # a new grammar compiles off the loop (ms to a few 100 ms for a large schema): the
            # running requests keep stepping, this one is scheduled when its matcher is ready,
            # or fails alone from a later step if it does not compile
            if self._compiler is None:
                self._compiler = futures.ThreadPoolExecutor(1, thread_name_prefix="ftrs-grammar")
            self._compiling[req.request_id] = (
                seq, self._compiler.submit(self._grammars.new_matcher, params.structured))
            return
        # a cached grammar: a copy of its matcher now
        matcher = (self._grammars.new_matcher(params.structured)
                   if params.structured is not None else None)
        self.scheduler.add(seq)
        self._seqs[req.request_id] = seq
        if matcher is not None:
            self._matchers[req.request_id] = matcher

    def abort(self, request_id: str) -> None:
        self._compiling.pop(request_id, None)  # its compile finishes unused (and cached)
        seq = self._seqs.pop(request_id, None)
        self._matchers.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq, "abort")

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._compiling)

    def num_requests(self) -> int:
        """Requests the engine holds (running, waiting, or waiting for their grammar)."""
        return len(self._seqs) + len(self._compiling)

    def fail_requests(self, request_ids: Iterable[str] | None,
                      error: dict[str, Any]) -> list[TokenEvent]:
        """Finish `request_ids` (None: every request) with `finish_reason="error"` and `error`
        (the wire form `TokenEvent.error` holds), freeing their KV pages; the others keep
        running. Unknown ids are skipped. One event per request failed."""
        ids = list(self._seqs) + list(self._compiling) if request_ids is None else list(request_ids)
        events = []
        for rid in ids:
            compiling = self._compiling.pop(rid, None)
            if compiling is not None:
                events.append(TokenEvent(rid, [], finish_reason="error", error=error,
                                         num_prompt_tokens=compiling[0].num_prompt))
                continue
            seq = self._seqs.pop(rid, None)
            self._matchers.pop(rid, None)
            if seq is not None:
                self.scheduler.finish(seq, "abort")
                events.append(TokenEvent(rid, [], finish_reason="error", error=error,
                                         num_prompt_tokens=seq.num_prompt,
                                         num_cached_tokens=seq.first_cached or 0))
        return events

    # --- the step ---------------------------------------------------------------------------

    def step_request_ids(self) -> list[str] | None:
        """The ids of the requests the current (or last) step carried; None when a step failed
        before it knew them. A step that raises fails exactly these (`server.engine_process`)."""
        return None if self._step_ids is None else list(self._step_ids)

    def step(self) -> tuple[list[TokenEvent], StepStats]:
        t0 = time.perf_counter()
        self._step_ids = None
        admitted = self._admit_compiled() if self._compiling else []
        if self._drafter is not None:
            self._drafter.propose(self.scheduler.running)
        self.scheduler.prefill_with_decodes = self._chunker.limit(self.scheduler.budget)
        work = self.scheduler.schedule()
        self._step_ids = [w.seq.request_id for w in work]
        self._step += 1
        if not work:
            return admitted, self._stats(t0, "idle", 0, 0)
        self.rt.use_device()  # the thread that runs steps may not be the one that loaded
        batch = build_batch(work, self.pool.page_size, self.rt.device, states=self.has_states,
                            paged=self.rt.decoder.uses_paged_kernel)
        h2d_before = (fetch.h2d_bytes(self.expert_stats()) if batch.num_prefill_tokens
                      else None)  # `fetch.note_prefill_fetch`: prefill steps only
        # the grammar masks of this step's constrained rows, computed while the forward runs
        g_rows = [r for r, s in enumerate(batch.sample_seqs) if s.request_id in self._matchers]
        masks = self._start_masks([batch.sample_seqs[r] for r in g_rows]) if g_rows else None
        try:
            graphs = self.rt.graphs  # decode steps that fit a bucket replay its CUDA graph
            if graphs is not None and graphs.bucket_for(work, batch) is not None:
                hidden = graphs.run(work, batch)
            else:
                hidden = self.rt.decoder.forward(batch.input_ids, batch.positions, batch.meta,
                                                 self.rt.kv)
            if self._prompt_logits:
                probes.keep_prompt_logits(self, work, hidden)
            rows = hidden if batch.sample_all else hidden[batch.sample_rows]
            allowed = self._masks.wait(masks) if masks is not None and self._masks else None
            sampled = sample(self.rt.decoder.logits(rows), batch.sample_seqs,  # on the device
                             allowed, g_rows)
        except DeviceError as err:  # say what the failed step carried (crash report, OOM)
            err.evidence.setdefault("failed_step", {
                "step": self._step, "request_ids": [w.seq.request_id for w in work],
                "prefill_tokens": batch.num_prefill_tokens,
                "decode_tokens": batch.num_decode_tokens})
            raise
        finally:
            if masks is not None:  # the matchers are the worker's until it is done
                futures.wait([masks])
        settle = self._drafter.commit if self._drafter is not None else commit_step
        events, drafted, accepted = settle(work, batch.sample_seqs, sampled, self._append)
        kind = ("mixed" if batch.num_prefill_tokens and batch.num_decode_tokens
                else "prefill" if batch.num_prefill_tokens else "decode")
        stats = self._stats(t0, kind, batch.num_prefill_tokens, batch.num_decode_tokens,
                            prefix_hit=batch.prefix_hit_tokens)
        stats.draft_tokens, stats.accepted_tokens = drafted, accepted
        fetch.note_prefill_fetch(stats, h2d_before)
        self._chunker.observe(batch.num_prefill_tokens, batch.num_decode_tokens, stats.duration_s)
        if self._drafter is not None and kind == "decode":
            self._drafter.observe(len(batch.input_ids), stats.duration_s)
        return admitted + events, stats

    def _append(self, seq: Sequence, tok: int | None, rec: object,
                failure: str | None = None) -> TokenEvent:
        if tok is None:  # the sampler found nothing to draw for this row: it fails alone
            p = seq.params
            err = InvalidRequest(f"sampling failed: {failure}", evidence={
                "temperature": p.temperature, "repetition_penalty": p.repetition_penalty})
            wire = {**err.to_dict(), "http_status": err.http_status, "code": err.code}
            failed = self.fail_requests([seq.request_id], wire)
            return failed[0] if failed else TokenEvent(seq.request_id, [], "error", error=wire)
        seq.tokens.append(tok)
        budget.after_token(seq, tok)
        p = seq.params
        reason = None
        matcher = self._matchers.get(seq.request_id)
        grammar = advance(matcher, tok) if matcher is not None else None
        if grammar not in (None, "stop"):  # cannot happen while the mask is applied
            assert p.structured is not None
            err = InvalidRequest(f"structured output failed: {grammar}",
                                 evidence={"param": p.structured.param})
            wire = {**err.to_dict(), "http_status": err.http_status, "code": err.code}
            failed = self.fail_requests([seq.request_id], wire)
            return failed[0] if failed else TokenEvent(seq.request_id, [], "error", error=wire)
        if ((tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids
                or grammar == "stop"):  # the grammar is complete: nothing more may follow
            reason = "stop"
        elif seq.num_output >= p.max_tokens or len(seq.tokens) >= self.max_model_len:
            reason = "length"
        event = TokenEvent(seq.request_id, [tok], reason, [rec] if rec is not None else None,  # type: ignore[list-item]
                           seq.num_prompt, seq.first_cached or 0)
        if reason is not None:
            self._seqs.pop(seq.request_id, None)
            self._matchers.pop(seq.request_id, None)
            self.scheduler.finish(seq, reason)
        return event

    def _admit_compiled(self) -> list[TokenEvent]:
        """Schedule the requests whose grammar has compiled; an error event for each whose
        grammar failed. With nothing else to run, wait a little for the first compile rather
        than spin through idle steps."""
        if not self.scheduler.has_work():
            futures.wait([f for _, f in self._compiling.values()], timeout=0.05,
                         return_when=futures.FIRST_COMPLETED)
        events = []
        for rid, (seq, fut) in list(self._compiling.items()):
            if not fut.done():
                continue
            del self._compiling[rid]
            try:
                matcher = fut.result()
            except Exception as exc:  # it fails its own request, nothing else
                err = exc if isinstance(exc, FtrsError) else InvalidRequest(
                    f"structured output: the grammar did not compile: {exc}")
                wire = {**err.to_dict(), "http_status": err.http_status, "code": err.code}
                events.append(TokenEvent(rid, [], finish_reason="error", error=wire,
                                         num_prompt_tokens=seq.num_prompt))
                continue
            self.scheduler.add(seq)
            self._seqs[rid] = seq
            self._matchers[rid] = matcher
        return events

    def _start_masks(self, seqs: list[Sequence]) -> futures.Future[torch.Tensor]:
        """Start filling the grammar masks of `seqs` on the mask worker (engine/grammar.py)."""
        if self._masks is None:
            self._masks = MaskFiller(self.vocab_size, self.rt.device)
        return self._masks.start([self._matchers[s.request_id] for s in seqs])

    def _stats(self, t0: float, kind: str, prefill: int, decode: int,
               prefix_hit: int = 0) -> StepStats:
        moe = self.rt.decoder.moe
        return StepStats(
            step=self._step, time=time.time(), duration_s=time.perf_counter() - t0, kind=kind,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            prefill_tokens=prefill, decode_tokens=decode,
            kv_usage_ratio=self.scheduler.kv_usage(), prefix_hit_tokens=prefix_hit,
            prefill_with_decodes=self.scheduler.prefill_with_decodes,
            preemptions=self.scheduler.num_preemptions,
            experts=moe.stats() if moe is not None else {})

    def close(self) -> None:
        if self._masks is not None:
            self._masks.close()
        if self._compiler is not None:
            self._compiler.shutdown(wait=True, cancel_futures=True)
        self._compiling.clear()
        self.rt.close()

    # --- what the guard, the drills, the benches and `LLM` use (never `.rt`) ------------------

    @property
    def device(self) -> torch.device:
        """The compute device."""
        return self.rt.device

    @property
    def kernels(self) -> str:
        """Which side runs the ops with a kernel: "triton", "cpu" or "torch" (`ftrs.kernels`)."""
        return self.rt.kernels.name

    def set_step_budget(self, tokens: int) -> None:
        """Tokens one step may compute (prefill chunks and decodes together): the adaptive
        guard's live prefill ceiling. Applies from the next step; call it from the thread that
        runs the steps."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ConfigError(f"step budget: must be an integer >= 1, got {tokens!r}")
        self.scheduler.budget = tokens

    def step_carried(self) -> dict[str, Any]:
        """What the current step carries, for a hang report (`probes.step_carried`)."""
        return probes.step_carried(self)

    def step_budget(self) -> int:
        return self.scheduler.budget

    def transfer_engine(self) -> Any:
        """The offload strategy's Rust `TransferEngine` (copy pacing, fault drills), or None
        when no expert crosses a link (resident strategy, dense model)."""
        return getattr(self.rt.decoder.moe, "engine", None)

    def expert_pool_bytes(self) -> int:
        """Bytes of the host expert pool: every routed expert in the checkpoint's encoding,
        tensor alignment included; 0 for a dense model."""
        experts = self.rt.loaded.experts
        return int(experts.pool.nbytes) if experts is not None else 0

    def kv_cache_bytes(self) -> int:
        """Bytes of the KV cache on the compute device: keys, values and, with
        `--kv-cache-dtype int8`, their scales (MLA's one latent tensor counted once)."""
        return self.rt.kv.nbytes()

    def kv_cache_info(self) -> dict[str, Any]:
        """What `/health` tells of the KV cache: the dtype its rows are stored in, the tokens
        its pages hold, and its bytes."""
        kv = self.rt.kv
        dtype = "int8" if kv.k_scale is not None else str(kv.k.dtype).removeprefix("torch.")
        return {"dtype": dtype, "tokens": self.rt.num_pages * self.config.page_size,
                "bytes": self.kv_cache_bytes()}

    def kv_slots(self) -> int:
        """Token slots of the KV cache (its pages, and the graphs' scratch page if any)."""
        return int(self.rt.kv.k.shape[1])

    def cuda_graphs_off(self) -> str | None:
        """None when decode steps replay CUDA graphs, else why they do not."""
        return self.rt.graphs_off or (None if self.rt.graphs else "capture failed (see the log)")

    def warm_grammar(self) -> None:
        """Build the grammar engine's view of the tokenizer now (1-2 s for a 50k vocabulary,
        holding the GIL) rather than at the first structured request, which would stall steps."""
        self._grammars.warm()

    def grammar_stats(self) -> dict[str, float]:
        """Structured output's mask worker: fills, seconds filling, seconds steps waited for a
        fill after their forward ({} before the first constrained request)."""
        return self._masks.stats() if self._masks is not None else {}

    def set_speculative_ngram(self, max_draft: int,
                              step_cost: Callable[[int], float | None] | None = None) -> None:
        """Draft up to `max_draft` tokens per decode from the next step on (0: off; benches
        compare both over one loaded engine); its counts start again, what steps cost is kept.
        `step_cost`: seconds of a decode step by its rows, instead of the ones measured (tests:
        drafts made free)."""
        EngineConfig(speculative_ngram=max_draft)  # the option's validation
        cost = step_cost if step_cost is not None else self._step_cost
        self._drafter = (NgramDrafter(max_draft, self.max_model_len, cost)
                         if max_draft and not self.has_states else None)

    def speculative_stats(self) -> dict[str, int]:
        """N-gram speculative decoding since the engine started: draft tokens computed and
        accepted ({} when it is off)."""
        d = self._drafter
        return {} if d is None else {"draft_tokens": d.drafted, "accepted_tokens": d.accepted}

    def expert_stats(self) -> dict[str, Any]:
        """The MoE strategy's counters (what `StepStats.experts` carries); {} for dense models."""
        moe = self.rt.decoder.moe
        return moe.stats() if moe is not None else {}

    def progress_at(self) -> float:
        """Monotonic time of the forward pass's last sign of life (a decoder layer computed, or
        queued on a GPU): the hang watchdog counts from it within a step that runs long."""
        return self.rt.decoder.progress_at

    def moe_strategy(self) -> MoEStrategy | None:
        """The strategy the decoder runs routed experts through (None for a dense model)."""
        return self.rt.decoder.moe

    def use_moe_strategy(self, strategy: MoEStrategy) -> MoEStrategy | None:
        """Run routed experts through `strategy` from the next forward on (benches compare
        strategies over one loaded model); returns the previous one, which stays open. Call it
        between steps, from the thread that runs them."""
        if self.rt.decoder.moe is None:
            raise ConfigError(f"{self.spec.arch}: a dense model has no MoE strategy to replace")
        self._step_cost.clear()  # its steps cost what they cost: measured again
        return self.rt.replace_moe(strategy)  # decode graphs are captured again for it

    def moe_parts(self) -> MoEParts:
        """The spec, host experts, routers and device another strategy is built from."""
        experts = self.rt.loaded.experts
        if experts is None:
            raise ConfigError(f"{self.spec.arch}: a dense model has no routed experts")
        dense = self.rt.loaded.dense
        routers = {layer: layer_router(dense, layer) for layer in self.spec.moe_layers}
        return MoEParts(self.spec, experts, routers, self.rt.device, self.rt.kernels)

    def forward_once(self, ids: list[int]) -> None:
        """One forward over `ids` as a fresh prompt, nothing kept: `probes.forward_once`."""
        probes.forward_once(self, ids)

    def logits(self, prompt_ids: Iterable[int], *, chunked: bool = False) -> torch.Tensor:
        """Logits at every position of one prompt, (len, vocab) fp32 on the CPU:
        `probes.prompt_logits`."""
        return probes.prompt_logits(self, prompt_ids, chunked=chunked)
