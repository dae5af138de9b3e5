#!/usr/bin/env bash
# The Python that runs the unit tier (`make test-unit`), for any user, without root: the set-up's .venv when this
# user can run it (`make setup` makes it as root, often over a root-only interpreter), else a virtual environment of
# this user's own, made once per lock and interpreter in their cache directory (the checkout may be read-only): this
# user's python3 (3.10 or later) with only what the unit tests import, at requirements.lock's pins. Nothing is
# built: no compiler, no native extension, no CRIU (the unit tests import none of them).
#
#   scripts/unit-env.sh                  prints that Python's path
#   scripts/unit-env.sh -m pytest ...    runs it with these arguments (what `make test-unit` does)
#
# Safe when one user runs it several times at once (two `make test-unit`, or a run while the lock changed): one
# process at a time makes the environment (`flock` on ENV.make.lock; the others wait, then find it made), it is
# marked complete (.unit-sum) only once made, and a run holds ENV.lock shared while its Python runs (an inherited
# descriptor), so a remake for a changed lock first waits for the runs using the old one to end.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# The unit tests' imports: the SDK's dependencies (pyproject.toml), the extras the pure tests of the tap, the Agents
# SDK, MCP and E2B adapters use (not Ray's or SkyRL's large binary ones: tests/test_exported_members.py HEAVY), and
# the test tools. Pinned by the lock (-c), never resolved afresh.
PACKAGES=(anyio httpx msgspec xxhash protobuf "exceptiongroup; python_version < '3.11'" openai openai-agents mcp
    uvicorn starlette python-multipart psutil PyYAML pytest pytest-asyncio pytest-timeout)

if "$root/.venv/bin/python" -c 'import pytest, msgspec' 2>/dev/null; then
    (($#)) && exec "$root/.venv/bin/python" "$@"
    echo "$root/.venv/bin/python"
    exit 0
fi
PYTHON=${PYTHON:-python3}
"$PYTHON" -c 'import sys; assert sys.version_info[:2] >= (3, 10)' 2>/dev/null || {
    echo "unit-env.sh: need Python 3.10 or later (set PYTHON=)" >&2
    exit 1
}
command -v flock >/dev/null || {
    echo "unit-env.sh: flock not found (util-linux)" >&2
    exit 1
}
version=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
sum=$( (sha256sum "$root/requirements.lock"; printf '%s\n' "${PACKAGES[@]}") | sha256sum | cut -c1-16)
env=${BUNSHIN_UNIT_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/bunshin/unit-venv-$version}
mkdir -p "$(dirname "$env")"

exec 8>>"$env.make.lock"
flock 8 # one maker at a time; a run that finds the environment made waits only for a make under way
if [[ "$(cat "$env/.unit-sum" 2>/dev/null)" != "$sum" ]]; then
    exec 9>>"$env.lock"
    flock 9 # exclusive: no run is using the environment it replaces
    echo "unit-env.sh: making $env (the unit tests' dependencies, pinned by requirements.lock)" >&2
    rm -rf "$env"
    "$PYTHON" -m venv "$env" >&2 || {
        echo "unit-env.sh: $PYTHON cannot make a virtual environment (Debian: apt install python3-venv)" >&2
        exit 1
    }
    "$env/bin/python" -m pip install -q --disable-pip-version-check -c "$root/requirements.lock" "${PACKAGES[@]}" >&2
    echo "$sum" >"$env/.unit-sum" # last: complete
    exec 9>&-
fi
if (($#)); then
    exec 9>>"$env.lock"
    flock -s 9 # held by the Python below (fd 9 is inherited) until it exits; taken before the maker's lock is let go
    exec 8>&-
    exec "$env/bin/python" "$@"
fi
echo "$env/bin/python"
