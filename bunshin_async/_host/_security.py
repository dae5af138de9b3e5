"""``Security``: the workspace as a security boundary, and its explicit relaxations.

On by default, as the major container engines do it (runc and moby are the reference):

- a user namespace (``_userns``): root inside is an unprivileged host uid/gid range, so the capabilities below
  count over the workspace's own namespaces only;
- capabilities: every set of every process reduced to the container default set (``DEFAULT_CAPABILITIES``, moby's
  list without ``NET_RAW``: raw and packet sockets are of no use in a loopback-only net namespace and are what an
  attacker wants them for; podman drops it too), so no ``CAP_SYS_ADMIN``, ``SYS_MODULE``, ``SYS_RAWIO``,
  ``SYS_PTRACE``, ``SYS_TIME``, ``SYS_BOOT``, ``NET_ADMIN``, ``BPF``, ``PERFMON``, ``SYSLOG``, ... in the host's view;
- ``no_new_privs`` and a seccomp filter equivalent to moby's default profile (native/security.c says what differs);
- runc's masked and read-only ``/proc`` and ``/sys`` paths (``/proc/sys`` read-only, ``/proc/kcore``,
  ``/proc/keys``, ``/proc/timer_list``, ``/proc/kmsg`` masked), ``/sys`` read-only;
- a device allow-list (the cgroup v1 devices controller, ``DEFAULT_DEVICES``): ``mknod`` of anything else makes a
  node that cannot be opened. A host without that controller (cgroup v2 has no file interface for it) gets
  ``MKNOD`` dropped instead, and says so in the log and in ``bunshin doctor``.

pid 1 applies all of it before it execs, so every process of the workspace inherits it; CRIU dumps and restores
capability sets, ``no_new_privs``, seccomp filters and mounts, so forks and rollbacks keep it. Each relaxation is a
named field, and a workspace that starts with one logs it (logger ``bunshin_async.security``, level WARNING).
"""

from __future__ import annotations

import logging
import re

import msgspec

from .._exceptions import SecurityError
from ._userns import DEFAULT_IDMAP

__all__ = ["CAPABILITIES", "DEFAULT_CAPABILITIES", "DEFAULT_DEVICES", "Security"]

log = logging.getLogger("bunshin_async.security")

CAPABILITIES = (
    "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "SETPCAP",
    "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW", "IPC_LOCK", "IPC_OWNER",
    "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT", "SYS_ADMIN", "SYS_BOOT", "SYS_NICE",
    "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD", "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP",
    "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG", "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF",
    "CHECKPOINT_RESTORE",
)  # fmt: skip
"""Linux capability names without ``CAP_``, in the kernel's order (bit n is ``CAPABILITIES[n]``)."""

DEFAULT_CAPABILITIES = (
    "CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "MKNOD", "SETGID", "SETUID", "SETFCAP", "SETPCAP",
    "NET_BIND_SERVICE", "SYS_CHROOT", "KILL", "AUDIT_WRITE",
)  # fmt: skip
"""What a workspace's processes hold: moby's default set (oci/caps/defaults.go) without NET_RAW."""

DEFAULT_DEVICES = (
    "c 1:3 rwm",  # null
    "c 1:5 rwm",  # zero
    "c 1:7 rwm",  # full
    "c 1:8 rwm",  # random
    "c 1:9 rwm",  # urandom
    "c 5:0 rwm",  # tty
    "c 5:2 rwm",  # ptmx (devpts' own)
    "c 136:* rwm",  # pts/*
    "c *:* m",  # mknod of any node is allowed; opening one not listed above is not (runc does the same)
    "b *:* m",
)
"""The cgroup v1 devices allow-list of every workspace (``devices.allow`` syntax)."""

_DEVICE_RULE = re.compile(r"[cb] (\*|\d{1,4}):(\*|\d{1,7}) [rwm]{1,3}")


def _cap_name(name: str) -> str:
    upper = name.upper()
    return upper[4:] if upper.startswith("CAP_") else upper


class Security(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The boundary of one workspace (and of its forks). The default is the safe one; every field that is not its
    default is a relaxation, named in the log when the workspace starts.

    ``capabilities``: capabilities kept on top of ``DEFAULT_CAPABILITIES`` (``"NET_RAW"``, ``"CAP_SYS_PTRACE"``);
    keeping one also allows the syscalls moby's profile gates on it (``SYS_ADMIN``: mount, unshare, setns, ...).
    ``seccomp``: False leaves syscalls unfiltered (and ``no_new_privs`` unset). ``masked_paths``: False leaves
    ``/proc`` and ``/sys`` as mounted. ``devices``: more ``devices.allow`` rules (``"c 10:200 rwm"``);
    ``all_devices``: no allow-list at all. ``userns``: False runs the workspace without a user namespace, its root
    the host's (a kept capability then counts over the host's objects: fanotify mount marks want that).
    ``Security.off()`` relaxes everything (the host's root, as before)."""

    capabilities: tuple[str, ...] = ()
    seccomp: bool = True
    masked_paths: bool = True
    devices: tuple[str, ...] = ()
    all_devices: bool = False
    userns: bool = True

    def __post_init__(self) -> None:
        for name in self.capabilities:
            if not isinstance(name, str) or _cap_name(name) not in CAPABILITIES:
                raise SecurityError(
                    f"unknown capability {name!r} (one of {', '.join(CAPABILITIES)})", field="capabilities"
                )
        for rule in self.devices:
            if not isinstance(rule, str) or not _DEVICE_RULE.fullmatch(rule):
                raise SecurityError(
                    f"bad device rule {rule!r}: 'c|b MAJOR|*:MINOR|* [rwm]', e.g. 'c 10:200 rwm'", field="devices"
                )

    @classmethod
    def off(cls) -> Security:
        """No boundary beyond the namespaces: every capability, no seccomp, no masks, every device."""
        return cls(capabilities=CAPABILITIES, seccomp=False, masked_paths=False, all_devices=True, userns=False)

    @property
    def kept_capabilities(self) -> frozenset[str]:
        return frozenset(DEFAULT_CAPABILITIES) | {_cap_name(c) for c in self.capabilities}

    def capability_mask(self, *, mknod: bool = True) -> int:
        """Bit n set for every capability kept (``mknod=False`` drops MKNOD: a host without a devices controller)."""
        kept = self.kept_capabilities - (set() if mknod else {"MKNOD"})
        return sum(1 << CAPABILITIES.index(c) for c in kept)

    def relaxations(self) -> list[str]:
        """What this configuration relaxes against the default, by name (empty for the default)."""
        out = [f"capability {c}" for c in sorted(self.kept_capabilities - set(DEFAULT_CAPABILITIES))]
        if not self.seccomp:
            out.append("seccomp off (and no_new_privs unset)")
        if not self.masked_paths:
            out.append("/proc and /sys unmasked and writable where the kernel allows")
        if self.all_devices:
            out.append("every device node can be opened")
        if not self.userns:
            out.append("no user namespace (root inside is the host's root)")
        out += [f"device {rule}" for rule in self.devices]
        return out

    def device_rules(self) -> list[str] | None:
        """The devices allow-list of the workspace's cgroup; None for no list (``all_devices``)."""
        return None if self.all_devices else [*DEFAULT_DEVICES, *self.devices]

    def init_args(self, *, nofile: int | None, mknod: bool = True) -> list[str]:
        """bunshin-init's options for this configuration (native/security.c)."""
        args = ["--caps", f"{self.capability_mask(mknod=mknod):x}"]
        args += ["--seccomp", "1" if self.seccomp else "0", "--masks", "1" if self.masked_paths else "0"]
        if nofile is not None:
            args += ["--nofile", str(nofile)]
        if self.userns:
            args += ["--userns", DEFAULT_IDMAP.init_arg()]
        return args

    def log_relaxations(self, workspace_id: str) -> None:
        relaxed = self.relaxations()
        if relaxed:
            log.warning("workspace %s starts with a relaxed security boundary: %s", workspace_id, "; ".join(relaxed))
