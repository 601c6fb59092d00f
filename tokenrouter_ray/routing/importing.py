"""``tokenrouter-ray import-router``: convert a router trained elsewhere into our checkpoint
format (one safetensors file, see ``routers.py``), so serving never unpickles.

``--format r2r``: a router published by R2R (thu-nics/R2R): a ``torch.save`` dict with
``model_type``, ``init_args``, ``common_args`` (decision ``threshold``, ``input_type``),
``model_specific_args`` and ``state_dict``. Its ``HiddenStatesTokenLMHeadLogitsClassifier``
(inputs: last hidden state, sampled token, top-k raw logits) maps one to one onto our
``R2RRouter`` with ``features="concat"``: same inputs, same layers, same blocks; only the
parameter names change. The architecture is read from the weights' shapes and checked
against ``init_args``. A ``token_embeddings.weight`` in the file becomes the router's own
embedding table (R2R's inference does the same); without it the router reads the small
model's input embeddings, as R2R fills that table from the small model.

``--format legacy``: a checkpoint our ``train-router`` wrote before the safetensors format
(``{kind, arch, state_dict, metrics}``).

The pickle is read with ``torch.load(weights_only=True)`` (tensors and plain containers
only; numpy scalars allowed); anything else needs ``--trust-pickle``. Torch is imported
only when the command runs, so building the CLI parser stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any

from tokenrouter_ray.errors import UserFacingError

FORMATS = ("r2r", "legacy")
R2R_CLASS = "HiddenStatesTokenLMHeadLogitsClassifier"
R2R_INPUTS = {"hidden_states", "token", "logits"}
R2R_RENAMES = (  # R2R's parameter prefix -> ours
    ("backbone.output_layer.0.", "norm."),
    ("backbone.output_layer.1.", "head."),
    ("backbone.input_projection.", "features.proj_in."),
    ("combined_projection.", "features.combine."),
    ("logits_projection.", "features.proj_logits."),
    ("layer_norm_hidden_states.", "features.norm_hidden."),
    ("layer_norm_token.", "features.norm_token."),
    ("token_embeddings.", "token_embeddings."),
)
R2R_BLOCK = re.compile(r"backbone\.blocks\.(\d+)\.(layer_norm|mlp\.0|mlp\.3|dim_change)\.(\w+)")
BLOCK_PARTS = {"layer_norm": "norm", "mlp.0": "up", "mlp.3": "down", "dim_change": "skip"}


def read_pickle(path: str | Path, trust: bool = False) -> dict[str, Any]:
    """The checkpoint dict, through torch's restricted unpickler unless ``trust``."""
    import pickle

    import numpy as np
    import torch

    path = Path(path)
    if not path.is_file():
        raise UserFacingError(f"{path} does not exist")
    if trust:
        blob = torch.load(path, map_location="cpu", weights_only=False)
    else:
        numpy_types = [np.dtype, *{type(np.dtype(t)) for t in ("f4", "f8", "i8", "i4", "?")}]
        numpy_types.append(np.float64(0).__reduce__()[0])  # numpy's scalar constructor
        try:
            with torch.serialization.safe_globals(numpy_types):
                blob = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            first = str(exc).strip().splitlines()[-1][:300]
            raise UserFacingError(
                f"{path} holds objects torch's restricted loader refuses ({first}). If you "
                "trust the file, re-run with --trust-pickle (it runs the file's pickle code)."
            ) from None
    if not isinstance(blob, dict):
        raise UserFacingError(f"{path} is not a checkpoint dict (got {type(blob).__name__})")
    return blob


def r2r_to_ours(blob: dict[str, Any], keep_embeddings: bool = True) -> tuple[dict, dict]:
    """(our R2RRouter arch, our state dict) from an R2R checkpoint dict."""
    model_type = blob.get("model_type")
    if model_type != R2R_CLASS:
        raise UserFacingError(
            f"R2R router type {model_type!r} is not supported: only {R2R_CLASS} (hidden "
            "state + token + top-k logits, the type R2R publishes) maps onto our R2R router"
        )
    inputs = (blob.get("common_args") or {}).get("input_type") or sorted(R2R_INPUTS)
    inputs = {inputs} if isinstance(inputs, str) else set(inputs)
    if inputs != R2R_INPUTS:
        raise UserFacingError(f"R2R router inputs {sorted(inputs)}: expected {sorted(R2R_INPUTS)}")
    state: dict[str, Any] = {}
    for key, value in blob["state_dict"].items():
        state[_rename(key)] = value
    if not keep_embeddings:
        state.pop("token_embeddings.weight", None)

    logits_w = state["features.proj_logits.weight"]  # (H, top_k)
    hidden_size, top_k = logits_w.shape
    combine_w = state["features.combine.weight"]  # (d0, 2H + E)
    embedding_size = combine_w.shape[1] - 2 * hidden_size
    num_blocks = 1 + max(
        (int(k.split(".")[1]) for k in state if k.startswith("blocks.")), default=-1
    )
    widths = [state[f"blocks.{i}.norm.weight"].shape[0] for i in range(num_blocks)]
    expansion = state["blocks.0.up.weight"].shape[0] // widths[0] if widths else 4
    table = state.get("token_embeddings.weight")
    arch = dict(
        hidden_size=hidden_size, top_k=top_k, width=combine_w.shape[0], num_blocks=num_blocks,
        expansion=expansion, block_widths=widths or None, features="concat",
        normalize_inputs="features.norm_hidden.weight" in state,
        embedding_size=embedding_size,
        vocab_size=None if table is None else table.shape[0],
    )  # fmt: skip
    _check_init_args(blob.get("init_args") or {}, arch, widths)
    return arch, state


def _rename(key: str) -> str:
    if key == "backbone.position_embedding":
        raise UserFacingError(
            "this R2R router uses position embeddings (use_position_embedding=True), which "
            "R2R's own token-level inference does not feed; not supported"
        )
    block = R2R_BLOCK.fullmatch(key)
    if block:
        index, part, param = block.groups()
        return f"blocks.{index}.{BLOCK_PARTS[part]}.{param}"
    for theirs, ours in R2R_RENAMES:
        if key.startswith(theirs):
            return ours + key[len(theirs) :]
    raise UserFacingError(f"unexpected parameter {key!r} in the R2R router's state_dict")


def _check_init_args(init: dict[str, Any], arch: dict[str, Any], widths: list[int]) -> None:
    """The shapes decide the architecture; init_args, where present, must agree."""
    expected = {
        "hidden_states_size": arch["hidden_size"],
        "logits_size": arch["top_k"],
        "hidden_dims": widths,
        "expansion_factor": arch["expansion"],
        "normalize_input": arch["normalize_inputs"],
        "use_position_embedding": False,
    }
    for name, value in expected.items():
        if name in init and (list(init[name]) if name == "hidden_dims" else init[name]) != value:
            raise UserFacingError(
                f"R2R router init_args {name}={init[name]!r} disagrees with its weights "
                f"({value!r}): the file is inconsistent"
            )
    topk = init.get("topk")
    if topk not in (None, arch["top_k"]):
        raise UserFacingError(f"R2R router topk={topk} but logits_size={arch['top_k']}")


def legacy_to_ours(blob: dict[str, Any]) -> tuple[str, dict, dict, dict]:
    """(kind, arch, state dict, metrics) from our pre-safetensors pickle."""
    if "kind" not in blob or "state_dict" not in blob:
        raise UserFacingError("not a legacy tokenrouter-ray router checkpoint (no kind/state_dict)")
    state = dict(blob["state_dict"])
    if blob["kind"] == "r2r":  # its input projections now live under `features`
        state = {("features." + k if k.startswith("proj_") else k): v for k, v in state.items()}
    return blob["kind"], dict(blob["arch"]), state, dict(blob.get("metrics") or {})


def import_router(
    fmt: str, src: str | Path, out: str | Path, keep_embeddings: bool = True,
    trust: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Convert ``src`` to our format at ``out``; returns what was written (kind, arch,
    metrics incl. the recommended ``threshold`` when the source has one)."""
    from tokenrouter_ray.routing.routers import build_router, load_router, save_router

    if fmt not in FORMATS:
        raise UserFacingError(f"unknown router format {fmt!r}: one of {FORMATS}")
    blob = read_pickle(src, trust)
    source: dict[str, Any] = {"format": fmt, "file": str(Path(src).resolve())}
    if fmt == "r2r":
        kind = "r2r"
        arch, state = r2r_to_ours(blob, keep_embeddings)
        common = blob.get("common_args") or {}
        metrics = {"threshold": common.get("threshold"), "input_type": common.get("input_type")}
        source.update(
            model_type=blob.get("model_type"), init_args=blob.get("init_args"),
            model_specific_args=blob.get("model_specific_args"),
        )  # fmt: skip
    else:
        kind, arch, state, metrics = legacy_to_ours(blob)
    try:
        module = build_router(kind, arch, state)
    except RuntimeError as exc:
        raise UserFacingError(f"{src}: weights do not fit the architecture: {exc}") from None
    out = Path(out)
    staging = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    save_router(module, staging, metrics, source)
    load_router(staging, kind)  # what serving will do: must round-trip
    staging.replace(out)
    return {"kind": kind, "arch": module.arch, "metrics": metrics, "out": str(out)}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "import-router",
        help="convert a published router (R2R's) into tokenrouter-ray's safetensors format",
        description="Convert a router trained elsewhere into tokenrouter-ray's checkpoint "
        "format (one safetensors file), so serving never unpickles. --format r2r reads a "
        "router R2R publishes (its architecture is read from the weights and checked against "
        "the file's init_args); --format legacy reads a checkpoint an older train-router "
        "wrote. The file is read with torch.load(weights_only=True) unless --trust-pickle. "
        "It prints the policy options that use the result.",
        epilog="example (R2R's router for Qwen3-0.6B + Qwen3-8B):\n"
        "  tokenrouter-ray import-router --format r2r router.pt --out routers/r2r.safetensors",
    )
    p.add_argument(
        "--format", required=True, choices=FORMATS, dest="fmt", help="who wrote the file"
    )
    p.add_argument("input", help="the router file to convert (e.g. R2R's router .pt)")
    p.add_argument("--out", required=True, help="file to write (e.g. routers/r2r.safetensors)")
    p.add_argument(
        "--drop-embeddings", action="store_true",
        help="r2r: drop a token-embedding table stored in the file and read the small "
        "model's input embeddings instead (smaller file; equal when the table is the small "
        "model's, as in routers trained with freeze_lm_head)",
    )  # fmt: skip
    p.add_argument(
        "--trust-pickle", action="store_true",
        help="load the file with full unpickling (runs code from the file: trusted files only)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    p.set_defaults(func=run_import_router)


def run_import_router(args: argparse.Namespace) -> int:
    done = import_router(
        args.fmt, args.input, args.out, not args.drop_embeddings, args.trust_pickle
    )
    if args.json:
        print(json.dumps(done, indent=2, default=str))
        return 0
    threshold = done["metrics"].get("threshold", done["metrics"].get("threshold_for_rate"))
    arch = done["arch"]
    print(f"{done['kind']} router -> {done['out']}")
    print("  arch: " + ", ".join(f"{k}={v}" for k, v in arch.items() if v is not None))
    use = f"checkpoint: {done['out']}" + (f", threshold: {threshold:.6g}" if threshold else "")
    print(f"  use: policy options {{{use}}}")
    return 0
