"""Runs one packed forward of a transformers causal LM over the paged KV cache.

Input: a ``SchedulerOutput`` (which tokens of which requests). Output: a ``StepResult``
with one sampled token per request whose chunk reached its last token, plus the logits and
last hidden states of those rows when asked. Only those rows go through ``lm_head``.
"""

from __future__ import annotations

import time

import torch
from transformers import PreTrainedModel

from tokenrouter_ray.engine.attention import PagedBatch, flash_attn_available
from tokenrouter_ray.engine.block_pool import ModelFootprint, kv_bytes_per_token
from tokenrouter_ray.engine.kv_cache import PagedKVCache
from tokenrouter_ray.engine.outputs import StepResult, StepTimings
from tokenrouter_ray.engine.sampler import sample
from tokenrouter_ray.engine.scheduler import SchedulerOutput


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


class ModelRunner:
    def __init__(
        self,
        model: PreTrainedModel,
        num_blocks: int,
        block_size: int,
        keep_logits: bool = False,
        keep_hidden: bool = False,
    ) -> None:
        self.model = model
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        cfg = model.config
        self.use_flash = flash_attn_available(self.device) and block_size % 256 == 0
        self.kv = PagedKVCache(
            num_layers=cfg.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            dtype=self.dtype,
            device=self.device,
        )
        self.keep_logits = keep_logits
        self.keep_hidden = keep_hidden
        self.softcap = getattr(cfg, "final_logit_softcapping", None)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, timings: StepTimings) -> StepResult:
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
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)[None]  # (1, num_tokens)
        position_ids = torch.tensor(positions, dtype=torch.long, device=dev)[None]
        batch = PagedBatch.build(self.kv, seqs, dev, use_flash=self.use_flash)
        t1 = time.perf_counter()

        hidden = self.decoder(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, paged=batch
        ).last_hidden_state[0]  # (num_tokens, hidden_size)
        last = hidden[torch.tensor(rows, dtype=torch.long, device=dev)]  # (num_rows, hidden)
        logits = self.lm_head(last).float()  # (num_rows, vocab)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        t2 = time.perf_counter()

        sample_positions = [r.num_tokens for r in sampling_requests]
        tokens = sample(
            logits,
            [r.sampling for r in sampling_requests],
            [r.seed for r in sampling_requests],
            sample_positions,
        )
        token_list = tokens.tolist()
        t3 = time.perf_counter()
        timings.prepare, timings.forward, timings.sample = t1 - t0, t2 - t1, t3 - t2
        return StepResult(
            request_ids=[r.request_id for r in sampling_requests],
            sampled=tokens,
            token_ids=token_list,
            positions=sample_positions,
            logits=logits if self.keep_logits else None,
            hidden=last if self.keep_hidden else None,
            num_scheduled_tokens=len(ids),
            batch_size=len(out.chunks),
            timings=timings,
        )
