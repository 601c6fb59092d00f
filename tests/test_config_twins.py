"""No class's fields are a hand-written copy of another's: every pair of classes in two
modules of the package (the pydantic models of config.py, and every dataclass, msgspec
``Struct`` and pydantic model elsewhere) that share at least ``SHARED`` field names is
related by inheritance (the shared fields declared once, in a common base), built from the
other by a generic copy (``GENERIC_COPIES``, checked to name the fields nowhere), or listed
below with the reason it is not a copy.

The classes are read from the source with ``ast``, so nothing is imported: modules that
load torch (``engine/``, ``routing/``) count like the rest, and the test stays fast.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tokenrouter_ray"
SHARED = 5  # this many field names in common make two classes twins

Pair = tuple[str, str]  # ("module.Class", "module.Class"), modules relative to the package

# Twins built one from the other by a generic copy: pair -> the package's top-level
# functions that copy, none of which names the shared fields.
GENERIC_COPIES: dict[Pair, tuple[str, ...]] = {
    ("protocol.RouteState", "replica.tracking.Tracked"): ("_converters",),
    ("config.RequestLimitSpec", "openai.validation.RequestLimits"): ("request_limits_of",),
}

# Pairs whose shared names are not a copy: shapes the OpenAI API or transformers define (two
# endpoints' bodies, a response that echoes its request's parameters, a model's
# generation_config.json), or different things that share names.
NOT_COPIES: dict[Pair, str] = {
    ("openai.generation_defaults.GenerationDefaults", "openai.schemas._SamplingRequest"): (
        "a model's generation_config.json as transformers names its keys, and the request body"
    ),
    ("engine.request.SamplingParams", "openai.generation_defaults.GenerationDefaults"): (
        "a model's generation_config.json as transformers names its keys, and the engine's "
        "sampling that takes them as defaults"
    ),
    ("demo.artifacts.Recipe", "routing.training.train.TrainOptions"): (
        "two different trainings (the small model's distillation, the router's) whose "
        "parameters share names (epochs, lr, top_k, seed, max_tokens)"
    ),
    ("engine.request.SamplingParams", "openai.schemas._SamplingRequest"): (
        "the request body as the API defines it, and the engine's sampling that validation "
        "checks and fills field by field from it (defaults, bounds, generation_config)"
    ),
    ("openai.schemas._SamplingRequest", "openai.validation.SamplingOptions"): (
        "the request body, and the few options only the ingress reads, validated from it"
    ),
    ("openai.responses_input.ResponsesRequest", "openai.schemas._SamplingRequest"): (
        "the Responses and the Chat/Completions request bodies, each as the API defines it"
    ),
    ("openai.responses_input.ResponsesRequest", "openai.responses_output.ResponseObject"): (
        "the Responses API's request and the response object that echoes its parameters"
    ),
    ("openai.responses_output.ResponseObject", "openai.schemas._SamplingRequest"): (
        "a Responses API response object and a Chat/Completions request body"
    ),
    ("openai.responses.Completion", "openai.responses_output.ResponseObject"): (
        "the Completions and the Responses API's response envelopes"
    ),
    ("openai.responses.ChatCompletion", "openai.responses_output.ResponseObject"): (
        "the Chat Completions and the Responses API's response envelopes"
    ),
}

# Hand-written copies that carry no config: statuses, results and reports whose
# fields are filled one by one from another layer's. Each still declares its fields twice.
HAND_COPIES: dict[Pair, str] = {
    ("engine.outputs.EngineStatus", "replica.status.ReplicaStatus"): (
        "ReplicaStatus.of copies the engine's status field by field"
    ),
    ("protocol.FinishSummary", "replica.tracking.Tracked"): (
        "Tracked.summary fills the FINISHED's summary field by field"
    ),
    ("replica.profile.HostProfile", "replica.status.HostSteps"): (
        "the status's host-time section, filled from the profile field by field"
    ),
    ("openai.token_reports.RequestMetrics", "protocol.FinishSummary"): (
        "the API's per-request metrics, from the FINISHED's summary"
    ),
    ("openai.token_reports.RequestMetrics", "protocol.RouteState"): (
        "the same metric names as the routing state they accumulate in"
    ),
    ("openai.token_reports.RequestMetrics", "replica.tracking.Tracked"): (
        "the same metric names as the routing state they accumulate in"
    ),
    ("openai.token_reports.DroppedToken", "traceview.model.DroppedToken"): (
        "traceview reads the routing trace's dropped tokens into its own class"
    ),
    ("quality.evaluate.SystemResult", "quality.frontier.FrontierPoint"): (
        "a frontier point repeats an evaluated system's result"
    ),
}


@dataclass
class ClassInfo:
    module: str
    name: str
    bases: list[str]
    own: list[str]  # fields declared in its body
    dataclass: bool
    parents: list[str] = field(default_factory=list)  # resolved keys of package bases

    @property
    def key(self) -> str:
        return f"{self.module}.{self.name}"


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _own_fields(node: ast.ClassDef) -> list[str]:
    found = []
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            annotation = ast.unparse(stmt.annotation)
            if "ClassVar" in annotation or "InitVar" in annotation:
                continue
            if not stmt.target.id.startswith("_"):
                found.append(stmt.target.id)
    return found


@functools.cache
def read_classes() -> dict[str, ClassInfo]:
    classes: dict[str, ClassInfo] = {}
    imported: dict[str, dict[str, str]] = {}  # module -> local name -> "module.Class"
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module(path)
        tree = ast.parse(path.read_text())
        names = imported[module] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "tokenrouter_ray."
            ):
                source = node.module.removeprefix("tokenrouter_ray.")
                for alias in node.names:
                    names[alias.asname or alias.name] = f"{source}.{alias.name}"
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                decorators = [ast.unparse(d).split("(")[0] for d in node.decorator_list]
                classes[f"{module}.{node.name}"] = ClassInfo(
                    module,
                    node.name,
                    [ast.unparse(b).split("[")[0] for b in node.bases],
                    _own_fields(node),
                    any(d.rsplit(".", 1)[-1] == "dataclass" for d in decorators),
                )
    for info in classes.values():
        for base in info.bases:
            local = f"{info.module}.{base}"
            key = local if local in classes else imported[info.module].get(base)
            if key in classes:
                info.parents.append(key)
    return classes


def _ancestors(classes: dict[str, ClassInfo], key: str) -> set[str]:
    found: set[str] = set()
    for parent in classes[key].parents:
        found |= {parent} | _ancestors(classes, parent)
    return found


def _is_record(classes: dict[str, ClassInfo], key: str) -> bool:
    """A dataclass, msgspec Struct or pydantic model, itself or through its bases."""
    info = classes[key]
    if info.dataclass:
        return True
    external = [b for b in info.bases if f"{info.module}.{b}" not in classes]
    if any(b.endswith("BaseModel") or b in ("Struct", "msgspec.Struct") for b in external):
        return True
    return any(_is_record(classes, parent) for parent in info.parents)


def _fields(classes: dict[str, ClassInfo], key: str) -> dict[str, str]:
    """Every field of a class -> the class that declares it (bases first, then its own)."""
    found: dict[str, str] = {}
    for parent in reversed(classes[key].parents):
        found.update(_fields(classes, parent))
    found.update({name: key for name in classes[key].own})
    return found


@functools.cache
def find_twins() -> dict[Pair, list[str]]:
    """Every pair of record classes in two modules sharing ``SHARED`` field names declared
    in different classes, not one a base of the other; of a family of such pairs, only the
    one whose classes are furthest up their hierarchies (where a fix would go)."""
    classes = read_classes()
    records = sorted(k for k in classes if _is_record(classes, k))
    fields = {k: _fields(classes, k) for k in records}
    ancestors = {k: _ancestors(classes, k) for k in records}
    twins: dict[Pair, list[str]] = {}
    for i, a in enumerate(records):
        for b in records[i + 1 :]:
            if classes[a].module == classes[b].module:
                continue
            if a in ancestors[b] or b in ancestors[a]:
                continue
            shared = sorted(
                n for n in fields[a].keys() & fields[b].keys() if fields[a][n] != fields[b][n]
            )
            if len(shared) >= SHARED:
                twins[(a, b)] = shared
    return {
        (a, b): shared
        for (a, b), shared in twins.items()
        if not any(
            ((x, y) != (a, b) and x in ancestors[a] | {a} and y in ancestors[b] | {b})
            or ((y, x) != (a, b) and y in ancestors[a] | {a} and x in ancestors[b] | {b})
            for x, y in twins
        )
    }


def _above(pair: Pair, twin: Pair, ancestors: dict[str, set[str]]) -> bool:
    """``pair`` is ``twin``'s classes or their bases (in either order), and not ``twin``."""
    a, b = twin
    up_a, up_b = ancestors[a] | {a}, ancestors[b] | {b}
    x, y = pair
    return pair != twin and ((x in up_a and y in up_b) or (y in up_a and x in up_b))


def _names_in(function: str) -> set[str]:
    """Every identifier, attribute, keyword and string the package's top-level function
    ``function`` names."""
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == function:
                names: set[str] = set()
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Name):
                        names.add(sub.id)
                    elif isinstance(sub, ast.Attribute):
                        names.add(sub.attr)
                    elif isinstance(sub, ast.keyword) and sub.arg:
                        names.add(sub.arg)
                    elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                        names.add(sub.value)
                return names
    raise AssertionError(f"no function {function} in the package")


def test_no_class_copies_another_s_fields_by_hand() -> None:
    twins = find_twins()
    listed = set(GENERIC_COPIES) | set(NOT_COPIES) | set(HAND_COPIES)
    new = {f"{a} ~ {b}: {shared}" for (a, b), shared in twins.items() if (a, b) not in listed}
    assert not new, "fields declared twice (inherit a shared base, or copy generically):\n" + (
        "\n".join(sorted(new))
    )
    # an entry whose twins are gone goes too
    stale = (set(GENERIC_COPIES) | set(NOT_COPIES) | set(HAND_COPIES)) - set(twins)
    assert not stale, f"listed pairs no longer twins: {sorted(stale)}"


def test_generic_copies_name_no_shared_field() -> None:
    twins = find_twins()
    for pair, functions in GENERIC_COPIES.items():
        named = set().union(*(_names_in(f) for f in functions))
        assert len(named & set(twins[pair])) < SHARED, (pair, sorted(named & set(twins[pair])))


def test_the_scan_sees_inheritance_and_twins() -> None:
    """The scan can fail: it finds a pair it must, and skips a pair sharing a base."""
    twins = find_twins()
    assert ("protocol.RouteState", "replica.tracking.Tracked") in twins
    fields = _fields(read_classes(), "config.ModelSpec")
    assert fields["block_size"] == fields["dtype"] == "engine.config.EngineOptions"
    assert not any("config.ModelSpec" in pair and "EngineConfig" in str(pair) for pair in twins)
