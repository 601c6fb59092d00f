"""Teacher-forced agreement for task sets without answers: the large model as a greedy judge.

An item without an ``answer`` has nothing to be right about. What a routed answer can
still be measured by is how often its tokens are the ones the large model would have
written there: the large model (plain ``transformers``, in this process, fp32) reads the
item's chat-rendered prompt and the system's answer and predicts every answer position
greedily from the answer's own prefix; agreement is the share of positions where its choice
is the answer's token. 1.0 for the large model's own greedy answer (up to ties); for a
routed answer at least the large model's share of it.

Data enters as task items and a system's answers (``SystemResult``) and leaves as the same
result with ``accuracy`` standing for agreement over all answered positions (its interval a
Wilson interval over positions, which are not independent: read it as a rough width) and
``correct`` counting the answers that agree everywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from tokenrouter_ray.errors import UserFacingError
from tokenrouter_ray.quality.evaluate import SystemResult
from tokenrouter_ray.quality.stats import wilson_interval
from tokenrouter_ray.quality.tasks import TaskItem


class TeacherForcedJudge:
    """``agreement(item, response)`` -> (positions where the model's greedy choice given the
    response's prefix is the response's token, positions)."""

    def __init__(self, model_dir: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        except (OSError, ValueError) as exc:
            raise UserFacingError(
                f"--judge {model_dir!r}: cannot load a causal LM: {exc}"
            ) from None

    def agreement(self, item: TaskItem, response: str) -> tuple[int, int]:
        from tokenrouter_ray.openai.chat import render_chat

        messages = item.messages or [{"role": "user", "content": item.prompt}]
        prompt = list(render_chat(self.tokenizer, messages))
        answer = self.tokenizer(response, add_special_tokens=False)["input_ids"]
        if not answer:
            return 0, 0
        torch = self.torch
        with torch.inference_mode():
            logits = self.model(torch.tensor([prompt + answer])).logits[0]
        chosen = logits[len(prompt) - 1 : len(prompt) + len(answer) - 1].argmax(-1)
        return int((chosen == torch.tensor(answer)).sum()), len(answer)


def judged(result: SystemResult, items: Sequence[TaskItem], judge: Any) -> SystemResult:
    """``result`` with its answers scored by teacher-forced agreement (module docstring)."""
    by_id = {item.id: item for item in items}
    agree = positions = whole = 0
    for r in result.items:
        if r.error is not None:
            continue
        a, p = judge.agreement(by_id[r.id], r.response)
        agree, positions, whole = agree + a, positions + p, whole + (a == p and p > 0)
    accuracy = agree / positions if positions else 0.0
    return dataclasses.replace(
        result, correct=whole, accuracy=accuracy, interval=wilson_interval(agree, positions)
    )


def needs_judge(items: Sequence[TaskItem]) -> bool:
    """True when no item has an answer; a set that mixes both is an error."""
    without = sum(item.answer is None for item in items)
    if 0 < without < len(items):
        raise UserFacingError(
            f"{without} of {len(items)} items have no 'answer': give every item one, or none "
            "(then calibrate measures teacher-forced agreement with --judge)"
        )
    return without == len(items) and without > 0
