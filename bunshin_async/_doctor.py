"""``bunshin doctor``: what this host can do, and what each missing capability disables."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import msgspec

from . import _paths
from ._exceptions import BunshinError
from ._image import Image
from ._kernel import cgroup_version


class Check(msgspec.Struct, frozen=True):
    name: str
    ok: bool
    detail: str
    disables: str = ""


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _fork_mode_check() -> Check:
    """Which fork mode restores get (``_fork.restore_mode``) and why: CoW sharing needs the patched CRIU; without a
    usable CRIU, ``auto`` falls back to filesystem-only forks."""
    from ._criu import criu_unavailable
    from ._exceptions import CapabilityMissing
    from ._fork import cow_available, restore_mode

    try:
        mode = restore_mode()
    except (CapabilityMissing, ValueError) as exc:
        return Check("fork mode", False, str(exc), "live fork in the requested BUNSHIN_FORK_MODE")
    if mode == "fs":
        reason = criu_unavailable()
        why = f"CRIU unavailable: {reason}" if reason else "BUNSHIN_FORK_MODE=fs"
        return Check(
            "fork mode",
            reason is None,
            f"fs only: {why}; processes are restarted from the recorded setup, not carried",
            "live fork (memory, shell sessions and connections of the processes are not carried)",
        )
    cow = cow_available()
    what = {
        "criu-cow": "copies share memory pages until written (patched CRIU)",
        "criu": "copies get private memory"
        + ("" if cow else " (stock CRIU: criu/patches/0001-cow-restore.patch not built; BUNSHIN_FORK_MODE=ksm merges)"),
        "criu-ksm": "copies are KSM-mergeable (KSM is switched on while forking)",
    }[mode]
    return Check(
        "fork mode",
        mode == "criu-cow" or not cow or mode == "criu-ksm",
        f"{mode}: {what}",
        "memory sharing between forks (copies cost their full size)",
    )


def checks() -> list[Check]:
    out: list[Check] = []
    root = os.geteuid() == 0
    out.append(Check("root", root, f"euid {os.geteuid()}", "" if root else "workspaces (namespaces, mounts, cgroups)"))
    userns = _read("/proc/sys/user/max_user_namespaces")
    out.append(
        Check("user namespaces", bool(userns and userns != "0"), f"max_user_namespaces={userns}", "rootless mode")
    )
    overlay = "overlay" in (_read("/proc/filesystems") or "")
    out.append(Check("overlayfs", overlay, "in /proc/filesystems" if overlay else "not available", "workspaces"))
    cg = cgroup_version()
    out.append(Check("cgroups", cg is not None, f"v{cg}" if cg else "none", "workspace resource limits"))
    init = _paths.init_binary()
    out.append(Check("bunshin-init", init.exists(), str(init), "workspaces (reinstall: `make setup`)"))
    try:
        image = Image.base()
        out.append(Check("base image", True, image.rootfs))
    except BunshinError as exc:
        out.append(Check("base image", False, str(exc), "Workspace() without an explicit image"))
    from ._criu import criu_version

    criu = _paths.criu_binary()
    version = criu_version(criu) if criu else None
    out.append(
        Check(
            "criu",
            version is not None and version.startswith("4.2"),
            f"{criu} {version}" if criu else "not found (criu/build.sh builds 4.2.1)",
            "live fork, snapshot, rollback (filesystem-only fork remains)",
        )
    )
    if criu and version:
        res = subprocess.run([str(criu), "check"], capture_output=True, text=True, timeout=60)
        good = "Looks good" in res.stdout + res.stderr
        out.append(
            Check(
                "criu check",
                good,
                (res.stdout + res.stderr).strip().splitlines()[-1:][0]
                if good
                else (res.stdout + res.stderr).strip()[-300:],
                "live fork",
            )
        )
    out.append(_fork_mode_check())
    from ._fork import snapshot_store

    huge, where = snapshot_store()
    out.append(Check("snapshot store", huge, where, "large folios for page images (`bunshin snapstore` mounts them)"))
    ksm = _read("/sys/kernel/mm/ksm/run")
    out.append(
        Check(
            "ksm",
            ksm is not None,
            f"run={ksm}" if ksm is not None else "absent",
            "the stock-CRIU copy-on-write fallback (same-page merging)",
        )
    )
    uffd = Path("/proc/sys/vm/unprivileged_userfaultfd").exists()
    out.append(Check("userfaultfd", uffd, "present" if uffd else "absent", "lazy restore"))
    return out


def report() -> tuple[str, bool]:
    rows = checks()
    width = max(len(c.name) for c in rows)
    lines = []
    for c in rows:
        mark = "ok  " if c.ok else "MISS"
        line = f"{mark} {c.name:<{width}}  {c.detail}"
        if not c.ok and c.disables:
            line += f"\n     {'':<{width}}  disables: {c.disables}"
        lines.append(line)
    essential = {"root", "overlayfs", "cgroups", "bunshin-init", "base image"}
    return "\n".join(lines), all(c.ok for c in rows if c.name in essential)
