"""Checkpoint I/O in the Hugging Face layout: `load_model` and `save_pretrained`.

A checkpoint is a directory with `config.json` and `*.safetensors` (one file, or shards listed in
`model.safetensors.index.json`). Tensors are bf16/fp32, or the published FP8 block format: an
e4m3 `X.weight` with an fp32 `X.weight_scale_inv` of [ceil(out/128), ceil(in/128)] (the modules
listed as not converted stay bf16). FP8 weights are dequantized on load to the requested dtype.

Names differ from ours in two places only: routed experts are one tensor each on disk
(`mlp.experts.{e}.{gate,up,down}_proj.weight`) and stacked here, and the MTP layer is checkpoint
layer `model.layers.{num_hidden_layers + j}` and our `mtp.{j}`. Its copies of the shared
embedding / output head (`embed_tokens`, `shared_head.head`), which some checkpoints carry, are
read as the shared tensors they are and not written.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from megactx.config import ModelConfig
from megactx.model.quant import FP8, dequantize_blocks, quantize_blocks
from megactx.model.transformer import Transformer

INDEX_FILE = "model.safetensors.index.json"
# Linear weights the FP8 build quantizes; everything else stays bf16 (see the GLM-5.2 config note).
FP8_WEIGHTS = re.compile(
    r"\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|wq_b|wk|gate_proj|up_proj|down_proj)\.weight$"
)
FP8_NOT_CONVERTED = ["embed_tokens", "lm_head", "norm", "mlp.gate", "indexer.k_norm",
                     "indexer.weights_proj", "enorm", "hnorm", "eh_proj", "shared_head"]
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_MTP_COPIES = re.compile(r"^mtp\.\d+\.(embed_tokens\.weight|shared_head\.head\.weight)$")


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not match its config; the message names them."""


# ---------------------------------------------------------------------------- name mapping
def _to_internal(name: str, cfg: ModelConfig) -> tuple[str, tuple[int, str] | None]:
    """Checkpoint name -> (our parameter name, (expert, part) for a slice of a stacked expert)."""
    m = _LAYER.match(name)
    if m and int(m[1]) >= cfg.num_hidden_layers:
        name = f"mtp.{int(m[1]) - cfg.num_hidden_layers}.{m[2]}"
    m = _EXPERT.match(name)
    if m:
        return f"{m[1]}.{'down_proj' if m[3] == 'down' else 'gate_up_proj'}", (int(m[2]), m[3])
    return name, None


def _to_checkpoint(name: str, cfg: ModelConfig) -> str:
    if name.startswith("mtp."):
        j, rest = name[4:].split(".", 1)
        return f"model.layers.{cfg.num_hidden_layers + int(j)}.{rest}"
    return name


def checkpoint_tensors(model: Transformer) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every tensor a checkpoint of `model` holds."""
    cfg = model.cfg
    I = cfg.moe_intermediate_size
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        prefix = _to_checkpoint(name, cfg)
        if name.endswith("experts.gate_up_proj"):
            base = prefix[: -len(".gate_up_proj")]
            for e in range(t.shape[0]):
                yield f"{base}.{e}.gate_proj.weight", t[e, :I]
                yield f"{base}.{e}.up_proj.weight", t[e, I:]
        elif name.endswith("experts.down_proj"):
            base = prefix[: -len(".down_proj")]
            for e in range(t.shape[0]):
                yield f"{base}.{e}.down_proj.weight", t[e]
        else:
            yield prefix, t


def _target(params: dict[str, torch.Tensor], internal: str, part: tuple[int, str] | None,
            cfg: ModelConfig) -> torch.Tensor | None:
    p = params.get(internal)
    if p is None or part is None:
        return p
    e, kind = part
    if e >= p.shape[0]:
        return None
    I = cfg.moe_intermediate_size
    return {"gate": p[e, :I], "up": p[e, I:], "down": p[e]}[kind]


# ---------------------------------------------------------------------------- loading
def _weight_files(directory: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file holding it."""
    index = directory / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / f for name, f in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} has no *.safetensors files and no {INDEX_FILE}")
    out = {}
    for f in files:
        with safe_open(f, framework="pt") as fh:
            out.update({k: f for k in fh.keys()})
    return out


def _describe(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               backend: str = "torch", strict: bool = True, hf_overrides: dict | None = None) -> Transformer:
    """Load a `glm_moe_dsa` / `deepseek_v32` checkpoint directory into a `Transformer`.

    backend: "torch" (the pure-PyTorch reference) or "triton" (calling the model runs the paged
    path through the Triton kernels; see `Transformer.set_backend` for its cache dtypes). strict:
    refuse missing or unexpected tensors (else they are reported on stderr and missing ones keep
    uninitialised values). hf_overrides: config fields changed before the model is built
    (`megactx.config.apply_overrides`), e.g. {"rope_parameters": {"factor": 32}}.
    """
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend must be 'torch' or 'triton', got {backend!r}")
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"{path} is not a checkpoint directory (config.json + *.safetensors)")
    cfg = ModelConfig.from_pretrained(directory, hf_overrides)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model.cast(dtype)
    params = dict(model.state_dict())
    block = cfg.fp8_block_size or (128, 128)

    files = _weight_files(directory)
    expected = {name for name, _ in checkpoint_tensors(model)}
    loaded, unexpected = set(), []
    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        by_file.setdefault(f, []).append(name)
    handles = {}
    try:
        for f in tqdm(sorted(by_file), desc=f"loading {directory.name}", unit="file",
                      disable=len(by_file) < 4):
            handles[f] = fh = safe_open(f, framework="pt", device="cpu")
            for name in by_file[f]:
                if name.endswith("_scale_inv"):
                    continue  # read with its weight
                internal, part = _to_internal(name, cfg)
                if _MTP_COPIES.match(internal):
                    continue  # the MTP layer's copy of a shared tensor
                dst = _target(params, internal, part, cfg)
                if dst is None:
                    unexpected.append(name)
                    continue
                t = fh.get_tensor(name)
                if t.dtype == FP8:
                    scale_name = name + "_scale_inv"
                    if scale_name not in files:
                        raise CheckpointError(f"{name} is FP8 but {scale_name} is missing")
                    sf = files[scale_name]
                    handles.setdefault(sf, safe_open(sf, framework="pt", device="cpu"))
                    t = dequantize_blocks(t, handles[sf].get_tensor(scale_name), block)
                if tuple(t.shape) != tuple(dst.shape):
                    raise CheckpointError(f"{name} has shape {tuple(t.shape)}; the config implies {tuple(dst.shape)}")
                with torch.no_grad():
                    dst.copy_(t.to(dst.dtype))
                loaded.add(name)
    finally:
        handles.clear()

    missing = sorted(expected - loaded)
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensors missing from the checkpoint: {_describe(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensors in the checkpoint: {_describe(sorted(unexpected))}")
    if problems:
        message = f"{directory}: " + "; ".join(problems)
        if strict:
            raise CheckpointError(message + " (load_model(..., strict=False) loads the rest)")
        import sys

        print(f"warning: {message}", file=sys.stderr)
    model.set_backend(backend)
    return model.eval()


# ---------------------------------------------------------------------------- saving
def save_pretrained(model: Transformer, path: str | Path, dtype: torch.dtype | None = None,
                    quantize: str | None = None, max_shard_bytes: int = 4 << 30) -> None:
    """Write `model` as a Hugging Face checkpoint directory that `load_model` and transformers read.

    dtype: cast floating tensors (fp32-kept router/indexer weights stay fp32); default: as they are.
    quantize="fp8": the published FP8 block format (128×128 e4m3 blocks + weight_scale_inv) for
    the linear weights the FP8 build converts. Shards of at most max_shard_bytes, with an index
    when there is more than one.
    """
    if quantize not in (None, "fp8"):
        raise ValueError(f"quantize must be None or 'fp8', got {quantize!r}")
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    if quantize == "fp8":
        cfg = cfg.replace(quantization_config={
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128], "modules_to_not_convert": FP8_NOT_CONVERTED,
        })
    cfg.save(directory)

    fp32_kept = Transformer.FP32_PARAMS
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in checkpoint_tensors(model):
        t = t.detach()
        if dtype is not None and t.is_floating_point() and not name.endswith(fp32_kept):
            t = t.to(dtype)
        out = {name: t}
        if quantize == "fp8" and FP8_WEIGHTS.search(name):
            w8, scale = quantize_blocks(t, (128, 128))
            out = {name: w8, name + "_scale_inv": scale}
        nbytes = sum(x.numel() * x.element_size() for x in out.values())
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1].update({k: v.contiguous().cpu() for k, v in out.items()})
        size += nbytes

    for old in directory.glob("*.safetensors"):
        old.unlink()
    (directory / INDEX_FILE).unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], directory / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
        total += sum(v.numel() * v.element_size() for v in shard.values())
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                   indent=2) + "\n")
