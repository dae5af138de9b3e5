"""The integrations import no framework, and a missing framework is a clear error (what each public module
exports: tests/test_exported_members.py)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from bunshin_async import CapabilityMissing
from bunshin_async.integrations._require import require

pytestmark = pytest.mark.unit


def test_the_package_imports_no_framework() -> None:
    code = (
        "import sys, bunshin_async.integrations\n"
        "frameworks = {'mcp', 'agents', 'skyrl_gym', 'verl', 'torch', 'minisweagent', 'inspect_ai', 'harbor'}\n"
        "loaded = frameworks & set(sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_missing_framework_names_its_extra() -> None:
    with pytest.raises(CapabilityMissing) as info:
        require("bunshin_no_such_framework", framework="Nothing", extra="nothing")
    assert "pip install 'bunshin[nothing]'" in str(info.value) and info.value.capability == "bunshin_no_such_framework"
    # Ray is installed here: hidden from the import system, its module says which extra installs it.
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "from bunshin_async import CapabilityMissing\n"
        "try:\n    import bunshin_async.integrations.ray\n"
        "except CapabilityMissing as e:\n    print(e.remedy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "pip install 'bunshin[ray]'\n", out.stderr
    # verl lives in its own environment, not this one: importing its module here says where to get it.
    with pytest.raises(CapabilityMissing, match=r"bunshin\[verl\]"):
        importlib.import_module("bunshin_async.integrations.verl")
    # so do the agent harnesses (scripts/harness-env.sh)
    with pytest.raises(CapabilityMissing, match=r"bunshin\[mini-swe-agent\]"):
        importlib.import_module("bunshin_async.integrations.mini_swe_agent")
    with pytest.raises(CapabilityMissing, match=r"bunshin\[inspect\]"):
        importlib.import_module("bunshin_async.integrations.inspect")
    with pytest.raises(CapabilityMissing, match=r"bunshin\[harbor\]"):
        importlib.import_module("bunshin_async.integrations.harbor")
