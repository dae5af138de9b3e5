"""Bunshin side by side with what users would otherwise run: Docker, Podman and bubblewrap, in one run.

Every peer runs the same root filesystem: Bunshin's Debian base image, imported into Docker and Podman
(``docker import`` / ``podman import`` of a tarball of it, plus a one-line build adding the guest program) and used
directly by bubblewrap. Rows (medians and p90 in ms unless said otherwise; every row has a ``ratio_to_bunshin`` per
peer, > 1 meaning the peer is slower or bigger):

1. ``create_to_first_exec``: a new sandbox until ``true`` has run in it (``Workspace()`` + ``exec``,
   ``docker run --rm``, ``podman run --rm``, ``bwrap``).
2. ``exec_round_trip``: ``true`` in a running sandbox (``ws.exec``, ``docker exec``, ``podman exec``, and an exec
   through the Docker engine's HTTP API on its socket, which avoids the CLI's start-up).
3. ``live_fork``: a sandbox holding ``--mib`` MiB of Python state (tests/fork/guest_state.py) forked into 1 and
   ``--copies`` running copies, with the total PSS of the copies: ``ws.fork(n)``; ``podman container checkpoint
   --export`` then one ``podman container restore --import`` per copy; ``docker checkpoint create`` then one
   ``docker start --checkpoint`` per new container. Each copy must answer the parent's heap digest.
4. ``idle_memory``: PSS per sandbox with ``--idle`` idle sandboxes, counting the processes inside and, separately,
   the per-sandbox helpers on the host (containerd-shim, conmon).
5. ``concurrent_creations``: ``--concurrent`` sandboxes created at once, wall time until all ran a command.

A peer that fails a row is recorded with its error (``failed``), never hidden. Podman and bubblewrap are installed
from Debian's packages on first use (said in ``installed``); Docker comes with the set-up (scripts/docker.sh, which
starts the daemon with ``--experimental`` for checkpoints and the project's CRIU first on its PATH). Podman is
pointed at the project's CRIU the same way (runc finds ``criu`` on PATH).

    .venv/bin/python bench/peer_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stats import pss_kib, summary  # noqa: E402
from workspace_bench import idle_pss  # noqa: E402

from bunshin_async import Image, Workspace
from bunshin_async._host import _paths  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
GUEST = REPO / "tests" / "fork" / "guest_state.py"
DOCKER = "/usr/bin/docker"  # Debian's client for Debian's daemon (another docker may sit earlier on PATH)

# The temporary directory scripts/docker.sh gives the daemon: containerd 1.6 leaves each checkpoint's CRIU images
# there (ctrd-checkpoint<N>, containerd#10166), at each checkpoint and at each start from one. Only a daemon
# started by docker.sh writes in it; the benchmark removes what appeared while its own checkpoints ran (another
# run's may be in use). A daemon started otherwise leaves them in its own temporary directory (/tmp).
DOCKER_TMPDIR = Path(os.environ.get("BUNSHIN_DOCKER_TMPDIR", "/var/lib/bunshin-docker/tmp"))


def checkpoint_images() -> set[Path]:
    return set(DOCKER_TMPDIR.glob("ctrd-checkpoint*"))


def remove_images(images: set[Path]) -> None:
    for image in images:
        shutil.rmtree(image, ignore_errors=True)


DOCKER_SOCK = "/var/run/docker.sock"
PEERS = ("docker", "podman", "bwrap")
CRIU_PATH = f"{REPO / 'criu' / 'dist' / 'sbin'}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
WAIT_GUEST = "while [ ! -s /workspace/digest ]; do sleep 0.05; done; cat /workspace/digest"


class PeerFailed(Exception):
    """A peer could not do what a row asks; the reason goes into the JSON."""


# Every container this run starts carries it, so whatever a failed step left (a container created but never
# started, say) is removed at the end.
RUN_LABEL = f"bunshin-peer-run={os.getpid()}"


async def run(*argv: str, timeout: float = 300, check: bool = True, env: dict[str, str] | None = None) -> str:
    for cli in ((DOCKER,), podman()):
        if argv[: len(cli) + 1] == (*cli, "run"):
            argv = (*argv[: len(cli) + 1], "--label", RUN_LABEL, *argv[len(cli) + 1 :])
    if argv[:4] == (*podman(), "run"):
        # Explicit nofile/nproc: podman 4.3 hands runc the limits it raised for itself, which runc 1.1.5 then fails
        # to set (EPERM) once it has dropped CAP_SYS_RESOURCE.
        argv = (*argv[:4], "--ulimit", "nofile=1024:4096", "--ulimit", "nproc=4096:4096", *argv[4:])
    with anyio.fail_after(timeout):
        res = await anyio.run_process(list(argv), check=False, env=env)
    if check and res.returncode:
        err = (res.stderr or b"").decode(errors="replace").strip()[-400:]
        raise PeerFailed(f"{' '.join(argv[:4])}...: exit {res.returncode}: {err}")
    return res.stdout.decode(errors="replace").strip()


def podman(*args: str) -> tuple[str, ...]:
    return ("podman", "--runtime", "runc", *args)


# ---------------------------------------------------------------------------------------------------- set-up


def ensure_packages(installed: list[str]) -> None:
    """Install podman and bubblewrap from Debian's packages the first time the benchmark needs them."""
    missing = [pkg for pkg, exe in (("podman", "podman"), ("bubblewrap", "bwrap")) if shutil.which(exe) is None]
    if not missing:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing, "runc"]
    if subprocess.run(cmd, env=env, capture_output=True).returncode:
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=True, capture_output=True)
        subprocess.run(cmd, env=env, check=True, capture_output=True)
    installed += missing


async def import_images(image: Image) -> dict[str, str]:
    """The base image in Docker and Podman, tagged by content, with the guest program added; built once."""
    tag = hashlib.sha256(f"{image.digest}:{hashlib.sha256(GUEST.read_bytes()).hexdigest()}".encode()).hexdigest()[:12]
    refs: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bunshin-peer-") as tmp:
        ctx = Path(tmp)
        shutil.copy(GUEST, ctx / "guest_state.py")
        (ctx / "Dockerfile").write_text(
            "ARG BASE\nFROM $BASE\nCOPY guest_state.py /opt/guest_state.py\nRUN mkdir -p /workspace\n"
        )
        tarball = ctx / "rootfs.tar"
        for engine, cli in (("docker", (DOCKER,)), ("podman", podman())):
            ref = f"localhost/bunshin-peer:{tag}"
            if not await run(*cli, "images", "-q", ref, check=False):
                if not tarball.exists():
                    await run("tar", "-C", image.rootfs, "-cf", str(tarball), ".")
                base = f"localhost/bunshin-peer-base:{tag}"
                await run(*cli, "import", str(tarball), base, timeout=600)
                await run(*cli, "build", "--network=none", "--build-arg", f"BASE={base}", "-t", ref, str(ctx))
            refs[engine] = ref
    return refs


# ---------------------------------------------------------------------------------------------------- row helpers


async def timed(n: int, once: Callable[[], Awaitable[None]]) -> dict[str, float]:
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        await once()
        samples.append(time.perf_counter() - t)
    return summary(samples)


def ratios(row: dict[str, Any], key: str = "median") -> None:
    """``ratio_to_bunshin`` for every peer of ``row`` that has a figure."""
    base = row.get("bunshin", {}).get(key)
    for name, fig in row.items():
        if name != "bunshin" and isinstance(fig, dict) and key in fig and base:
            fig["ratio_to_bunshin"] = round(fig[key] / base, 2)


async def attempt(row: dict[str, Any], name: str, fn: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    try:
        row[name] = await fn()
    except Exception as exc:  # a peer's failure is a result: record it, keep measuring the others
        row[name] = {"failed": f"{type(exc).__name__}: {exc}"[:600]}


def tree_pids(root_pid: int) -> list[int]:
    try:
        proc = psutil.Process(root_pid)
        return [root_pid, *(c.pid for c in proc.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def helper_pids(cmd_part: str, container_ids: list[str]) -> list[int]:
    """Host-side per-container helpers (containerd-shim-runc-v2, conmon) whose command line names a container."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if cmd_part in cmdline and any(cid[:12] in cmdline for cid in container_ids):
            out.append(p.pid)
    return out


def bwrap_argv(rootfs: str, *cmd: str) -> list[str]:
    return [
        "bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", rootfs, "/",
        "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/workspace", *cmd,
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------------- rows


async def row_create(image: Image, refs: dict[str, str], n: int) -> dict[str, Any]:
    row: dict[str, Any] = {}

    async def bunshin() -> None:
        async with Workspace(image) as ws:
            await ws.exec(["true"])

    async def docker() -> None:
        await run(DOCKER, "run", "--rm", "--network=none", refs["docker"], "true")

    async def podman_run() -> None:
        await run(*podman("run", "--rm", "--network=none", refs["podman"], "true"))

    async def bwrap() -> None:
        await run(*bwrap_argv(image.rootfs, "true"))

    for name, once in (("bunshin", bunshin), ("docker", docker), ("podman", podman_run), ("bwrap", bwrap)):
        await attempt(row, name, lambda once=once: timed(n, once))  # type: ignore[misc]
    ratios(row)
    return row


async def _void(aw: Awaitable[Any]) -> None:
    await aw


async def row_exec(image: Image, refs: dict[str, str], n: int) -> dict[str, Any]:
    row: dict[str, Any] = {}

    async def bunshin() -> dict[str, Any]:
        async with Workspace(image) as ws:
            for _ in range(10):
                await ws.exec(["true"])
            return await timed(n, lambda: _void(ws.exec(["true"])))

    async def cli(engine: str, base: tuple[str, ...]) -> dict[str, Any]:
        cid = await run(*base, "run", "-d", "--network=none", refs[engine], "sleep", "infinity")
        try:
            return await timed(n, lambda: _void(run(*base, "exec", cid, "true")))
        finally:
            await run(*base, "rm", "-f", cid, check=False)

    async def docker_api() -> dict[str, Any]:
        cid = await run(DOCKER, "run", "-d", "--network=none", refs["docker"], "sleep", "infinity")
        transport = httpx.AsyncHTTPTransport(uds=DOCKER_SOCK)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://docker", timeout=30) as http:

                async def once() -> None:
                    r = await http.post(f"/containers/{cid}/exec", json={"Cmd": ["true"]})
                    r.raise_for_status()
                    exec_id = r.json()["Id"]
                    (await http.post(f"/exec/{exec_id}/start", json={"Detach": False})).raise_for_status()
                    # The start call can return before the engine has recorded the exit: wait for it.
                    info = (await http.get(f"/exec/{exec_id}/json")).json()
                    for _ in range(1000):
                        if not info["Running"]:
                            break
                        await anyio.sleep(0.001)
                        info = (await http.get(f"/exec/{exec_id}/json")).json()
                    if info["ExitCode"] != 0:
                        raise PeerFailed(f"exec of true exited {info['ExitCode']}")

                return await timed(n, once)
        finally:
            await run(DOCKER, "rm", "-f", cid, check=False)

    await attempt(row, "bunshin", bunshin)
    await attempt(row, "docker", lambda: cli("docker", (DOCKER,)))
    await attempt(row, "docker_api", docker_api)
    await attempt(row, "podman", lambda: cli("podman", podman()))
    ratios(row)
    return row


async def row_fork(image: Image, refs: dict[str, str], mib: int, copies: list[int]) -> dict[str, Any]:
    row: dict[str, Any] = {}
    guest = ["python3", "/opt/guest_state.py", "server", str(mib)]

    async def bunshin() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with Workspace(image) as ws:
            await ws.write_file("guest_state.py", GUEST.read_bytes())
            await ws.spawn(["python3", "/workspace/guest_state.py", "server", str(mib)])
            digest = (await ws.exec(["sh", "-c", WAIT_GUEST], timeout=600)).stdout.strip()
            for n in copies:
                t = time.perf_counter()
                forked = await ws.fork(n)
                ms = (time.perf_counter() - t) * 1000
                try:
                    for c in forked:
                        got = (await c.exec(["sh", "-c", "cat /workspace/digest"])).stdout.strip()
                        if got != digest:
                            raise PeerFailed(f"copy {c.id} has digest {got!r}, parent {digest!r}")
                    pids = [p for c in forked if c.cgroup for p in c.cgroup.pids()]
                    out[str(n)] = {"ms": round(ms, 1), "total_pss_mib": round(pss_kib(pids) / 1024, 1)}
                finally:
                    for c in forked:
                        await c.aclose()
        return out

    async def podman_fork() -> dict[str, Any]:
        env = {**os.environ, "PATH": CRIU_PATH}
        out: dict[str, Any] = {}
        cid = await run(*podman("run", "-d", "--network=none", refs["podman"], *guest))
        made: list[str] = []
        try:
            digest = await run(*podman("exec", cid, "sh", "-c", WAIT_GUEST), timeout=600)
            with tempfile.TemporaryDirectory(prefix="bunshin-peer-cp-", dir="/var/tmp") as tmp:
                for n in copies:
                    export = f"{tmp}/cp-{n}.tar"
                    t = time.perf_counter()
                    await run(*podman("container", "checkpoint", "--leave-running", f"--export={export}", cid),
                              env=env, timeout=600)  # fmt: skip
                    names = []
                    for i in range(n):
                        name = f"bunshin-peer-{os.getpid()}-{n}-{i}"
                        await run(*podman("container", "restore", f"--import={export}", "--name", name),
                                  env=env, timeout=600)  # fmt: skip
                        names.append(name)
                        made.append(name)
                    ms = (time.perf_counter() - t) * 1000
                    pids: list[int] = []
                    for name in names:
                        got = await run(*podman("exec", name, "cat", "/workspace/digest"))
                        if got != digest:
                            raise PeerFailed(f"restored {name} has digest {got!r}, parent {digest!r}")
                        pid = int(await run(*podman("inspect", "-f", "{{.State.Pid}}", name)))
                        pids += tree_pids(pid)
                    out[str(n)] = {"ms": round(ms, 1), "total_pss_mib": round(pss_kib(pids) / 1024, 1)}
                    for name in names:
                        await run(*podman("rm", "-f", name), check=False)
                        made.remove(name)
        finally:
            for name in made:
                await run(*podman("rm", "-f", name), check=False)
            await run(*podman("rm", "-f", cid), check=False)
        return out

    async def docker_fork() -> dict[str, Any]:
        info = await run(DOCKER, "version", "--format", "{{.Server.Experimental}}")
        if info != "true":
            raise PeerFailed("docker checkpoint needs a daemon started with --experimental (scripts/docker.sh does)")
        out: dict[str, Any] = {}
        cid = await run(DOCKER, "run", "-d", "--network=none", "--security-opt", "seccomp=unconfined",
                        refs["docker"], *guest)  # fmt: skip
        made: list[str] = []
        images = await anyio.to_thread.run_sync(checkpoint_images)
        try:
            digest = await run(DOCKER, "exec", cid, "sh", "-c", WAIT_GUEST, timeout=600)
            for n in copies:
                cp = f"cp{n}"
                t = time.perf_counter()
                await run(DOCKER, "checkpoint", "create", "--leave-running", cid, cp, timeout=600)
                names = []
                for i in range(n):
                    name = f"bunshin-peer-{os.getpid()}-{n}-{i}"
                    await run(DOCKER, "create", "--name", name, "--network=none", "--security-opt",
                              "seccomp=unconfined", refs["docker"], *guest)  # fmt: skip
                    made.append(name)
                    names.append(name)
                    # Docker 20.10 restores only from a container's own checkpoint dir (`--checkpoint-dir` on
                    # start: "custom checkpointdir is not supported"), so the checkpoint is copied there, the
                    # known workaround; restoring one checkpoint into other containers is where Docker falls short.
                    new_id = await run(DOCKER, "inspect", "-f", "{{.Id}}", name)
                    src = Path(f"/var/lib/docker/containers/{cid}/checkpoints/{cp}")
                    dst = Path(f"/var/lib/docker/containers/{new_id}/checkpoints/{cp}")
                    await anyio.to_thread.run_sync(functools.partial(shutil.copytree, src, dst, symlinks=True))
                    await run(DOCKER, "start", "--checkpoint", cp, name, timeout=600)
                ms = (time.perf_counter() - t) * 1000
                pids: list[int] = []
                for name in names:
                    got = await run(DOCKER, "exec", name, "cat", "/workspace/digest", check=False)
                    if got != digest:
                        alive = await run(DOCKER, "top", name, check=False)
                        raise PeerFailed(
                            f"restored {name} lacks the parent's files (digest {got!r}, parent {digest!r}): docker "
                            "checkpoint carries the processes"
                            + (" (running)" if "guest_state" in alive else " (not running)")
                            + ", not the container's writable layer"
                        )
                    pids += tree_pids(int(await run(DOCKER, "inspect", "-f", "{{.State.Pid}}", name)))
                out[str(n)] = {"ms": round(ms, 1), "total_pss_mib": round(pss_kib(pids) / 1024, 1)}
                for name in names:
                    await run(DOCKER, "rm", "-f", name, check=False)
                    made.remove(name)
        finally:
            for name in made:
                await run(DOCKER, "rm", "-f", name, check=False)
            await run(DOCKER, "rm", "-f", cid, check=False)
            await anyio.to_thread.run_sync(remove_images, await anyio.to_thread.run_sync(checkpoint_images) - images)
        return out

    await attempt(row, "bunshin", bunshin)
    await attempt(row, "podman", podman_fork)
    await attempt(row, "docker", docker_fork)
    row["bwrap"] = {"failed": "bubblewrap has no checkpoint or fork of a running sandbox"}
    base = row.get("bunshin", {})
    for name in ("podman", "docker"):
        for n, fig in row.get(name, {}).items():
            if isinstance(fig, dict) and n in base:
                fig["ratio_to_bunshin"] = round(fig["ms"] / base[n]["ms"], 2)
                fig["memory_ratio_to_bunshin"] = round(fig["total_pss_mib"] / max(base[n]["total_pss_mib"], 0.1), 2)
    return row


async def row_idle(image: Image, refs: dict[str, str], count: int) -> dict[str, Any]:
    row: dict[str, Any] = {}

    async def bunshin() -> dict[str, Any]:
        fig = await idle_pss(lambda: Workspace(image), count)  # the workspace benchmark's own measurement
        mib = fig["per_workspace_mib"]
        return {"median": mib, "per_sandbox_mib": mib, "host_helpers_mib": 0.0}

    async def engine(name: str, base: tuple[str, ...], helper: str) -> dict[str, Any]:
        ids: list[str] = []
        try:
            for _ in range(count):
                ids.append(await run(*base, "run", "-d", "--network=none", refs[name], "sleep", "infinity"))
            await anyio.sleep(0.5)
            inside: list[int] = []
            for cid in ids:
                inside += tree_pids(int(await run(*base, "inspect", "-f", "{{.State.Pid}}", cid)))
            mib = pss_kib(inside) / 1024 / count
            helpers = pss_kib(helper_pids(helper, ids)) / 1024 / count
            # The per-container shim or conmon is part of what each sandbox costs the host.
            return {
                "median": round(mib + helpers, 2),
                "per_sandbox_mib": round(mib, 2),
                "host_helpers_mib": round(helpers, 2),
            }
        finally:
            if ids:
                await run(*base, "rm", "-f", *ids, check=False)

    async def bwrap() -> dict[str, Any]:
        procs = [
            subprocess.Popen(bwrap_argv(image.rootfs, "sleep", "infinity"), stdin=subprocess.DEVNULL)
            for _ in range(count)
        ]
        try:
            await anyio.sleep(0.5)
            mib = pss_kib([p for proc in procs for p in tree_pids(proc.pid)]) / 1024 / count
            return {"median": round(mib, 2), "per_sandbox_mib": round(mib, 2), "host_helpers_mib": 0.0}
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()

    await attempt(row, "bunshin", bunshin)
    await attempt(row, "docker", lambda: engine("docker", (DOCKER,), "containerd-shim"))
    await attempt(row, "podman", lambda: engine("podman", podman(), "conmon"))
    await attempt(row, "bwrap", bwrap)
    ratios(row)
    return row


async def row_concurrent(image: Image, refs: dict[str, str], count: int) -> dict[str, Any]:
    row: dict[str, Any] = {}

    async def all_at_once(one: Callable[[int], Awaitable[None]]) -> dict[str, Any]:
        t = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(count):
                tg.start_soon(one, i)
        wall = (time.perf_counter() - t) * 1000
        return {"median": round(wall, 1), "wall_ms": round(wall, 1), "sandboxes": count}

    async def bunshin() -> dict[str, Any]:
        workspaces = [Workspace(image) for _ in range(count)]
        try:

            async def one(i: int) -> None:
                await workspaces[i].start()
                await workspaces[i].exec(["true"])

            return await all_at_once(one)
        finally:
            for ws in workspaces:
                await ws.aclose()

    async def engine(base: tuple[str, ...], ref: str) -> dict[str, Any]:
        label = f"bunshin-peer-{os.getpid()}-{time.monotonic_ns()}"
        try:

            async def one(i: int) -> None:
                await run(*base, "run", "--rm", "--network=none", "--label", label, ref, "true", timeout=600)

            return await all_at_once(one)
        finally:
            left = (await run(*base, "ps", "-aq", "--filter", f"label={label}", check=False)).split()
            if left:
                await run(*base, "rm", "-f", *left, check=False)

    await attempt(row, "bunshin", bunshin)
    await attempt(row, "docker", lambda: engine((DOCKER,), refs["docker"]))
    await attempt(row, "podman", lambda: engine(podman(), refs["podman"]))
    await attempt(row, "bwrap", lambda: all_at_once(lambda i: _void(run(*bwrap_argv(image.rootfs, "true")))))
    ratios(row)
    return row


async def main(args: argparse.Namespace) -> dict[str, Any]:
    installed: list[str] = []
    await anyio.to_thread.run_sync(ensure_packages, installed)
    image = Image.base()
    refs = await import_images(image)
    out: dict[str, Any] = {
        "benchmark": "peers",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.node()} {os.cpu_count()} cores, {psutil.virtual_memory().total >> 30} GiB, "
        f"kernel {platform.release()}",
        "installed": installed,
        "versions": {
            "docker": await run(DOCKER, "version", "--format", "{{.Server.Version}}", check=False),
            "podman": await run("podman", "--version", check=False),
            "bwrap": await run("bwrap", "--version", check=False),
        },
        "image": image.name,
        "mib": args.mib,
        "run_label": RUN_LABEL,  # what its containers carry: a check for leftovers looks for its own only
    }
    try:
        out["create_to_first_exec"] = await row_create(image, refs, args.repeat)
        out["exec_round_trip"] = await row_exec(image, refs, args.repeat)
        out["live_fork"] = await row_fork(image, refs, args.mib, [1, args.copies])
        out["idle_memory"] = await row_idle(image, refs, args.idle)
        out["concurrent_creations"] = await row_concurrent(image, refs, args.concurrent)
    finally:
        with anyio.CancelScope(shield=True):
            for cli in ((DOCKER,), podman()):
                left = (await run(*cli, "ps", "-aq", "--filter", f"label={RUN_LABEL}", check=False)).split()
                if left:
                    await run(*cli, "rm", "-f", *left, check=False)
    return out


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repeats and small sizes (the test's mode)")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--mib", type=int, default=200)
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--idle", type=int, default=16)
    parser.add_argument("--concurrent", type=int, default=32)
    args = parser.parse_args()
    if args.quick:
        args.repeat, args.mib, args.copies, args.idle, args.concurrent = 2, 16, 2, 2, 4
    if not Path(_paths.init_binary()).exists():
        sys.exit("bunshin is not set up: run `make setup`")
    print(json.dumps(anyio.run(main, args), indent=2))


if __name__ == "__main__":
    cli()
