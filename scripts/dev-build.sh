#!/usr/bin/env bash
# Developer loop: rebuild the Rust extension (ftrs._core) into .venv after a Rust change.
# scripts/bootstrap.sh does the same as part of a full install; this skips the dependencies.
# A lock serialises concurrent rebuilds from several shells.
set -euo pipefail
cd "$(dirname "$0")/.."
exec flock /tmp/ftrs-dev-build.lock .venv/bin/python -m pip install --quiet --no-deps -e .
