"""The lossless alternative: stock speculative decoding, never ours.

    python -m loadtest.baselines.speculative                 # demo pair, batch 1, CPU
    python -m loadtest.baselines.speculative --prompts 2 --max-tokens 16   # tiny (CI)
    python -m loadtest.baselines.speculative --serve --port 18214       # over the chat API

``--serve`` (``build_app``) puts the same assisted generation behind the harness's chat API
(``loadtest.baselines.api``), so ``python -m loadtest --systems speculative,...`` puts it in
the speed / quality table beside the routed systems. Assisted generation takes one sequence
at a time, so the server runs one request at a time, in arrival order, on its own thread;
tokens stream as transformers' streamer hands them over (a verified run at a time).

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
from typing import TYPE_CHECKING, Any

from loadtest.common import QUESTIONS, command, machine

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from fastapi import FastAPI

    from loadtest.baselines.api import Answer, ChatRequest


def load_pair(small: str, large: str, dtype: str = "float32") -> tuple[Any, Any, Any]:
    """Tokenizer, target and draft; ``dtype`` a torch dtype name or "auto" (the checkpoint's,
    as our engine's "auto")."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(large)
    kwargs = {"dtype": dtype if dtype == "auto" else getattr(torch, dtype)}
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


class SpeculativeServer:
    """Assisted generation behind the chat API: one request at a time, on one thread."""

    def __init__(self, small: str, large: str, draft_tokens: int, dtype: str) -> None:
        import threading

        self.tokenizer, self.target, self.draft = load_pair(small, large, dtype)
        self.target.generation_config.num_assistant_tokens = draft_tokens
        self.lock = threading.Lock()  # batch 1: requests take turns, in arrival order

    def _run(self, ids: list[int], req: ChatRequest, emit: Any) -> None:
        import torch
        from transformers.generation.streamers import BaseStreamer

        class Tokens(BaseStreamer):  # transformers' streamer interface: ids as verified
            first = True

            def put(self, value: torch.Tensor) -> None:
                if self.first:  # generate() hands the prompt over first
                    self.first = False
                    return
                emit(("tokens", value.reshape(-1).tolist()))

            def end(self) -> None:
                pass

        prompt = torch.tensor([ids])
        lengths = {"min_new_tokens": req.max_tokens} if req.ignore_eos else {}
        try:
            with self.lock, torch.inference_mode():
                self.target.generate(
                    prompt,
                    attention_mask=torch.ones_like(prompt),
                    assistant_model=self.draft,
                    max_new_tokens=req.max_tokens,
                    do_sample=False,
                    pad_token_id=self.tokenizer.eos_token_id,
                    streamer=Tokens(),
                    **lengths,
                )
        except Exception as exc:  # the client gets it as an error message
            emit(("error", str(exc)))
        emit(("end", None))

    async def generate(self, req: ChatRequest, answer: Answer) -> AsyncIterator[str]:
        import asyncio

        from loadtest.baselines.api import posted_tokens
        from tokenrouter_ray.openai.chat import render_chat
        from tokenrouter_ray.openai.detokenizer import IncrementalDetokenizer

        ids = render_chat(self.tokenizer, req.messages)
        answer.prompt_tokens = len(ids)
        loop, out = asyncio.get_running_loop(), asyncio.Queue()
        emit = lambda item: loop.call_soon_threadsafe(out.put_nowait, item)  # noqa: E731
        work = loop.run_in_executor(None, self._run, ids, req, emit)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids=ids)
        eos = self.tokenizer.eos_token_id
        try:
            async for value in posted_tokens(out):
                if not req.ignore_eos and eos in value:  # generate() stops there; so do we
                    value = value[: value.index(eos)]
                    answer.finish_reason = "stop"
                answer.completion_tokens += len(value)
                yield detok.push(value)
        finally:
            await work
        answer.tokens_per_model = {"large": answer.completion_tokens}  # the target's tokens
        if answer.completion_tokens >= req.max_tokens:
            answer.finish_reason = "length"


def build_app(small: str, large: str, draft_tokens: int = 5, dtype: str = "float32") -> FastAPI:
    from loadtest.baselines.api import chat_app

    server = SpeculativeServer(small, large, draft_tokens, dtype)
    return chat_app(server.generate, "speculative")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest speculative", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--small", help="draft model dir (default: the demo's small model)")
    parser.add_argument("--large", help="target model dir (default: the demo's large model)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--draft-tokens", type=int, default=5, help="tokens drafted per round")
    parser.add_argument("--vllm", action="store_true", help="vLLM's draft-model spec decode")
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--serve", action="store_true", help="serve it over the chat API")
    parser.add_argument("--port", type=int, default=18214)
    parser.add_argument("--dtype", default="float32", help="torch dtype name, or auto")
    args = parser.parse_args(argv)
    small, large = args.small, args.large
    if small is None or large is None:
        from tokenrouter_ray.demo import built_artifact

        small, large = small or built_artifact("small"), large or built_artifact("large")
    if args.serve:
        import uvicorn

        app = build_app(small, large, args.draft_tokens, args.dtype)
        uvicorn.run(app, host="127.0.0.1", port=args.port)
        return 0
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
