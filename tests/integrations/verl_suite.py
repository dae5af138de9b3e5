"""The verl integration through verl's real tool loading (``initialize_tools_from_config``), agent-loop registry and
``ToolAgentLoop`` state machine, with a scripted model server standing in only for the LLM (it returns token ids
of hermes tool calls). Runs in the verl environment (``.venv-verl``, made by ``scripts/setup.sh``):
``tests/integrations/test_verl.py`` runs this file there."""

from __future__ import annotations

import asyncio
import re
import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

with warnings.catch_warnings():
    # verl imports ray.experimental's state API, which ray deprecates on import; nothing here uses it.
    warnings.simplefilter("ignore", DeprecationWarning)
    import hydra
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry
    from verl.tools.tool_registry import initialize_tools_from_config
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.workers.rollout.replica import TokenOutput

    from bunshin_async.integrations.verl import AGENT_NAME, BunshinToolAgentLoop, VerlRuntime

from tests.integrations.conftest import Clean
from tests.test_exported_members import check_public_module

CHATML = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- if m.tool_calls %}{% for tc in m.tool_calls %}<tool_call>{{ tc.function | tojson }}</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS_YAML = """
tools:
  - class_name: bunshin_async.integrations.verl.BashTool
    config: {type: native}
  - class_name: bunshin_async.integrations.verl.ReadFileTool
    config: {type: native}
  - class_name: bunshin_async.integrations.verl.WriteFileTool
    config: {type: native}
"""


def test_public_module() -> None:
    """What tests/test_exported_members.py checks of every other public module (verl imports only here)."""
    import bunshin_async.integrations.verl as module

    check_public_module(module)


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A small byte-level BPE tokenizer trained here (no hub), with a ChatML template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [CHATML, TOOLS_YAML, '<tool_call>{"name": "bash", "arguments": {"command": "cat setup.log"}}</tool_call>']
    tok.train_from_iterator(corpus * 20, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = CHATML
    return hf


class ScriptedServer:
    """Stands in for verl's LLM server manager: ``generate`` answers each request's next scripted turn as token
    ids. ``script(prompt_name, rollout, turn)`` gives the text; rollouts are numbered per prompt as they arrive."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, script: Callable[[str, int, int], str]) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.turns: dict[str, int] = defaultdict(int)
        self.rollout: dict[str, tuple[str, int]] = {}
        self.per_prompt: dict[str, int] = defaultdict(int)
        self.last_prompt: dict[tuple[str, int], str] = {}

    async def generate(self, *, request_id: str, prompt_ids: list[int], **_: Any) -> TokenOutput:
        text = self.tokenizer.decode(prompt_ids)
        if request_id not in self.rollout:
            name = re.search(r"prompt (\w+)", text).group(1)  # type: ignore[union-attr]
            self.rollout[request_id] = (name, self.per_prompt[name])
            self.per_prompt[name] += 1
        name, i = self.rollout[request_id]
        self.last_prompt[name, i] = text
        self.turns[request_id] += 1
        await asyncio.sleep(0.01)  # the model "thinks": siblings interleave
        ids = self.tokenizer.encode(self.script(name, i, self.turns[request_id]) + "<|im_end|>")
        return TokenOutput(token_ids=ids, log_probs=[0.0] * len(ids), stop_reason="completed")


def call(name: str, **arguments: Any) -> str:
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def config() -> Any:
    return OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {
                    "prompt_length": 8192,
                    "response_length": 8192,
                    "full_determinism": False,
                    "multi_turn": {
                        "max_user_turns": 6,
                        "max_assistant_turns": 6,
                        "max_parallel_calls": 1,
                        "max_tool_response_length": 4000,
                        "tool_response_truncate_side": "middle",
                        "format": "hermes",
                    },
                }
            },
            "data": {"apply_chat_template_kwargs": {}},
        }
    )


def make_loop(server: ScriptedServer, tools: list[Any]) -> BunshinToolAgentLoop:
    """As verl's ``AgentLoopWorker._run_agent_loop`` does: from the registry, through hydra."""
    cfg = config()
    loop = hydra.utils.instantiate(
        config=_agent_loop_registry[AGENT_NAME],
        trainer_config=DictConfigWrap(config=cfg),
        server_manager=server,
        tokenizer=server.tokenizer,
        processor=None,
        hf_model_type=None,
        dataset_cls=RLHFDataset,
        data_config=DictConfigWrap(cfg.data),
        tools=ToolListWrap(tools),
    )
    assert isinstance(loop, BunshinToolAgentLoop)
    return loop


def sample(name: str) -> dict[str, Any]:
    return {
        "raw_prompt": [{"role": "user", "content": f"prompt {name}: leave your mark in mine.txt"}],
        "uid": f"uid-{name}",
        "extra_info": {
            "bunshin": {
                "files": {"task.txt": f"task {name}\n"},
                "setup": ["echo set-up >> setup.log", "python3 -c 'import json' && echo warm >> setup.log"],
                "reward_command": f"grep -qx '{name}-0' mine.txt",
            }
        },
        "tools_kwargs": {},
    }


@pytest.fixture
def tools(tmp_path: Path) -> list[Any]:
    path = tmp_path / "tools.yaml"
    path.write_text(TOOLS_YAML)
    loaded = initialize_tools_from_config(str(path))
    assert [t.name for t in loaded] == ["bash", "read_file", "write_file"]
    return loaded


@pytest.fixture
def runtime() -> Any:
    rt = VerlRuntime()
    BunshinToolAgentLoop.runtime = rt
    yield rt
    BunshinToolAgentLoop.runtime = None


async def test_two_prompts_times_four_fork_one_setup_each(tools: list[Any], runtime: VerlRuntime, clean: Clean) -> None:
    def script(name: str, i: int, turn: int) -> str:
        return {
            1: call("bash", command="cat setup.log task.txt"),
            2: call("write_file", path="mine.txt", content=f"{name}-{i}\n"),
            3: call("bash", command="cat mine.txt; ls"),
            4: "All done.",
        }[turn]

    tok = make_tokenizer()
    server = ScriptedServer(tok, script)
    samples = [sample(name) for name in ("A", "B") for _ in range(4)]  # verl repeats each prompt n=4 times
    outputs = await asyncio.gather(
        *(make_loop(server, tools).run({"temperature": 1.0}, index=k, **s) for k, s in enumerate(samples))
    )
    for name in ("A", "B"):
        assert runtime.forks.setups(f"uid-{name}") == 1
        for i in range(4):
            text = server.last_prompt[name, i]
            assert f"set-up\nwarm\ntask {name}" in text  # the set-up, run once, seen by every fork
            assert f"exit code 0\n{name}-{i}\n" in text  # its own mark, read back
            others = {f"{n}-{j}" for n in ("A", "B") for j in range(4)} - {f"{name}-{i}"}
            assert not any(f"\n{o}\n" in text for o in others), text  # forks are isolated
    assert sorted(o.reward_score for o in outputs) == [0.0] * 6 + [1.0] * 2
    assert all(o.extra_fields["bunshin_fork_mode"] != "fresh" for o in outputs)
    assert all(o.num_turns == 8 for o in outputs)
    metrics = runtime.cache.metrics()
    assert metrics.hits >= 6, metrics  # siblings' identical first reads were served from the cache
    assert runtime.forks.live == 0
    await runtime.aclose()
    await clean()


async def test_cancelled_and_failing_rollouts_close_their_workspaces(
    tools: list[Any], runtime: VerlRuntime, clean: Clean
) -> None:
    tok = make_tokenizer()
    slow = ScriptedServer(tok, lambda name, i, turn: call("bash", command="sleep 60") if turn == 1 else "done")
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(4):
            await asyncio.gather(*(make_loop(slow, tools).run({}, index=k, **sample("C")) for k in range(2)))
    assert runtime.forks.live == 0

    def bad(name: str, i: int, turn: int) -> str:
        raise RuntimeError("the model server died")

    with pytest.raises(RuntimeError, match="died"):
        await make_loop(ScriptedServer(tok, bad), tools).run({}, index=0, **sample("D"))
    assert runtime.forks.live == 0
    # A tool outside a Bunshin loop says so instead of running anywhere.
    response, _, _ = await tools[0].execute("x", {"command": "true"})
    assert "bunshin_tool_agent" in response.text
    await runtime.aclose()
    await clean()
