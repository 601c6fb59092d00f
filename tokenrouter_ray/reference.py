"""The sequential reference for routed generation: one request at a time, a full-context
forward per token, no KV reuse, no batching, no messages.

It runs each policy's semantics plainly (whoever is active generates; ``route`` picks the
next model; ``send`` says whether the token just sampled is dropped) on plain transformers
models, so it checks everything the runtime adds: paged KV, extends after handoffs,
batching, anchors, the protocol. Greedy ``LocalRuntime`` output must equal it token for
token.

Sampling is the engine's: the same logits processors (``engine/logits_processors.py``:
logit_bias, min_tokens, penalties over the whole sequence so far) on the active model's raw
logits, then the same sampler; routing sees the raw logits, as in the runtime.

A request with a grammar (``sampling.grammar``) is masked here too, by one matcher per
model that follows the whole sequence (``grammars``: each model's ``GrammarBook``, by
name), and routed on masked or raw logits as the policy says, as the runtime does.

A request's own routing threshold(s) (``thresholds``: the API's ``routing`` field, which
the runtime carries in ``RouteState.thresholds``) replace the policy's configured one here
too, at every model it visits. The policy decides through ``decide`` on its device path
(``route`` on the masked or raw logits) even where it has a host path, so where the runtime
takes the host path the comparison checks that the two agree as well.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from tokenrouter_ray.engine.grammar import GrammarBook, GrammarState
from tokenrouter_ray.engine.logits_processors import apply_processors
from tokenrouter_ray.engine.outputs import StepResult
from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.engine.sampler import sample
from tokenrouter_ray.routing.policy import (
    Policy,
    RequestView,
    RouteBatch,
    capped_dst,
    decide,
    threshold_overrides,
)


@dataclass
class ReferenceResult:
    token_ids: list[int] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    handoffs: int = 0
    finish_reason: str = "length"


def _eos_ids(model: PreTrainedModel) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    return set([eos] if isinstance(eos, int) else (eos or []))


@torch.inference_mode()
def reference_generate(
    models: Sequence[tuple[str, PreTrainedModel]],
    policy: Policy,
    prompt: Sequence[int],
    sampling: SamplingParams,
    seed: int,
    grammars: dict[str, GrammarBook] | None = None,
    max_share: float | None = None,
    thresholds: Sequence[float] = (),
) -> ReferenceResult:
    """``max_share``: the request's cap on the top model's share (``capped_dst``);
    ``thresholds``: its own decision threshold(s) (``row_threshold``; (): the policy's)."""
    names = [n for n, _ in models]
    sequence = list(prompt)
    result = ReferenceResult()
    active = 0
    states: dict[str, GrammarState] = {}
    while True:
        model = models[active][1]
        out = model(torch.tensor([sequence]), output_hidden_states=True)
        logits = out.logits[0, -1:].float()  # (1, V)
        hidden = out.hidden_states[-1][0, -1:]  # (1, H) after the final norm
        chosen_from = apply_processors(
            logits, [sampling], [sequence], [len(prompt)], _eos_ids(model)
        )
        masked = None
        if sampling.grammar is not None:
            book = (grammars or {})[names[active]]
            state = states.get(names[active])
            if state is None:
                state = states[names[active]] = book.new_state(
                    sampling.grammar, sampling.stop_token_ids
                )
            state.sync(sequence, len(prompt))
            masked = chosen_from.clone() if chosen_from is logits else chosen_from
            book.apply(masked, [(0, state)])
        chosen = chosen_from if masked is None else masked
        token = sample(chosen, [sampling], [seed], [len(sequence)])
        step = StepResult(["ref"], token, token.tolist(), [len(sequence)], logits, hidden)
        step.masked_logits = masked
        batch = RouteBatch(
            model=active,
            step=step,
            positions=torch.tensor([len(sequence)]),
            prev_tokens=torch.tensor([sequence[-1]]),
            is_first=torch.tensor([len(sequence) == len(prompt)]),
            seeds=[seed],
            embed=model.get_input_embeddings(),
            threshold_overrides=threshold_overrides([thresholds], active),
        )
        dst = decide(policy, batch, host=False)[0]
        top = len(names) - 1
        top_tokens = result.counts.get(names[top], 0)
        dst = capped_dst(dst, active, top, top_tokens, len(result.token_ids), max_share)
        drop = (
            dst != active
            and policy.send(RequestView("ref", active, len(sequence)), dst).drop_sampled
        )
        if not drop:
            t = int(token[0])
            sequence.append(t)
            result.token_ids.append(t)
            result.counts[names[active]] = result.counts.get(names[active], 0) + 1
            stops = t in sampling.stop_token_ids or (
                not sampling.ignore_eos and t in _eos_ids(model)
            )
            if stops and len(result.token_ids) > sampling.min_tokens:
                result.finish_reason = "stop"
                return result
            if len(result.token_ids) >= sampling.max_tokens:
                return result
        result.handoffs += dst != active  # a finished request hands nothing off
        active = dst
