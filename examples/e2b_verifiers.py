"""verifiers' ``E2BRuntime`` (PyPI ``verifiers[e2b]``, unmodified) on ``bunshin e2b serve``: a template build from a
Docker image, a command with its exit code and both streams, a binary file round trip, teardown.

verifiers pins ``mcp==2.0.0`` and ``openai<3``, so it lives in an environment of its own, not beside Bunshin::

    python3 -m venv /tmp/venv-verifiers && /tmp/venv-verifiers/bin/pip install 'verifiers[e2b]==0.4.0'
    sudo bunshin e2b serve        # another terminal: it prints E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY; export them
    /tmp/venv-verifiers/bin/python examples/e2b_verifiers.py IMAGE   # IMAGE: a Docker image of the local engine
"""

from __future__ import annotations

import asyncio
import sys

from verifiers.v1.runtimes.e2b import E2BConfig, E2BRuntime


async def main(image: str) -> None:
    # one core and 1 GB (E2B's template rules); no creation pacing (a local server has no rate limit)
    runtime = E2BRuntime(E2BConfig(image=image, cpu=1, memory=1.0, creates_per_sec=None), name="bunshin")
    await runtime.start()  # builds the template vf-<digest> from the image, then creates a sandbox of it
    try:
        result = await runtime.run(["sh", "-c", "echo hi; echo err >&2; exit 3"], {"X": "1"})
        assert (result.exit_code, result.stdout, result.stderr) == (3, "hi\n", "err\n"), result
        await runtime.write("data/in.bin", b"payload\x00\xff")
        assert await runtime._read("data/in.bin") == b"payload\x00\xff"
        print("verifiers E2BRuntime on Bunshin: command and file round trip ok")
    finally:
        await runtime.teardown()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
