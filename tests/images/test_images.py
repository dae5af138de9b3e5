"""Real images from the real Docker engine (built in the set-up, ``_build``) as workspaces: files, config, forks
with processes and memory, the formats ``docker save`` writes, and a GRPO group on a SWE-style task image."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import aiohttp
import anyio
import pytest

from bunshin_async import Image, ImageError, InvalidArgument, Workspace
from bunshin_async._images._docker import AiodockerEngine
from bunshin_async._images._layers import LayerStore
from bunshin_async.rollout import GroupRollout, RolloutContext, Step, Task, Trajectory

from . import _build
from ._archives import legacy_save_to_oci
from ._faults import HeldExport, HeldUnpack

# A process whose state lives only in its memory: a random token drawn at start, written out on SIGUSR1. A copy
# that answers with the parent's token was restored with its memory (a restarted process would draw a new one).
TOKEN_PROC = (
    'T=$(od -An -N8 -tx1 /dev/urandom | tr -d " \\n"); trap \'echo "$T" > /tmp/token\' USR1; '
    "echo up > /tmp/token.ready; while :; do sleep 0.02; done"
)


async def _read_when(ws: Workspace, path: str, timeout: float = 20) -> str:
    with anyio.fail_after(timeout):
        while True:
            r = await ws.exec(f"cat {path} 2>/dev/null")
            if r.exit_code == 0 and r.stdout.strip():
                return r.stdout.strip()
            await anyio.sleep(0.05)


async def assert_forks_with_state(ws: Workspace, n: int = 2) -> None:
    """Fork ``ws`` ``n`` ways with a live process holding state in memory; each copy is criu-cow and has it."""
    proc = await ws.spawn(["/bin/sh", "-c", TOKEN_PROC])
    await _read_when(ws, "/tmp/token.ready")
    await proc.signal(10)
    token = await _read_when(ws, "/tmp/token")
    await ws.exec("rm /tmp/token")
    copies = await ws.fork(n)
    try:
        for c in copies:
            assert c.fork_mode == "criu-cow"
            cp = c.setup[-1]
            assert cp.argv is not None and cp.argv[-1] == TOKEN_PROC
            from bunshin_async import BackgroundProcess

            bp = BackgroundProcess(c, proc.pid, cp)
            assert await bp.poll() is None
            assert (await c.exec("test -e /tmp/token")).exit_code == 1
            await bp.signal(10)
            assert await _read_when(c, "/tmp/token") == token
    finally:
        for c in copies:
            await c.aclose()


async def test_a_whiteouts_and_opaque_dirs_inside_the_workspace(layers_image: Image) -> None:
    assert len(layers_image.layers) == 3  # the imported base and two RUN layers
    async with Workspace(layers_image) as ws:
        r = await ws.exec(
            "cd /data && ls -A . opq keep f2d && cat file opq/new keep/k keep/k2 d2f f2d/y && "
            "test ! -e gone && test ! -e gone-dir && test ! -e opq/old && test ! -e opq/sub && test -f d2f && "
            "test -d f2d && test ! -e /usr/share/doc && test ! -e /data/.wh.gone"
        )
        assert r.exit_code == 0, r
        assert r.stdout.split("\n\n")[0].split() == [".:", "d2f", "f2d", "file", "keep", "opq"]
        assert "opq:\nnew" in r.stdout and "keep:\nk\nk2" in r.stdout and "f2d:\ny" in r.stdout
        assert r.stdout.endswith("replaced\nnew\nk\nk2\nnow-file\nnow-dir\n")
        # the workspace can delete and re-create what the layers hold, as in any overlay
        r = await ws.exec("rm -r /data/opq && mkdir /data/opq && echo mine > /data/opq/x && ls /data/opq")
        assert r.stdout == "x\n"
        await assert_forks_with_state(ws)


async def test_b_env_workdir_and_entrypoint_of_the_config(user_image: Image) -> None:
    cfg = user_image.config
    assert cfg.working_dir == "/testbed" and cfg.user == "app" and cfg.env["VAR"] == "hello from the image"
    async with Workspace(user_image, env={"GREETING": "caller"}) as ws:
        assert ws.workdir == "/testbed"
        r = await ws.exec('pwd; echo "$VAR"; echo "$GREETING"; echo "$PATH"')
        assert r.stdout == "/testbed\nhello from the image\ncaller\n/opt/tools:/usr/local/bin:/usr/bin:/bin\n"
        await ws.write_file("notes.txt", "relative to the image's WorkingDir\n")
        assert (await ws.exec("cat /testbed/notes.txt")).stdout.startswith("relative")
        await ws.start_entrypoint()
        log = await _read_when(ws, "/testbed/entry.log")
        assert log.endswith("in /testbed with the-default-cmd")
        await ws.start_entrypoint(["other-arg"])
        await assert_forks_with_state(ws)
    async with Workspace(user_image, workdir="/srv") as ws:
        assert (await ws.exec("pwd")).stdout == "/srv\n"


async def test_b_image_without_entrypoint(layers_image: Image) -> None:
    async with Workspace(layers_image) as ws:
        assert ws.workdir == "/workspace"  # no WorkingDir in the config
        with pytest.raises(InvalidArgument, match="no Entrypoint or Cmd"):
            await ws.start_entrypoint()


async def test_d_debian_13_with_python_3_13(trixie_image: Image) -> None:
    top = Path(trixie_image.layers[-1])  # the debootstrapped root
    assert (top / "etc/debian_version").read_text().startswith("13.")
    assert any(top.glob("usr/lib/python3.13/os.py"))
    assert trixie_image.config.env["PYTHONDONTWRITEBYTECODE"] == "1"


async def test_docker_save_forms_and_the_engine_agree(
    tmp_path: Path, layers_image: Image, bookworm_tag: str, fresh_store: LayerStore
) -> None:
    tag = _build.build("layers", bookworm_tag)
    _build.docker("save", "-o", str(tmp_path / "save.tar"), tag)
    legacy = await Image.from_docker_archive(tmp_path / "save.tar", store=fresh_store)
    assert legacy.digest == layers_image.digest and legacy.name == tag
    assert [Path(p).name for p in legacy.layers] == [Path(p).name for p in layers_image.layers]
    legacy_save_to_oci(tmp_path / "save.tar", tmp_path / "oci", ref="converted:1")  # Docker 25+'s save layout
    oci = await Image.from_oci(tmp_path / "oci", store=fresh_store)
    new_form = await Image.from_docker_archive(tmp_path / "oci", store=fresh_store)
    assert oci.digest == new_form.digest and oci.layers == new_form.layers == legacy.layers  # layers shared
    with pytest.raises(ImageError, match="no image"):
        await Image.from_docker("bunshin-test/does-not-exist:nope", store=fresh_store)


class RunTests:
    """The rollout's 'agent': leaves a mark of its own, then runs the project's tests in its copy."""

    async def run(self, ctx: RolloutContext) -> Trajectory:
        await ctx.ws.write_file("mine.txt", f"{ctx.rollout}\n")
        r = await ctx.ws.exec("python -m unittest discover -s tests -v 2>&1; cat setup.log mine.txt", timeout=120)
        return Trajectory(
            task_id=ctx.task.task_id,
            rollout=ctx.rollout,
            steps=[Step(tool="bash", args={"command": "tests"}, observation=r.stdout, exit_code=r.exit_code)],
        )


async def test_e_group_rollout_on_a_swe_task_image(swe_image: Image) -> None:
    task = Task(
        task_id="swe-calc",
        prompt="fix calc",
        setup=["python -c 'import calc, sys; print(sys.prefix)' >> setup.log"],
        background=["python -c 'import calc, time; time.sleep(1e6)'"],  # a warm interpreter, forked live
        reward_command="cd /testbed && python -m unittest discover -s tests",
        image=swe_image.name,  # a reference, looked up in the layer store
    )
    async with GroupRollout(task, 4, RunTests(), fork="always") as group:  # the live interpreter in every copy
        results = [r async for r in group]
    assert group.image is not None and group.image.digest == swe_image.digest
    assert sorted(r.rollout for r in results) == [0, 1, 2, 3]
    for r in results:
        assert r.status == "finished" and r.fork_mode == "criu-cow" and r.reward == 1.0, r
        assert r.trajectory is not None
        out = r.trajectory.steps[0].observation or ""
        assert "Ran 2 tests" in out and "OK" in out
        assert out.endswith(f"/opt/venv\n{r.rollout}\n")  # set up once, in the venv; each copy its own files


async def test_cancelled_engine_import_leaves_nothing(layers_image: Image, bookworm_tag: str, tmp_path: Path) -> None:
    tag = _build.build("layers", bookworm_tag)
    store = HeldUnpack(tmp_path / "store")

    async def cancelled_when(engine: AiodockerEngine, reached: Callable[[], bool]) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: Image.from_docker(tag, engine=engine, store=store))
            with anyio.fail_after(120):
                while not reached():
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        assert [p.name for p in store.root.iterdir() if p.name.startswith(".export-")] == []
        assert [p.name for p in store.layers.iterdir() if p.name.startswith(".tmp-")] == []

    held = HeldExport()
    await cancelled_when(held, held.exported.is_set)  # during the export: its archive written, the import not begun
    assert not store.unpacking.is_set()
    await cancelled_when(AiodockerEngine(), store.unpacking.is_set)  # during the unpacking of the first layer
    image = await Image.from_docker(tag, store=store)  # and a later import completes
    assert image.digest == layers_image.digest


async def test_export_cancelled_mid_stream_closes_its_response(bookworm_tag: str, tmp_path: Path) -> None:
    """Cancelled once the archive has started to arrive (not at a guessed delay), the engine's response is closed
    there and then, not left to the garbage collector (which warns of an unclosed connection, in whatever test)."""
    tag = _build.build("layers", bookworm_tag)
    dest = tmp_path / "image.tar"
    async with anyio.create_task_group() as tg:
        tg.start_soon(AiodockerEngine().save, tag, dest)
        with anyio.fail_after(60):
            while not dest.exists() or dest.stat().st_size == 0:
                await anyio.sleep(0.005)
        tg.cancel_scope.cancel()
    assert 0 < dest.stat().st_size
    unclosed = [o for o in gc.get_objects() if isinstance(o, aiohttp.ClientResponse) and not o.closed]
    assert unclosed == []
