"""The fake engine of `faulty_backend.py` for the stop-on-request tests.

`load` makes a named multiprocessing semaphore that lives as long as the engine process, as
tqdm's progress bars do in the real loader (its write lock), so a test sees whether the
engine's exit unlinks it. `--model slow-load` loads for `SLOW_LOAD_S` seconds, so a test can
stop the server while the model loads.
"""

from __future__ import annotations

import multiprocessing as mp
import time

from faulty_backend import FaultyEngine, load_tokenizer

from ftrs.config import EngineConfig
from ftrs.server.engine_process import LoadedEngine

SLOW_LOAD_S = 60.0
_kept: list[object] = []  # the engine's semaphore, alive until the process ends


def load(config: EngineConfig) -> LoadedEngine:
    _kept.append(mp.get_context("spawn").RLock())
    if config.model == "slow-load":
        time.sleep(SLOW_LOAD_S)
    return LoadedEngine(FaultyEngine(), config.model)


__all__ = ["load", "load_tokenizer"]
