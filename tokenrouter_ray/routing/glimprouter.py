"""GlimpRouter: step-level routing. A reasoning step ends at a blank line; the small
model's first token of each step is a glimpse whose entropy picks who writes the step.

    at the small model, position p:
        if p starts a step (first output token, or the previous token ended one):
            if H_small(p) / log V > tau:  discard the glimpse; the large model writes the step
    at the large model:
        commit each token; after the token that ends the step, return to the small model

When the small model keeps the step, its glimpse is kept too: under greedy decoding
regenerating it would give the same token, and under sampling it is a valid draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from pydantic import Field

from tokenrouter_ray.routing.policy import (
    Policy,
    PolicyConfig,
    RouteBatch,
    normalized_entropy,
    register_policy,
)


class GlimpConfig(PolicyConfig):
    tau: float = Field(0.3, ge=0, le=1, description="Normalized-entropy threshold of a glimpse.")
    step_end_token_ids: list[int] | None = Field(
        None,
        description="Tokens that end a step. None: every token whose text holds a blank line "
        "(needs the tokenizer).",
    )


def blank_line_tokens(tokenizer: Any) -> list[int]:
    vocab = tokenizer.get_vocab()
    ids = list(vocab.values())
    texts = tokenizer.batch_decode([[i] for i in ids])
    return [i for i, text in zip(ids, texts, strict=True) if "\n\n" in text]


@register_policy
class GlimpRouter(Policy):
    name = "glimprouter"
    Config = GlimpConfig
    needs_logits = True
    needs_tokenizer = True  # step ends default to the tokenizer's blank-line tokens

    def __init__(self, config: GlimpConfig, models: Sequence[str], tokenizer: Any = None) -> None:
        super().__init__(config, models, tokenizer)
        ids = config.step_end_token_ids
        if ids is None:
            if tokenizer is None:
                raise ValueError("glimprouter needs step_end_token_ids or a tokenizer")
            ids = blank_line_tokens(tokenizer)
        self.step_end_ids = torch.tensor(sorted(set(ids)), dtype=torch.long)

    def _ends_step(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.isin(tokens, self.step_end_ids.to(tokens.device))

    def route(self, batch: RouteBatch) -> torch.Tensor:
        if batch.model == 0:
            starts = batch.is_first | self._ends_step(batch.prev_tokens)
            entropy = normalized_entropy(batch.step.logits)
            batch.scores = entropy.masked_fill(~starts, float("nan"))  # glimpses only
            unsure = entropy > batch.thresholds(self.config.tau, entropy.dtype)
            return (starts & unsure).long()
        return (~self._ends_step(batch.step.sampled)).long()  # stay until the step ends
