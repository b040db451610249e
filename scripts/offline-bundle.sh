#!/usr/bin/env bash
# A folder that makes this checkout run on an offline GPU host whose own Python already has
# torch and triton (an air-gapped or lent machine that reaches no package index): ftrs's Rust
# extension built for that host's Python, and wheels of every other runtime and test
# dependency. Left out: torch, triton and numpy (the host's own, which its torch was built
# against), and what only the CPU suite's oracles or linters need (transformers, accelerate,
# ruff, mypy; accelerate would pull torch).
#
#   scripts/offline-bundle.sh [OUT] [PYTHON]    # OUT: .offline/ ; PYTHON: python3.12
#
# PYTHON is an interpreter here of the host's version (the extension is built against it;
# wheels are fetched for that version, manylinux x86_64). Copy the checkout with OUT inside to
# the host, then from the checkout's root:
#
#   source OUT/env.sh && GPU_CHECK_PY=python3 scripts/gpu-check.sh
#
# env.sh installs the wheels into a folder of their own (FTRS_OFFLINE_SITE, default
# /tmp/ftrs-offline-site; nothing of the host's Python changes), puts the extension beside the
# checkout's sources and sets PYTHONPATH to the sources, that folder and tests/.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.offline}
py=${2:-python3.12}
if ! command -v "$py" >/dev/null 2>&1; then
  echo "offline-bundle: no $py here: the extension is built against the host's Python version" >&2
  exit 2
fi
ver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
rm -rf "$out/wheels" "$out/ext"
mkdir -p "$out/wheels" "$out/ext"
# the dependencies as pyproject.toml names them, less what the host brings or never needs
if ! python3 -c "import tomllib" 2>/dev/null; then
  echo "offline-bundle: needs python3 >= 3.11 here (tomllib reads pyproject.toml)" >&2
  exit 2
fi
mapfile -t reqs < <(python3 - <<'EOF'
import re
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
skip = {"torch", "numpy", "transformers", "accelerate", "ruff", "mypy"}
for req in project["dependencies"] + project["optional-dependencies"]["test"]:
    name = re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0]
    if name.lower() not in skip:
        print(req)
EOF
)
echo "offline-bundle: wheels for CPython $ver: ${reqs[*]}"
python3 -m pip download --quiet --only-binary=:all: --python-version "$ver" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --dest "$out/wheels" "${reqs[@]}"
rm -f "$out"/wheels/numpy-*.whl  # a dependency of gguf: the host's own stays in force
echo "offline-bundle: building the extension for $py"
if command -v maturin >/dev/null 2>&1; then
  maturin build --quiet --release --interpreter "$py" --out "$out/ext"
elif "$py" -m pip --version >/dev/null 2>&1; then
  # maturin as the build backend; $py's own pip, so the extension is built for $py's version
  "$py" -m pip wheel --quiet --no-deps --wheel-dir "$out/ext" .
else
  echo "offline-bundle: neither maturin nor $py's pip here to build the extension with" >&2
  exit 2
fi
cat > "$out/env.sh" <<'EOF'
# Source from the checkout's root on the offline host (scripts/offline-bundle.sh made this).
_bundle=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
_site=${FTRS_OFFLINE_SITE:-/tmp/ftrs-offline-site}
python3 -m pip install --quiet --no-index --no-deps --no-compile --target "$_site" \
  "$_bundle"/wheels/*.whl
python3 -m zipfile -e "$_bundle"/ext/ftrs-*.whl "$_site/.ftrs-wheel"
cp "$_site"/.ftrs-wheel/ftrs/_core*.so python/ftrs/
export PYTHONPATH="$PWD/python:$_site:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import ftrs._core, torch; print('ftrs offline bundle ready: torch', torch.__version__)"
EOF
du -sh "$out" | awk -v out="$out" '{print "offline-bundle: " out " (" $1 ")"}'
