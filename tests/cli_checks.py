"""What a CLI test checks of `ftrs ...` refusing its input: one `ftrs: error:` line on stderr."""

from __future__ import annotations

import pytest


def one_error_line(capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    """The one line `ftrs` wrote to stderr, checked to be its error line (no traceback) holding
    each of `needles`."""
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("ftrs: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)
    return err
