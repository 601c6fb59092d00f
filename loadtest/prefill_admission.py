"""Time to first token with and without ``prefill_at_admission`` (issue 38): the served demo.

    python -m loadtest prefill-admission [--lengths 300,600,1000,1400] [--repeats 3]

The demo app (``conf/local.yaml``'s overrides: the demo pair, R2R with its trained router,
ZeroMQ, the live tuner) is deployed twice on a Ray cluster started here, with
``models.large.prefill_at_admission`` off and then on (``--prefill-at``, 1: every prompt).
Against each, one request at a time through the official ``openai`` client: 1-token chat
completions whose prompt renders to about each ``--lengths`` tokens, every prompt unique
from its first words on (nothing is shared through the prefix cache), ``--repeats`` times
per length and first-token owner. The owner is set per request with the routing extension
(``routing.threshold``: 0 escalates the first token to the large model, 1 keeps it on the
small one) and read back from the answer's routing summary.

Printed per length: the median TTFT of both owners, off and on, and the ratio escalated /
kept (the issue's target: <= 1.2 at the longest length, on); the escalated TTFT with it on
beside the longer of the two prefills (the large model's own, estimated as escalated minus
kept with it off: what "the longer prefill, not the sum" means); then what the large model computed
while the small model kept every token (the prefills that were never used): its busy
seconds per request from ``/v1/tokenrouter/stats`` (the host time of its steps: on a CPU
the forward runs inside ``launch``), off and on.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import httpx

from loadtest.common import command, machine, ray_serve_deploy
from loadtest.systems import wait_ready

DEMO = ["models=demo_pair", "policy=r2r_demo", "transport=zmq_ipc", "placement=local"]
WORDS = [
    "river",
    "stone",
    "lantern",
    "meadow",
    "copper",
    "violet",
    "harbor",
    "thunder",
    "orchard",
    "pepper",
    "canyon",
    "willow",
    "marble",
    "falcon",
    "saddle",
    "velvet",
    "glacier",
    "cobalt",
    "ember",
    "juniper",
]
TARGET_RATIO = 1.2


def prompt_text(tokenizer: Any, length: int, nonce: int) -> str:
    """A user message whose chat rendering is about ``length`` tokens; it starts with the
    nonce, so no two prompts share a KV block."""
    from tokenrouter_ray.openai.chat import render_chat

    words, text = [f"Note {nonce}:"], ""
    step = 64
    while True:
        words += [WORDS[(nonce + i) % len(WORDS)] for i in range(len(words), len(words) + step)]
        text = " ".join(words) + ". Answer with one word."
        n = len(render_chat(tokenizer, [{"role": "user", "content": text}]))
        if n >= length:
            return text
        step = max(1, min(64, length - n))


def large_busy_s(url: str) -> float:
    """The large model's step time so far (seconds; the demo runs one replica of it): its
    launches, where a CPU computes the forward, and its waits for the device."""
    host = httpx.get(f"{url}/tokenrouter/stats", timeout=30).json()["models"]["large"]["host"]
    phases = host["per_step_us"]
    return host["steps"] * (phases.get("launch", 0.0) + phases.get("wait", 0.0)) / 1e6


def measure(
    url: str, tokenizer: Any, lengths: list[int], repeats: int, salt: int
) -> tuple[dict[tuple[int, str], list[float]], float]:
    """TTFT (s) per (length, owner), and the large model's busy seconds per kept request."""
    import openai

    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    ttft: dict[tuple[int, str], list[float]] = {}
    kept_busy, kept = 0.0, 0
    nonce = salt
    for length in lengths:
        for _ in range(repeats):
            for owner, threshold in (("small", 1.0), ("large", 0.0)):
                nonce += 1
                text = prompt_text(tokenizer, length, nonce)
                before = large_busy_s(url) if owner == "small" else 0.0
                t0 = time.perf_counter()
                answer = client.chat.completions.create(
                    model="tokenrouter",
                    messages=[{"role": "user", "content": text}],
                    max_tokens=1,
                    temperature=0,
                    extra_body={"routing": {"threshold": threshold}},
                )
                took = time.perf_counter() - t0
                counts = answer.choices[0].model_extra["routing"]["tokens_per_model"]
                wrote = max(counts, key=counts.get) if counts else "?"
                if wrote != owner:
                    print(f"  (length {length}: the first token came from {wrote}, not {owner})")
                ttft.setdefault((length, wrote), []).append(took)
                if owner == "small":
                    time.sleep(0.5)  # the large model's admission prefill, if any, finishes
                    kept_busy += large_busy_s(url) - before
                    kept += 1
    return ttft, kept_busy / max(1, kept)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="300,600,1000,1400")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill-at", type=int, default=1)
    parser.add_argument("--http-port", type=int, default=8765)
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    from transformers import AutoTokenizer

    from tokenrouter_ray.demo import prepare_demo

    tokenizer = AutoTokenizer.from_pretrained(str(prepare_demo(quiet=True)))
    print(f"# {command()}\n# machine: {machine()}")
    deploy = ray_serve_deploy(args.http_port)
    results: dict[str, tuple[dict[tuple[int, str], list[float]], float]] = {}
    for mode, extra in (
        ("off", []),
        ("on", [f"models.large.prefill_at_admission={args.prefill_at}"]),
    ):
        with deploy(DEMO + extra, f"prefill_{mode}") as url:
            wait_ready(url)
            measure(url, tokenizer, lengths[:1], 1, salt=10_000 * (mode == "on"))  # warm-up
            results[mode] = measure(url, tokenizer, lengths, args.repeats, salt=len(results) * 1000)
    print("length  owner  TTFT off (s)  TTFT on (s)")
    ratios: dict[str, dict[int, float]] = {"off": {}, "on": {}}
    for length in lengths:
        for owner in ("small", "large"):
            cells = []
            for mode in ("off", "on"):
                times = results[mode][0].get((length, owner), [])
                cells.append(f"{statistics.median(times):12.3f}" if times else f"{'-':>12}")
            print(f"{length:6}  {owner:5}  {cells[0]}  {cells[1]}")
        for mode in ("off", "on"):
            kept = results[mode][0].get((length, "small"))
            esc = results[mode][0].get((length, "large"))
            if kept and esc:
                ratios[mode][length] = statistics.median(esc) / statistics.median(kept)
    nan = float("nan")
    for length in lengths:
        off, on = ratios["off"].get(length, nan), ratios["on"].get(length, nan)
        print(f"escalated / kept at {length}: off {off:.2f}, on {on:.2f}")
    print("the longer prefill (off, escalated minus kept: the large model's own) vs on, escalated:")
    for length in lengths:
        off_esc = results["off"][0].get((length, "large"))
        off_kept = results["off"][0].get((length, "small"))
        on_esc = results["on"][0].get((length, "large"))
        if off_esc and off_kept and on_esc:
            longer = statistics.median(off_esc) - statistics.median(off_kept)
            on = statistics.median(on_esc)
            print(f"  {length}: longer prefill {longer:.3f} s, on {on:.3f} s ({on / longer:.2f}x)")
    longest = ratios["on"].get(lengths[-1])
    verdict = "PASS" if longest is not None and longest <= TARGET_RATIO else "MISS"
    print(f"target: escalated / kept <= {TARGET_RATIO} at {lengths[-1]} tokens, on: "
          f"{longest or float('nan'):.2f} {verdict}")  # fmt: skip
    print(
        f"large model busy per request the small model kept: off "
        f"{results['off'][1] * 1e3:.0f} ms, on {results['on'][1] * 1e3:.0f} ms (the unused prefill)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
