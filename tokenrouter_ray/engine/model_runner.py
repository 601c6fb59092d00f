"""Runs one packed forward of a transformers causal LM over the paged KV cache.

Input: a ``SchedulerOutput`` (which tokens of which requests). Output: a ``StepResult``
with one sampled token per request whose chunk reached its last token, plus the logits and
last hidden states of those rows when asked. Only those rows go through ``lm_head``.

Steps whose every chunk samples and is short (decodes, handoff extends) can take the
bucketed fixed-shape path (``static_forward.py``): captured as CUDA graphs on CUDA, or run
eagerly when ``static_batches`` asks for it (the CPU tests do, to check it token for token).

``launch`` queues a step and returns the call that reads it back (``execute`` is both): on
CUDA the host is free while the device computes (``device_step.py``), on CPU the step is
computed in ``launch``. Between the two nothing reads the device and nothing copies
synchronously, whatever the rows ask (greedy, sampled, seeded, penalised, biased,
min_tokens, grammar-constrained, logprobs): host values are staged through
``device_step.to_device``, the sampler and processors decide from the params, and the
tokens and logprobs come back in one non-blocking copy each behind the ``done`` event.

Timings: on CUDA ``forward`` is the device time from the forward's start to the ``done``
event (forward and sampler), ``launch`` the host time spent queuing them (inside that
device time, so not in ``total``), ``sample`` the read-back; on CPU ``forward`` and
``sample`` are the host's compute times.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tokenrouter_ray.engine.attention import (
    PagedBatch,
    flash_attn_unusable,
    sdpa_backends,
    sdpa_context,
)
from tokenrouter_ray.engine.block_pool import ModelFootprint, kv_bytes_per_token
from tokenrouter_ray.engine.device_step import DeviceStep, EventWatcher, host_buffer, to_device
from tokenrouter_ray.engine.kv_cache import PagedKVCache
from tokenrouter_ray.engine.logits_processors import apply_processors
from tokenrouter_ray.engine.outputs import StepResult, StepTimings
from tokenrouter_ray.engine.sampler import queue_logprobs, sample
from tokenrouter_ray.engine.scheduler import SchedulerOutput
from tokenrouter_ray.engine.static_forward import (
    DEFAULT_BATCH_BUCKETS,
    DEFAULT_QUERY_BUCKETS,
    MAX_STATIC_CONTEXT,
    HostBatch,
    StaticForward,
    StaticOutputs,
    bucket,
    build_host_batch,
    static_path_blocker,
    static_shapes,
    width_buckets,
)


def model_footprint(model: PreTrainedModel) -> ModelFootprint:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    dtype_bytes = next(model.parameters()).element_size()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return ModelFootprint(
        weight_bytes=weights,
        kv_bytes_per_token=kv_bytes_per_token(
            cfg.num_hidden_layers, kv_heads, head_dim, dtype_bytes
        ),
    )


if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from tokenrouter_ray.engine.config import EngineConfig
    from tokenrouter_ray.engine.grammar import GrammarBook


class ModelRunner:
    @classmethod
    def for_engine(
        cls, model: PreTrainedModel, num_blocks: int, config: EngineConfig, **extra: object
    ) -> ModelRunner:
        """A runner with the engine config's cache and path settings (``extra``: the rest)."""
        return cls(
            model,
            num_blocks,
            config.block_size,
            config.keep_logits,
            config.keep_hidden,
            static_batches=config.static_batches,
            cuda_graphs=config.cuda_graphs,
            max_model_len=config.max_model_len,
            sdpa_backend=config.sdpa_backend,
            **extra,
        )

    def __init__(
        self,
        model: PreTrainedModel,
        num_blocks: int,
        block_size: int,
        keep_logits: bool = False,
        keep_hidden: bool = False,
        static_batches: bool = False,
        cuda_graphs: bool = True,
        max_model_len: int | None = None,
        batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS,
        query_buckets: tuple[int, ...] = DEFAULT_QUERY_BUCKETS,
        tp_size: int = 1,  # tensor parallel: the cache holds this rank's KV heads only
        sdpa_backend: str = "efficient",  # the SDPA kernels allowed (attention.SDPA_BACKENDS)
    ) -> None:
        self.model = model
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # Why flash-attn is not used (None: it is): fp16/bf16, head_dim, block_size, GPU.
        self.flash_unusable = flash_attn_unusable(self.device, self.dtype, head_dim, block_size)
        self.use_flash = self.flash_unusable is None
        self.sdpa_backend = sdpa_backend
        self.sdpa_backends = sdpa_backends(sdpa_backend)  # raises on an unknown name
        # The launch/collect split behind device events (CUDA); a CPU test may set it with
        # a stand-in ``_new_event`` to run that path.
        self.overlap = self.device.type == "cuda"
        self.kv = PagedKVCache(
            num_layers=cfg.num_hidden_layers,
            num_blocks=num_blocks + 1,  # + a scratch block for padded rows, never pooled
            block_size=block_size,
            num_kv_heads=(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
            // tp_size,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            dtype=self.dtype,
            device=self.device,
        )
        self.keep_logits = keep_logits
        self.keep_hidden = keep_hidden
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        # Bucketed fixed-shape steps: CUDA graphs on CUDA, eager when asked (tests).
        self.static_blocker = static_path_blocker(model)  # e.g. dynamic RoPE: eager only
        self.capture = cuda_graphs and self.device.type == "cuda" and not self.static_blocker
        self.static_enabled = (static_batches or self.capture) and not self.static_blocker
        self.scratch_block = num_blocks
        limit = max_model_len or getattr(cfg, "max_position_embeddings", None) or 4096
        self.max_blocks = -(-min(limit, num_blocks * block_size) // block_size)
        self.batch_buckets, self.query_buckets = batch_buckets, query_buckets
        # KV width (blocks per sequence) is bucketed too, by powers of two up to a cap:
        # SDPA gathers at most 2x the batch's longest context; flash-attn reads in place
        # (one width, the model length).
        cap = None if self.use_flash else MAX_STATIC_CONTEXT
        self.width_buckets = width_buckets(self.max_blocks, block_size, cap)
        shapes = static_shapes(
            batch_buckets, query_buckets, self.width_buckets, block_size, self.use_flash
        )
        self.static_shapes = set(shapes)
        self.static: dict[tuple[int, int, int], StaticForward] = {}
        self._static_outputs: StaticOutputs | None = None  # shared by every bucket
        self.static_steps = 0  # steps that took the bucketed path
        # open LayerTaps (engine/taps.py), each told every launch's batch; while any is
        # open, static buckets run eagerly (a graph replay runs no hook)
        self.taps: list[Callable[[SchedulerOutput], None]] = []
        self._graph_pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.capture_seconds = 0.0  # time capture_static took
        self.grammars: GrammarBook | None = None  # structured outputs, on first use
        self._watcher: EventWatcher | None = None  # CUDA: wakes the step loop per step

    def _static_bucket(self, out: SchedulerOutput) -> tuple[int, int, int] | None:
        """(batch, query rows, KV blocks) bucket of a step, or None: dynamic path."""
        if not self.static_enabled or not out.chunks:
            return None
        if not all(c.samples for c in out.chunks):
            return None
        bs = self.kv.block_size
        b = bucket(len(out.chunks), self.batch_buckets)
        q = bucket(max(c.num_tokens for c in out.chunks), self.query_buckets)
        ctx = max(c.start + c.num_tokens for c in out.chunks)
        w = bucket(-(-ctx // bs), self.width_buckets)
        if self.use_flash and w is not None:
            w = self.width_buckets[-1]  # flash reads the table in place: one width
        shape = None if b is None or q is None or w is None else (b, q, w)
        if shape not in self.static_shapes:
            return None
        if self.capture and shape not in self.static:
            return None  # graphs are captured at start-up only (capture_static)
        return shape

    def capture_static(self) -> int:
        """Build every static bucket, largest first; on CUDA capture each as a graph into
        the shared pool. Called once when the replica starts, before any request. Warm-up
        and capture write only into the scratch block. Returns the number of buckets."""
        if not self.static_enabled:
            return 0
        order = sorted(self.static_shapes, key=lambda s: (s[0] * s[1] * s[2], s), reverse=True)
        t0 = time.perf_counter()
        with torch.inference_mode(), sdpa_context(self.sdpa_backends, self.device):
            for shape in order:
                fwd = self._new_static_forward(shape)
                if self.capture:  # pragma: no cover - needs CUDA
                    fwd.capture(self._graph_pool)
                else:
                    fwd.warm_up(steps=1)
                self.static[shape] = fwd
        self.capture_seconds = time.perf_counter() - t0
        return len(order)

    def _static_forward(self, shape: tuple[int, int, int]) -> StaticForward:
        """The bucket's forward, built (and on CUDA captured) on first use."""
        fwd = self.static.get(shape)
        if fwd is None:  # eager static path (no capture): built on first use
            fwd = self.static[shape] = self._new_static_forward(shape)
        return fwd

    def _new_static_forward(self, shape: tuple[int, int, int]) -> StaticForward:
        batch, q_len, width = shape
        if self._static_outputs is None:  # once, outside any graph
            cfg = self.model.config
            self._static_outputs = StaticOutputs.allocate(
                max(self.batch_buckets), cfg.vocab_size, cfg.hidden_size, self.dtype, self.device
            )
        return StaticForward(
            self.decoder,
            self.lm_head,
            self.kv,
            batch,
            q_len,
            width,
            use_flash=self.use_flash,
            scratch_block=self.scratch_block,
            outputs=self._static_outputs,
        )

    # ------------------------------------------- what the engine reads of its model
    def grammar_book(self) -> GrammarBook:
        """This model's structured-output matchers (engine/grammar.py), built on the first
        constrained request from the tokenizer saved with the model; a runner built around
        a tokenizer elsewhere sets ``grammars`` itself."""
        if self.grammars is None:
            from tokenrouter_ray.engine.grammar import GrammarBook

            self.grammars = GrammarBook.for_model_dir(
                self.model.name_or_path, self.vocab_size, sorted(self.eos_token_ids)
            )
        return self.grammars

    @property
    def vocab_size(self) -> int:
        return self.model.get_input_embeddings().num_embeddings

    @property
    def eos_token_ids(self) -> frozenset[int]:
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = self.model.config.eos_token_id
        return frozenset([eos] if isinstance(eos, int) else (eos or []))

    @property
    def max_positions(self) -> int | None:
        """The model's position limit, if its config states one."""
        return getattr(self.model.config, "max_position_embeddings", None)

    @property
    def embed_tokens(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """Token ids -> input embeddings (for policies that read them)."""
        return self.model.get_input_embeddings()

    def execute(self, out: SchedulerOutput, timings: StepTimings) -> StepResult:
        """One step, start to finish."""
        return self.launch(out, timings)()

    @property
    def stats(self) -> None:
        """A real model's runner keeps no device counters (``Runner.stats``)."""
        return None

    def check_alive(self) -> None:
        """A single-process runner can always step (``TensorParallelRunner`` checks its
        ranks)."""

    def close(self) -> None:
        """Nothing outside this process to release (``TensorParallelRunner`` stops its
        ranks)."""

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, timings: StepTimings) -> Callable[[], StepResult]:
        """Prepare the step, queue its forward and sampler, and return the call that reads
        the sampled tokens back and gives the ``StepResult``. On CUDA nothing here waits for
        the device, whatever the rows ask (tests/engine/test_no_host_sync.py), and the call
        is a ``DeviceStep``; on CPU the step is computed here."""
        for tap in self.taps:
            tap(out)
        shape = self._static_bucket(out)
        if shape is not None:
            return self._launch_static(out, shape, timings)
        t0 = time.perf_counter()
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []  # packed rows whose logits we need
        seqs: list[tuple[int, int, list[int]]] = []
        sampling_requests = []
        for chunk in out.chunks:
            r, start, n = chunk.request, chunk.start, chunk.num_tokens
            ids.extend(r.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            seqs.append((start, n, r.block_ids))
            if chunk.samples:
                rows.append(len(ids) - 1)
                sampling_requests.append(r)
        dev = self.device
        input_ids = to_device(ids, torch.long, dev)[None]  # (1, num_tokens)
        position_ids = to_device(positions, torch.long, dev)[None]  # (1, num_tokens)
        row_index = to_device(rows, torch.long, dev)  # (num_rows,)
        batch = PagedBatch.build(self.kv, seqs, dev, use_flash=self.use_flash)
        t1 = time.perf_counter()
        started = self._device_event(t1)
        with sdpa_context(self.sdpa_backends, dev):
            hidden = self.decoder(
                input_ids=input_ids, position_ids=position_ids, use_cache=False, paged=batch
            ).last_hidden_state[0]  # (num_tokens, hidden_size)
        last = hidden.index_select(0, row_index)  # (num_rows, hidden)
        logits = self.lm_head(last).float()  # (num_rows, vocab)
        t2 = time.perf_counter()
        timings.prepare += t1 - t0  # (a tensor-parallel rank 0 adds its control frames)
        timings.forward = t2 - t1
        return self._sample(out, sampling_requests, logits, last, len(ids), timings, started)

    def _launch_static(
        self, out: SchedulerOutput, shape: tuple[int, int, int], timings: StepTimings
    ) -> Callable[[], StepResult]:
        t0 = time.perf_counter()
        fwd = self._static_forward(shape)
        seqs = [
            (c.start, c.request.token_ids[c.start : c.start + c.num_tokens], c.request.block_ids)
            for c in out.chunks
        ]
        host = build_host_batch(
            seqs,
            *shape,
            self.kv.block_size,
            self.scratch_block,
            with_mask=False,  # the forward builds its SDPA mask from ctx_lens on the device
        )
        host = self._pinned(host)
        t1 = time.perf_counter()
        started = self._device_event(t1)
        with sdpa_context(self.sdpa_backends, self.device):
            logits, last = fwd.run(host, replay=not self.taps)
        t2 = time.perf_counter()
        timings.prepare += t1 - t0  # (a tensor-parallel rank 0 adds its control frames)
        timings.forward = t2 - t1
        self.static_steps += 1
        sampling_requests = [c.request for c in out.chunks]
        num_tokens = sum(c.num_tokens for c in out.chunks)
        return self._sample(out, sampling_requests, logits, last, num_tokens, timings, started)

    def _pinned(self, host: HostBatch) -> HostBatch:
        """The static batch's host tensors in pinned memory on CUDA (their non-blocking
        loads then do not block the host), as they are elsewhere."""
        if self.device.type != "cuda":
            return host
        fields = ("input_ids", "positions", "slots", "block_table", "ctx_lens")  # pragma: no cover
        pinned = {name: getattr(host, name).pin_memory() for name in fields}  # pragma: no cover
        return dataclasses.replace(host, **pinned)  # pragma: no cover - needs CUDA

    def _new_event(self) -> torch.cuda.Event:  # pragma: no cover - needs CUDA
        """A timing event whose ``synchronize`` sleeps instead of spinning a core."""
        return torch.cuda.Event(enable_timing=True, blocking=True)

    def _device_event(self, now: float) -> torch.cuda.Event | float:
        """Where the forward starts: a timing event queued on CUDA (the step's device time
        is read from it when the step is collected), else the host clock."""
        if not self.overlap:
            return now
        event = self._new_event()
        event.record()
        return event

    def _sample(
        self,
        out: SchedulerOutput,
        sampling_requests: list,
        logits: torch.Tensor,
        last: torch.Tensor,
        num_tokens: int,
        timings: StepTimings,
        started: torch.cuda.Event | float,
    ) -> Callable[[], StepResult]:
        """Sample one token per row on the device; returns the call that reads the tokens
        (and asked logprobs) back and builds the ``StepResult``. ``timings`` has prepare
        and forward filled in; on CUDA the forward's device time replaces the host's when
        the step is read back (``started``: its start event)."""
        t2 = time.perf_counter()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        sample_positions = [r.num_tokens for r in sampling_requests]
        params = [r.sampling for r in sampling_requests]
        chosen_from = logits  # raw logits stay raw: routing and logprobs read them
        if any(r.uses_processors for r in sampling_requests):  # penalties, bias, min_tokens
            chosen_from = apply_processors(
                logits,
                params,
                [r.token_ids for r in sampling_requests],
                [r.num_prompt_tokens for r in sampling_requests],
                self.eos_token_ids,
            )
        constrained = [i for i, r in enumerate(sampling_requests) if r.sampling.grammar]
        masked = None  # what the rows were sampled from, the grammar's mask applied
        if constrained:
            if chosen_from is logits:  # masked in place unless the raw logits are read
                keep_raw = self.keep_logits or any(p.logprobs is not None for p in params)
                chosen_from = logits.clone() if keep_raw else logits
            self.grammar_book().mask_rows(chosen_from, sampling_requests, constrained)
            masked = chosen_from
        tokens = sample(
            chosen_from,
            params,
            [r.seed for r in sampling_requests],
            sample_positions,
        )  # (num_rows,) long, on the device
        # Asked logprobs (raw logits, asked rows only) are queued here, before ``done``.
        queued = queue_logprobs(logits, tokens, [p.logprobs for p in params])
        readback, done = tokens, None
        if self.overlap:  # the copies back start now, into pinned memory, behind the step
            readback = host_buffer(tuple(tokens.shape), tokens.dtype, self.device)
            readback.copy_(tokens, non_blocking=True)
            queued = queued.to_host() if queued is not None else None
            done = self._new_event()
            done.record()
        t3 = time.perf_counter()
        if done is None:  # computed on the host: the sampler's own time
            timings.sample = t3 - t2
        else:  # queued: the host's time is inside the device's, not added to it
            timings.launch = timings.forward + (t3 - t2)
            timings.forward = timings.sample = 0.0

        def finish() -> StepResult:
            t4 = time.perf_counter()
            token_list = readback.tolist()
            logprobs = queued.read() if queued is not None else None
            if done is not None:  # the forward and sampler on the device, once
                timings.forward = started.elapsed_time(done) / 1e3
            timings.sample += time.perf_counter() - t4
            return StepResult(
                request_ids=[r.request_id for r in sampling_requests],
                sampled=tokens,
                token_ids=token_list,
                positions=sample_positions,
                logits=logits if self.keep_logits else None,
                masked_logits=masked if self.keep_logits else None,
                hidden=last if self.keep_hidden else None,
                num_scheduled_tokens=num_tokens,
                batch_size=len(out.chunks),
                timings=timings,
                logprobs=logprobs,
            )

        if done is None:
            return finish
        if self._watcher is None:  # pragma: no cover - needs CUDA
            device = self.device
            self._watcher = EventWatcher(
                f"{device}-events", on_start=lambda: torch.cuda.set_device(device)
            )
        return DeviceStep(done, finish, self._watcher)
