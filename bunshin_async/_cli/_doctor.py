"""``bunshin doctor``: what this host can do, and what each missing capability disables."""

from __future__ import annotations

import os
import socket
import subprocess
from importlib import resources
from pathlib import Path

import msgspec

from .._config import Config
from .._exceptions import BunshinError
from .._host import _hostsetup, _paths
from .._host._kernel import cgroup_version
from .._host._userns import DEFAULT_IDMAP
from .._images._image import Image


class Check(msgspec.Struct, frozen=True):
    name: str
    ok: bool
    detail: str
    disables: str = ""
    remedy: str = ""
    """The command that provides what is missing."""


SETUP = "sudo bunshin setup (make setup in a checkout)"


def system_packages() -> list[tuple[str, str]]:
    """(package, what needs it) from ``system-packages.txt``, the list scripts/setup.sh installs from."""
    text = resources.files("bunshin_async").joinpath("system-packages.txt").read_text()
    rows = [line.split(None, 1) for line in text.splitlines() if line.strip() and not line.startswith("#")]
    return [(row[0], row[1].strip() if len(row) > 1 else "") for row in rows]


def _installed(packages: list[str]) -> set[str]:
    try:
        res = subprocess.run(
            ["dpkg-query", "-W", "-f", "${Package} ${Status}\n", *packages],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {line.split()[0] for line in res.stdout.splitlines() if line.endswith(" install ok installed")}


def _package_checks() -> list[Check]:
    wanted = system_packages()
    have = _installed([name for name, _ in wanted])
    return [
        Check(f"package {name}", name in have, "installed" if name in have else "not installed", why,
              f"apt-get install {name} (or {SETUP})")
        for name, why in wanted
    ]  # fmt: skip


def _docker_check() -> Check:
    sock = Path("/var/run/docker.sock")
    detail = "no daemon socket at /var/run/docker.sock"
    if sock.is_socket():
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(5)
                s.connect(str(sock))
                s.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
                ok = b" 200 " in s.recv(256)
        except OSError as exc:
            ok, detail = False, f"{sock}: {exc.strerror or exc}"
        if ok:
            return Check("docker engine", True, f"answers on {sock}")
    return Check(
        "docker engine", False, detail, "Image.from_docker and the peer benchmark", "scripts/docker.sh (make setup)"
    )


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _fork_mode_check() -> Check:
    """Which fork mode restores get (``_fork._modes.plan``) and what the configured mode lacks: a fork in a mode
    the host cannot give raises ``CapabilityMissing``; ``auto`` takes the best there is, with one warning."""
    from .._fork._modes import plan

    try:
        mode, losses = plan()
    except ValueError as exc:
        return Check("fork mode", False, str(exc), "fork", "set BUNSHIN_FORK_MODE to cow, criu, ksm, fs or auto")
    what = {
        "criu-cow": "copies share memory pages until written (patched CRIU)",
        "criu": "copies get private memory",
        "criu-ksm": "copies are KSM-mergeable (KSM is switched on while forking)",
        "fs": "files only: processes are restarted from the recorded setup, not carried",
    }[mode]
    if not losses:
        return Check("fork mode", True, f"{mode}: {what}")
    auto = Config.current().fork_mode == "auto"
    detail = "; ".join(loss.missing for loss in losses)
    detail += f" (auto gives {mode}: {what})" if auto else " (fork() raises CapabilityMissing)"
    return Check("fork mode", False, detail, "; ".join(loss.lost for loss in losses), losses[0].remedy)


def _host_setup_check() -> Check:
    """What host.toml records (``bunshin setup``) and whether its CRIU fits this package's patch set. The agent and
    init ship in the package (content-addressed layers, so packages with other agents coexist): the record of
    which package set the host up is information, not a requirement."""
    from .._host._criu import package_patch_set
    from ._setup import package_record

    path = _hostsetup.host_config_path()
    record = _paths.host_config()
    criu = record.get("criu", {})
    if not criu:
        return Check(
            "host set-up",
            False,
            f"{path}: no CRIU recorded (the host was not set up with `bunshin setup`)",
            "finding CRIU from any environment (BUNSHIN_CRIU or a checkout's criu/dist still work)",
            SETUP,
        )
    by = record.get("bunshin", {})
    mine = package_record()
    who = (
        f"set up by bunshin {by.get('version', '?')} (agent {by.get('agent', '?')}; "
        f"this package: {mine['version']}, agent {mine['agent']})"
    )
    want = package_patch_set()
    if want is not None and criu.get("patches") != want:
        return Check(
            "host set-up",
            False,
            f"{path}: CRIU {criu.get('path')} carries patch set {criu.get('patches')}, this package needs {want}; "
            + who,
            "live fork with the host's CRIU",
            SETUP,
        )
    return Check("host set-up", True, f"{path}: CRIU {criu.get('path')} (patch set {criu.get('patches')}); {who}")


def _status_field(name: str) -> str | None:
    for line in (_read("/proc/self/status") or "").splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    return None


def security_checks() -> list[Check]:
    """Which protections of the workspace boundary (``Security``, ``Limits``) this host can enforce."""
    from .._host._kernel import devices_controller

    out: list[Check] = []
    seccomp = _status_field("Seccomp") is not None and Path("/proc/sys/kernel/seccomp/actions_avail").exists()
    out.append(Check("seccomp", seccomp, "filter mode" if seccomp else "no seccomp filters", "the syscall filter"))
    nnp = _status_field("NoNewPrivs") is not None
    out.append(Check("no_new_privs", nnp, "supported" if nnp else "absent", "no_new_privs"))
    last = _read("/proc/sys/kernel/cap_last_cap")
    out.append(Check("capability bounding set", last is not None, f"cap_last_cap={last}", "capability dropping"))
    dev = devices_controller()
    out.append(
        Check(
            "device allow-list",
            dev,
            "cgroup v1 devices controller" if dev else "no devices controller: MKNOD is dropped instead",
            "opening device nodes made with mknod is blocked by dropping MKNOD, not by an allow-list",
        )
    )
    out.append(
        Check(
            "disk limit",
            Path("/proc/filesystems").exists() and "tmpfs" in (_read("/proc/filesystems") or ""),
            "Limits.disk (1 GiB by default): the upper layer on a tmpfs of that size (no filesystem project quotas)",
            "Limits(disk=)",
        )
    )
    userns = _read("/proc/sys/user/max_user_namespaces")
    ok = userns is not None and userns.strip() not in ("", "0")
    m = DEFAULT_IDMAP
    out.append(
        Check(
            "user namespace per workspace",
            ok,
            f"root inside is host uid {m.host_uid} (gid {m.host_gid}, {m.count} ids); layers shifted once, "
            "no idmapped mounts"
            if ok
            else f"max_user_namespaces={userns}: workspaces need Security(userns=False)",
            "root inside a workspace mapped to an unprivileged host range",
        )
    )
    return out


def checks() -> list[Check]:
    out: list[Check] = []
    root = os.geteuid() == 0
    out.append(Check("root", root, f"euid {os.geteuid()}", "workspaces (namespaces, mounts, cgroups)", "run as root"))
    userns = _read("/proc/sys/user/max_user_namespaces")
    out.append(
        Check(
            "user namespaces",
            bool(userns and userns != "0"),
            f"max_user_namespaces={userns}",
            "rootless mode",
            "sysctl -w user.max_user_namespaces=15000",
        )
    )
    overlay = "overlay" in (_read("/proc/filesystems") or "")
    out.append(
        Check(
            "overlayfs",
            overlay,
            "in /proc/filesystems" if overlay else "not available",
            "workspaces",
            "modprobe overlay (a kernel with CONFIG_OVERLAY_FS)",
        )
    )
    cg = cgroup_version()
    out.append(
        Check("cgroups", cg is not None, f"v{cg}" if cg else "none", "workspace resource limits", "mount cgroupfs")
    )
    init = _paths.init_binary()
    out.append(Check("bunshin-init", init.exists(), str(init), "workspaces", SETUP))
    try:
        image = Image.base()
        out.append(Check("base image", True, image.rootfs))
    except BunshinError as exc:
        out.append(Check("base image", False, str(exc), "Workspace() without an explicit image", "bunshin image build"))
    from .._host._criu import criu_version

    criu = _paths.criu_binary()
    version = criu_version(criu) if criu else None
    out.append(
        Check(
            "criu",
            version is not None and version.startswith("4.2"),
            f"{criu} {version}" if criu else "not found (`bunshin setup` builds 4.2.1 with criu/patches)",
            "live fork, snapshot, rollback (only fork_mode='fs' remains)",
            SETUP,
        )
    )
    out.append(_host_setup_check())
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
                "a kernel with CONFIG_CHECKPOINT_RESTORE (see `criu check --all`)",
            )
        )
    out.append(_fork_mode_check())
    from .._host._snapstore import snapshot_store

    huge, where = snapshot_store()
    out.append(Check("snapshot store", huge, where, "large folios for CRIU's page images", "bunshin snapstore"))
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
    out.append(Check("userfaultfd", uffd, "present" if uffd else "absent", "lazy restore", "CONFIG_USERFAULTFD"))
    out += _package_checks()
    out.append(_docker_check())
    return out + security_checks()


def report() -> tuple[str, bool]:
    rows = checks()
    width = max(len(c.name) for c in rows)
    lines = []
    for c in rows:
        mark = "ok  " if c.ok else "MISS"
        line = f"{mark} {c.name:<{width}}  {c.detail}"
        if not c.ok and c.disables:
            line += f"\n     {'':<{width}}  disables: {c.disables}"
        if not c.ok and c.remedy:
            line += f"\n     {'':<{width}}  fix: {c.remedy}"
        lines.append(line)
    essential = {"root", "overlayfs", "cgroups", "bunshin-init", "base image"}
    return "\n".join(lines), all(c.ok for c in rows if c.name in essential)
