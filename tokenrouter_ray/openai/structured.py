"""Structured outputs and forced tool calls: from a request's fields to one ``GrammarSpec``.

Fields (each a 400 naming it when malformed, never a 5xx):

- ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}`` (any
  JSON object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``;
- vLLM's ``structured_outputs`` (>= 0.10): exactly one of ``json`` (a schema, object or
  text), ``regex``, ``choice`` (a list of strings), ``grammar`` (EBNF), ``json_object``
  (true) or ``structural_tag`` (xgrammar's, as text);
- the older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``;
- chat ``tool_choice`` ``"required"`` or ``{"type": "function", "function": {"name"}}``:
  a grammar that admits only Hermes-style calls (``<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>``, Qwen's format) of the offered functions, whose arguments match
  each function's parameter schema; one or more calls (``required``; exactly one with
  ``parallel_tool_calls: false``), or exactly one call of the named function.

At most one of these may be given. ``structured_grammar`` returns the spec and the field
(None: the request is unconstrained); the grammar is parsed here once (xgrammar, no tokenizer) so a
bad schema, regex or EBNF is a 400, and compiled by each model against its vocabulary.

When the chat template thinks (Qwen3), the grammar leaves the thinking free: if the prompt
is inside an open ``<think>`` block, anything up to ``</think>`` comes first; if the model
may open one itself (thinking on, nothing rendered), an optional ``<think>...</think>``
block comes first. With thinking off (the template closed an empty block) the grammar
starts at the first output token.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from tokenrouter_ray.engine.grammar import check_grammar
from tokenrouter_ray.engine.request import GrammarSpec
from tokenrouter_ray.openai.errors import InvalidRequestError
from tokenrouter_ray.openai.reasoning import ReasoningFormat
from tokenrouter_ray.openai.schemas import ResponseFormat
from tokenrouter_ray.openai.tool_parser import TOOL_CALL_END, TOOL_CALL_START

MAX_CHOICES = 1024  # guided_choice / structured_outputs.choice entries


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code="invalid_value")


def _schema_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise _bad(f"'{param}' is not valid JSON", param) from None
    if not isinstance(value, (dict, bool)):
        raise _bad(f"'{param}' must be a JSON schema (an object)", param)
    return json.dumps(value)


def _choices(values: Sequence[str], param: str) -> list[str]:
    if not values or len(values) > MAX_CHOICES or not all(values):
        raise _bad(f"'{param}' must be 1..{MAX_CHOICES} non-empty strings", param)
    return list(values)


# a constraint: (param it came from, structural-tag format dict, plain spec or None)
Constraint = tuple[str, dict[str, Any], GrammarSpec | None]


def _from_response_format(rf: ResponseFormat) -> Constraint | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return "response_format", _json({"type": "object"}), GrammarSpec("json_object")
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise _bad(
            "'response_format' of type json_schema needs 'json_schema.schema'", "response_format"
        )
    text = _schema_text(rf.json_schema.schema_, "response_format.json_schema.schema")
    return "response_format", _json(json.loads(text)), GrammarSpec("json_schema", text)


def _from_fields(
    param: str,
    json_schema: Any = None,
    regex: str | None = None,
    choice: list[str] | None = None,
    grammar: str | None = None,
    json_object: bool | None = None,
    structural_tag: str | None = None,
) -> list[Constraint]:
    found: list[Constraint] = []
    if json_schema is not None:
        name = f"{param}.json" if param == "structured_outputs" else "guided_json"
        text = _schema_text(json_schema, name)
        found.append((name, _json(json.loads(text)), GrammarSpec("json_schema", text)))
    if regex is not None:
        name = f"{param}.regex" if param == "structured_outputs" else "guided_regex"
        found.append((name, {"type": "regex", "pattern": regex}, GrammarSpec("regex", regex)))
    if choice is not None:
        name = f"{param}.choice" if param == "structured_outputs" else "guided_choice"
        fmt = {"type": "or", "elements": [_const(c) for c in _choices(choice, name)]}
        found.append((name, fmt, None))
    if grammar is not None:
        name = f"{param}.grammar" if param == "structured_outputs" else "guided_grammar"
        found.append((name, {"type": "grammar", "grammar": grammar}, GrammarSpec("ebnf", grammar)))
    if json_object:
        found.append(
            (f"{param}.json_object", _json({"type": "object"}), GrammarSpec("json_object"))
        )
    if structural_tag is not None:
        name = f"{param}.structural_tag"
        try:
            fmt = json.loads(structural_tag).get("format")
        except (ValueError, AttributeError):
            fmt = None
        if not isinstance(fmt, dict):
            raise _bad(f"'{name}' must be a structural tag: JSON with a 'format'", name)
        found.append((name, fmt, GrammarSpec("structural_tag", structural_tag)))
    return found


def _json(schema: Any) -> dict[str, Any]:
    """A JSON value of ``schema`` inside a structural tag: at most one whitespace character
    between tokens (free whitespace lets a small model wander into endless blank runs)."""
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def _tool_calls(tools: Sequence[Any], only: str | None, single: bool) -> dict[str, Any]:
    """Hermes-style calls of ``tools`` (``only``: that function), one or more."""
    tags = []
    for tool in tools:
        fn = tool.function
        if only is not None and fn.name != only:
            continue
        head = f'{TOOL_CALL_START}\n{{"name": {json.dumps(fn.name)}, "arguments": '
        params = fn.parameters if fn.parameters is not None else {"type": "object"}
        tags.append(
            {"type": "tag", "begin": head, "content": _json(params), "end": f"}}\n{TOOL_CALL_END}"}
        )
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": "\n",
        "at_least_one": True,
        "stop_after_first": single,
    }


def _tool_constraint(request: Any) -> Constraint | None:
    choice = getattr(request, "tool_choice", None)
    if choice is None or choice in ("auto", "none"):
        return None
    if not request.tools:
        raise _bad("'tool_choice' forces a call but no 'tools' are given", "tool_choice")
    if choice == "required":
        single = request.parallel_tool_calls is False
        return "tool_choice", _tool_calls(request.tools, None, single), None
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise _bad(
            '\'tool_choice\' must name a function: {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in {t.function.name for t in request.tools}:
        raise _bad(f"'tool_choice' names {name!r}, which is not among the 'tools'", "tool_choice")
    return "tool_choice", _tool_calls(request.tools, name, True), None


def _constraints(request: Any) -> list[Constraint]:
    found: list[Constraint] = []
    rf = getattr(request, "response_format", None)
    if rf is not None:
        c = _from_response_format(rf)
        found += [c] if c is not None else []
    so = request.structured_outputs
    if so is not None:
        found += _from_fields(
            "structured_outputs",
            so.json_,
            so.regex,
            so.choice,
            so.grammar,
            so.json_object,
            so.structural_tag,
        )
    found += _from_fields(
        "guided",
        request.guided_json,
        request.guided_regex,
        request.guided_choice,
        request.guided_grammar,
    )
    tool = _tool_constraint(request)
    found += [tool] if tool is not None else []
    return found


def _thinking_first(fmt: dict[str, Any], reasoning: ReasoningFormat, opened: bool) -> dict:
    """``fmt`` after the thinking block (already open: close it first; else optional)."""
    think = {
        "type": "tag",
        "begin": "" if opened else reasoning.start,
        "content": {"type": "any_text"},
        "end": reasoning.end,
    }
    gap = {"type": "regex", "pattern": r"\n{0,2}"}
    first = think if opened else {"type": "optional", "content": think}
    return {"type": "sequence", "elements": [first, gap, fmt]}


def structured_grammar(
    request: Any,
    reasoning: ReasoningFormat | None = None,
    thinking: Literal["open", "may", "off"] = "off",
) -> tuple[GrammarSpec, str] | None:
    """The request's grammar and the field it came from, or None. ``thinking``: the prompt
    is inside an open thinking block (``open``), the model may open one (``may``), or no
    thinking (``off``)."""
    found = _constraints(request)
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(f"'{name}'" for name, _, _ in found)
        raise _bad(f"Give at most one output constraint; got {names}", found[1][0])
    param, fmt, plain = found[0]
    if request.ignore_eos:
        raise _bad(f"'ignore_eos' cannot be combined with '{param}'", "ignore_eos")
    if reasoning is not None and thinking != "off":
        fmt = _thinking_first(fmt, reasoning, thinking == "open")
        plain = None
    spec = plain
    if spec is None:
        spec = GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))
    try:
        check_grammar(spec)
    except ValueError as exc:
        raise _bad(f"Invalid value for '{param}': {exc}", param) from None
    return spec, param
