"""The public surface is exactly what ``__all__`` says (httpx's test_exported_members)."""

from __future__ import annotations

import pickle

import bunshin_async
from bunshin_async import _exceptions


def test_all_is_exported_and_public() -> None:
    exported = {name for name in dir(bunshin_async) if not name.startswith("_")} - {"annotations"}
    # public submodules imported by users, not names
    modules = {"llm", "agent", "cache", "speculation", "transfer", "integrations"}
    assert set(bunshin_async.__all__) == exported - modules
    for name in bunshin_async.__all__:
        assert getattr(bunshin_async, name).__module__.startswith("bunshin_async")


def test_every_error_is_a_bunshin_error_and_pickles() -> None:
    samples = [
        _exceptions.CapabilityMissing("no criu", capability="criu", remedy="run make setup"),
        _exceptions.ImageError("missing", image="x"),
        _exceptions.WorkspaceClosed("closed", workspace_id="abc"),
        _exceptions.ForkError("failed", workspace_id="abc"),
        _exceptions.ToolTimeout("slow", tool="exec", timeout=1.5, stdout="partial", stderr=""),
        _exceptions.PathOutsideWorkspace("out", tool="read_file", path="../x"),
        _exceptions.LLMHTTPError("500", status=500, body="oops"),
        _exceptions.ToolCallError("bad json", tool_name="bash", index=1),
        _exceptions.StoreUnavailable("down", store="redis"),
        _exceptions.StoreFull("full", workspace_id="abc", store="/dev/shm/bunshin-snap", free_bytes=0),
        _exceptions.TransferError("truncated", snapshot_id="0123456789ab"),
        _exceptions.HostError("died", host="n1"),
    ]
    for exc in samples:
        assert isinstance(exc, bunshin_async.BunshinError)
        copy = pickle.loads(pickle.dumps(exc))
        assert type(copy) is type(exc) and str(copy) == str(exc) and copy._kwargs == exc._kwargs
    timeout = pickle.loads(pickle.dumps(samples[4]))
    assert isinstance(timeout, _exceptions.ToolTimeout)
    assert (timeout.stdout, timeout.timeout) == ("partial", 1.5)
    assert "run make setup" in str(samples[0])


def test_doctor_reports_this_host(capsys) -> None:  # type: ignore[no-untyped-def]
    from bunshin_async._cli import main

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for line in ("ok   root", "ok   overlayfs", "ok   cgroups", "ok   criu ", "ok   criu check"):
        assert line in out, out
