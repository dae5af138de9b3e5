"""Builds the C extension, the workspace init and agent binaries, and ships criu/ as package data; everything else
is in pyproject.toml. The extension uses the stable ABI (abi3, Python 3.10+), so one wheel serves 3.10-3.13."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

CRIU_FILES = ("VERSION", "SHA256", "build.sh", "README.md")


class BuildWithCriu(build_py):
    """Copies criu/ (VERSION, SHA256, build.sh, the patches) into the built package as ``bunshin_async/_criu_build``,
    so that ``bunshin setup`` builds the same CRIU from an installed wheel (bunshin_async/_host/_hostsetup.py). A
    checkout (editable install) reads criu/ itself, so nothing is written into the source tree."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        dst = Path(self.build_lib) / "bunshin_async" / "_criu_build"
        shutil.rmtree(dst, ignore_errors=True)
        (dst / "patches").mkdir(parents=True)
        for name in CRIU_FILES:
            shutil.copy2(Path("criu") / name, dst / name)
        for patch in sorted(Path("criu/patches").iterdir()):
            shutil.copy2(patch, dst / "patches" / patch.name)


class BuildWithInit(build_ext):
    """Also compiles native/init.c (with native/security.c) into ``bunshin_async/bunshin-init`` and native/agent.c
    into ``bunshin_async/bunshin-agent``, next to the extension module: static executables, since both run inside
    workspaces and may use nothing from their images."""

    def run(self) -> None:
        super().run()
        ext_dir = os.path.dirname(self.get_ext_fullpath("bunshin_async._native"))
        if self.inplace:  # a version-specific build left from before abi3 would be imported first
            built = os.path.basename(self.get_ext_fullpath("bunshin_async._native"))
            for stale in Path(ext_dir).glob("_native.cpython-*.so"):
                if stale.name != built:
                    stale.unlink()
        os.makedirs(ext_dir, exist_ok=True)
        out = os.path.join(ext_dir, "bunshin-init")
        cc = os.environ.get("CC", "cc")
        # Both static: pid 1 and the agent run on any image, one without a libc included.
        flags = ["-static", "-O2", "-Wall", "-Wextra", "-Werror"]
        subprocess.check_call([cc, *flags, "-o", out, "native/init.c", "native/security.c"])
        agent = os.path.join(ext_dir, "bunshin-agent")
        subprocess.check_call([cc, *flags, "-pthread", "-o", agent, "native/agent.c"])


setup(
    ext_modules=[
        Extension(
            "bunshin_async._native",
            ["native/_native.c"],
            extra_compile_args=["-Wall", "-Werror"],
            define_macros=[("Py_LIMITED_API", "0x030A0000")],
            py_limited_api=True,
        )
    ],
    cmdclass={"build_ext": BuildWithInit, "build_py": BuildWithCriu},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
