"""The lossless alternative: stock speculative decoding, never ours.

    python -m loadtest.baselines.speculative                 # demo pair, batch 1, CPU
    python -m loadtest.baselines.speculative --prompts 2 --max-tokens 16   # tiny (CI)

On CPU it is transformers' assisted generation (``generate(..., assistant_model=small)``)
with the demo's small model as the draft and the large model as the target, batch 1
(assisted generation takes one sequence at a time), greedy. Beside it, in the same run and
process: the large model alone with plain ``generate`` (same prompts, same length). Its
quality equals the large model's by construction, and the run checks it: the assisted
answers must be token-identical to the plain ones (printed as ``match``).

With vLLM installed (a GPU host), ``--vllm`` instead runs vLLM's draft-model speculative
decoding through its offline ``LLM`` API, for the ``paper`` preset: the numbers then come
from vLLM's own engine.

Prints tok/s for each, the draft's acceptance (tokens per target forward, from the step
count transformers reports when available, else the speed-up alone) and the command.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from loadtest.common import QUESTIONS, command, machine


def load_pair(small: str, large: str) -> tuple[Any, Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(large)
    kwargs = {"dtype": torch.float32}
    target = AutoModelForCausalLM.from_pretrained(large, **kwargs).eval()
    draft = AutoModelForCausalLM.from_pretrained(small, **kwargs).eval()
    return tok, target, draft


def run_transformers(
    small: str, large: str, prompts: list[str], max_tokens: int, draft_tokens: int
) -> dict[str, Any]:
    import torch

    tok, target, draft = load_pair(small, large)
    encoded = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt"
        )
        for p in prompts
    ]
    encoded = [e["input_ids"] if hasattr(e, "keys") else e for e in encoded]
    common = {
        "max_new_tokens": max_tokens,
        "min_new_tokens": max_tokens,  # same length for every system
        "do_sample": False,
        "pad_token_id": tok.eos_token_id,
    }

    def timed(**extra: Any) -> tuple[float, list[list[int]]]:
        outputs, tokens, t0 = [], 0, time.perf_counter()
        with torch.inference_mode():
            for ids in encoded:
                out = target.generate(ids, attention_mask=torch.ones_like(ids), **common, **extra)
                new = out[0, ids.shape[1] :].tolist()
                outputs.append(new)
                tokens += len(new)
        return tokens / (time.perf_counter() - t0), outputs

    target.generation_config.num_assistant_tokens = draft_tokens
    timed()  # warm-up (first-call allocations)
    plain_tps, plain = timed()
    assisted_tps, assisted = timed(assistant_model=draft)
    return {
        "large_alone_tok_s": plain_tps,
        "speculative_tok_s": assisted_tps,
        "speedup": assisted_tps / plain_tps,
        "match": sum(a == b for a, b in zip(assisted, plain, strict=True)) / len(plain),
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "draft_tokens": draft_tokens,
    }


def run_vllm(small: str, large: str, prompts: list[str], max_tokens: int, k: int) -> dict:
    from vllm import LLM, SamplingParams  # only where vLLM is installed

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    results = {}
    draft = {"model": small, "num_speculative_tokens": k}
    for name, spec in (("large_alone", None), ("speculative", draft)):
        llm = LLM(model=large, speculative_config=spec) if spec else LLM(model=large)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        results[f"{name}_tok_s"] = tokens / (time.perf_counter() - t0)
        del llm
    results["speedup"] = results["speculative_tok_s"] / results["large_alone_tok_s"]
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", help="draft model dir (default: the demo's small model)")
    parser.add_argument("--large", help="target model dir (default: the demo's large model)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--draft-tokens", type=int, default=5, help="tokens drafted per round")
    parser.add_argument("--vllm", action="store_true", help="vLLM's draft-model spec decode")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    small, large = args.small, args.large
    if small is None or large is None:
        from tokenrouter_ray.demo import built_artifact

        small, large = small or built_artifact("small"), large or built_artifact("large")
    prompts = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.prompts)]
    print(f"# speculative decoding baseline: {machine()}\n# {command()}", flush=True)
    run = run_vllm if args.vllm else run_transformers
    result = run(small, large, prompts, args.max_tokens, args.draft_tokens)
    print(json.dumps(result, indent=1))
    if "match" in result:
        print(f"{'PASS' if result['match'] == 1.0 else 'MISS'}  lossless: assisted answers "
              f"equal the large model's ({result['match']:.0%})")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
