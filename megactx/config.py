"""Model configuration: the fields of a `glm_moe_dsa` / `deepseek_v32` Hugging Face `config.json`
that change the computation, validated, with the derived per-layer schedules.

`ModelConfig.from_pretrained` takes a checkpoint directory, a path to a `config.json`, or a preset
name (`glm-5.2`, `glm-5.1`, `tiny`). Fields that the computation does not depend on (initializer
range, architectures, transformers version, ...) are ignored; a field whose value we cannot honour
is refused with a `ConfigError` that names it.

`overrides` (`megactx serve/generate/eval --hf-overrides JSON`, vLLM's name) change fields of the
checkpoint's config.json before it is read, nested dicts merged key by key; e.g. serving a model
trained with YaRN factor 16 at factor 32: `{"rope_parameters": {"factor": 32}}`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")
PRESET_DIR = Path(__file__).parent / "presets"
PRESETS = {p.stem: p for p in sorted(PRESET_DIR.glob("*.json"))}


class ConfigError(ValueError):
    """A config.json that megactx cannot run as written; the message names the field."""


@dataclass
class ModelConfig:
    model_type: str = "glm_moe_dsa"
    vocab_size: int = 154880
    hidden_size: int = 6144
    num_hidden_layers: int = 78
    intermediate_size: int = 12288  # dense MLP of the leading layers
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    pad_token_id: int | None = None

    # mla
    num_attention_heads: int = 64
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    attention_bias: bool = False
    rope_interleave: bool = True  # MLA rope dims laid out as (x0, x1), (x2, x3), ... pairs
    # rope: "default" or "yarn"; the yarn fields follow transformers' `rope_parameters`
    rope_parameters: dict[str, Any] = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0}
    )

    # index (DSA lightning indexer + IndexShare)
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    indexer_rope_interleave: bool = True  # GLM: interleaved; DeepSeek-V3.2: half-split
    indexer_types: list[str] | None = None  # per layer "full" | "shared"; derived if None
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 2
    index_topk_pattern: str | None = None  # e.g. "FFFSSSF...", one letter a layer
    index_share_for_mtp_iteration: bool = False  # IndexShare + KVShare across MTP draft steps

    # moe
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    first_k_dense_replace: int = 3
    moe_layer_freq: int = 1
    mlp_layer_types: list[str] | None = None  # per layer "dense" | "sparse"; derived if None

    # mtp
    num_nextn_predict_layers: int = 0

    # quantization of the stored weights (None: plain bf16/fp32 tensors)
    quantization_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self._validate_and_derive()

    # ------------------------------------------------------------------ derived values
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values a token stores per layer in the MLA cache: latent + shared rope key (576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters["rope_theta"])

    @property
    def softmax_scale(self) -> float:
        """MLA attention scale: qk_head_dim^-1/2, times mscale^2 under YaRN (DeepSeek's rule)."""
        scale = self.qk_head_dim**-0.5
        rp = self.rope_parameters
        if rp.get("rope_type") == "yarn" and rp.get("mscale_all_dim"):
            m = yarn_mscale(rp["factor"], rp["mscale_all_dim"])
            scale *= m * m
        return scale

    @property
    def full_layers(self) -> list[int]:
        """Indices of the layers that run their own indexer (and keep an indexer cache)."""
        return [i for i, t in enumerate(self.indexer_types) if t == "full"]

    def topk_source(self, layer: int) -> int:
        """The full layer whose top-k `layer` uses: itself, or the nearest full layer below."""
        while self.indexer_types[layer] != "full":
            layer -= 1
        return layer

    def is_moe_layer(self, layer: int) -> bool:
        """MoE or dense MLP; the MTP layer (index num_hidden_layers) follows the same rule."""
        if layer < self.num_hidden_layers:
            return self.mlp_layer_types[layer] == "sparse"
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def fp8_block_size(self) -> tuple[int, int] | None:
        if self.quantization_config is None:
            return None
        return tuple(self.quantization_config["weight_block_size"])

    # ------------------------------------------------------------------ validation
    def _validate_and_derive(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {self.model_type!r} is not supported; megactx runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} checkpoints"
            )
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "index_n_heads", "index_head_dim", "index_topk", "intermediate_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not self.q_lora_rank:
            raise ConfigError("q_lora_rank must be set: the DSA indexer reads the low-rank query "
                              "(q_lora_rank=None checkpoints have no indexer input)")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ConfigError(f"index_head_dim ({self.index_head_dim}) must be at least "
                              f"qk_rope_head_dim ({self.qk_rope_head_dim}): the indexer ropes that many dims")
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = [self.eos_token_id]
        self.eos_token_id = list(self.eos_token_id or [])

        self._validate_rope()
        self._derive_indexer_types()
        self._validate_moe()
        if self.num_nextn_predict_layers < 0:
            raise ConfigError(f"num_nextn_predict_layers must be >= 0, got {self.num_nextn_predict_layers}")
        self._validate_quantization()

    def _validate_rope(self) -> None:
        rp = dict(self.rope_parameters or {})
        rp.setdefault("rope_type", rp.pop("type", "default"))
        rp.setdefault("rope_theta", 10000.0)
        if rp["rope_type"] not in ("default", "yarn"):
            raise ConfigError(f"rope_parameters.rope_type {rp['rope_type']!r} is not supported "
                              "(only 'default' and 'yarn')")
        if rp["rope_type"] == "yarn":
            if "original_max_position_embeddings" not in rp:
                raise ConfigError("rope_parameters.original_max_position_embeddings is required for yarn")
            rp.setdefault("factor", self.max_position_embeddings / rp["original_max_position_embeddings"])
        self.rope_parameters = rp

    def _derive_indexer_types(self) -> None:
        n = self.num_hidden_layers
        if self.index_topk_freq < 1:
            raise ConfigError(f"index_topk_freq must be >= 1, got {self.index_topk_freq}")
        from_pattern = None
        if self.index_topk_pattern is not None:
            pattern = self.index_topk_pattern.upper()
            if len(pattern) != n or set(pattern) - {"F", "S"}:
                raise ConfigError(f"index_topk_pattern must be {n} letters of F (full) / S (shared), "
                                  f"got {self.index_topk_pattern!r}")
            from_pattern = ["full" if c == "F" else "shared" for c in pattern]
        if self.indexer_types is None:
            if from_pattern is not None:
                self.indexer_types = from_pattern
            else:
                freq, off = self.index_topk_freq, self.index_skip_topk_offset
                self.indexer_types = ["full" if max(i - off + 1, 0) % freq == 0 else "shared" for i in range(n)]
        else:
            self.indexer_types = list(self.indexer_types)
            if from_pattern is not None and from_pattern != self.indexer_types:
                raise ConfigError("indexer_types and index_topk_pattern disagree; give one of them")
        if len(self.indexer_types) != n:
            raise ConfigError(f"indexer_types has {len(self.indexer_types)} entries for {n} layers")
        bad = sorted(set(self.indexer_types) - {"full", "shared"})
        if bad:
            raise ConfigError(f"indexer_types may hold only 'full' and 'shared', got {bad}")
        if self.indexer_types[0] != "full":
            raise ConfigError("indexer_types[0] must be 'full': a shared layer reuses the top-k of a "
                              "full layer below it, and layer 0 has none")

    def _validate_moe(self) -> None:
        n = self.num_hidden_layers
        if self.mlp_layer_types is None:
            self.mlp_layer_types = [
                "sparse" if (i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0) else "dense"
                for i in range(n)
            ]
        self.mlp_layer_types = list(self.mlp_layer_types)
        if len(self.mlp_layer_types) != n or set(self.mlp_layer_types) - {"dense", "sparse"}:
            raise ConfigError(f"mlp_layer_types must be {n} entries of 'dense' / 'sparse'")
        if "sparse" not in self.mlp_layer_types and self.num_nextn_predict_layers == 0:
            return
        if self.scoring_func != "sigmoid":
            raise ConfigError(f"scoring_func {self.scoring_func!r} is not supported (only 'sigmoid')")
        if self.topk_method not in ("noaux_tc", "greedy"):
            raise ConfigError(f"topk_method {self.topk_method!r} is not supported")
        if self.n_group < 1 or self.n_routed_experts % self.n_group:
            raise ConfigError(f"n_routed_experts ({self.n_routed_experts}) must be divisible by "
                              f"n_group ({self.n_group})")
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(f"topk_group ({self.topk_group}) must be in 1..n_group ({self.n_group})")
        if self.n_routed_experts // self.n_group < 2 and self.n_group > 1:
            raise ConfigError("group-limited routing needs at least 2 experts a group (n_routed_experts / n_group)")
        reachable = self.topk_group * (self.n_routed_experts // self.n_group)
        if not 1 <= self.num_experts_per_tok <= reachable:
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..{reachable} "
                              "(topk_group groups of n_routed_experts / n_group experts)")

    def _validate_quantization(self) -> None:
        qc = self.quantization_config
        if qc is None:
            return
        if qc.get("quant_method") != "fp8":
            raise ConfigError(f"quantization_config.quant_method {qc.get('quant_method')!r} is not "
                              "supported (only the 'fp8' block format)")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"quantization_config.fmt {qc.get('fmt')!r} is not supported (only 'e4m3')")
        block = qc.get("weight_block_size")
        if block is None or len(block) != 2:
            raise ConfigError("quantization_config.weight_block_size must be [rows, cols], e.g. [128, 128]")

    # ------------------------------------------------------------------ I/O
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config dict; unknown keys are ignored."""
        raw = dict(raw)
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type {model_type!r} is not supported; megactx runs "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)} checkpoints")
        # Older configs keep rope in `rope_theta` + `rope_scaling`; newer ones in `rope_parameters`.
        rp = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        if "rope_theta" in raw:
            rp.setdefault("rope_theta", raw["rope_theta"])
        raw["rope_parameters"] = rp
        if model_type == "deepseek_v32":
            # DeepSeek-V3.2's indexer ropes the half-split layout, and every layer has an indexer:
            # IndexShare fields are not part of that architecture (transformers ignores them too).
            raw.setdefault("indexer_rope_interleave", False)
            for name in ("indexer_types", "index_topk_pattern", "index_topk_freq", "index_skip_topk_offset"):
                raw.pop(name, None)
        if raw.get("num_key_value_heads", raw.get("num_attention_heads")) != raw.get("num_attention_heads"):
            raise ConfigError("num_key_value_heads must equal num_attention_heads for MLA "
                              f"(got {raw.get('num_key_value_heads')} and {raw.get('num_attention_heads')})")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})

    @classmethod
    def from_pretrained(cls, path_or_preset: str | Path, overrides: dict[str, Any] | None = None) -> ModelConfig:
        """A checkpoint directory, a config.json, or a preset name (see `PRESETS`); `overrides`
        change its fields first (`apply_overrides`)."""
        p = Path(path_or_preset)
        if p.is_dir():
            p = p / "config.json"
        elif not p.exists() and str(path_or_preset) in PRESETS:
            p = PRESETS[str(path_or_preset)]
        if not p.is_file():
            raise FileNotFoundError(
                f"{path_or_preset!s} is neither a checkpoint directory with a config.json, a config "
                f"file, nor a preset ({', '.join(PRESETS)})"
            )
        try:
            raw = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p} is not valid JSON: {e}") from None
        return cls.from_dict(apply_overrides(raw, overrides) if overrides else raw)

    def to_dict(self) -> dict[str, Any]:
        """A Hugging Face config dict that transformers and `from_dict` both read."""
        d = dataclasses.asdict(self)
        d["architectures"] = [
            "GlmMoeDsaForCausalLM" if self.model_type == "glm_moe_dsa" else "DeepseekV32ForCausalLM"
        ]
        d["num_key_value_heads"] = self.num_attention_heads
        d["rope_theta"] = self.rope_theta
        d["eos_token_id"] = self.eos_token_id[0] if len(self.eos_token_id) == 1 else self.eos_token_id
        if self.quantization_config is None:
            d.pop("quantization_config")
        if self.index_topk_pattern is None:
            d.pop("index_topk_pattern")
        return d

    def save(self, directory: str | Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed; derived schedules are recomputed unless given."""
        d = dataclasses.asdict(self)
        d.update(changes)
        if ("index_topk_freq" in changes or "index_skip_topk_offset" in changes
                or "index_topk_pattern" in changes) and "indexer_types" not in changes:
            d["indexer_types"] = None
        if ("first_k_dense_replace" in changes or "num_hidden_layers" in changes) and "mlp_layer_types" not in changes:
            d["mlp_layer_types"] = None
        if "num_hidden_layers" in changes and "indexer_types" not in changes:
            d["indexer_types"] = None
        return ModelConfig(**d)


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of the config dict `raw` with `overrides` applied: a dict value is merged into the
    dict it replaces key by key, anything else replaces the value. Top-level keys must be fields
    of `ModelConfig` (`rope_scaling` and `rope_theta` too, they land where `raw` keeps its rope),
    so that a misspelt name is refused rather than silently ignored."""
    if not isinstance(overrides, dict):
        raise ConfigError(f"config overrides must be a JSON object, got {overrides!r}")
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    rope_key = "rope_scaling" if "rope_scaling" in raw and "rope_parameters" not in raw else "rope_parameters"
    known = names | {"rope_scaling", "rope_theta"}
    unknown = sorted(set(overrides) - known)
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        raise ConfigError(f"config overrides name an unknown field {unknown[0]!r}"
                          + (f"; did you mean {close[0]!r}?" if close else "; see megactx.config.ModelConfig"))

    def merge(old: Any, new: Any) -> Any:
        if isinstance(old, dict) and isinstance(new, dict):
            return {**old, **{k: merge(old.get(k), v) for k, v in new.items()}}
        return new

    out = dict(raw)
    for key, value in overrides.items():
        key = rope_key if key in ("rope_scaling", "rope_parameters") else key
        if key == "rope_theta" and isinstance(out.get(rope_key), dict):
            out[rope_key] = {**out[rope_key], "rope_theta": value}
        out[key] = merge(out.get(key), value)
    return out


def describe_overrides(overrides: dict[str, Any] | None) -> str:
    """{"rope_parameters": {"factor": 32}} -> "rope_parameters.factor=32", for reports ('' for none)."""
    def flat(prefix: str, value: Any) -> list[str]:
        if isinstance(value, dict) and value:
            return [item for k, v in value.items() for item in flat(f"{prefix}.{k}" if prefix else k, v)]
        return [f"{prefix}={json.dumps(value)}"]

    return ", ".join(flat("", overrides)) if overrides else ""


def parse_overrides(text: str) -> dict[str, Any]:
    """--hf-overrides: a JSON object of config fields (see `apply_overrides`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--hf-overrides is not valid JSON ({e}); e.g. '{{\"rope_parameters\": "
                          f"{{\"factor\": 32}}}}'") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--hf-overrides must be a JSON object of config fields, got {text!r}")
    return value


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention-magnitude correction for a context `scale`× the trained one."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
