"""A Bunshin host of its own on this machine: home, workspaces dir, snapshot store (a tmpfs with large folios, as
`bunshin snapstore` makes) and cgroup parent, so that nothing is shared with another host through the filesystem.
The base image is the machine's installation (``images`` links to it), as each real host builds its own."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from bunshin_async._host import _paths
from bunshin_async._host._kernel import CGROUP_ROOT

SYSTEM_IMAGES = Path("/var/lib/bunshin/images")


class Home:
    def __init__(self, name: str) -> None:
        self.root = Path(tempfile.mkdtemp(prefix=f"bunshin-{name}-"))
        (self.root / "home").mkdir()
        images = _paths.images_dir() if _paths.images_dir().is_dir() else SYSTEM_IMAGES
        (self.root / "home" / "images").symlink_to(images.resolve())
        (self.root / "ws").mkdir()
        self.snapdir = Path(tempfile.mkdtemp(prefix=f"bunshin-snap-{name}-", dir="/dev/shm"))
        self.cgroup_parent = f"{os.environ.get('BUNSHIN_CGROUP_PARENT', 'bunshin')}-{name}"
        self.env = {
            "BUNSHIN_HOME": str(self.root / "home"),
            "BUNSHIN_RUNDIR": str(self.root / "ws"),
            "BUNSHIN_SNAPDIR": str(self.snapdir),
            "BUNSHIN_CGROUP_PARENT": self.cgroup_parent,
        }
        with self.active():
            from bunshin_async._host._snapstore import prepare_snapshot_store

            prepare_snapshot_store()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """This process works on this host's directories inside the ``with`` (environment variables)."""
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def leftovers(self) -> list[str]:
        found = [f"snapshot {p.name}" for p in self.snapdir.iterdir()]
        ws = self.root / "ws"
        found += [f"dir {p.name}" for p in ws.iterdir()] if ws.exists() else []
        for ctrl in [CGROUP_ROOT, *CGROUP_ROOT.iterdir()]:
            parent = ctrl / self.cgroup_parent
            if parent.is_dir():
                found += [f"cgroup {p}" for p in parent.iterdir() if p.is_dir()]
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if str(ws).encode() in cmdline:
                args = cmdline.replace(b"\0", b" ")[:100]
                found.append(f"process {pid} {args!r}")
        return found

    def remove(self) -> None:
        for ctrl in [CGROUP_ROOT, *CGROUP_ROOT.iterdir()]:
            with contextlib.suppress(OSError):
                (ctrl / self.cgroup_parent).rmdir()
        subprocess.run(["umount", "--lazy", str(self.snapdir)], check=False)
        shutil.rmtree(self.snapdir, ignore_errors=True)
        shutil.rmtree(self.root, ignore_errors=True)
