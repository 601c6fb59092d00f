"""The routing-trace viewer (tokenrouter_ray/traceview): the HTML page's spans, strip and
counts from a hand-written trace, the PNG's pixels, the page as headless Chromium renders
it, the CLI from a saved response, and the CLI against a served app (the whole OpenAI flow
on tiny models, over real HTTP)."""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from tokenrouter_ray.cli import main
from tokenrouter_ray.traceview import TraceError, render_html, trace_from_json
from tokenrouter_ray.traceview.model import alpha_of, hex_to_rgb, model_colours, parse_text, shade

MODELS = ["small", "large"]
TOKENS = [
    {"id": 9906, "text": "Hello", "model": "small", "score": 0.031},
    {"id": 11, "text": ",", "model": "large", "score": None},
    {"id": 70, "text": " <script>alert('x')</script>", "model": "small", "score": 0.25},
    {"id": 71, "text": " world", "model": "small", "score": 0.95},
    {"id": 198, "text": "\n", "model": "large", "score": None},
    {"id": 72, "text": "", "model": "small", "score": 0.5},
    {"id": 73, "text": "\ufffd", "model": "small", "score": 0.4},
    {"id": 74, "text": " & done", "model": "large", "score": None},
]
DROPPED = [
    {"index": 1, "id": 13, "text": ".", "model": "small", "score": 0.71, "replaced_by": "large"},
    {"index": 7, "id": 75, "text": " &end", "model": "small", "score": 0.8,
     "replaced_by": "large"},
]  # fmt: skip
TRACE = {"models": MODELS, "tokens": TOKENS, "dropped": DROPPED}


def chat_response(trace: dict[str, Any] | None = TRACE) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": "".join(t["text"] for t in TOKENS)},
        "finish_reason": "length",
        "routing": {"tokens_per_model": {"small": 5, "large": 3}, "handoffs": 4},
    }
    if trace is not None:
        choice["routing_trace"] = trace
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "tokenrouter",
            "choices": [choice]}  # fmt: skip


def streamed_chunks(cuts: list[int]) -> list[dict[str, Any]]:
    """The response as stream chunks: tokens split at ``cuts``, drops (absolute indices)
    on the chunk that holds their replacement, ``models`` on the first chunk only."""
    chunks = []
    bounds = [0, *cuts, len(TOKENS)]
    for k, (a, b) in enumerate(itertools.pairwise(bounds)):
        part: dict[str, Any] = {
            "tokens": TOKENS[a:b],
            "dropped": [d for d in DROPPED if a <= d["index"] < b],
        }
        if k == 0:
            part["models"] = MODELS
        delta = {"content": "".join(t["text"] for t in TOKENS[a:b])}
        choice = {"index": 0, "delta": delta, "routing_trace": part}
        chunks.append({"object": "chat.completion.chunk", "choices": [choice]})
    return chunks


class Page(HTMLParser):
    """The token spans (class ``t``), dropped spans (``drop``), strip cells and the
    summary's per-model counts of a rendered page, in document order."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.items: list[dict[str, Any]] = []  # token and dropped spans, in order
        self.cells: list[dict[str, str]] = []
        self.counts: dict[str, int] = {}
        self._open: dict[str, Any] | None = None
        self._row: str | None = None
        self._in_count = False
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        classes = a.get("class", "").split()
        if tag == "span" and ("t" in classes or "drop" in classes):
            self._open = {**a, "classes": classes, "text": ""}
            self.items.append(self._open)
        elif tag == "div" and "cell" in classes:
            self.cells.append(a)
        elif tag == "tr" and "model" in classes:
            self._row = a["data-model"]
        elif tag == "td" and "count" in classes:
            self._in_count = True

    def handle_endtag(self, tag: str) -> None:
        if tag == "span":
            self._open = None
        self._in_count = False

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self._open["text"] += data
        if self._in_count and self._row is not None:
            self.counts[self._row] = int(data)

    @property
    def tokens(self) -> list[dict[str, Any]]:
        return [s for s in self.items if "t" in s["classes"]]


def background(style: str) -> str:
    match = re.search(r"background:(#[0-9a-f]{6})", style)
    assert match, style
    return match.group(1)


def test_html_spans_carry_writer_score_escaping_and_drops() -> None:
    trace = trace_from_json(chat_response())
    html = render_html(trace, title="a <em> title")
    page = Page(html)
    colours = model_colours(MODELS)
    assert [s["text"] for s in page.tokens] == [t["text"] for t in TOKENS]
    for i, (span, t) in enumerate(zip(page.tokens, TOKENS, strict=True)):
        assert span["data-model"] == t["model"] and span["data-id"] == str(t["id"])
        assert f"m{MODELS.index(t['model'])}" in span["classes"] and span["data-i"] == str(i)
        if t["score"] is None:
            assert "data-score" not in span and "score none" in span["title"]
        else:
            assert float(span["data-score"]) == pytest.approx(t["score"])
            assert f"score {t['score']:.3f}" in span["title"]
        assert background(span["style"]) == shade(colours[t["model"]], alpha_of(t["score"]))
    # darker = higher score, within one model
    small = [shade(colours["small"], alpha_of(s)) for s in (0.031, 0.25, 0.95)]
    assert [sum(hex_to_rgb(c)) for c in small] == sorted((sum(hex_to_rgb(c)) for c in small),
                                                         reverse=True)  # fmt: skip
    # the token text and the title are escaped, never markup
    assert "<script>" not in html and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in html
    assert "<em>" not in html and "a &lt;em&gt; title" in html
    assert "white-space: pre-wrap" in html and "<script" not in html.lower()
    # each dropped proposal right before its replacement, as the proposer wrote it
    kinds = ["drop" if "drop" in s["classes"] else "t" for s in page.items]
    assert kinds == ["t", "drop", "t", "t", "t", "t", "t", "t", "drop", "t"]
    drop = page.items[1]
    assert drop["text"] == "." and drop["data-model"] == "small" and "m0" in drop["classes"]
    assert "replaced by large" in drop["title"] and "score 0.710" in drop["title"]
    assert page.items[8]["text"] == " &end"
    # summary numbers and the strip
    assert page.counts == {"small": 5, "large": 3}
    assert re.search(r'id="changes">(\d+)<', html).group(1) == "5"
    assert re.search(r'id="dropped">(\d+)<', html).group(1) == "2"
    assert len(page.cells) == len(TOKENS)
    assert [c["class"].split()[1] for c in page.cells] == [
        f"m{MODELS.index(t['model'])}" for t in TOKENS
    ]
    handoff = [i for i, c in enumerate(page.cells) if "h" in c["class"].split()]
    dropped = [i for i, c in enumerate(page.cells) if "d" in c["class"].split()]
    assert handoff == [1, 2, 4, 5, 7] and dropped == [1, 7]
    for k, m in enumerate(MODELS):  # the CSS paints each model's cells in its colour
        assert f".cell.m{k}, .sw.m{k} {{ background: {colours[m]}; }}" in html


def test_trace_summary_numbers() -> None:
    trace = trace_from_json(TRACE)
    summary = trace.summary()
    assert summary["tokens_per_model"] == {"small": 5, "large": 3}
    assert summary["writer_changes"] == 5  # 0 small|1 large|2,3 small|4 large|5,6 small|7 large
    assert summary["dropped"] == 2 and summary["dropped_per_model"] == {"small": 2, "large": 0}
    assert summary["mean_score_per_model"]["small"] == pytest.approx((0.031 + 0.25 + 0.95 + 0.5
                                                                      + 0.4) / 5)  # fmt: skip
    assert summary["mean_score_per_model"]["large"] is None


def test_streamed_chunks_and_sse_give_the_response_trace() -> None:
    whole = trace_from_json(chat_response())
    for cuts in ([1], [2, 5], list(range(1, len(TOKENS)))):
        assert trace_from_json(streamed_chunks(cuts)) == whole
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in streamed_chunks([3])) + "data: [DONE]\n\n"
    assert trace_from_json(parse_text(sse)) == whole
    assert trace_from_json(TRACE) == whole  # a bare routing_trace object
    # a writer the models list leaves out is kept (after the listed ones)
    odd = copy.deepcopy(TRACE)
    odd["tokens"][0]["model"] = "mid"
    assert trace_from_json(odd).models == ["small", "large", "mid"]


def test_inputs_without_a_usable_trace_are_clear_errors() -> None:
    with pytest.raises(TraceError, match=r"carries no routing_trace.*extra_body"):
        trace_from_json(chat_response(trace=None))
    with pytest.raises(TraceError, match="no choice 2"):
        trace_from_json(chat_response(), choice=2)
    bad = copy.deepcopy(TRACE)
    bad["dropped"][0]["index"] = 8
    with pytest.raises(TraceError, match="index 8 is outside the 8 output tokens"):
        trace_from_json(bad)
    bad = copy.deepcopy(TRACE)
    del bad["tokens"][2]["model"]
    with pytest.raises(TraceError, match=r"tokens\[2\]: missing key 'model'"):
        trace_from_json(bad)
    with pytest.raises(TraceError, match=r"expected a chat\.completion"):
        trace_from_json({"object": "list", "data": []})


def colour_present(pixels: Any, colour: str, tolerance: int = 2) -> bool:
    import numpy as np

    rgb = np.asarray(pixels)[..., :3].astype(int)
    return bool((np.abs(rgb - np.array(hex_to_rgb(colour))).max(axis=-1) <= tolerance).any())


def read_png(path: Path) -> Any:
    from PIL import Image

    with Image.open(path) as image:
        assert image.format == "PNG"
        return image.convert("RGB")


def test_png_is_a_sane_image_with_each_models_colour(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from tokenrouter_ray.traceview import render_png
    from tokenrouter_ray.traceview.png import MAX_TEXT_TOKENS

    trace = trace_from_json(TRACE)
    image = read_png(render_png(trace, tmp_path / "t.png"))
    assert 1000 <= image.width <= 2000 and 300 <= image.height <= 1500
    colours = model_colours(MODELS)
    for m in MODELS:  # the strip, exactly; the text's shading, as the HTML page paints it
        assert colour_present(image, colours[m]), m
    assert colour_present(image, shade(colours["small"], alpha_of(0.95)))
    assert colour_present(image, shade(colours["large"], alpha_of(None)))
    # a long output: the text is capped, the figure stays bounded
    long = copy.deepcopy(TRACE)
    long["tokens"] = [dict(t, text=f" w{i}") for i, t in enumerate(TOKENS * 80)]
    big = read_png(render_png(trace_from_json(long), tmp_path / "long.png"))
    assert big.width == image.width and big.height < 4000
    assert len(long["tokens"]) > MAX_TEXT_TOKENS


def test_cli_from_a_saved_response_writes_both(tmp_path: Path, capsys, monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    saved = tmp_path / "response.json"
    saved.write_text(json.dumps(chat_response()))
    monkeypatch.chdir(tmp_path)
    assert main(["trace", "--input", str(saved)]) == 0  # default: trace.html + trace.png
    out = capsys.readouterr().out
    assert "8 tokens (small 5, large 3), 5 writer changes, 2 dropped" in out
    assert len(Page((tmp_path / "trace.html").read_text()).tokens) == len(TOKENS)
    read_png(tmp_path / "trace.png")
    chunks = tmp_path / "chunks.json"
    chunks.write_text(json.dumps(streamed_chunks([4])))
    assert main(["trace", "--input", str(chunks), "--html", str(tmp_path / "s.html")]) == 0
    assert not (tmp_path / "s.png").exists()
    assert (tmp_path / "s.html").read_text() == (tmp_path / "trace.html").read_text()
    saved.write_text(json.dumps(chat_response(trace=None)))
    assert main(["trace", "--input", str(saved), "--out", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "carries no routing_trace" in err and "Traceback" not in err
    assert not (tmp_path / "none.html").exists()


def test_png_without_matplotlib_names_the_extra(tmp_path: Path, capsys, monkeypatch) -> None:
    saved = tmp_path / "response.json"
    saved.write_text(json.dumps(chat_response()))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["trace", "--input", str(saved), "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert "tokenrouter-ray[bench]" in err and "t.html" in err  # the HTML was still written
    assert (tmp_path / "t.html").exists() and not (tmp_path / "t.png").exists()


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(
    CHROMIUM is None,
    reason="chromium is not installed (scripts/test.sh installs Debian's chromium with apt-get)",
)
def test_chromium_renders_the_shaded_tokens(tmp_path: Path) -> None:
    trace = copy.deepcopy(TRACE)
    for t in trace["tokens"]:  # longer tokens: enough shaded pixels to find
        t["text"] = t["text"] * 3 if t["text"].strip() else t["text"]
    page = tmp_path / "trace.html"
    page.write_text(render_html(trace_from_json(trace)), encoding="utf-8")
    flags = [
        CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1000,700",
    ]  # fmt: skip
    dom = subprocess.run(
        [*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=60
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    parsed = Page(dom.stdout)  # the page parsed into the DOM Chromium serialises back
    assert [s["data-model"] for s in parsed.tokens] == [t["model"] for t in TOKENS]
    assert [s["text"] for s in parsed.tokens] == [t["text"] for t in trace["tokens"]]
    assert "&lt;script&gt;" in dom.stdout and len(parsed.cells) == len(TOKENS)
    shot = tmp_path / "shot.png"
    run = subprocess.run(
        [*flags, f"--screenshot={shot}", page.as_uri()], capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert run.returncode == 0 and shot.exists(), run.stderr[-2000:]
    image = read_png(shot)
    colours = model_colours(MODELS)
    for m in MODELS:  # strip cells and legend swatches
        assert colour_present(image, colours[m]), m
    for t in TOKENS:  # every token's shade is on screen
        if t["text"].strip():
            want = shade(colours[t["model"]], alpha_of(t["score"]))
            assert colour_present(image, want), (t, want)


# ---- against a served app ----------------------------------------------------------------


def test_cli_url_against_a_served_app(served_chain_dirs, tmp_path: Path, capsys) -> None:
    """`trace --url` over real HTTP: uvicorn serving deployments/ingress.py's app ->
    IngressServer -> LocalRuntime on the tiny chain. A response without a trace (not asked
    for, or a server without the feature) is one clear error; with one, both files."""
    import openai
    from transformers import AutoTokenizer

    from tests.openai.ingress_app import SERVED, served
    from tests.tiny_models import chain_engines
    from tokenrouter_ray.openai.validation import RequestLimits
    from tokenrouter_ray.routing.policy import build_policy

    tokenizer = AutoTokenizer.from_pretrained(served_chain_dirs["small"])
    limits = RequestLimits(max_model_len=256, vocab_size=128)
    prompt = "w5 w17 w3 w99"
    out = tmp_path / "served"

    async def go() -> tuple[int, dict[str, Any]]:
        policy = build_policy("entropy", {"threshold": 0.45}, MODELS)
        engines = chain_engines(served_chain_dirs, MODELS)
        async with served(
            engines, policy, tokenizer, limits=limits, socket=True, log_level="warning"
        ) as flow:
            url = flow.url
            rc = await asyncio.to_thread(main, [
                "trace", "--url", url, "--model", SERVED, "--prompt", prompt,
                "--max-tokens", "12", "--temperature", "0", "--out", str(out),
                "--save-response", str(tmp_path / "traced.json"),
            ])  # fmt: skip
            client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0)
            async with client:  # the same request, trace not asked for
                plain = await client.chat.completions.create(
                    model=SERVED, max_tokens=12, temperature=0,
                    messages=[{"role": "user", "content": prompt}],
                )  # fmt: skip
            await flow.runtime.wait_idle()
            return rc, plain.model_dump()

    rc, plain = asyncio.run(go())
    captured = capsys.readouterr()
    traced = json.loads((tmp_path / "traced.json").read_text())
    assert traced["object"] == "chat.completion" and traced["choices"][0]["message"]["content"]
    # a real response without a trace, saved and read back: the --input error
    saved = tmp_path / "plain.json"
    saved.write_text(json.dumps(plain))
    assert main(["trace", "--input", str(saved), "--out", str(tmp_path / "p")]) == 2
    assert "carries no routing_trace" in capsys.readouterr().err
    if "routing_trace" not in traced["choices"][0]:
        assert rc == 2 and "the server did not return a routing trace" in captured.err
        assert "Traceback" not in captured.err and not out.with_suffix(".html").exists()
        pytest.skip("the server does not return routing_trace yet")
    assert rc == 0, captured.err
    trace = traced["choices"][0]["routing_trace"]
    routing = traced["choices"][0]["routing"]
    page = Page(out.with_suffix(".html").read_text())
    assert len(page.tokens) == traced["usage"]["completion_tokens"] == len(trace["tokens"])
    assert trace["models"] == MODELS
    assert page.counts == {m: routing["tokens_per_model"].get(m, 0) for m in MODELS}
    assert [s["data-model"] for s in page.tokens] == [t["model"] for t in trace["tokens"]]
    pytest.importorskip("matplotlib")
    read_png(out.with_suffix(".png"))


# ---- the docs --------------------------------------------------------------------------------

DOC = Path(__file__).resolve().parents[1] / "docs" / "user-guide" / "observability.md"


def test_docs_commands_parse_and_the_example_trace_says_what_the_docs_say() -> None:
    import shlex

    from tokenrouter_ray.cli import build_parser

    text = DOC.read_text()
    section = text[text.index("## Routing traces and heatmaps") :]
    block = re.search(r"```bash\n(# one prompt.*?)```", section, re.S).group(1)
    lines = [ln for ln in block.replace("\\\n", " ").splitlines() if not ln.startswith("#")]
    parsed = [build_parser().parse_args(shlex.split(ln)[1:]) for ln in lines]
    assert [a.command for a in parsed] == ["trace", "trace"]
    assert parsed[0].url and parsed[0].prompt and parsed[1].input == Path("france.json")
    for body in re.findall(r"-d \\\n\s+'(.*?)'", section, re.S):  # the curl body is JSON
        assert json.loads(body)["routing_trace"] is True
    example = DOC.parent / "routing_trace_example.json"
    trace = trace_from_json(json.loads(example.read_text()))
    assert (len(trace.tokens), len(trace.dropped)) == (90, 29) and trace.models == MODELS
    threshold = 0.595  # the doc's figure: every drop at or above it, every kept score below
    assert all(d.score >= threshold and d.model == "small" for d in trace.dropped)
    assert all(t.score < threshold for t in trace.tokens if t.model == "small")
    assert all(t.score is None for t in trace.tokens if t.model == "large")
    assert "threshold 0.595" in section and "Every drop (29)" in section
