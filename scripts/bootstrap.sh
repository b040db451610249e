#!/usr/bin/env bash
# Create .venv (once) and install ftrs into it, building the Rust extension with maturin.
# Usage: scripts/bootstrap.sh [extra]   (extra: "test" installs the test dependencies too)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! command -v cargo >/dev/null 2>&1; then
  echo "bootstrap: cargo not found; installing Rust with rustup" >&2
  curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal
  # shellcheck disable=SC1091
  . "$HOME/.cargo/env"
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
target="."
[ "${1:-}" = "test" ] && target=".[test]"
.venv/bin/python -m pip install --quiet -e "$target"
