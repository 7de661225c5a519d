"""The model megactx ships: `megactx-tiny`, a trained checkpoint directory (config.json,
model.safetensors, tokenizer.json with a chat template) in the repository's `models/` folder, beside
the package. It is the default of every command that takes --model (`generate`, `serve`, `demo`,
`bench spec`, `bench engine`).

An install without the repository (a pip wheel) carries no model; `shipped_model()` then returns
None and each command falls back in its own way (a cached random checkpoint, or an error that says
how to pass --model). This module is the one place that knows where the model lives.
"""

from __future__ import annotations

from pathlib import Path

SHIPPED_MODEL_NAME = "megactx-tiny"
# read at call time, so tests can point it elsewhere
SHIPPED_MODEL_DIR = Path(__file__).parent.parent / "models" / SHIPPED_MODEL_NAME


def shipped_model() -> Path | None:
    """The shipped checkpoint directory, or None when it is not there (no config.json in it)."""
    return SHIPPED_MODEL_DIR if (SHIPPED_MODEL_DIR / "config.json").is_file() else None


def shipped_model_missing() -> str:
    """Why there is no default model, for messages: where it was looked for."""
    return (f"the shipped {SHIPPED_MODEL_NAME} model is not at {SHIPPED_MODEL_DIR} (it lives in the megactx "
            "repository; an install without the repository carries no model)")
