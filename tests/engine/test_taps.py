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
