"""Engine.tap_layer: the residual stream after layer k, per request, as the model computes it."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from tests.engine.conftest import make_engine
from tests.tiny_models import save_tiny
from tokenrouter_ray.engine.request import SamplingParams


def test_tapped_states_equal_the_models_hidden_states(tmp_path) -> None:
    path = save_tiny(tmp_path / "m", "llama", seed=3, num_hidden_layers=3)
    engine = make_engine(path, max_num_seqs=2)
    prompts = {"a": [1, 2, 3, 4, 5], "b": [9, 8, 7]}
    outputs: dict[str, list[int]] = {rid: [] for rid in prompts}
    with engine.tap_layer(2) as tap:  # batched: both requests' rows share each step
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, SamplingParams(max_tokens=4))
        while engine.has_unfinished:
            for out in engine.step():
                outputs[out.request_id].extend(out.new_token_ids)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    for rid, prompt in prompts.items():
        ids = torch.tensor([prompt + outputs[rid][:-1]])  # every token the engine computed
        with torch.no_grad():
            want = reference(ids, output_hidden_states=True).hidden_states[2][0]
        got = tap.states(rid, ids.shape[1]).double()
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)  # kept in bf16
    engine.add_request("c", [4, 4], SamplingParams(max_tokens=2))
    engine.step()
    assert "c" not in tap.chunks  # closed: nothing recorded after the block


def test_tapped_states_on_the_padded_static_layout(tmp_path) -> None:
    """The bucketed path (what CUDA graphs replay, eagerly here) pads each sequence to the
    bucket's query rows, real tokens last: the tap reads each request's own rows, equal to
    the same run on the dynamic path; a 3-token extend beside decodes lands in a q_len-4
    bucket, so front padding is exercised."""
    path = save_tiny(tmp_path / "m", "llama", seed=5, num_hidden_layers=3)
    prompts = {"a": [1, 2, 3, 4, 5], "b": [9, 8, 7], "c": [6, 5, 4, 3]}

    def tapped(static: bool) -> tuple[dict[str, torch.Tensor], int]:
        engine = make_engine(path, max_num_seqs=4, static_batches=static)
        with engine.tap_layer(2) as tap:
            for rid, prompt in prompts.items():
                engine.add_request(rid, prompt, SamplingParams(max_tokens=8, ignore_eos=True))
            for _ in range(3):
                engine.step()
            engine.pause("a")
            engine.step()
            held = list(engine.requests["a"].token_ids)
            engine.resume("a", [11, 12, 13], anchor=len(held) - 1)
            while engine.has_unfinished:
                engine.step()
            lengths = {rid: max(s + len(p) for s, p in tap.chunks[rid]) for rid in prompts}
            states = {rid: tap.states(rid, n) for rid, n in lengths.items()}
        return states, engine.runner.static_steps

    dynamic, none = tapped(static=False)
    static, steps = tapped(static=True)
    assert none == 0 and steps > 0
    for rid in prompts:
        assert static[rid].shape == dynamic[rid].shape
        want = dynamic[rid].double()
        torch.testing.assert_close(static[rid].double(), want, rtol=1e-2, atol=1e-3)
