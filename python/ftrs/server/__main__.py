"""`python -m ftrs.server [options]`: the same as `ftrs serve`."""

from __future__ import annotations

import sys

from ftrs.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
