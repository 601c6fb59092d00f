"""Sampling parity through the official ``openai`` client and the real FastAPI app (over
ASGI, in-process; `test_ingress_server.run_flow`): each of presence_penalty,
frequency_penalty, logit_bias, repetition_penalty, min_p, min_tokens,
include_stop_str_in_output and skip_special_tokens reaches every model and gives the tokens
the runtime gives for the same spec; bad values are 400s naming the field."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.ingress.test_ingress_server import PROMPTS, ids_of, run_flow
from tests.openai.ingress_app import SERVED
from tokenrouter_ray.ingress.openai_server import IngressServer
from tokenrouter_ray.local import LocalRuntime
from tokenrouter_ray.protocol import SamplingSpec

N = 20


def words(ids: list[int]) -> str:
    return " ".join(f"w{t}" for t in ids)


def test_each_field_through_the_openai_client(served_chain_dirs) -> None:
    async def body(client: Any, runtime: LocalRuntime, server: IngressServer) -> None:
        prompt = PROMPTS[2]
        plain = await runtime.complete(prompt, SamplingSpec(max_tokens=N, seed=0))
        cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
            ({"presence_penalty": 1.5}, {"presence_penalty": 1.5}),
            ({"frequency_penalty": 1.2}, {"frequency_penalty": 1.2}),
            (
                {"logit_bias": {str(plain.token_ids[0]): -100, "9": 6}},
                {"logit_bias": tuple(sorted({plain.token_ids[0]: -100.0, 9: 6.0}.items()))},
            ),
            ({"extra_body": {"repetition_penalty": 1.6}}, {"repetition_penalty": 1.6}),
        ]
        changed = 0
        for fields, spec_fields in cases:
            want = await runtime.complete(prompt, SamplingSpec(max_tokens=N, seed=0, **spec_fields))
            got = await client.completions.create(
                model=SERVED, prompt=prompt, max_tokens=N, temperature=0, **fields
            )
            assert ids_of(got.choices[0].text) == want.token_ids, fields
            changed += want.token_ids != plain.token_ids
        assert changed == len(cases)  # every field changed the greedy output
        # min_p with sampling: same seed, same tokens as the runtime with the same spec
        spec = SamplingSpec(temperature=1.0, min_p=0.2, max_tokens=N, seed=7)
        want = await runtime.complete(prompt, spec)
        got = await client.completions.create(
            model=SERVED, prompt=prompt, max_tokens=N, temperature=1.0, seed=7,
            extra_body={"min_p": 0.2},
        )  # fmt: skip
        assert ids_of(got.choices[0].text) == want.token_ids
        # min_tokens: stop tokens the plain output writes early are masked until then
        stops = sorted(set(plain.token_ids[1:8]))
        spec = SamplingSpec(max_tokens=N, seed=0, stop_token_ids=tuple(stops), min_tokens=4)
        want = await runtime.complete(prompt, spec)
        assert want.finish_reason == "stop" and want.token_ids[-1] in stops
        assert len(want.token_ids) > 4 and not set(want.token_ids[:4]) & set(stops)
        extra = {"stop_token_ids": stops, "min_tokens": 4}
        got = await client.completions.create(
            model=SERVED, prompt=prompt, max_tokens=N, temperature=0, extra_body=extra
        )
        assert ids_of(got.choices[0].text) == want.token_ids[:-1]  # the stop token: no text
        assert got.choices[0].finish_reason == "stop"
        assert got.usage.completion_tokens == len(want.token_ids)
        kept = await client.completions.create(
            model=SERVED, prompt=prompt, max_tokens=N, temperature=0,
            extra_body={**extra, "include_stop_str_in_output": True},
        )  # fmt: skip
        assert ids_of(kept.choices[0].text) == want.token_ids
        # include_stop_str_in_output with a stop string; skip_special_tokens (none here)
        stop_text = f"w{plain.token_ids[3]}"
        cut = await client.completions.create(
            model=SERVED, prompt=prompt, max_tokens=N, temperature=0, stop=[stop_text]
        )
        with_stop = await client.completions.create(
            model=SERVED, prompt=prompt, max_tokens=N, temperature=0, stop=[stop_text],
            extra_body={"include_stop_str_in_output": True, "skip_special_tokens": False},
        )  # fmt: skip
        assert with_stop.choices[0].text == cut.choices[0].text + stop_text
        assert with_stop.choices[0].finish_reason == cut.choices[0].finish_reason == "stop"
        chat = await client.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": words(prompt)}],
            max_tokens=N, temperature=0, presence_penalty=1.5, frequency_penalty=0.5,
        )  # fmt: skip
        assert chat.choices[0].message.content  # the chat route carries them too

    run_flow(served_chain_dirs, body)


BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logit_bias": {"128": 1}}, "logit_bias"),  # outside the 128-token vocabulary
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"extra_body": {"min_tokens": 30}}, "min_tokens"),  # more than max_tokens
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"extra_body": {"min_p": -0.1}}, "min_p"),
]


def test_bad_values_are_400_naming_the_field(served_chain_dirs) -> None:
    async def body(client: Any, runtime: LocalRuntime, server: IngressServer) -> None:
        for fields, param in BAD:
            for route in ("completions", "chat"):
                with pytest.raises(openai.BadRequestError) as bad:
                    if route == "chat":
                        await client.chat.completions.create(
                            model=SERVED, max_tokens=N,
                            messages=[{"role": "user", "content": words(PROMPTS[0])}],
                            **fields,
                        )  # fmt: skip
                    else:
                        await client.completions.create(
                            model=SERVED, prompt=PROMPTS[0], max_tokens=N, **fields
                        )
                assert bad.value.status_code == 400 and bad.value.param == param, fields

    run_flow(served_chain_dirs, body)
