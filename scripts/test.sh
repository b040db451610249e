#!/usr/bin/env bash
# The whole test suite: Rust (fmt, clippy, tests) and Python (ruff, mypy, pytest).
# Installs what it needs into .venv first. Exits non-zero when anything fails, including
# pytest collecting no tests (exit 5), which is a failure here, not a pass.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh test
export PATH="$PWD/.venv/bin:$PATH"

echo "== cargo fmt --check";   cargo fmt --all --check
echo "== cargo clippy";        cargo clippy --workspace --all-targets --quiet -- -D warnings
echo "== cargo test";          cargo test --workspace --quiet
echo "== ruff";                ruff check python tests bench
echo "== mypy";                mypy
echo "== pytest"
set +e
python -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$rc"
