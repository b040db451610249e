"""The linear attention state cache: slot accounting, its size, and resets of single slots."""

from __future__ import annotations

import pytest
import torch

from ftrs.kvcache.state import StateCache, StateSlots, state_bytes
from ftrs.models.arch import arch_from_config

CFG = {"model_type": "qwen3_next", "vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 4,
       "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "num_experts": 3,
       "num_experts_per_tok": 2, "moe_intermediate_size": 8, "linear_num_key_heads": 2,
       "linear_num_value_heads": 4, "linear_key_head_dim": 6, "linear_value_head_dim": 5,
       "linear_conv_kernel_dim": 3, "full_attention_interval": 2}


def test_slots_are_handed_out_once_and_come_back() -> None:
    slots = StateSlots(3)
    got = [slots.alloc() for _ in range(3)]
    assert sorted(got) == [0, 1, 2] and slots.alloc() is None  # type: ignore[type-var]
    slots.free(1)
    assert slots.num_free == 1 and slots.alloc() == 1
    slots.free(2)
    with pytest.raises(AssertionError):
        slots.free(2)


def test_size_and_reset_of_one_slot() -> None:
    spec = arch_from_config(CFG)
    assert spec.layer_types == ("linear_attention", "full_attention") * 2
    cache = StateCache.allocate(spec, 3, torch.bfloat16, torch.device("cpu"))
    # 2 linear layers x 3 slots x (conv (2*12+20) x 2 bf16 + recurrent 4x6x5 fp32)
    assert cache.conv.shape == (2, 3, 44, 2) and cache.recurrent.shape == (2, 3, 4, 6, 5)
    assert state_bytes(spec, 3, torch.bfloat16) == cache.conv.nbytes + cache.recurrent.nbytes
    cache.conv.fill_(1)
    cache.recurrent.fill_(1)
    cache.reset(torch.tensor([1]))
    assert cache.conv[:, 1].eq(0).all() and cache.recurrent[:, 1].eq(0).all()
    assert cache.conv[:, [0, 2]].eq(1).all() and cache.recurrent[:, [0, 2]].eq(1).all()
