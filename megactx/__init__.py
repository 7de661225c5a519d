"""megactx: million-token contexts the GLM-5.2 way (IndexShare sparse attention, MTP drafts)."""

from megactx.config import ConfigError, ModelConfig
from megactx.engine import LLM, SamplingParams
from megactx.model import build_model, load_model, save_pretrained

__version__ = "0.1.0"
__all__ = ["ModelConfig", "ConfigError", "load_model", "save_pretrained", "build_model", "LLM", "SamplingParams"]
