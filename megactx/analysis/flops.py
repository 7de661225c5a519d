"""FLOPs and KV-cache bytes of one generated token, per `ModelConfig`, at a context length L.

The model: decode of one new token that attends to the L tokens before it, batch 1, target model
only. The numbers are analytic (no tensors are built), exact integers.

Accounting
----------
- A multiply-accumulate (MAC) is 2 FLOPs. Only matmuls / dot products are counted; elementwise
  work (RMSNorm, LayerNorm, RoPE, softmax, ReLU, SiLU, gating, top-k selection, residual adds) is
  neglected. The embedding lookup costs 0. The MTP layer is not counted: these are FLOPs per token
  of the target model, not per draft.
- Notation: hidden size d, H attention heads, q_lora_rank r_q, kv_lora_rank r_kv, rope width
  d_r = qk_rope_head_dim, d_nope = qk_nope_head_dim, d_v = v_head_dim; indexer heads H_I =
  index_n_heads of width D_I = index_head_dim; top-k = index_topk.

Buckets (each in FLOPs per generated token, summed over the `num_hidden_layers` layers):

- `indexer` — on "full" layers only (`cfg.indexer_types`; a "shared" layer reuses the top-k of the
  full layer below it and runs no indexer). Projections: wq_b (r_q -> H_I*D_I), wk (d -> D_I),
  weights_proj (d -> H_I). Scoring over all L keys: H_I*D_I MACs for the q·k dot products plus
  H_I MACs for the per-head weighting, per key. Counted at every L, even L <= top-k where a kernel
  could skip the indexer.
- `attention` — MLA on every layer, in its absorbed form (MQA over the r_kv + d_r latent), the way
  sparse decode kernels run it. Projections: q_a_proj (d -> r_q), q_b_proj (r_q -> H*(d_nope+d_r)),
  kv_a_proj_with_mqa (d -> r_kv + d_r), the absorbed W_UK (H*d_nope*r_kv: nope query into latent
  space), the absorbed W_UV (H*r_kv*d_v: latent output back to per-head values), o_proj
  (H*d_v -> d). Core over min(L, top-k) keys (sparse attention reads only the selected keys):
  H*(r_kv + d_r) MACs a key for the scores and H*r_kv MACs a key for P·V.
- `mlp` — dense layers: 3*d*intermediate_size (gate, up, down). MoE layers: the router
  (d*n_routed_experts) plus (num_experts_per_tok + n_shared_experts) experts of
  3*d*moe_intermediate_size each.
- `head` — lm_head, d*vocab_size.
- `total` — the sum of the four buckets.

KV-cache bytes per token of context (what one cached token costs, summed over layers):

- `mla_bf16` — latent + rope key in bf16: (r_kv + d_r)*2 B a layer (1152 B for GLM-5.x).
- `mla_fp8` — r_kv e4m3 bytes + one fp32 scale per 128 latent values + d_r bf16 rope values:
  r_kv + 4*ceil(r_kv/128) + 2*d_r B a layer (656 B for GLM-5.x).
- `indexer` — D_I e4m3 bytes + one fp32 scale = D_I + 4 B, on full layers only (132 B for GLM-5.x).
- `total_bf16` = mla_bf16 + indexer; `total_fp8` = mla_fp8 + indexer.

Units in the printed table: GFLOP = 1e9 FLOPs, TFLOP = 1e12 FLOPs, KB = 1e3 B, GB = 1e9 B;
context lengths use binary suffixes (32k = 32768, 1m = 1048576).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any

from megactx.config import ModelConfig

FLOP_BUCKETS = ("indexer", "attention", "mlp", "head")
KV_KEYS = ("mla_bf16", "mla_fp8", "indexer", "total_bf16", "total_fp8")
FP8_SCALE_BLOCK = 128  # latent values sharing one fp32 scale in the FP8 MLA cache
_SUFFIXES = {"k": 1024, "m": 1024 * 1024}


@dataclass
class TokenCost:
    """Cost of one decoded token at `context` keys.

    flops: FLOPs per generated token, keys `indexer`, `attention`, `mlp`, `head`, `total`.
    kv_bytes: KV-cache bytes per token of context (summed over layers), keys `mla_bf16`, `mla_fp8`,
        `indexer`, `total_bf16`, `total_fp8`.
    num_layers / num_indexers: decoder layers, and how many of them are full (run an indexer).
    """

    context: int
    flops: dict[str, int] = field(default_factory=dict)
    kv_bytes: dict[str, int] = field(default_factory=dict)
    num_layers: int = 0
    num_indexers: int = 0

    def kv_cache_bytes(self, fmt: str = "fp8") -> int:
        """Bytes of KV cache holding all `context` tokens of one sequence; fmt "fp8" or "bf16"."""
        return self.kv_bytes[f"total_{fmt}"] * self.context


# ---------------------------------------------------------------------------------------- MACs
def _indexer_macs(cfg: ModelConfig, context: int) -> int:
    """MACs of one full layer's lightning indexer for one query token over `context` keys."""
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    projections = cfg.q_lora_rank * hi * di + cfg.hidden_size * di + cfg.hidden_size * hi
    return projections + context * (hi * di + hi)


def _attention_macs(cfg: ModelConfig, context: int) -> int:
    """MACs of one layer's absorbed MLA for one query token; it reads min(context, top-k) keys."""
    d, h, r_q, r_kv = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    projections = (
        d * r_q                                   # q_a_proj
        + r_q * h * cfg.qk_head_dim               # q_b_proj
        + d * (r_kv + cfg.qk_rope_head_dim)       # kv_a_proj_with_mqa
        + h * cfg.qk_nope_head_dim * r_kv         # W_UK absorbed into the query
        + h * r_kv * cfg.v_head_dim               # W_UV applied to the latent output
        + h * cfg.v_head_dim * d                  # o_proj
    )
    keys = min(context, cfg.index_topk)
    core = keys * h * (r_kv + cfg.qk_rope_head_dim) + keys * h * r_kv  # scores, then P·V
    return projections + core


def _mlp_macs(cfg: ModelConfig, layer: int) -> int:
    d = cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        return 3 * d * cfg.intermediate_size
    experts = cfg.num_experts_per_tok + (cfg.n_shared_experts or 0)
    return d * cfg.n_routed_experts + experts * 3 * d * cfg.moe_intermediate_size


def kv_bytes_per_token(cfg: ModelConfig) -> dict[str, int]:
    """KV-cache bytes one token of context costs, summed over layers (keys: `KV_KEYS`)."""
    n, n_full = cfg.num_hidden_layers, len(cfg.full_layers)
    r_kv, d_r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    mla_bf16 = n * (r_kv + d_r) * 2
    mla_fp8 = n * (r_kv + 4 * math.ceil(r_kv / FP8_SCALE_BLOCK) + 2 * d_r)
    indexer = n_full * (cfg.index_head_dim + 4)
    return {"mla_bf16": mla_bf16, "mla_fp8": mla_fp8, "indexer": indexer,
            "total_bf16": mla_bf16 + indexer, "total_fp8": mla_fp8 + indexer}


def token_cost(cfg: ModelConfig, context: int) -> TokenCost:
    """FLOPs and KV bytes of one decoded token that attends to `context` previous tokens.

    See the module docstring for exactly what each bucket counts. `context` >= 0 (tokens).
    """
    if context < 0:
        raise ValueError(f"context must be >= 0 tokens, got {context}")
    n = cfg.num_hidden_layers
    n_full = len(cfg.full_layers)
    macs = {
        "indexer": n_full * _indexer_macs(cfg, context),
        "attention": n * _attention_macs(cfg, context),
        "mlp": sum(_mlp_macs(cfg, i) for i in range(n)),
        "head": cfg.hidden_size * cfg.vocab_size,
    }
    flops = {k: 2 * v for k, v in macs.items()}
    flops["total"] = sum(flops.values())
    return TokenCost(context=context, flops=flops, kv_bytes=kv_bytes_per_token(cfg),
                     num_layers=n, num_indexers=n_full)


# ---------------------------------------------------------------------------------------- input
def parse_context(text: str) -> list[int]:
    """"32k,128k,1m" -> [32768, 131072, 1048576]; k = 1024, m = 1024², plain integers accepted."""
    out = []
    for item in text.split(","):
        s = item.strip().lower()
        mult = _SUFFIXES.get(s[-1:], 1)
        digits = s[:-1] if s[-1:] in _SUFFIXES else s
        if not digits.isdigit() or int(digits) * mult <= 0:
            raise ValueError(f"bad context length {item.strip()!r} in {text!r}: "
                             "expected a positive integer, optionally with k (×1024) or m (×1024²), e.g. 32k,1m")
        out.append(int(digits) * mult)
    return out


def context_label(n: int) -> str:
    """4096 -> "4K", 1048576 -> "1M", 1000 -> "1000"."""
    for suffix, mult in (("M", 1024 * 1024), ("K", 1024)):
        if n % mult == 0:
            return f"{n // mult}{suffix}"
    return str(n)


# ---------------------------------------------------------------------------------------- output
def format_table(results: dict[str, list[TokenCost]]) -> str:
    """A fixed-width table per model (model label -> costs at each context), plus comparison lines.

    FLOPs in GFLOP (MFLOP for models under 1 GFLOP a token) and TFLOP; KV in KB per token of
    context and GB for the whole context of one sequence (fp8 MLA + indexer). With exactly two
    models, one line per context gives second / first total FLOPs per token, then one line per
    model on indexers kept by IndexShare.
    """
    lines = []
    header = (f"{'context':>8} {'indexer':>9} {'attention':>9} {'mlp':>9} {'head':>9} {'total':>9} {'total':>7}"
              f" {'KV fp8':>9} {'KV bf16':>9} {'KV fp8/seq':>10}")
    for name, costs in results.items():
        if not costs:
            continue
        c0 = costs[0]
        # GFLOP for real models; MFLOP when a small (test) model would print only zeros
        unit, scale = ("GFLOP", 1e9) if max(c.flops["total"] for c in costs) >= 1e9 else ("MFLOP", 1e6)
        units = (f"{'':>8}" + f" {unit:>9}" * 5 + f" {'TFLOP':>7}"
                 f" {'KB/tok':>9} {'KB/tok':>9} {'GB':>10}")
        lines.append(f"{name}: {c0.num_layers} layers, {c0.num_indexers} with an indexer")
        lines += [header, units]
        for c in costs:
            f = c.flops
            lines.append(
                f"{context_label(c.context):>8}"
                + "".join(f" {f[k] / scale:>9.1f}" for k in (*FLOP_BUCKETS, "total"))
                + f" {f['total'] / 1e12:>7.3f}"
                + f" {c.kv_bytes['total_fp8'] / 1e3:>9.1f} {c.kv_bytes['total_bf16'] / 1e3:>9.1f}"
                + f" {c.kv_cache_bytes('fp8') / 1e9:>10.2f}"
            )
        lines.append("")
    names = [n for n, c in results.items() if c]
    if len(names) == 2:
        a, b = names
        for ca, cb in zip(results[a], results[b]):
            if ca.context != cb.context:
                continue
            lines.append(f"{b} / {a} FLOPs per token at {context_label(ca.context)}: "
                         f"{cb.flops['total'] / ca.flops['total']:.2f}x")
        ka, kb = results[a][0].kv_bytes["total_fp8"], results[b][0].kv_bytes["total_fp8"]
        lines.append(f"{b} / {a} fp8 KV bytes per token: {kb / ka:.2f}x")
    for name in names:
        c0 = results[name][0]
        removed = c0.num_layers - c0.num_indexers
        note = f"IndexShare removes {removed}" if removed else "no IndexShare"
        lines.append(f"{name}: {c0.num_indexers} indexers of {c0.num_layers} layers ({note})")
    return "\n".join(lines).rstrip() + "\n"


def to_json(results: dict[str, list[TokenCost]]) -> dict[str, list[dict[str, Any]]]:
    """Model label -> one object per context: context, flops (incl. total), kv_bytes_per_token, ..."""
    return {
        name: [
            {
                "context": c.context,
                "flops": dict(c.flops),
                "kv_bytes_per_token": dict(c.kv_bytes),
                "kv_cache_bytes_fp8": c.kv_cache_bytes("fp8"),
                "kv_cache_bytes_bf16": c.kv_cache_bytes("bf16"),
                "num_layers": c.num_layers,
                "num_indexers": c.num_indexers,
            }
            for c in costs
        ]
        for name, costs in results.items()
    }


# ---------------------------------------------------------------------------------------- CLI
_DESCRIPTION = """\
FLOPs and KV-cache bytes of one generated token (decode, batch 1) at each context length.

Accounting: 2 FLOPs per multiply-accumulate; matmuls only (norms, RoPE, softmax, activations
neglected); embedding lookup free; the MTP layer not counted. Buckets:
  indexer    full layers only: wq_b, wk, weights_proj + H_I*D_I + H_I MACs per key over all L keys
  attention  MLA in absorbed form (MQA over the kv_lora_rank + rope latent): q_a, q_b, kv_a, W_UK,
             W_UV, o_proj + H*(kv_lora+rope) + H*kv_lora MACs per key over min(L, index_topk) keys
  mlp        dense 3*d*intermediate; MoE router + (top-k + shared) experts of 3*d*moe_intermediate
  head       d*vocab
KV bytes per token of context: MLA fp8 (e4m3 latent + fp32 scale per 128 + bf16 rope) or bf16,
plus the FP8 indexer key (D_I + 4 B) on full layers only. GFLOP/TFLOP = 1e9/1e12 FLOPs;
KB/GB = 1e3/1e9 bytes; context suffixes are binary (32k = 32768, 1m = 1048576).
"""


def add_flops_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `flops` subcommand on an argparse subparsers object; sets `func=run_flops`."""
    p = subparsers.add_parser(
        "flops", help="FLOPs and KV-cache bytes per generated token at given context lengths",
        description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="glm-5.2,glm-5.1",
                   help="comma-separated presets or checkpoint directories (default: %(default)s); "
                        "with exactly two, the table ends with second / first ratios")
    p.add_argument("--context", default="32k,128k,1m",
                   help="comma-separated context lengths in tokens, k = 1024, m = 1048576 (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON (one object per model and context) instead")
    p.set_defaults(func=run_flops)
    return p


def run_flops(args: argparse.Namespace) -> int:
    """Print the table (or JSON) for `args.model` x `args.context`; 0 on success, 2 on bad input."""
    try:
        contexts = parse_context(args.context)
        names = [m.strip() for m in args.model.split(",") if m.strip()]
        if not names:
            raise ValueError(f"--model {args.model!r} names no model")
        results = {}
        for name in names:
            cfg = ModelConfig.from_pretrained(name)
            results[name] = [token_cost(cfg, L) for L in contexts]
    except (ValueError, OSError) as e:  # ConfigError is a ValueError
        print(f"megactx flops: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(to_json(results), indent=2))
    else:
        print(format_table(results), end="")
    return 0
