"""The short demo behind ``bunshin demo``: a workspace, a few tools, timings."""

from __future__ import annotations

import time

from .._workspace._facade import Workspace


async def demo() -> None:
    t0 = time.perf_counter()
    async with Workspace() as ws:
        t1 = time.perf_counter()
        print(f"workspace {ws.id} started in {1000 * (t1 - t0):.1f} ms (pid 1 is host pid {ws.pid})")
        r = await ws.exec("uname -sr; cat /etc/debian_version; python3 --version; ps -eo pid,comm")
        print(f"$ uname, debian_version, python3 --version, ps  ({1000 * r.duration:.1f} ms)\n{r.stdout}")
        await ws.write_file("hello.py", "print('hello from', __import__('socket').gethostname())\n")
        r = await ws.exec(["python3", "hello.py"])
        print(f"$ python3 hello.py -> {r.stdout.strip()!r} exit {r.exit_code}")
        async with ws.shell() as sh:
            await sh.run("cd /tmp && export GREETING=hi && counter=41")
            r = await sh.run('echo "$GREETING from $(pwd), counter=$((counter + 1))"')
            print(f"persistent shell -> {r.stdout.strip()!r}")
        n, t = 200, time.perf_counter()
        for _ in range(n):
            await ws.exec(["true"])
        print(f"exec round-trip of `true`: {1e6 * (time.perf_counter() - t) / n:.0f} us on average over {n}")
        print("files in /workspace:", [e.name for e in await ws.list_dir()])
    print(f"closed; total {1000 * (time.perf_counter() - t0):.0f} ms")
