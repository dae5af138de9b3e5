"""verifiers' ``E2BRuntime`` (PyPI ``verifiers[e2b]``, unmodified), run by ``test_verifiers.py`` with
``.venv-verifiers``'s Python against an E2B server that the environment (``E2B_API_URL``, ``E2B_SANDBOX_URL``,
``E2B_API_KEY``) names. It builds its template from a Docker image of the local engine (argv[1]), then prints, as
one JSON line, what each of its calls returned; the test judges them."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from _sdk_exit import exit_without_finalizing  # noqa: E402
from verifiers.v1.runtimes.e2b import E2BConfig, E2BRuntime


async def main(image: str) -> dict[str, object]:
    # One core and 1 GB (E2B's template rules); no creation pacing (a local server has no rate limit).
    runtime = E2BRuntime(E2BConfig(image=image, cpu=1, memory=1.0, creates_per_sec=None), name="bunshin")
    out: dict[str, object] = {}
    await runtime.start()  # builds the template vf-<digest> from the image, creates a sandbox of it, makes /app
    try:
        out["sandbox"] = runtime.info.id
        out["template"] = runtime.info.template
        res = await runtime.run(["sh", "-c", 'echo "hi $X"; echo err >&2; pwd; id -un; exit 3'], {"X": "1"})
        out["run"] = [res.exit_code, res.stdout, res.stderr]
        payload = bytes(range(256)) * 64
        await runtime.write("data/in.bin", payload)
        out["file_equal"] = await runtime._read("data/in.bin") == payload
        res = await runtime.run(["sha256sum", "data/in.bin"], {})
        out["file_sum"] = res.stdout.split()[0] if res.exit_code == 0 else res.stderr
        res = await runtime.run_program(["sh", "-c", "echo durable; echo warn >&2; exit 5"], {})
        out["program"] = [res.exit_code, res.stdout, res.stderr]
        proc = await runtime.open_process(["head", "-n", "1"], {})
        await proc.write(b"line \xff\n")
        out["process"] = [await proc.wait(), b"".join([c async for c in proc.stdout]).decode("latin-1")]
    finally:
        await runtime.teardown()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))), flush=True)
    exit_without_finalizing(0)  # e2b's HTTP client can abort a finalizing 3.11 (bench/_sdk_exit.py)
