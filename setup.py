"""Builds the C extension and the workspace init binary; everything else is in pyproject.toml."""

from __future__ import annotations

import os
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildWithInit(build_ext):
    """Also compiles native/init.c (with native/security.c) into ``bunshin_async/bunshin-init`` and native/agent.c
    into ``bunshin_async/bunshin-agent``, next to the extension module: static executables, since both run inside
    workspaces and may use nothing from their images."""

    def run(self) -> None:
        super().run()
        ext_dir = os.path.dirname(self.get_ext_fullpath("bunshin_async._native"))
        os.makedirs(ext_dir, exist_ok=True)
        out = os.path.join(ext_dir, "bunshin-init")
        cc = os.environ.get("CC", "cc")
        # Both static: pid 1 and the agent run on any image, one without a libc included.
        flags = ["-static", "-O2", "-Wall", "-Wextra", "-Werror"]
        subprocess.check_call([cc, *flags, "-o", out, "native/init.c", "native/security.c"])
        agent = os.path.join(ext_dir, "bunshin-agent")
        subprocess.check_call([cc, *flags, "-pthread", "-o", agent, "native/agent.c"])


setup(
    ext_modules=[Extension("bunshin_async._native", ["native/_native.c"], extra_compile_args=["-Wall", "-Werror"])],
    cmdclass={"build_ext": BuildWithInit},
)
