"""verl's agent loop with Bunshin's tools: one prompt, n=4 samples under one uid, set up once and forked.

    .venv-verl/bin/python examples/verl/agent_loop.py

Runs verl's real tool loading and ``bunshin_tool_agent`` loop; a scripted server stands in for the LLM (it answers
hermes tool calls) and a byte-level tokenizer trained on the spot stands in for the model's, so nothing is
downloaded. In training, verl's AgentLoopWorker makes the loops the same way, one per sample.
"""

from __future__ import annotations

import asyncio
import json
import warnings
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # verl imports ray's deprecated experimental state API
    import hydra
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry
    from verl.tools.tool_registry import initialize_tools_from_config
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.workers.rollout.replica import TokenOutput

    from bunshin_async.integrations.verl import AGENT_NAME, default_runtime

CHATML = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- if m.tool_calls %}{% for tc in m.tool_calls %}<tool_call>{{ tc.function | tojson }}</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FIXES = ["a + b", "b + a", "a - b", "a * b"]  # what four samples of a policy might try


def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([CHATML] * 10, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = CHATML
    return hf


class ScriptedServer:
    """verl's server manager interface (``generate`` -> token ids); sample k tries FIXES[k]."""

    def __init__(self, tok: PreTrainedTokenizerFast) -> None:
        self.tok, self.turns, self.sample = tok, dict[str, int](), dict[str, int]()

    async def generate(self, *, request_id: str, prompt_ids: list[int], **_: Any) -> TokenOutput:
        k = self.sample.setdefault(request_id, len(self.sample))
        turn = self.turns[request_id] = self.turns.get(request_id, 0) + 1
        edit = f"sed -i 's/return .*/return {FIXES[k]}/' calc.py && cat calc.py"
        steps = {1: {"name": "bash", "arguments": {"command": edit}}, 2: None}
        step = steps.get(turn)
        text = f"<tool_call>{json.dumps(step)}</tool_call>" if step else "Done."
        ids = self.tok.encode(text + "<|im_end|>")
        return TokenOutput(token_ids=ids, log_probs=[0.0] * len(ids), stop_reason="completed")


async def main() -> None:
    tools = initialize_tools_from_config(str(Path(__file__).with_name("tools.yaml")))
    cfg = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {
                    "prompt_length": 4096,
                    "response_length": 4096,
                    "full_determinism": False,
                    "multi_turn": {
                        "max_user_turns": 4,
                        "max_assistant_turns": 4,
                        "max_parallel_calls": 1,
                        "max_tool_response_length": 2000,
                        "tool_response_truncate_side": "middle",
                        "format": "hermes",
                    },
                }
            },
            "data": {"apply_chat_template_kwargs": {}},
        }
    )
    server = ScriptedServer(tokenizer())
    row = {
        "raw_prompt": [{"role": "user", "content": "Fix add() in calc.py."}],
        "uid": "prompt-0",
        "extra_info": {
            "bunshin": {
                "files": {"calc.py": "def add(a, b):\n    return a - b\n"},
                "setup": ["python3 -m venv .venv"],  # the expensive part, once for the four samples
                "reward_command": ".venv/bin/python -c 'import calc; assert calc.add(2, 3) == 5'",
            }
        },
    }

    async def one(k: int) -> Any:
        loop = hydra.utils.instantiate(
            config=_agent_loop_registry[AGENT_NAME],
            trainer_config=DictConfigWrap(config=cfg),
            server_manager=server,
            tokenizer=server.tok,
            processor=None,
            hf_model_type=None,
            dataset_cls=RLHFDataset,
            data_config=DictConfigWrap(cfg.data),
            tools=ToolListWrap(tools),
        )
        return await loop.run({"temperature": 1.0}, index=k, **row)

    try:
        outputs = await asyncio.gather(*(one(k) for k in range(4)))
        print("rewards:", [o.reward_score for o in outputs])
        print("set-ups for prompt-0:", default_runtime().forks.setups("prompt-0"))
        print("fork modes:", {o.extra_fields["bunshin_fork_mode"] for o in outputs})
    finally:
        await default_runtime().aclose()


if __name__ == "__main__":
    asyncio.run(main())
