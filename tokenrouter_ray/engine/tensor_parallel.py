"""Tensor parallelism: one model over ``k`` ranks, driven by rank 0's engine.

Rank 0 is the model's replica: its ``Engine`` owns the scheduler, the block tables and
the sampling; its runner is a ``TensorParallelRunner``. Ranks 1..k-1 are workers
(``run_worker``): they hold their shard of the weights and the KV of their heads, and only
run forwards. Every step, rank 0 encodes the step's inputs as one small int64 frame
(``encode_step``: per sequence its start, new token ids, block ids and whether it samples)
and sends it to every worker over a TCP socket; then every rank runs the same forward on the
same inputs, so the collectives inside it (one all-reduce after each row-parallel layer, one
all-gather of the sampled rows' logits) line up. Only rank 0 samples, routes and commits.
Block tables are rank 0's and travel with each step, so every rank's cache has the same
layout; the last hidden state is replicated, so rank 0 hands the router the full one.

Sharding is transformers' own: the model is loaded with ``DistributedConfig(tp_plan="auto")``
(the architecture's ``base_model_tp_plan``: q/k/v and gate/up column-parallel, o_proj and
down_proj row-parallel with an all-reduce, lm_head column-parallel with its output gathered).
Those layers call the attention function with this rank's heads only, so our paged attention
and KV cache work unchanged, with ``num_kv_heads / k`` heads per rank. Nothing is written by
hand for the math; what is ours is the step fan-out, the start-up, the failure handling, and
one change to the plan: every rank keeps the full input-embedding table (with tied
embeddings the plan shards it along with lm_head, and then the lookup a policy makes on
rank 0 alone, outside any step, would be a collective). A worker replays each step through
the same ``ModelRunner.execute`` as rank 0 (from a minimal stand-in for the scheduler's
output), so both take the same path (dynamic or bucketed, the same bucket) and issue the same
collectives in the same order; its sampling is a no-op.

Why a socket and not a collective for the step message: workers legitimately wait between
steps for as long as the server is idle, which a collective with a timeout would turn into
an error, and one without a timeout into a possible hang. A worker blocked on ``recv``
instead sees EOF the moment rank 0's process dies and exits; rank 0 sees a worker's EOF the
same way (``check_alive``, the replica's health check). Collectives inside a step (all ranks
are in lock-step there) run on a process group created with ``collective_timeout_s``.

Start-up: rank 0 opens a ``TCPStore`` and a listening socket on free ports, starts the
workers through a ``WorkerLauncher`` (``LocalProcessLauncher`` here; deployments/ has one
placing Ray actors in the replica's placement group bundles), every rank joins the process
group (gloo on CPU, NCCL for tensors on CUDA), loads its shard, and the KV block count is the
minimum over ranks of what each rank's memory allows. One tensor-parallel model per process
(it uses the default process group); all ranks on one node.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from tokenrouter_ray.engine.attention import register_attention
from tokenrouter_ray.engine.block_pool import (
    ModelFootprint,
    device_budget,
    kv_bytes_per_token,
    plan_num_blocks,
)
from tokenrouter_ray.engine.config import EngineConfig
from tokenrouter_ray.engine.loader import resolve_dtype
from tokenrouter_ray.engine.memory_reserve import forward_reserve
from tokenrouter_ray.engine.model_runner import ModelRunner
from tokenrouter_ray.engine.outputs import StepResult, StepTimings
from tokenrouter_ray.engine.scheduler import SchedulerOutput
from tokenrouter_ray.errors import ModelLoadError

OP_STEP, OP_STOP = 1, 2
_LEN = struct.Struct("<Q")

# One sequence of a step as the forward sees it: (start position, new token ids, the block
# ids its context reaches, whether its last row is sampled).
StepSeq = tuple[int, list[int], list[int], bool]


# ------------------------------------------------------------------------- config checks
def check_tensor_parallel(model_config: Any, tensor_parallel: int) -> None:
    """A clear error when ``tensor_parallel`` cannot split this model's heads evenly."""
    k = tensor_parallel
    if k == 1:
        return
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    if kv_heads % k or heads % k:
        raise ValueError(
            f"tensor_parallel={k} must divide the model's attention heads: it has {heads} query "
            f"heads and {kv_heads} KV heads, and each rank holds whole heads (and their KV). "
            f"Choose a tensor_parallel that divides {kv_heads}"
        )
    if not getattr(model_config, "base_model_tp_plan", None):
        raise ValueError(
            f"tensor_parallel={k}: {type(model_config).__name__} has no tensor-parallel plan "
            "in transformers (base_model_tp_plan); run it with tensor_parallel: 1"
        )


def check_local_model(path: str, tensor_parallel: int, gguf_file: str | None = None) -> None:
    """``check_tensor_parallel`` for a local checkpoint directory (hub ids: at load)."""
    if tensor_parallel > 1 and Path(path).is_dir():
        config = AutoConfig.from_pretrained(path, gguf_file=gguf_file)
        check_tensor_parallel(config, tensor_parallel)


# ------------------------------------------------------------------------ step messages
def step_seqs(out: SchedulerOutput, block_size: int) -> list[StepSeq]:
    """What the workers need of a scheduled step (everything else stays on rank 0)."""
    seqs: list[StepSeq] = []
    for c in out.chunks:
        r, end = c.request, c.start + c.num_tokens
        blocks = r.block_ids[: -(-end // block_size)]
        seqs.append((c.start, r.token_ids[c.start : end], blocks, c.samples))
    return seqs


def encode_step(seqs: Sequence[StepSeq]) -> bytes:
    """One int64 frame: [op, num_seqs, (start, num_tokens, num_blocks, samples) per sequence,
    all new token ids, all block ids]. Only the blocks a sequence's context reaches travel."""
    head = [OP_STEP, len(seqs)]
    tokens: list[int] = []
    blocks: list[int] = []
    for start, new, block_ids, samples in seqs:
        head += (start, len(new), len(block_ids), int(samples))
        tokens += new
        blocks += block_ids
    return np.asarray(head + tokens + blocks, dtype=np.int64).tobytes()


def decode_step(frame: bytes) -> list[StepSeq] | None:
    """The sequences of a step frame; ``None`` for a stop frame."""
    data = np.frombuffer(frame, dtype=np.int64).tolist()
    if data[0] == OP_STOP:
        return None
    n = data[1]
    meta = data[2 : 2 + 4 * n]
    at = 2 + 4 * n
    tok_at, blk_at = at, at + sum(meta[1::4])
    seqs: list[StepSeq] = []
    for i in range(n):
        start, num_tokens, num_blocks, samples = meta[4 * i : 4 * i + 4]
        seqs.append(
            (
                start,
                data[tok_at : tok_at + num_tokens],
                data[blk_at : blk_at + num_blocks],
                bool(samples),
            )
        )
        tok_at += num_tokens
        blk_at += num_blocks
    return seqs


def _send_frame(sock: socket.socket, frame: bytes) -> None:
    sock.sendall(_LEN.pack(len(frame)) + frame)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None  # the peer closed: its process ended
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> bytes | None:
    head = _recv_exact(sock, _LEN.size)
    return None if head is None else _recv_exact(sock, _LEN.unpack(head)[0])


# ---------------------------------------------------------------------------- workers
class _Tokens:
    """The part of a request's token ids a step reads (positions start..start+n)."""

    def __init__(self, start: int, tokens: list[int]) -> None:
        self.start, self.tokens = start, tokens

    def __getitem__(self, span: slice) -> list[int]:
        return self.tokens[span.start - self.start : span.stop - self.start]


@dataclass
class _SeqRequest:
    token_ids: _Tokens
    block_ids: list[int]


@dataclass
class _Chunk:
    request: _SeqRequest
    start: int
    num_tokens: int
    samples: bool


@dataclass
class _Step:
    """A worker's replay of rank 0's ``SchedulerOutput``: what the runner reads of it."""

    chunks: list[_Chunk]

    @classmethod
    def of(cls, seqs: list[StepSeq]) -> _Step:
        return cls(
            [
                _Chunk(_SeqRequest(_Tokens(start, new), blocks), start, len(new), samples)
                for start, new, blocks, samples in seqs
            ]
        )


class WorkerRunner(ModelRunner):
    """Ranks 1..k-1: the same forward as rank 0 (same path, same collectives), no sampling."""

    def _sample(self, *args: object, **kwargs: object) -> Callable[[], None]:  # type: ignore[override]
        return _nothing


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to join: picklable, sent once at launch."""

    engine_config: dict[str, Any]  # EngineConfig.model_dump()
    rank: int
    world_size: int
    host: str  # rank 0's store and control socket (same node)
    store_port: int
    control_port: int
    num_threads: int | None = None  # torch threads on CPU


class WorkerLauncher(Protocol):
    """Starts ranks 1..k-1, each running ``run_worker(spec)``, and stops them."""

    def launch(self, specs: Sequence[WorkerSpec]) -> None: ...

    def stop(self) -> None: ...


class LocalProcessLauncher:
    """Workers as child processes of this one (spawned: fresh interpreters)."""

    def __init__(self) -> None:
        self.processes: list[multiprocessing.process.BaseProcess] = []

    def launch(self, specs: Sequence[WorkerSpec]) -> None:
        ctx = multiprocessing.get_context("spawn")
        for spec in specs:
            proc = ctx.Process(target=run_worker, args=(spec,), daemon=True, name=f"tp-{spec.rank}")
            proc.start()
            self.processes.append(proc)

    def stop(self) -> None:
        for proc in self.processes:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self.processes.clear()


def _config(data: dict[str, Any]) -> EngineConfig:
    return EngineConfig.model_validate(data)


def run_worker(spec: WorkerSpec) -> None:
    """A worker's life: connect, join, load its shard, then run every step rank 0 sends
    until it sends stop or its socket closes."""
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    config = _config(spec.engine_config)
    sock = socket.create_connection((spec.host, spec.control_port), timeout=60)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _send_frame(sock, struct.pack("<q", spec.rank))
    try:
        timeout = datetime.timedelta(seconds=config.collective_timeout_s)
        store = dist.TCPStore(spec.host, spec.store_port, spec.world_size, False, timeout=timeout)
        runner = _build_rank(config, spec.rank, spec.world_size, store)[0]
        timings = StepTimings()
        while True:
            frame = _recv_frame(sock)
            seqs = None if frame is None else decode_step(frame)
            if seqs is None:
                break
            runner.execute(_Step.of(seqs), timings)  # type: ignore[arg-type]
    finally:
        sock.close()
        if dist.is_initialized():
            dist.destroy_process_group()


# ------------------------------------------------------------------------ every rank
def _local_device(config: EngineConfig, rank: int) -> torch.device:
    dev = torch.device(config.device)
    if dev.type != "cuda":
        return dev
    # Under Ray each rank sees only its own GPU; as local processes, rank i takes GPU i.
    return torch.device("cuda", rank % max(1, torch.cuda.device_count()))


def load_tp_model(config: EngineConfig, device: torch.device) -> PreTrainedModel:
    """This rank's shard of the model, loaded by transformers' tensor-parallel plan."""
    from transformers.distributed import DistributedConfig

    try:
        model_config = AutoConfig.from_pretrained(config.model, gguf_file=config.gguf_file)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read a model config from {config.model!r}: {exc}") from exc
    try:
        check_tensor_parallel(model_config, config.tensor_parallel)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    os.environ["LOCAL_RANK"] = str(device.index or 0)  # where transformers binds this rank
    overrides = {}
    if config.num_hidden_layers is not None:
        overrides["num_hidden_layers"] = config.num_hidden_layers
    try:
        model = AutoModelForCausalLM.from_pretrained(
            config.model,
            gguf_file=config.gguf_file,
            dtype=resolve_dtype(config.dtype, device),
            attn_implementation=register_attention(),
            distributed_config=DistributedConfig(tp_plan="auto", tp_size=config.tensor_parallel),
            **overrides,
        )
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"cannot load {config.model!r} tensor-parallel: {exc}") from exc
    return model.eval()


def _replicate_input_embeddings(model: PreTrainedModel) -> None:
    """Rank 0's policy embeds sampled ids alone (R2R's router), but a plan may shard the
    input embedding table (tied embeddings follow the column-parallel lm_head; some
    architectures shard ``embed_tokens`` outright), which makes a lookup a collective. So
    every rank takes a full copy of the table (one all-gather at start-up) and the plain
    lookup back; lm_head keeps its shard."""
    embed = model.get_input_embeddings()
    if not hasattr(embed.weight, "full_tensor"):
        return
    embed.weight = torch.nn.Parameter(embed.weight.full_tensor(), requires_grad=False)
    embed.__dict__.pop("forward", None)  # the plan's vocab-parallel forward, if installed


def tp_footprint(model: PreTrainedModel, tensor_parallel: int) -> ModelFootprint:
    """What one rank holds: its local weights and the KV of its heads."""

    def local(p: torch.Tensor) -> torch.Tensor:
        return p.to_local() if hasattr(p, "to_local") else p

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    params = [local(p) for p in model.parameters()]
    return ModelFootprint(
        weight_bytes=sum(p.numel() * p.element_size() for p in params),
        kv_bytes_per_token=kv_bytes_per_token(
            cfg.num_hidden_layers, kv_heads // tensor_parallel, head_dim, params[0].element_size()
        ),
    )


def _build_rank(
    config: EngineConfig, rank: int, world: int, store: dist.Store
) -> tuple[ModelRunner, int]:
    """Join the group, load the shard, agree on the block count, build the runner."""
    device = _local_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=config.collective_timeout_s)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    model = load_tp_model(config, device)
    _replicate_input_embeddings(model)
    footprint = tp_footprint(model, world)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    if free is not None:  # activations and CUDA graphs first (full-width: conservative)
        free = max(0, free - forward_reserve(model, config))
    budget = device_budget(config.memory_budget_bytes, footprint.weight_bytes, free)
    num_blocks = config.num_blocks or plan_num_blocks(budget, footprint, config.block_size)
    agreed = torch.tensor([num_blocks], dtype=torch.long)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)  # CPU tensor: gloo, also on CUDA
    runner_cls = WorkerRunner if rank else TensorParallelRunner
    runner = runner_cls.for_engine(model, int(agreed.item()), config, tp_size=world)
    if runner.capture:  # every rank captures the same buckets in the same order
        runner.capture_static()
    return runner, int(agreed.item())


# ---------------------------------------------------------------------------- rank 0
class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: sends each step to the workers, then runs its own shard."""

    workers: list[socket.socket]
    launcher: WorkerLauncher | None
    control_s: float  # seconds spent encoding and sending step frames, all steps
    control_bytes: int  # bytes of the last step frame
    num_forwards: int

    def attach(self, workers: list[socket.socket], launcher: WorkerLauncher) -> None:
        self.workers, self.launcher = workers, launcher
        self.control_s, self.control_bytes, self.num_forwards = 0.0, 0, 0
        self.broken: str | None = None  # why the ranks may be out of step

    def launch(self, out: SchedulerOutput, timings: StepTimings) -> Callable[[], StepResult]:
        if self.broken is not None:
            raise RuntimeError(f"tensor-parallel group is out of step: {self.broken}")
        t0 = time.perf_counter()
        frame = encode_step(step_seqs(out, self.kv.block_size))
        for sock in self.workers:
            _send_frame(sock, frame)
        sent = time.perf_counter() - t0
        self.control_s += sent
        self.control_bytes = len(frame)
        self.num_forwards += 1
        timings.prepare += sent
        try:
            finish = super().launch(out, timings)
        except BaseException as exc:
            # The workers got this step; they may still be in (or past) its collectives,
            # so a next step could pair with the wrong ones. Fail until the group restarts.
            self.broken = f"a step failed on rank 0: {exc!r}"
            raise
        return finish

    def check_alive(self) -> None:
        """Raise when a worker's process has ended (its socket reads EOF), or a step
        failed on rank 0 after the workers had it."""
        if self.broken is not None:
            raise RuntimeError(f"tensor-parallel group is out of step: {self.broken}")
        for rank, sock in enumerate(self.workers, start=1):
            try:  # MSG_DONTWAIT: non-blocking for this call only (a step may be sending)
                data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue  # nothing to read: the worker is there
            except OSError as exc:
                raise RuntimeError(f"tensor-parallel rank {rank} is gone: {exc}") from exc
            if not data:
                raise RuntimeError(f"tensor-parallel rank {rank} is gone (its socket closed)")

    def close(self) -> None:
        for sock in self.workers:
            with contextlib.suppress(OSError):
                _send_frame(sock, np.asarray([OP_STOP], dtype=np.int64).tobytes())
            sock.close()
        self.workers = []
        if self.launcher is not None:
            self.launcher.stop()
            self.launcher = None
        if dist.is_initialized():
            dist.destroy_process_group()


def build_tp_runner(
    config: EngineConfig, launcher: WorkerLauncher | None = None, host: str = "127.0.0.1"
) -> tuple[TensorParallelRunner, int]:
    """Start the workers and rank 0; returns rank 0's runner and the agreed block count."""
    world = config.tensor_parallel
    try:  # before any process starts: a clear error for heads that do not split
        model_config = AutoConfig.from_pretrained(config.model, gguf_file=config.gguf_file)
        check_tensor_parallel(model_config, world)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{config.model!r}: {exc}") from exc
    if dist.is_initialized():
        raise RuntimeError(
            "one tensor-parallel model per process: this process already belongs to a "
            "process group (close() the other engine first, or run the models in separate "
            "replicas)"
        )
    launcher = launcher or LocalProcessLauncher()
    timeout = datetime.timedelta(seconds=config.collective_timeout_s)
    store = dist.TCPStore(host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
    listener = socket.create_server((host, 0))
    listener.settimeout(config.startup_timeout_s)
    specs = [
        WorkerSpec(
            engine_config=config.model_dump(mode="json"),
            rank=rank,
            world_size=world,
            host=host,
            store_port=store.port,
            control_port=listener.getsockname()[1],
            num_threads=torch.get_num_threads() if config.device == "cpu" else None,
        )
        for rank in range(1, world)
    ]
    launcher.launch(specs)
    workers: dict[int, socket.socket] = {}
    try:
        while len(workers) < world - 1:
            sock, _ = listener.accept()
            sock.settimeout(config.startup_timeout_s)
            hello = _recv_frame(sock)  # the worker's rank
            if hello is None or len(hello) != 8:
                sock.close()
                continue
            rank = struct.unpack("<q", hello)[0]
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            workers[rank] = sock
    except TimeoutError as exc:
        launcher.stop()
        raise RuntimeError(
            f"tensor-parallel workers did not connect within {config.startup_timeout_s:.0f} s "
            f"({len(workers)} of {world - 1})"
        ) from exc
    finally:
        listener.close()
    try:
        runner, num_blocks = _build_rank(config, 0, world, store)
    except BaseException:
        for sock in workers.values():
            sock.close()
        launcher.stop()
        raise
    assert isinstance(runner, TensorParallelRunner)
    runner.attach([workers[r] for r in sorted(workers)], launcher)
    runner._store = store  # the store lives as long as the group
    return runner, num_blocks
