"""Neural routers: the small networks R2R, CITER and Co-LLM put on a model's step output.

Each router maps a batch of step features to one logit per row. A checkpoint is one
``torch.save`` dict (``kind``, ``arch`` kwargs, ``state_dict``, training ``metrics``), loaded
with ``weights_only=True``; ``load_router`` rebuilds the module from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn


class ResidualMLPBlock(nn.Module):
    """Pre-LN residual MLP block: x + W2 gelu(W1 LN(x)), ``expansion``-wide inside."""

    def __init__(self, width: int, expansion: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, width * expansion)
        self.down = nn.Linear(width * expansion, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class R2RRouter(nn.Module):
    """R2R: (last hidden state, embedding of the sampled token, top-k raw logits), each
    projected, concatenated, then residual MLP blocks to one logit.

    The paper's size is ``width=1024, num_blocks=6`` (x4 expansion); the CPU default is
    smaller.
    """

    kind = "r2r"

    def __init__(
        self,
        hidden_size: int,
        top_k: int = 100,
        width: int = 256,
        num_blocks: int = 2,
        expansion: int = 4,
    ) -> None:
        super().__init__()
        self.arch = dict(
            hidden_size=hidden_size,
            top_k=top_k,
            width=width,
            num_blocks=num_blocks,
            expansion=expansion,
        )
        self.top_k = top_k
        part = width // 3
        self.proj_hidden = nn.Linear(hidden_size, part)
        self.proj_token = nn.Linear(hidden_size, part)
        self.proj_logits = nn.Linear(top_k, width - 2 * part)
        self.blocks = nn.Sequential(
            *(ResidualMLPBlock(width, expansion) for _ in range(num_blocks))
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 1)

    def forward(
        self,
        hidden: torch.Tensor,  # (B, H)
        token_embedding: torch.Tensor,  # (B, H)
        logits: torch.Tensor,  # (B, V) raw
    ) -> torch.Tensor:  # (B,) logit of "route to the large model"
        top = logits.topk(self.top_k, dim=-1).values  # (B, top_k), sorted
        x = torch.cat(
            [self.proj_hidden(hidden), self.proj_token(token_embedding), self.proj_logits(top)],
            dim=-1,
        )
        return self.head(self.norm(self.blocks(x))).squeeze(-1)


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


def save_router(module: nn.Module, path: str | Path, metrics: dict[str, Any] | None = None) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().float() for k, v in module.state_dict().items()}
    torch.save(
        {"kind": module.kind, "arch": module.arch, "state_dict": state, "metrics": metrics or {}},
        path,
    )


def load_router(path: str | Path, expect: str) -> tuple[nn.Module, dict[str, Any]]:
    """(module in eval mode, training metrics). Errors name the file and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"router checkpoint {path} does not exist (train one with "
            "`tokenrouter-ray train-router`)"
        )
    blob = torch.load(path, map_location="cpu", weights_only=True)
    if blob.get("kind") != expect:
        raise ValueError(f"{path} holds a {blob.get('kind')!r} router, expected {expect!r}")
    module = ROUTER_KINDS[expect](**blob["arch"])
    module.load_state_dict(blob["state_dict"])
    return module.eval(), blob.get("metrics", {})


def random_router(kind: str, seed: int, **arch: Any) -> nn.Module:
    """An untrained router with seeded weights: for tests and wiring experiments only."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return ROUTER_KINDS[kind](**arch).eval()
