"""The output directory of `ftrs models make-tiny` and `ftrs models upcycle`.

A path the user gives that cannot hold a checkpoint (a regular file, a place no directory can be
made, a directory that already holds files when the writer needs it empty) is refused up front
with a `ConfigError` that names the command, the flag and the path, so the CLI prints one
`ftrs: error:` line instead of an `OSError` traceback. An `OSError` while writing becomes the
same kind of error through `writing_into`, and so does safetensors' `SafetensorError`, which
is how `save_file` reports a full disk (it is no `OSError`). `made_for` prepares the directory for a block and,
when the block fails, removes the directories it made, so a failed command leaves no trace.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError

from ftrs.errors import ConfigError

SHOWN_NAMES = 3  # entries of a non-empty directory named in the error


def prepare_out_dir(path: Path, command: str, flag: str, *, must_be_empty: bool = False) -> None:
    """Create `path` (and its parents) as a directory, or raise ConfigError. With
    `must_be_empty`, an existing directory must hold nothing: files of another model left
    beside the new ones would be loaded with them (a stale `model.safetensors` next to an index)."""
    where = f"{command}: {flag} {path}"
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{where} is a file, not a directory: give a new or empty directory")
    try:
        held = sorted(p.name for p in path.iterdir()) if must_be_empty and path.is_dir() else []
        if held:
            shown = ", ".join(held[:SHOWN_NAMES]) + (", ..." if len(held) > SHOWN_NAMES else "")
            raise ConfigError(f"{where} is not empty (holds {shown}): give a new or empty "
                              "directory, so no file of another model is left beside the new one")
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{where}: cannot create the directory ({e.strerror or e}): give a "
                          "directory you can write to") from e


@contextmanager
def writing_into(path: Path, command: str, flag: str) -> Iterator[None]:
    """Turn an `OSError` or a `SafetensorError` of the writes in the block (disk full, no
    permission) into a ConfigError naming `flag` and `path`."""
    try:
        yield
    except (OSError, SafetensorError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise ConfigError(f"{command}: cannot write into {flag} {path} ({why}): give "
                          "a directory you can write to, with space for the checkpoint") from e


@contextmanager
def made_for(path: Path, command: str, flag: str, *, must_be_empty: bool = False
             ) -> Iterator[None]:
    """`prepare_out_dir`, then the block; if the block raises, the directories this call made
    (`path` and any missing parents) are removed with what the block wrote into them. An
    existing directory is left in place."""
    made = [p for p in (path, *path.parents) if not p.exists() and not p.is_symlink()]
    prepare_out_dir(path, command, flag, must_be_empty=must_be_empty)
    try:
        yield
    except BaseException:
        if made:
            shutil.rmtree(made[-1], ignore_errors=True)  # the outermost one made here
        raise
