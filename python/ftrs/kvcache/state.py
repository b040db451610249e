"""State of the linear attention layers, beside the paged KV cache: one slot per sequence.

A Gated DeltaNet layer keeps, per running sequence, its conv state (the last K-1 inputs of the
causal conv, model dtype) and its recurrent state (v_heads x k_dim x v_dim, fp32): a fixed size
whatever the context, so one slot holds a whole sequence. The scheduler hands a slot to a
sequence when it starts running and takes it back when the sequence finishes or is preempted
(`StateSlots`); the decoder zeroes the slot of every sequence that starts at token 0.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ftrs.models.arch import LINEAR_ATTENTION, ArchSpec

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StateCache:
    """conv: (linear layers, slots, conv_dim, K-1); recurrent: (linear layers, slots, v_heads,
    k_dim, v_dim) fp32. Layer i of these is the i-th linear attention layer of the model."""

    conv: torch.Tensor
    recurrent: torch.Tensor

    @classmethod
    def allocate(cls, spec: ArchSpec, num_slots: int, dtype: torch.dtype,
                 device: torch.device) -> StateCache:
        lin = spec.linear
        assert lin is not None  # invariant: called for models with linear attention only
        layers = len(spec.layers_of(LINEAR_ATTENTION))
        conv = torch.zeros(layers, num_slots, lin.conv_dim, lin.conv_kernel - 1, dtype=dtype,
                           device=device)
        rec = torch.zeros(layers, num_slots, lin.num_v_heads, lin.k_head_dim, lin.v_head_dim,
                          dtype=torch.float32, device=device)
        log.info("linear attention state: %d slots of %.2f MiB", num_slots,
                 (conv[:, 0].nbytes + rec[:, 0].nbytes) / 2**20)
        return cls(conv, rec)

    def reset(self, slots: torch.Tensor) -> None:
        """Zero `slots` (int64) in every layer: their sequences start from token 0."""
        if slots.numel():
            self.conv.index_fill_(1, slots, 0)
            self.recurrent.index_fill_(1, slots, 0)


def state_bytes(spec: ArchSpec, num_slots: int, dtype: torch.dtype) -> int:
    """Bytes of the `StateCache` of `num_slots` slots (0 without linear attention layers)."""
    lin = spec.linear
    if lin is None or not spec.has_linear_attention:
        return 0
    per_layer = (lin.conv_dim * (lin.conv_kernel - 1) * dtype.itemsize
                 + lin.num_v_heads * lin.k_head_dim * lin.v_head_dim * 4)
    return len(spec.layers_of(LINEAR_ATTENTION)) * num_slots * per_layer


class StateSlots:
    """Free list of state slots. Invariant: a slot is free or held by exactly one sequence."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        assert slot not in self._free, "state slot freed twice"
        self._free.append(slot)
