#!/usr/bin/env bash
# Prints the Python that runs the unit tier (`make test-unit`), for any user, without root: the set-up's .venv when
# this user can run it (`make setup` makes it as root, often over a root-only interpreter), else a virtual environment
# of this user's own, made once per lock and interpreter in their cache directory (the checkout may be read-only):
# this user's python3 (3.10 or later) with only what the unit tests import, at requirements.lock's pins. Nothing is
# built: no compiler, no native extension, no CRIU (the unit tests import none of them).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# The unit tests' imports: the SDK's dependencies (pyproject.toml), the extras the pure tests of the tap, the Agents
# SDK, MCP and E2B adapters use (not Ray's or SkyRL's large binary ones: tests/test_exported_members.py HEAVY), and
# the test tools. Pinned by the lock (-c), never resolved afresh.
PACKAGES=(anyio httpx msgspec xxhash protobuf "exceptiongroup; python_version < '3.11'" openai openai-agents mcp
    uvicorn starlette python-multipart psutil PyYAML pytest pytest-asyncio pytest-timeout)

if .venv/bin/python -c 'import pytest, msgspec' 2>/dev/null; then
    echo .venv/bin/python
    exit 0
fi
PYTHON=${PYTHON:-python3}
"$PYTHON" -c 'import sys; assert sys.version_info[:2] >= (3, 10)' 2>/dev/null || {
    echo "unit-env.sh: need Python 3.10 or later (set PYTHON=)" >&2
    exit 1
}
version=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
sum=$( (sha256sum requirements.lock; printf '%s\n' "${PACKAGES[@]}") | sha256sum | cut -c1-16)
env=${BUNSHIN_UNIT_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/bunshin/unit-venv-$version}
if [[ "$(cat "$env/.unit-sum" 2>/dev/null)" != "$sum" ]]; then
    echo "unit-env.sh: making $env (the unit tests' dependencies, pinned by requirements.lock)" >&2
    rm -rf "$env"
    "$PYTHON" -m venv "$env" >&2 || {
        echo "unit-env.sh: $PYTHON cannot make a virtual environment (Debian: apt install python3-venv)" >&2
        exit 1
    }
    "$env/bin/python" -m pip install -q --disable-pip-version-check -c requirements.lock "${PACKAGES[@]}" >&2
    echo "$sum" > "$env/.unit-sum"
fi
echo "$env/bin/python"
