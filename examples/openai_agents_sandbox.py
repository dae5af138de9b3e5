"""An OpenAI Agents SDK ``SandboxAgent`` whose shell runs in a Bunshin workspace; then the session is forked.

    python examples/openai_agents_sandbox.py          # the SDK's scripted model stands in for the LLM
    python examples/openai_agents_sandbox.py --live   # a real model (OPENAI_API_KEY; --model NAME)

Needs root (workspaces) and ``pip install 'bunshin[openai-agents]'``.
"""

from __future__ import annotations

import asyncio
import sys

from agents import RunConfig, Runner, set_tracing_disabled
from agents.sandbox import SandboxAgent, SandboxRunConfig
from agents.testing import ScriptedModel, assistant_message, function_call

from bunshin_async.integrations.openai_agents import BunshinSandboxClient, BunshinSandboxClientOptions

TASK = "Write the first ten squares to squares.txt, one per line, and tell me their sum."


def model() -> object:
    if "--live" in sys.argv:
        return sys.argv[sys.argv.index("--model") + 1] if "--model" in sys.argv else "gpt-5-mini"
    cmd = "python3 -c 'print(*[i*i for i in range(1, 11)], sep=chr(10))' > squares.txt && paste -sd+ squares.txt | bc"
    return ScriptedModel(
        [[function_call("exec_command", {"cmd": cmd}, call_id="c1")], [assistant_message("The sum is 385.")]]
    )


async def main() -> None:
    set_tracing_disabled("--live" not in sys.argv)  # the scripted run has nothing to export
    async with BunshinSandboxClient() as client:
        session = await client.create(options=BunshinSandboxClientOptions(memory=1 << 30, pids=512))
        async with session:
            agent = SandboxAgent(name="calc", instructions="Use the shell.", model=model())  # type: ignore[arg-type]
            result = await Runner.run(agent, TASK, run_config=RunConfig(sandbox=SandboxRunConfig(session=session)))
            print("answer:", result.final_output)
            copies = await client.fork(session, 3)  # three live copies of the finished state
            for i, copy in enumerate(copies):
                r = await copy.exec(f"echo {i} >> squares.txt; wc -l < squares.txt")
                print(f"copy {i}: {r.stdout.decode().strip()} lines")
                await client.delete(copy)
            print("original:", (await session.exec("wc -l < squares.txt")).stdout.decode().strip(), "lines")


if __name__ == "__main__":
    asyncio.run(main())
