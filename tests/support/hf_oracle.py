"""transformers' float32 copy of the default model (the suite's oracle), built from the GGUF once per run.

transformers takes about 30 s on two cores to build the model from the GGUF (most
of it reading the file's metadata); several session fixtures need it, and under
pytest-xdist every worker has its own session. The first caller in a run builds
it from the GGUF and keeps its config, generation config and float32 weights
(safetensors) in a folder all the run's workers share; the others build the
same architecture from that config and load those weights, the same tensors
bit for bit, in a second or two. A lock on the folder makes the others wait
for the first.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

WEIGHTS = "model.safetensors"


def causal_lm(folder: Path) -> Any:
    """transformers' ``AutoModelForCausalLM`` of the default GGUF in float32, in eval mode."""
    import torch
    import transformers
    from safetensors.torch import load_model, save_model

    from inferflux.backends.models import default_model_path

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "wb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / WEIGHTS).exists():
            path = default_model_path()
            model = transformers.AutoModelForCausalLM.from_pretrained(
                os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
            )
            model.config.to_json_file(folder / "config.json")
            model.generation_config.to_json_file(folder / "generation_config.json")
            save_model(model, str(folder / f"{WEIGHTS}.part"))  # tied weights stored once
            (folder / f"{WEIGHTS}.part").rename(folder / WEIGHTS)  # complete or absent
            return model.eval()
    config = transformers.AutoConfig.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    load_model(model, str(folder / WEIGHTS))
    model.generation_config = transformers.GenerationConfig.from_pretrained(folder)
    return model.eval()
