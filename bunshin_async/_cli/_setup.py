"""``bunshin setup`` (and ``python -m bunshin_async setup``): the host set-up from an installed package, as root on
Debian 12 or 13, idempotently. The host part (system packages, CRIU from criu/patches, /etc/bunshin/host.toml) is
``_hostsetup``, which ``make setup`` runs too; then the parts that need the package: the snapshot store, this
package's record in host.toml, and the workspace images."""

from __future__ import annotations

import hashlib
import os
import sys

from .._exceptions import BunshinError
from .._host import _hostsetup, _paths


def package_record() -> dict[str, str]:
    """What host.toml records of the package that set the host up (``bunshin doctor`` compares)."""
    from .. import __version__

    return {"version": __version__, "agent": agent_digest()}


def agent_digest() -> str:
    """The in-workspace agent this package ships (a host set up by another build names another one)."""
    try:
        return hashlib.sha256(_paths.agent_binary().read_bytes()).hexdigest()[:16]
    except OSError:
        return "missing"


def main(*, images: bool = True, gui: bool = False) -> int:
    rc = _hostsetup.main([])
    if rc:
        return rc
    from .._host._snapstore import prepare_snapshot_store

    try:
        _hostsetup.log("snapshot store")
        print(f"snapshot store: {prepare_snapshot_store()}")
        _hostsetup.write_host_config(bunshin=package_record())
        if not images:
            print("skipped (--no-images): the workspace images")
        elif os.environ.get("BUNSHIN_CLEAN_ROOT_CHECK"):
            print("skipped (clean-root check): building the workspace images (debootstrap inside a chroot)")
        else:
            from .._images._image import build_base_image, build_gui_image

            _hostsetup.log("base image")
            print(f"base image ready: {build_base_image().rootfs}")
            if gui:
                print(f"GUI image ready: {build_gui_image().rootfs}")
    except BunshinError as exc:
        print(f"bunshin setup: {exc}", file=sys.stderr)
        return 1
    _hostsetup.log("host ready")
    return 0
