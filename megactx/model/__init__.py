"""The GLM-5.x / DeepSeek-V3.2 model in plain PyTorch (the reference) and its checkpoint I/O."""

from megactx.model.mtp import Drafts, draft
from megactx.model.transformer import Transformer, init_weights
from megactx.model.weights import CheckpointError, load_model, save_pretrained


def build_model(cfg, device="cpu", dtype=None, seed: int = 0) -> Transformer:
    """A randomly initialised model of `cfg` (a ModelConfig or a preset / path) for tests and demos."""
    import torch

    from megactx.config import ModelConfig

    if not isinstance(cfg, ModelConfig):
        cfg = ModelConfig.from_pretrained(cfg)
    model = init_weights(Transformer(cfg), seed=seed).cast(dtype or torch.float32)
    return model.to(device).eval()


__all__ = ["Transformer", "init_weights", "build_model", "load_model", "save_pretrained",
           "CheckpointError", "draft", "Drafts"]
