"""``tokenrouter-ray import-router``: R2R's published router checkpoints (and our older
pickles) become our safetensors format, and the imported router scores exactly what R2R's
own network computes on the same inputs.

``R2RReference`` is a small re-implementation of R2R's ``HiddenStatesTokenLMHeadLogitsClassifier``
(thu-nics/R2R, ``r2r/models/router.py``) written from reading it: same layers, same parameter
names, so its ``state_dict`` has R2R's key layout; the checkpoint dict around it is the one
R2R's ``save_model`` writes (``model_type``, ``init_args``, ``common_args``,
``model_specific_args``, ``state_dict``).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from tokenrouter_ray.cli import main
from tokenrouter_ray.errors import UserFacingError
from tokenrouter_ray.routing._neural import NeuralConfig, RouterHolder
from tokenrouter_ray.routing.importing import import_router
from tokenrouter_ray.routing.policy import build_policy
from tokenrouter_ray.routing.routers import (
    R2RRouter,
    RouterCheckpointError,
    inspect_router,
    is_router_file,
    load_router,
)

HIDDEN, VOCAB, TOP_K, BATCH = 24, 300, 16, 32
INPUTS = ["hidden_states", "token", "logits"]


class ReferenceBlock(nn.Module):
    """R2R's ClassifierBlock: dim_change(x) + MLP(LN(x)), dropout inside the MLP."""

    def __init__(self, d_in: int, d_out: int, expansion: int) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(d_in)
        self.mlp = nn.Sequential(
            nn.Linear(d_in, d_in * expansion),
            nn.GELU(),
            nn.Dropout(0.3),
            nn.Linear(d_in * expansion, d_out),
            nn.Dropout(0.3),
        )
        self.dim_change = nn.Linear(d_in, d_out) if d_in != d_out else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dim_change(x) + self.mlp(self.layer_norm(x))


class ReferenceBackbone(nn.Module):
    """R2R's ClassifierBackbone: input projection, blocks over hidden_dims + [last], LN + head."""

    def __init__(self, d_in: int, dims: list[int], expansion: int) -> None:
        super().__init__()
        self.input_projection = nn.Linear(d_in, dims[0])
        ends = dims + dims[-1:]
        self.blocks = nn.ModuleList(
            ReferenceBlock(ends[i], ends[i + 1], expansion) for i in range(len(dims))
        )
        self.output_layer = nn.Sequential(nn.LayerNorm(dims[-1]), nn.Linear(dims[-1], 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.input_projection(x)
        for block in self.blocks:
            x = block(x)
        return self.output_layer(x)


class R2RReference(nn.Module):
    """R2R's router: (hidden state, token id, top-k logits) -> one logit, shape (B, 1)."""

    def __init__(
        self, hidden: int, vocab: int, top_k: int, dims: list[int], expansion: int, normalize: bool
    ) -> None:
        super().__init__()
        self.init_args = {  # only what was passed, as R2R's capture_init_args records
            "hidden_states_size": hidden,
            "logits_size": top_k,
            "hidden_dims": dims,
            "expansion_factor": expansion,
            "dropout_rate": 0.3,
            "pretrained_model_name": "Qwen/Qwen3-0.6B",
            "normalize_input": normalize,
        }
        self.top_k = top_k
        self.normalize_input = normalize
        if normalize:
            self.layer_norm_hidden_states = nn.LayerNorm(hidden)
            self.layer_norm_token = nn.LayerNorm(hidden)
        self.token_embeddings = nn.Embedding(vocab, hidden)
        self.logits_projection = nn.Linear(top_k, hidden)
        self.combined_projection = nn.Linear(3 * hidden, dims[0])
        self.backbone = ReferenceBackbone(dims[0], dims, expansion)

    def forward(
        self, hidden_states: torch.Tensor, token: torch.Tensor, logits: torch.Tensor
    ) -> torch.Tensor:
        embedded = self.token_embeddings(token)
        if self.normalize_input:
            hidden_states = self.layer_norm_hidden_states(hidden_states)
            embedded = self.layer_norm_token(embedded)
            logits = torch.softmax(logits, dim=-1)
        features = torch.cat([hidden_states, embedded, self.logits_projection(logits)], dim=-1)
        return self.backbone(self.combined_projection(features))


def reference_router(
    dims: list[int], normalize: bool, seed: int = 0, hidden: int = HIDDEN, vocab: int = VOCAB,
    top_k: int = TOP_K,
) -> R2RReference:  # fmt: skip
    """Every parameter random (LayerNorms too), so a mis-mapped one changes the score."""
    torch.manual_seed(seed)
    ref = R2RReference(hidden, vocab, top_k, dims, 2, normalize).double().eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return ref


def reference_score(ref: R2RReference, hidden, tokens, logits) -> torch.Tensor:
    """R2R's inference: top-k of the raw logits (sorted), sigmoid of the (B, 1) output."""
    top = torch.topk(logits, k=ref.top_k, dim=-1).values
    return torch.sigmoid(ref(hidden_states=hidden, token=tokens, logits=top)).squeeze(-1)


def save_r2r_checkpoint(
    path: Path, ref: R2RReference, with_table: bool, threshold: float = 0.4375
) -> Path:
    """The dict R2R's ``save_model`` writes (its slim file drops the embedding table)."""
    state = ref.state_dict()
    if not with_table:
        del state["token_embeddings.weight"]
    torch.save(
        {
            "model_type": "HiddenStatesTokenLMHeadLogitsClassifier",
            "init_args": ref.init_args,
            "common_args": {"threshold": threshold, "input_type": INPUTS},
            "model_specific_args": {"best_recall": np.float64(0.93), "epochs": np.int64(8)},
            "state_dict": state,
        },
        path,
    )
    return path


def features(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(BATCH, HIDDEN, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, VOCAB, (BATCH,), generator=g)
    logits = 4 * torch.randn(BATCH, VOCAB, generator=g, dtype=torch.float64)
    return hidden, tokens, logits


@pytest.mark.parametrize(
    ("dims", "normalize", "with_table"),
    [([32, 48, 32], False, False), ([32, 48, 32], True, True), ([40], True, False)],
    ids=["bottleneck", "normalized+own-table", "one-block"],
)
def test_imported_router_scores_equal_r2r_reference(
    tmp_path: Path, dims: list[int], normalize: bool, with_table: bool
) -> None:
    ref = reference_router(dims, normalize)
    src = save_r2r_checkpoint(tmp_path / "router.pt", ref, with_table)
    out = tmp_path / "r2r.safetensors"
    done = import_router("r2r", src, out)
    assert done["metrics"]["threshold"] == 0.4375
    assert done["arch"]["block_widths"] == dims and done["arch"]["top_k"] == TOP_K
    assert (done["arch"]["vocab_size"] == VOCAB) is with_table

    hidden, tokens, logits = features()
    want = reference_score(ref, hidden, tokens, logits)
    # What the R2R policy hands the router: the model's own embedding of the sampled token
    # (here R2R's table stands for the small model's, as R2R fills it from that model).
    model_embedding = ref.token_embeddings(tokens).detach()
    holder = RouterHolder(NeuralConfig(checkpoint=str(out)), "r2r")
    got = holder.score(hidden, model_embedding, logits, tokens)
    torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-12)
    assert got.max() - got.min() > 1e-3  # the inputs matter: not a constant score
    if with_table:  # the router reads its own table: the model's embedding is ignored
        scrambled = holder.score(hidden, torch.randn_like(model_embedding), logits, tokens)
        torch.testing.assert_close(scrambled, got, rtol=0, atol=0)


def test_cli_imports_and_the_policy_uses_it(tmp_path: Path, capsys) -> None:
    dims = [32, 48, 32]
    src = save_r2r_checkpoint(tmp_path / "router.pt", reference_router(dims, False), False)
    out = tmp_path / "routers" / "r2r.safetensors"
    out.parent.mkdir()
    assert main(["import-router", "--format", "r2r", str(src), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"checkpoint: {out}, threshold: 0.4375" in printed
    header = inspect_router(out, "r2r")
    assert header["source"]["model_type"] == "HiddenStatesTokenLMHeadLogitsClassifier"
    assert header["source"]["init_args"]["pretrained_model_name"] == "Qwen/Qwen3-0.6B"
    policy = build_policy("r2r", {"checkpoint": str(out), "threshold": None}, ["s", "l"])
    assert policy.router.threshold == 0.4375  # None: the threshold R2R recorded
    assert policy.router.module is None  # checked at build, weights read on first use
    policy = build_policy("r2r", {"checkpoint": str(out), "threshold": 0.25}, ["s", "l"])
    assert policy.router.threshold == 0.25
    with pytest.raises(ValueError, match="needs a checkpoint"):
        build_policy("r2r", {"threshold": None}, ["s", "l"])
    assert not list(tmp_path.glob("routers/.*tmp"))  # staged file renamed away


def test_serving_never_unpickles_and_says_how_to_convert(tmp_path: Path) -> None:
    dims = [32]
    src = save_r2r_checkpoint(tmp_path / "router.pt", reference_router(dims, False), False)
    with pytest.raises(RouterCheckpointError, match="import-router --format r2r"):
        build_policy("r2r", {"checkpoint": str(src)}, ["s", "l"])
    assert not is_router_file(src, "r2r")
    import_router("r2r", src, tmp_path / "r2r.safetensors")
    assert is_router_file(tmp_path / "r2r.safetensors", "r2r")
    assert not is_router_file(tmp_path / "r2r.safetensors", "hidden_mlp")
    with pytest.raises(RouterCheckpointError, match=r"does not exist.*import-router.*train-router"):
        build_policy("r2r", {"checkpoint": str(tmp_path / "nope.safetensors")}, ["s", "l"])
    with pytest.raises(RouterCheckpointError, match="train-router") as info:
        build_policy("citer", {"checkpoint": str(tmp_path / "nope.safetensors")}, ["s", "l"])
    assert "import-router" not in str(info.value)  # R2R publishes only R2R routers


class Payload:
    def __reduce__(self):  # what a malicious pickle does: call something on load
        return (print, ("pwned",))


def test_pickles_with_code_are_refused_unless_trusted(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.pt"
    torch.save({"model_type": "x", "state_dict": {}, "extra": Payload()}, bad)
    with pytest.raises(UserFacingError, match="--trust-pickle"):
        import_router("r2r", bad, tmp_path / "out.safetensors")
    assert "pwned" not in capsys.readouterr().out
    with pytest.raises(UserFacingError, match="only HiddenStatesTokenLMHeadLogitsClassifier"):
        import_router("r2r", bad, tmp_path / "out.safetensors", trust=True)  # loads, then checks
    assert not (tmp_path / "out.safetensors").exists()


def test_unsupported_r2r_variants_are_clear_errors(tmp_path: Path) -> None:
    dims = [32]
    ref = reference_router(dims, False)
    path = save_r2r_checkpoint(tmp_path / "router.pt", ref, False)
    blob = torch.load(path, weights_only=False)
    blob["model_type"] = "LogitsClassifier"
    torch.save(blob, path)
    with pytest.raises(UserFacingError, match=r"LogitsClassifier.*not supported"):
        import_router("r2r", path, tmp_path / "o.safetensors")
    blob["model_type"] = "HiddenStatesTokenLMHeadLogitsClassifier"
    blob["init_args"]["hidden_dims"] = [64]
    torch.save(blob, path)
    with pytest.raises(UserFacingError, match=r"hidden_dims.*disagrees"):
        import_router("r2r", path, tmp_path / "o.safetensors")
    blob["init_args"]["hidden_dims"] = dims
    blob["state_dict"]["backbone.position_embedding"] = torch.zeros(8, 32)
    torch.save(blob, path)
    with pytest.raises(UserFacingError, match="position embeddings"):
        import_router("r2r", path, tmp_path / "o.safetensors")


def test_legacy_pickled_checkpoint_converts(tmp_path: Path) -> None:
    torch.manual_seed(3)
    ours = R2RRouter(HIDDEN, top_k=TOP_K, width=30, num_blocks=2).double().eval()
    old_state = {k.removeprefix("features."): v for k, v in ours.state_dict().items()}
    arch = {k: ours.arch[k] for k in ("hidden_size", "top_k", "width", "num_blocks", "expansion")}
    legacy = tmp_path / "r2r.pt"
    blob = {"kind": "r2r", "arch": arch, "state_dict": old_state, "metrics": {"auc": 0.7}}
    torch.save(blob, legacy)
    out = tmp_path / "r2r.safetensors"
    main(["import-router", "--format", "legacy", str(legacy), "--out", str(out)])
    module, metrics = load_router(out, "r2r")
    assert metrics == {"auc": 0.7}
    hidden, _, logits = features()
    embedding = torch.randn(BATCH, HIDDEN, dtype=torch.float64)
    torch.testing.assert_close(
        module.double()(hidden, embedding, logits), ours(hidden, embedding, logits)
    )


def test_pickle_module_is_what_torch_save_writes(tmp_path: Path) -> None:
    """Guards the format sniffing: torch.save writes a zip, the header check relies on it."""
    path = tmp_path / "x.pt"
    torch.save({"a": torch.zeros(1)}, path)
    assert path.read_bytes()[:4] == b"PK\x03\x04"
    assert pickle.HIGHEST_PROTOCOL >= 2
