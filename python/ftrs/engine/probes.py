"""One-off forwards of an `EngineCore` outside serving, for benches and references.

`forward_once` times a prefill chunk alone (nothing kept); `prompt_logits` returns every
position's logits of one prompt run through the scheduler like any request (the reference the
model tests compare with transformers). `EngineCore.forward_once` / `.logits` are the public
seam; the step calls `keep_prompt_logits` while such a prompt runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from ftrs.engine.batch import build_batch
from ftrs.engine.protocol import GenerateRequest
from ftrs.errors import FtrsError, InvalidRequest
from ftrs.sampling import SamplingParams
from ftrs.scheduler.scheduler import Work
from ftrs.scheduler.sequence import Sequence

if TYPE_CHECKING:
    from ftrs.engine.core import EngineCore


@torch.inference_mode()
def forward_once(core: EngineCore, ids: list[int]) -> None:
    """One forward over `ids` as a fresh prompt, into KV pages taken from the pool and given
    back (no logits, no sampling, nothing cached); returns when the device is done. For
    benches that time a prefill chunk alone. Needs a model without linear attention state
    and enough free pages: InvalidRequest otherwise."""
    if not ids:
        raise InvalidRequest("forward_once: need at least one token")
    if core.has_states:
        raise InvalidRequest(f"forward_once: {core.spec.arch} keeps per-sequence state")
    seq = Sequence("forward-once", list(ids), len(ids), SamplingParams(max_tokens=1), None, 0.0)
    seq.pages = core.pool.alloc(-(-len(ids) // core.pool.page_size)) or []
    if not seq.pages:
        raise InvalidRequest(f"forward_once: not enough free KV pages for {len(ids)} tokens")
    try:
        batch = build_batch([Work(seq, len(ids))], core.pool.page_size, core.rt.device,
                            paged=core.rt.decoder.uses_paged_kernel)
        core.rt.decoder.forward(batch.input_ids, batch.positions, batch.meta, core.rt.kv)
        if core.rt.device.type == "cuda":
            torch.cuda.synchronize(core.rt.device)  # kernels run asynchronously
    finally:
        for p in seq.pages:
            core.pool.unref(p)


@torch.inference_mode()
def prompt_logits(core: EngineCore, prompt_ids: Iterable[int], *,
                  chunked: bool = False) -> torch.Tensor:
    """Logits at every position of one prompt: (len, vocab) fp32, on the CPU.

    The prompt runs as a request through the scheduler like any other (KV pages from the
    pool or evicted from the prefix cache, cached when done), but in full: it takes no
    prefix from the cache, since every position's logits need its hidden state. By default
    the step budget is raised to the prompt's length for it, so it runs in one forward (as
    a reference, and for counters of one forward); `chunked=True` keeps the budget, which
    then splits it like any prompt. Steps run until it is done, so the engine must hold no
    other request (their events would be lost): InvalidRequest otherwise, and for a bad
    prompt."""
    ids = list(prompt_ids)
    if not ids:
        raise InvalidRequest("logits: need at least one token", evidence={"param": "prompt"})
    if core._seqs:
        raise InvalidRequest("logits: the engine is serving other requests")
    rid = f"logits-{core._step}"
    core.add_request(GenerateRequest(rid, ids, SamplingParams(max_tokens=1, temperature=0.0,
                                                              ignore_eos=True)))
    core._seqs[rid].prompt_logits = True
    chunks = core._prompt_logits[rid] = {}
    budget = core.scheduler.budget
    if not chunked:
        core.scheduler.budget = max(budget, len(ids))
    try:
        while rid in core._seqs:
            core.step()
    finally:
        core.scheduler.budget = budget
        core._prompt_logits.pop(rid, None)
        core.abort(rid)  # a step that raised leaves it in the scheduler
    out, at = [], 0
    for start in sorted(chunks):
        if start != at:
            break
        out.append(chunks[start])
        at += chunks[start].shape[0]
    if at != len(ids):  # cannot happen while the scheduler computes every position once
        raise FtrsError(f"logits: computed {at} of {len(ids)} positions")
    return torch.cat(out)


def keep_prompt_logits(core: EngineCore, work: list[Work], hidden: torch.Tensor) -> None:
    """Keep the logits of every prompt row of the requests `prompt_logits` runs. `hidden` holds the
    rows of `work` in order (`build_batch`); a chunk recomputed after a preemption
    replaces the one computed before."""
    row = 0
    for seq, n in work:
        chunks = core._prompt_logits.get(seq.request_id)
        if chunks is not None:
            end = min(seq.num_computed + n, seq.num_prompt)
            if end > seq.num_computed:
                rows = hidden[row:row + end - seq.num_computed]  # (tokens, hidden)
                chunks[seq.num_computed] = core.rt.decoder.logits(rows).float().cpu()
        row += n


def step_carried(engine: EngineCore) -> dict[str, Any]:
    """What the current (or last) step carries, without its batch: its requests, the decode
    rows among them and the prompt tokens they still have to compute (the step computes a
    chunk of those, at most the token budget); {} before the step knows its requests."""
    ids = engine.step_request_ids()
    if ids is None:
        return {}
    left = [s.num_uncomputed for s in engine.scheduler.running if s.request_id in set(ids)]
    return {"request_ids": ids, "decode_tokens": left.count(1),
            "prompt_tokens_pending": sum(n for n in left if n > 1),
            "token_budget": engine.scheduler.budget}
