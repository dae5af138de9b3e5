"""A small inspect task on the ``bunshin`` sandbox, for ``inspect eval`` (inspect_suite.py). It imports nothing of
Bunshin: inspect must find the provider through the package's entry point."""

from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.scorer import includes
from inspect_ai.solver import Generate, TaskState, solver
from inspect_ai.util import sandbox


@solver
def run_in_sandbox():  # type: ignore[no-untyped-def]
    async def solve(state: TaskState, generate: Generate) -> TaskState:
        r = await sandbox().exec(["sh", "-c", "cat /etc/hostname; id -un"])
        state.output.completion = r.stdout
        return state

    return solve


@task
def bunshin_hello() -> Task:
    return Task(
        dataset=[Sample(input="who", target="bunshin")], solver=run_in_sandbox(), scorer=includes(), sandbox="bunshin"
    )
