#!/usr/bin/env bash
# Install ftrs into .venv and serve the demo model (SmolLM2-135M upcycled to 8 experts, top-2)
# on http://127.0.0.1:8000/v1. Extra arguments go to `ftrs serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/ftrs serve --model demo --host 127.0.0.1 --port "${PORT:-8000}" "$@"
