"""The flagship's shapes through the engine on one GPU, for ``device.gpu_check``: random-weight
models shaped as Qwen3-0.6B and Qwen3-32B (as many of the 32B model's layers as the memory
plan allows), built on the device in bf16, block size 256. docs/deployment/gpu-check.md
says what ``check_flagship``, ``check_nccl_graph`` and ``bench_flagship`` cover;
``DEVICE = "cpu"`` runs them at toy sizes.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import Qwen3Config

from tokenrouter_ray.engine.attention import ATTN_IMPLEMENTATION, register_attention
from tokenrouter_ray.engine.block_pool import kv_bytes_per_token
from tokenrouter_ray.engine.config import EngineConfig
from tokenrouter_ray.engine.engine import Engine
from tokenrouter_ray.engine.memory_reserve import forward_reserve, forward_reserve_bytes
from tokenrouter_ray.engine.model_runner import ModelRunner
from tokenrouter_ray.engine.outputs import StepResult
from tokenrouter_ray.engine.random_model import random_causal_lm
from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.engine.scheduler import SchedulerConfig
from tokenrouter_ray.engine.static_forward import (
    DEFAULT_BATCH_BUCKETS,
    DEFAULT_QUERY_BUCKETS,
    StaticForward,
)

DEVICE = "cuda"
BLOCK_SIZE = 256
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True)  # fmt: skip
QWEN3_32B = QWEN3_06B | dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                             num_attention_heads=64, tie_word_embeddings=False)  # fmt: skip
DRY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 max_position_embeddings=1024)  # fmt: skip
DRY_BUCKETS = {"batch_buckets": (1, 4, 8), "query_buckets": (1, 4)}
SHAPES = {"qwen3_0.6b": QWEN3_06B, "qwen3_32b": QWEN3_32B}
HOT = dict(temperature=0.8, top_k=50, top_p=0.95, logprobs=2)  # seeded sampling, logprobs
SAMPLED_BENCH = dict(temperature=0.7, top_p=0.9)  # the benchmark's sampled row (seeded)
SAMPLED_BENCH_BATCH = 8


@dataclass(frozen=True)
class Sizes:
    """Workload sizes: the GPU's, or the dry run's toy ones."""

    long_prompt: int = 32768  # Qwen3's native context
    short_prompt: int = 512
    shorts: int = 31
    mixed_steps: int = 16
    sampled_requests: int = 8
    sampled_tokens: int = 24
    bench_prompt: int = 128
    bench_steps: int = 32
    bench_batches: tuple[int, ...] = (1, 8, 32, 64)
    headroom_bytes: int = 6 * 2**30  # left free when planning the 32B model's layers


GPU_SIZES = Sizes()
DRY_SIZES = Sizes(long_prompt=600, short_prompt=20, shorts=7, mixed_steps=3,
                  sampled_requests=4, sampled_tokens=6, bench_prompt=8, bench_steps=2,
                  bench_batches=(1, 2), headroom_bytes=0)  # fmt: skip
_MODELS: dict[str, torch.nn.Module] = {}
_PLANS: dict[str, dict[str, Any]] = {}


def sizes() -> Sizes:
    return GPU_SIZES if DEVICE == "cuda" else DRY_SIZES


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def shape_of(name: str) -> dict[str, Any]:
    return SHAPES[name] if DEVICE == "cuda" else DRY_SHAPE


def layer_bytes(shape: dict[str, Any], dtype_bytes: int = 2) -> tuple[int, int]:
    """(bytes per decoder layer, bytes outside the layers) of a Qwen3 shape."""
    h, inter, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h + 2 * d
    tables = shape["vocab_size"] * h * (1 if shape.get("tie_word_embeddings") else 2) + h
    return per_layer * dtype_bytes, tables * dtype_bytes


def kv_tokens_needed(s: Sizes) -> int:
    """KV tokens the checks of one engine hold at once (the mixed batch, or the largest
    benchmark batch), each request rounded up to whole blocks, plus slack."""

    def blocks(tokens: int) -> int:
        return -(-tokens // BLOCK_SIZE)

    mixed = blocks(s.long_prompt + s.mixed_steps + 8)
    mixed += s.shorts * blocks(s.short_prompt + s.mixed_steps + 8)
    bench = max(s.bench_batches) * blocks(s.bench_prompt + s.bench_steps + 24)
    sampled = s.sampled_requests * blocks(5 + 7 * s.sampled_requests + s.sampled_tokens + 8)
    return (max(mixed, bench, sampled) + 8) * BLOCK_SIZE


def plan_layers(name: str, reserve_guess: int) -> dict[str, Any]:
    """How many of the shape's layers fit: free memory less the checks' KV (one engine at a
    time), the reserve and headroom, in whole layers (at least 1)."""
    shape = shape_of(name)
    layers = shape["num_hidden_layers"]
    if DEVICE != "cuda":
        return {"layers": layers, "of": layers, "why": "dry run"}
    per_layer, tables = layer_bytes(shape)
    kv_per_layer = kv_bytes_per_token(1, shape["num_key_value_heads"], shape["head_dim"], 2)
    kv = kv_tokens_needed(sizes()) * kv_per_layer
    free = torch.cuda.mem_get_info()[0]
    room = free - tables - reserve_guess - sizes().headroom_bytes
    fit = max(1, min(layers, room // (per_layer + kv)))
    return {
        "layers": int(fit),
        "of": layers,
        "free_gib": round(free / 2**30, 1),
        "weights_gib": round((tables + fit * per_layer) / 2**30, 1),
        "kv_gib_planned": round(fit * kv / 2**30, 1),
        "why": "all layers fit" if fit == layers else "layers cut to the memory plan",
    }


def model(name: str) -> torch.nn.Module:
    """The random-weight model of ``name``, built on the device once (bf16 there)."""
    if name not in _MODELS:
        shape = shape_of(name)
        dtype = torch.bfloat16
        cfg0 = Qwen3Config(**shape)
        _PLANS[name] = plan_layers(name, _forward_reserve_of(cfg0))
        t0 = time.perf_counter()
        layers = _PLANS[name]["layers"]
        fields = {**shape, "num_hidden_layers": layers, "bos_token_id": None,
                  "eos_token_id": None, "pad_token_id": None}  # fmt: skip
        lm = random_causal_lm("qwen3", 0, device=DEVICE, dtype=dtype, **fields)
        lm.set_attn_implementation(register_attention())
        assert lm.config._attn_implementation == ATTN_IMPLEMENTATION
        sync()
        _PLANS[name]["build_seconds"] = round(time.perf_counter() - t0, 1)
        _MODELS[name] = lm.eval()
    return _MODELS[name]


def drop_models() -> None:
    _MODELS.clear()


def _config(graphs: bool, num_blocks: int, max_model_len: int | None = None) -> EngineConfig:
    cuda = DEVICE == "cuda"
    return EngineConfig(
        model="random-weights (built on the device)",
        dtype="bfloat16",
        device=DEVICE,
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        cuda_graphs=graphs and cuda,
        static_batches=not cuda or not graphs,  # graphs off: the same static path eagerly
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096),
    )


def _forward_reserve_of(cfg: Qwen3Config) -> int:
    """The reserve an engine of ``_config`` will set aside for this shape in bf16."""
    config = _config(True, 1)
    limit = cfg.max_position_embeddings
    return forward_reserve_bytes(
        cfg, 2, config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs,
        limit, static_rows=max(DEFAULT_BATCH_BUCKETS) * max(DEFAULT_QUERY_BUCKETS), graphs=True,
    )  # fmt: skip


def engine_on(lm: torch.nn.Module, graphs: bool, kv_tokens: int) -> Engine:
    """An engine on an in-memory model (``Engine.from_config`` without the load): the
    runner, its cache of ``kv_tokens``, and every static bucket built at start (on CUDA
    with graphs: captured)."""
    num_blocks = -(-kv_tokens // BLOCK_SIZE)
    config = _config(graphs, num_blocks)
    buckets = {} if DEVICE == "cuda" else DRY_BUCKETS  # the dry run: fewer to warm up
    runner = ModelRunner.for_engine(lm, num_blocks, config, **buckets)
    runner.capture_static()  # CUDA: every graph; else every static bucket warmed up eagerly
    return Engine(runner, config, num_blocks)


def _execute(eng: Engine, record: dict[str, list] | None = None) -> StepResult | None:
    result = eng.execute()
    if result is None:
        return None
    if record is not None:
        for i, rid in enumerate(result.request_ids):
            lp = result.logprobs[i] if result.logprobs is not None else None
            record.setdefault(rid, []).append((result.token_ids[i], lp))
    eng.commit(result)
    return result


def sampled_run(eng: Engine, vocab: int, s: Sizes) -> dict[str, list]:
    """Seeded sampled decoding with logprobs; r0 paused after 3 steps and resumed with 3
    new tokens (an extend bucket). Returns per request its (token, logprobs) per step."""
    rng = random.Random(3)
    record: dict[str, list] = {}
    for i in range(s.sampled_requests):
        prompt = [rng.randrange(vocab) for _ in range(5 + 7 * i)]
        params = SamplingParams(max_tokens=s.sampled_tokens, ignore_eos=True, seed=100 + i, **HOT)
        eng.add_request(f"r{i}", prompt, params)
    for _ in range(3):
        _execute(eng, record)
    eng.pause("r0")
    _execute(eng, record)
    held = list(eng.requests["r0"].token_ids)
    eng.resume("r0", [1, 2, 3], anchor=len(held) - 1)
    while eng.has_unfinished and _execute(eng, record) is not None:
        pass
    sync()
    return record


def mixed_run(eng: Engine, vocab: int, s: Sizes) -> dict[str, Any]:
    """One long prompt beside many short ones, then decodes: every request gets tokens."""
    rng = random.Random(5)
    lengths = [s.long_prompt] + [s.short_prompt] * s.shorts
    for i, n in enumerate(lengths):
        prompt = [rng.randrange(vocab) for _ in range(n)]
        eng.add_request(f"m{i}", prompt, SamplingParams(max_tokens=s.mixed_steps, ignore_eos=True))
    produced: dict[str, int] = {}
    steps = 0
    while eng.has_unfinished:
        result = _execute(eng)
        if result is None:
            break
        steps += 1
        for rid in result.request_ids:
            produced[rid] = produced.get(rid, 0) + 1
    sync()
    return {
        "requests": len(lengths),
        "long_prompt": s.long_prompt,
        "steps": steps,
        "all_finished": all(produced.get(f"m{i}", 0) == s.mixed_steps for i in range(len(lengths))),
    }


def check_flagship(name: str, report: dict) -> bool:
    s = sizes()
    lm = model(name)
    vocab = lm.config.vocab_size
    out: dict[str, Any] = {"plan": _PLANS[name]}
    report[f"flagship_{name}"] = out
    kv_tokens = kv_tokens_needed(s)
    runs = {}
    reserve, ok_peak = 0, True
    for graphs in (True, False):
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if DEVICE == "cuda" else 0
        eng = engine_on(lm, graphs, kv_tokens)
        if graphs:  # counted, not kept: a name on the buckets would keep this engine alive
            shapes = list(eng.runner.static)  # (batch, q_len, width) keys only
            out["buckets"] = len(shapes)
            out["decode_buckets"] = sum(q == 1 for _, q, _ in shapes)
            out["extend_buckets"] = sum(q > 1 for _, q, _ in shapes)
            out["capture_seconds"] = round(eng.runner.capture_seconds, 1)
        runs[graphs] = sampled_run(eng, vocab, s)
        out[f"static_steps_graphs_{graphs}"] = eng.runner.static_steps
        if graphs:  # the long-context mixed batch; peak over capture and both runs
            out["mixed"] = mixed_run(eng, vocab, s)
            reserve = forward_reserve(lm, eng.config)
            out["reserve_gib"] = round(reserve / 2**30, 2)
            if DEVICE == "cuda":
                beyond = torch.cuda.max_memory_allocated() - base - eng.runner.kv.nbytes
                out["peak_beyond_weights_and_kv_gib"] = round(beyond / 2**30, 2)
                ok_peak = beyond <= reserve
            out["peak_within_reserve"] = ok_peak
        del eng  # freed before the next engine is built: never two KV caches at once
        release()
    tokens = {g: {r: [t for t, _ in v] for r, v in run.items()} for g, run in runs.items()}
    out["sampled_tokens_equal"] = tokens[True] == tokens[False]
    out["logprobs_equal"] = runs[True] == runs[False]
    out["logprobs_present"] = all(lp is not None for v in runs[True].values() for _, lp in v)
    graphs_ok = out["extend_buckets"] > 0 and out["decode_buckets"] > 0
    return bool(
        graphs_ok
        and out["static_steps_graphs_True"] > 0
        and out["sampled_tokens_equal"]
        and out["logprobs_equal"]
        and out["logprobs_present"]
        and out["mixed"]["all_finished"]
        and ok_peak
    )


def release() -> None:
    """Free the last check's engines (KV caches, graph pools) before the next."""
    import gc

    gc.collect()
    if DEVICE == "cuda":
        with contextlib.suppress(RuntimeError):  # a sticky CUDA error: the next check says
            torch.cuda.empty_cache()


def check_nccl_graph(report: dict) -> bool:
    """A one-rank all-reduce captured in a CUDA graph and replayed (gloo, eagerly, on CPU)."""
    import torch.distributed as dist

    cuda = DEVICE == "cuda"
    out: dict[str, Any] = {"backend": "nccl" if cuda else "gloo"}
    report["nccl_graph"] = out
    if cuda:
        version = torch.cuda.nccl.version()
        out["nccl_version"] = ".".join(map(str, version)) if isinstance(version, tuple) else version
    dist.init_process_group(out["backend"], store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = torch.full((1 << 20,), 2.0, device=DEVICE)
        dist.all_reduce(x)  # communicator set up outside the capture
        if cuda:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                dist.all_reduce(x)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                dist.all_reduce(x)
            x.fill_(3.0)
            graph.replay()
            torch.cuda.synchronize()
            out["captured"] = True
            out["replayed_value"] = x[0].item()
            return out["replayed_value"] == 3.0
        out["captured"] = False  # the dry run: no graphs on CPU
        out["value"] = x[0].item()
        return out["value"] == 2.0
    finally:
        dist.destroy_process_group()


def copy_bandwidth() -> float:
    """Device bytes per second of a large device-to-device copy (read + write counted)."""
    if DEVICE != "cuda":
        return 0.0
    x = torch.empty(2**29, dtype=torch.float32, device=DEVICE)  # 2 GiB
    y = torch.empty_like(x)
    y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del x, y
    return 2 * 10 * 2**31 / seconds


def replay_ms(eng: Engine, batch: int) -> float | None:
    """Device time of one captured decode forward of ``batch`` (graph replay alone)."""
    if DEVICE != "cuda":
        return None
    shapes = [k for k, f in eng.runner.static.items() if k[0] == batch and k[1] == 1 and f.graph]
    if not shapes:
        return None
    fwd = eng.runner.static[min(shapes, key=lambda k: k[2])]
    fwd.graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        fwd.graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / 20 * 1e3


def kernels_per_forward(eng: Engine, batch: int) -> int | str:
    """CUDA kernels one decode forward of ``batch`` launches (run eagerly on the padding
    batch under the profiler: what its graph replays), or why it could not be counted."""
    if DEVICE != "cuda":
        return "no CUDA"
    shapes = [k for k in eng.runner.static if k[0] == batch and k[1] == 1]
    if not shapes:
        return "no bucket"
    fwd = eng.runner.static[min(shapes, key=lambda k: k[2])]
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        load_padding(fwd)  # outside the profile: its copies are not the forward's kernels
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            fwd._forward()
            torch.cuda.synchronize()
        return sum(e.device_type == DeviceType.CUDA for e in prof.events())
    except Exception as exc:  # the profiler is a nicety here, never a failure
        return f"not counted: {type(exc).__name__}: {exc}"


def load_padding(fwd: StaticForward) -> None:
    """Load a bucket's all-padding batch (scratch block only). Inside inference mode: the
    buffers were made there (capture, or the first launch), and an in-place write to an
    inference tensor outside it raises."""
    with torch.inference_mode():
        fwd.load(fwd.padding)


def _bench_batch(
    eng: Engine,
    batch: int,
    params_of: Callable[[int], SamplingParams],
    rng: random.Random,
    weights: int,
    per_token: int,
    bw: float,
    s: Sizes,
) -> dict[str, Any]:
    """Decode steps of ``batch`` requests (``params_of(i)`` each): the step time beside the
    bandwidth floor, the host phases, and the share of the step the host has free."""
    vocab = eng.runner.vocab_size
    ids = []
    for i in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(s.bench_prompt)]
        rid = f"b{batch}-{i}-{rng.randrange(1 << 30)}"
        eng.add_request(rid, prompt, params_of(i))
        ids.append(rid)
    for _ in range(4):  # prefill and the first decodes
        _execute(eng)
    sync()
    timings = []
    launch_s = 0.0  # host time inside launch: what the step loop waits to work on
    eng.runner.static_steps = 0
    t0 = time.perf_counter()
    for _ in range(s.bench_steps):
        t_launch = time.perf_counter()
        pending = eng.launch()
        if pending is None:  # nothing runnable: the rows below say how many ran
            break
        launch_s += time.perf_counter() - t_launch
        result = eng.collect(pending)
        eng.commit(result)
        timings.append(result.timings)
    sync()
    n_steps = max(1, len(timings))
    step = (time.perf_counter() - t0) / n_steps * 1e3
    ctx = s.bench_prompt + 4 + s.bench_steps / 2
    floor = (weights + batch * ctx * per_token) / bw * 1e3 if bw else None
    for rid in ids:
        eng.abort(rid)

    def ms(phase: str) -> float:
        return round(1e3 * sum(getattr(t, phase) for t in timings) / n_steps, 3)

    return {
        "step_ms": round(step, 3),
        "floor_ms": None if floor is None else round(floor, 3),
        "x_floor": None if floor is None else round(step / floor, 2),
        "steps": len(timings),
        "host_prepare_ms": ms("prepare"),
        "host_sample_ms": ms("sample"),  # the read-back (on CPU: the sampler itself)
        "host_queue_ms": ms("launch"),  # queuing forward + sampler (CUDA; inside forward)
        "forward_ms": ms("forward"),  # device time: forward and sampler (CPU: host)
        # the step queued by launch, read back by collect: the host is free for the rest
        # of the step (reports, sends, messages, the next step's draft)
        "launch_host_ms": round(1e3 * launch_s / n_steps, 3),
        "host_free_share": round(max(0.0, 1 - 1e3 * launch_s / n_steps / step), 2),
        "static_share": round(eng.runner.static_steps / n_steps, 2),
    }


def bench_flagship(report: dict, deadline: float, save: Callable[[], None] = lambda: None) -> None:
    """Decode step times with graphs beside the bandwidth floor, per shape and batch;
    ``save`` rewrites the JSON after each shape."""
    from loadtest.device.sampler_ref import SETTINGS, sample_per_row
    from tokenrouter_ray.engine.sampler import position_seed, race_noise, sample

    s = sizes()
    bw = copy_bandwidth()
    out: dict[str, Any] = {"copy_bandwidth_tb_s": round(bw / 1e12, 2)}
    report["bench_flagship"] = out
    for name in SHAPES:
        if time.monotonic() > deadline:
            out[name] = "skipped: time budget"
            continue
        lm = model(name)
        weights = sum(p.numel() * p.element_size() for p in lm.parameters())
        cfg = lm.config
        per_token = kv_bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                       cfg.head_dim, 2)  # fmt: skip
        eng = engine_on(lm, True, kv_tokens_needed(s))
        rows: dict[str, Any] = {"layers": cfg.num_hidden_layers, "capture_seconds":
                                round(eng.runner.capture_seconds, 1)}  # fmt: skip
        rng = random.Random(9)
        for batch in s.bench_batches:
            greedy = SamplingParams(max_tokens=s.bench_steps + 16, ignore_eos=True)
            row = _bench_batch(eng, batch, lambda i, p=greedy: p, rng, weights, per_token, bw, s)
            if batch == 1:
                replay = replay_ms(eng, 1)
                row["graph_replay_ms"] = None if replay is None else round(replay, 3)
                row["kernels_per_forward"] = kernels_per_forward(eng, 1)
                row["host_to_device_copies_per_step"] = 5  # StaticForward.load: 5 buffers
                if replay is not None:
                    host = row["step_ms"] - replay
                    row["dominant"] = "host (prepare, sample, commit)" if host > replay else (
                        "device (the forward's kernels)")  # fmt: skip
            rows[f"batch_{batch}"] = row
        # A sampled row (seeded temperature + top-p): its launch must not wait for the
        # device either, so its host_free_share should match the greedy rows'.
        batch = (
            SAMPLED_BENCH_BATCH if SAMPLED_BENCH_BATCH in s.bench_batches else s.bench_batches[-1]
        )
        rows[f"sampled_batch_{batch}"] = {
            "params": dict(SAMPLED_BENCH),
            **_bench_batch(eng, batch, lambda i: SamplingParams(
                max_tokens=s.bench_steps + 16, ignore_eos=True, seed=500 + i, **SAMPLED_BENCH
            ), rng, weights, per_token, bw, s),
        }  # fmt: skip
        if name == "qwen3_0.6b":
            b1 = rows.get("batch_1", {})
            rows["target_batch1_2ms"] = "PASS" if b1.get("step_ms", 1e9) <= 2.0 else "MISS"
        out[name] = rows
        save()
        del eng
        release()
    if DEVICE == "cuda" and time.monotonic() < deadline:  # the sampler, batch 64, vocab 151936
        logits = torch.randn(64, 151936, device=DEVICE) * 4
        seeds, positions = list(range(64)), [100 + i for i in range(64)]
        sampler: dict[str, Any] = {}
        for label, p in SETTINGS.items():
            params = [p] * 64
            args = (logits, params, seeds, positions)
            same = torch.equal(sample_per_row(*args), sample(*args))
            timed = {}
            for key, fn in (("before_ms", sample_per_row), ("after_ms", sample)):
                fn(*args)
                sync()
                t0 = time.perf_counter()
                for _ in range(5):
                    fn(*args)
                sync()
                timed[key] = round((time.perf_counter() - t0) / 5 * 1e3, 2)
            sampler[label] = {**timed, "same_tokens": same}
        # the noise stream is integer arithmetic: the GPU's should be the CPU's, up to the
        # float64 log's rounding (informative, never a failure)
        keys = torch.tensor([position_seed(a, b) for a, b in zip(seeds, positions, strict=True)])
        here = race_noise(keys.to(DEVICE), 151936).cpu()
        sampler["noise_vs_cpu_max_rel_diff"] = float(
            ((here - race_noise(keys, 151936)).abs() / here).max()
        )
        out["sampler_batch_64"] = sampler
