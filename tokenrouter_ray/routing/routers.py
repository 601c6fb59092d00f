"""Neural routers: the small networks R2R, CITER and Co-LLM put on a model's step output,
and their checkpoint file.

Each router maps a batch of step features to one logit per row. A checkpoint is one
safetensors file: the weights, plus JSON in the header's metadata (``kind``, the ``arch``
kwargs that rebuild the module, training ``metrics``, and where the weights came from).
Loading it never unpickles anything. ``save_router`` writes one, ``load_router`` rebuilds the
module, ``inspect_router`` checks one without reading its weights (the app builder calls it,
through the policy, so a missing or foreign file is an error at build time).
``tokenrouter-ray import-router`` (``routing/importing.py``) converts R2R's published
routers and older pickled checkpoints into this format.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenrouter_ray.errors import UserFacingError

FORMAT = "tokenrouter-router"
VERSION = "1"
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's container


class RouterCheckpointError(UserFacingError, ValueError):
    """A router checkpoint that is missing, pickled, or of the wrong kind."""


class ResidualMLPBlock(nn.Module):
    """Pre-LN residual MLP block: skip(x) + W2 gelu(W1 LN(x)), ``expansion``-wide inside.
    ``skip`` is the identity, or a linear map when the block changes width."""

    def __init__(self, width: int, expansion: int = 4, out_width: int | None = None) -> None:
        super().__init__()
        out_width = out_width or width
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, width * expansion)
        self.down = nn.Linear(width * expansion, out_width)
        self.skip = nn.Linear(width, out_width) if out_width != width else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, width) -> (B, out_width)
        residual = x if self.skip is None else self.skip(x)
        return residual + self.down(nn.functional.gelu(self.up(self.norm(x))))


class SplitFeatures(nn.Module):
    """Our R2R input stage: each input projected to its own third of the width."""

    def __init__(self, hidden_size: int, embedding_size: int, top_k: int, width: int) -> None:
        super().__init__()
        part = width // 3
        self.proj_hidden = nn.Linear(hidden_size, part)
        self.proj_token = nn.Linear(embedding_size, part)
        self.proj_logits = nn.Linear(top_k, width - 2 * part)

    def forward(
        self, hidden: torch.Tensor, token_embedding: torch.Tensor, top_logits: torch.Tensor
    ) -> torch.Tensor:  # (B, width)
        parts = [self.proj_hidden(hidden), self.proj_token(token_embedding)]
        return torch.cat([*parts, self.proj_logits(top_logits)], dim=-1)


class ConcatFeatures(nn.Module):
    """The input stage of R2R's published routers: optionally LayerNorm the hidden state and
    token embedding and softmax the top-k logits; project the logits to the hidden size;
    concatenate the three; two linear maps to the width."""

    def __init__(
        self, hidden_size: int, embedding_size: int, top_k: int, width: int, normalize: bool
    ) -> None:
        super().__init__()
        self.normalize = normalize
        if normalize:
            self.norm_hidden = nn.LayerNorm(hidden_size)
            self.norm_token = nn.LayerNorm(embedding_size)
        self.proj_logits = nn.Linear(top_k, hidden_size)
        self.combine = nn.Linear(2 * hidden_size + embedding_size, width)
        self.proj_in = nn.Linear(width, width)

    def forward(
        self, hidden: torch.Tensor, token_embedding: torch.Tensor, top_logits: torch.Tensor
    ) -> torch.Tensor:  # (B, width)
        if self.normalize:
            hidden = self.norm_hidden(hidden)
            token_embedding = self.norm_token(token_embedding)
            top_logits = torch.softmax(top_logits, dim=-1)
        x = torch.cat([hidden, token_embedding, self.proj_logits(top_logits)], dim=-1)
        return self.proj_in(self.combine(x))  # (B, 2H + E) -> (B, width)


FEATURES = ("split", "concat")


class R2RRouter(nn.Module):
    """R2R: (last hidden state, embedding of the sampled token, top-k raw logits) -> an input
    stage (``features``: ``split``, ours, or ``concat``, R2R's published routers) -> residual
    MLP blocks -> LayerNorm -> one logit.

    Blocks run at ``width`` (``num_blocks`` of them), or through ``block_widths`` (block i
    maps ``block_widths[i]`` to ``block_widths[i + 1]``, the last keeps its width: R2R's
    ``hidden_dims``). With ``vocab_size`` the router owns its token-embedding table and reads
    the sampled token ids instead of the model's embedding of them (an R2R checkpoint that
    carries ``token_embeddings.weight``). The paper's size is ``width=1024, num_blocks=6``
    (x4 expansion); the CPU default is smaller.
    """

    kind = "r2r"

    def __init__(
        self,
        hidden_size: int,
        top_k: int = 100,
        width: int = 256,
        num_blocks: int = 2,
        expansion: int = 4,
        block_widths: list[int] | None = None,
        features: str = "split",
        normalize_inputs: bool = False,
        embedding_size: int | None = None,
        vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        if features not in FEATURES:
            raise ValueError(f"R2R router features {features!r}: one of {FEATURES}")
        embedding_size = embedding_size or hidden_size
        widths = list(block_widths) if block_widths else [width] * num_blocks
        width = widths[0] if widths else width
        self.arch = dict(
            hidden_size=hidden_size, top_k=top_k, width=width, num_blocks=len(widths),
            expansion=expansion, block_widths=block_widths and widths, features=features,
            normalize_inputs=normalize_inputs, embedding_size=embedding_size,
            vocab_size=vocab_size,
        )  # fmt: skip
        self.top_k = top_k
        self.token_embeddings = (
            nn.Embedding(vocab_size, embedding_size) if vocab_size is not None else None
        )
        if features == "split":
            self.features = SplitFeatures(hidden_size, embedding_size, top_k, width)
        else:
            self.features = ConcatFeatures(
                hidden_size, embedding_size, top_k, width, normalize_inputs
            )
        outs = widths[1:] + widths[-1:]
        self.blocks = nn.Sequential(
            *(ResidualMLPBlock(w, expansion, o) for w, o in zip(widths, outs, strict=True))
        )
        final = widths[-1] if widths else width
        self.norm = nn.LayerNorm(final)
        self.head = nn.Linear(final, 1)

    def forward(
        self,
        hidden: torch.Tensor,  # (B, H)
        token_embedding: torch.Tensor,  # (B, E), the model's embedding of the sampled token
        logits: torch.Tensor,  # (B, V) raw
        tokens: torch.Tensor | None = None,  # (B,) sampled ids: read when the router owns
        # its embedding table
    ) -> torch.Tensor:  # (B,) logit of "route to the large model"
        if self.token_embeddings is not None:
            token_embedding = self.token_embeddings(tokens)  # (B, E)
        top = logits.topk(self.top_k, dim=-1).values  # (B, top_k), sorted descending
        x = self.blocks(self.features(hidden, token_embedding, top))
        return self.head(self.norm(x)).squeeze(-1)


class HiddenMLPRouter(nn.Module):
    """CITER's router: an MLP on the last hidden state (``num_layers=0`` is a linear head,
    Co-LLM's deferral head)."""

    kind = "hidden_mlp"

    def __init__(self, hidden_size: int, width: int = 256, num_layers: int = 2) -> None:
        super().__init__()
        self.arch = dict(hidden_size=hidden_size, width=width, num_layers=num_layers)
        layers: list[nn.Module] = []
        size = hidden_size
        for _ in range(num_layers):
            layers += [nn.Linear(size, width), nn.GELU()]
            size = width
        layers.append(nn.Linear(size, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (B, H) -> (B,)
        return self.net(hidden).squeeze(-1)


ROUTER_KINDS: dict[str, type[nn.Module]] = {"r2r": R2RRouter, "hidden_mlp": HiddenMLPRouter}
POLICY_OF_KIND = {"r2r": "r2r", "hidden_mlp": "citer|co_llm"}


def save_router(
    module: nn.Module,
    path: str | Path,
    metrics: dict[str, Any] | None = None,
    source: dict[str, Any] | None = None,
) -> None:
    """Write ``module`` as one safetensors file, weights in their own dtype (any name:
    ``.safetensors`` is the convention; the demo's ``.pt`` path holds the same format)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        "kind": module.kind,
        "arch": json.dumps(module.arch),
        "metrics": json.dumps(metrics or {}, default=str),
        "source": json.dumps(source or {}, default=str),
    }
    save_file(state, str(path), metadata=metadata)


def inspect_router(path: str | Path, expect: str) -> dict[str, Any]:
    """The checkpoint's header (``kind``, ``arch``, ``metrics``, ``source``), weights unread.
    Every problem is one ``RouterCheckpointError`` that says how to get a good file."""
    path = Path(path)
    if not path.is_file():
        raise RouterCheckpointError(
            f"router checkpoint {path} does not exist. Get one with " + how_to_get_router(expect)
        )
    with path.open("rb") as f:
        head = f.read(8)
        if head[:4] == ZIP_MAGIC:
            raise RouterCheckpointError(
                f"{path} is a pickled torch checkpoint (an R2R router, or one written by an "
                "older tokenrouter-ray); serving never unpickles. Convert it once with "
                f"`tokenrouter-ray import-router --format r2r|legacy {path} --out "
                f"{path.with_suffix('.safetensors')}`"
            )
        try:
            (size,) = struct.unpack("<Q", head)
            header = json.loads(f.read(size)) if 0 < size < 100_000_000 else {}
        except (struct.error, ValueError):
            header = {}
    meta = header.get("__metadata__") or {}
    if meta.get("format") != FORMAT:
        raise RouterCheckpointError(
            f"{path} is not a tokenrouter-ray router checkpoint (a safetensors file with "
            f"format={FORMAT!r} in its metadata). Get one with " + how_to_get_router(expect)
        )
    if meta.get("kind") != expect:
        raise RouterCheckpointError(
            f"{path} holds a {meta.get('kind')!r} router, expected {expect!r} "
            f"(policy {POLICY_OF_KIND.get(expect, expect)})"
        )
    return {
        "kind": meta["kind"],
        "arch": json.loads(meta["arch"]),
        "metrics": json.loads(meta.get("metrics", "{}")),
        "source": json.loads(meta.get("source", "{}")),
    }


def is_router_file(path: str | Path, kind: str) -> bool:
    """Whether ``path`` is a checkpoint of ``kind`` in this format (no exception)."""
    try:
        inspect_router(path, kind)
    except RouterCheckpointError:
        return False
    return True


def how_to_get_router(kind: str) -> str:
    train = (
        "`tokenrouter-ray train-router --policy POLICY --small DIR --large DIR --out FILE` "
        "(trains one on your model pair)"
    )
    if kind != "r2r":
        return train + "."
    return (
        "`tokenrouter-ray import-router --format r2r ROUTER.pt --out FILE` (converts a router "
        "R2R published for your model pair) or " + train.replace("POLICY", "r2r") + "; "
        "see docs/user-guide/router-training.md."
    )


def load_router(path: str | Path, expect: str) -> tuple[nn.Module, dict[str, Any]]:
    """(module in eval mode, training metrics). Errors name the file and what is wrong."""
    from safetensors.torch import load_file

    info = inspect_router(path, expect)
    return build_router(expect, info["arch"], load_file(str(path))), info["metrics"]


def build_router(kind: str, arch: dict[str, Any], state: dict[str, torch.Tensor]) -> nn.Module:
    """The module of ``kind`` with ``state`` loaded, in the weights' own float dtype."""
    module = ROUTER_KINDS[kind](**arch)
    dtype = next((v.dtype for v in state.values() if v.is_floating_point()), torch.float32)
    module.to(dtype).load_state_dict(state)
    return module.eval()


def random_router(kind: str, seed: int, **arch: Any) -> nn.Module:
    """An untrained router with seeded weights: for tests and wiring experiments only."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return ROUTER_KINDS[kind](**arch).eval()
