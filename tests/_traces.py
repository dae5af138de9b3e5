"""The public traces beside the project's checkout (``../shared/traces``; a worktree's checkout sits one level deeper).
They are no part of a clone: the tests that read them are host tests, never unit tests (``make test-unit`` runs
from any clone)."""

from __future__ import annotations

from pathlib import Path

_TRACE = "shared/traces/swebench-gemini-3-pro.jsonl.gz"
SHARED_TRACE = next((d / _TRACE for d in Path(__file__).resolve().parents[1:] if (d / _TRACE).is_file()), Path(_TRACE))
