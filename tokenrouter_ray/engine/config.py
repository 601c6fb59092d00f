"""How one engine is built: ``EngineConfig`` (model, dtype, device, KV blocks, memory budget,
CUDA graphs, SDPA kernels, tensor parallel, the scheduler's own config), over
``EngineOptions``, the part a model's config section sets directly.

Torch-free and import-cheap: config.py (the app's), the memory reserve and the tensor-parallel
launcher read it without loading the engine. ``Engine.from_config`` takes it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenrouter_ray.engine.scheduler import SchedulerConfig

# The SDPA kernel sets a model may allow on CUDA (engine/attention.py SDPA_BACKENDS).
SdpaBackend = Literal["auto", "efficient", "flash", "math", "cudnn"]
SDPA_BACKEND_HELP = (
    "SDPA kernels allowed on CUDA (engine/attention.py SDPA_BACKENDS): efficient (the "
    "default: flash where it takes the call, else memory-efficient, math last; never cuDNN), "
    "flash, math, cudnn (cuDNN first: a plan built per new shape, hundreds of ms each), or "
    "auto (PyTorch's own choice, which prefers cuDNN on an H100/H200 with a recent cuDNN)."
)


class EngineOptions(BaseModel):
    """What a model's config section (config.py ``ModelSpec``, which extends this) gives its
    engine as it stands; ``EngineConfig`` extends this with what the serving layer derives
    (the checkpoint, device, memory budget in bytes, scheduler) and the engine's own knobs."""

    model_config = ConfigDict(extra="forbid")

    gguf_file: str | None = Field(
        None, description="GGUF file inside the model's directory, if any."
    )
    dtype: str = Field("auto", description="auto (bf16 on CUDA, fp32 otherwise) or a dtype.")
    block_size: int = Field(
        16, ge=1, description="Tokens per KV block (flash-attn's paged path needs 256)."
    )
    max_model_len: int | None = Field(
        None, ge=2, description="Longest sequence; default: the model's position limit."
    )
    prefix_caching: bool = Field(
        True,
        description="Automatic prefix caching: full KV blocks are cached by content hash and "
        "reused by later requests (and handoffs' first visits) with the same prefix.",
    )
    sdpa_backend: SdpaBackend = Field("efficient", description=SDPA_BACKEND_HELP)
    tensor_parallel: int = Field(
        1,
        ge=1,
        description="Ranks the model is split over (tensor_parallel.py; one GPU each on CUDA, "
        "CPU processes otherwise), all on one node; must divide the model's attention and KV "
        "heads. 1: one device.",
    )

    def engine_options(self) -> dict[str, Any]:
        """These fields' values (of a subclass too: only the ``EngineOptions`` ones), as
        keyword arguments of ``EngineConfig``."""
        return {name: getattr(self, name) for name in EngineOptions.model_fields}


class EngineConfig(EngineOptions):
    model: str = Field(description="HF causal-LM directory or hub id.")
    device: str = Field("cpu", description="torch device, e.g. cpu or cuda:0.")
    num_hidden_layers: int | None = Field(
        None, ge=1, description="Run only the first N layers (early-exit small models)."
    )
    num_blocks: int | None = Field(
        None, ge=1, description="KV blocks; default: as many as kv_cache_bytes allows."
    )
    memory_budget_bytes: int = Field(
        2 * 2**30, ge=1, description="Device memory for weights + KV when num_blocks is unset."
    )
    keep_logits: bool = Field(False, description="Keep next-token logits for the policy.")
    keep_hidden: bool = Field(False, description="Keep last hidden states for the policy.")
    cuda_graphs: bool = Field(
        True, description="On CUDA, capture decode/small-extend steps as CUDA graphs per bucket."
    )
    static_batches: bool = Field(
        False, description="Run the bucketed fixed-shape path eagerly off CUDA (for checks)."
    )
    collective_timeout_s: float = Field(
        120.0, gt=0, description="Tensor parallel: a collective or the start-up join fails after."
    )
    startup_timeout_s: float = Field(
        600.0, gt=0, description="Tensor parallel: how long rank 0 waits for workers to connect."
    )
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
