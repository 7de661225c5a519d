"""Probes of a checkpoint's layer-0 indexer on real needle prompts, on a CPU in seconds: layer 0 sees
only the embeddings, so its keys over even a 1M-token prompt need no forward of the other layers.

    python scripts/layer0-indexer.py distances [--factors 16,32,64] [--contexts 64k,128k,256k]
    python scripts/layer0-indexer.py paths [--contexts 1m] [--rows 64]

distances: where the top-k of the prompt's last token lies, at several contexts and YaRN factors:
the share farther than the trained length (64K), within 1K tokens and within 8K; the probe behind
docs/megactx-tiny.md's "Past the trained length" (~15 s).
paths: which path of the Triton top-k's select step the prompt's last --rows rows take
(`megactx.kernels.topk.select_paths`: "buffer", "ties" or the one-program "fallback", a 29x
cliff at 64 x 1M), on the indexer's FP8-simulated scores, as the engine's FP8 cache gives them:
the last chunk of rows of a prefill at the engine's logits budget (64 rows at 1M; ~15 s at 1M).
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from megactx import load_model
from megactx.kernels.topk import select_paths
from megactx.train.data import needle_generator
from megactx.train.evaluate import parse_contexts
from megactx.train.needles import NeedleTask


def layer0_scores(model, ids: torch.Tensor, rows: int, fp8: bool = False) -> torch.Tensor:
    """Layer 0's indexer scores [rows, T] of the last `rows` positions of ids [1, T] over every key,
    -inf past each row's own position."""
    layer = model.model.layers[0]
    attn, indexer = layer.self_attn, layer.self_attn.indexer
    T = ids.shape[1]
    cos, sin = model.rotary(torch.arange(T)[None], torch.float32)
    x = layer.input_layernorm(model.embed(ids))  # [1, T, D]
    keys = indexer.keys(x, cos, sin)  # [1, T, DI]
    last = slice(T - rows, T)
    q_resid = attn.project_q(x[:, last], cos[:, last], sin[:, last])[0]
    q, w = indexer.queries(x[:, last], q_resid, cos[:, last], sin[:, last])
    scores = indexer.scores(q, w, keys, fp8=fp8)[0]  # [rows, T]
    future = torch.arange(T)[None] > torch.arange(T - rows, T)[:, None]
    return scores.masked_fill(future, float("-inf"))


def share(mask: torch.Tensor) -> str:
    return f"{mask.float().mean().item():.0%}"


def distances(args: argparse.Namespace, generator) -> None:
    for factor in map(float, args.factors.split(",")):
        model = load_model(args.model, hf_overrides={"rope_parameters": {"factor": factor}})
        for length in parse_contexts(args.contexts):
            ids = torch.tensor(generator.case(NeedleTask(), length, 0.5, "probe").input_ids)[None]  # [1, T]
            top = layer0_scores(model, ids, 1)[0].topk(model.cfg.index_topk).indices  # [K]
            distance = ids.shape[1] - 1 - top
            print(f"factor {factor:g}, {length // 1024}K: farther than {args.trained_length // 1024}K "
                  f"{share(distance > args.trained_length)}, within 1K {share(distance < 1024)}, "
                  f"within 8K {share(distance < 8192)}", flush=True)


def paths(args: argparse.Namespace, generator) -> None:
    model = load_model(args.model)
    for length in parse_contexts(args.contexts):
        ids = torch.tensor(generator.case(NeedleTask(), length, 0.5, "probe").input_ids)[None]
        scores = layer0_scores(model, ids, args.rows, fp8=True)
        T = ids.shape[1]
        key_len = torch.arange(T - args.rows + 1, T + 1, dtype=torch.int32)
        counts = Counter(select_paths(scores, model.cfg.index_topk, key_len))
        print(f"{length // 1024}K, the last {args.rows} rows: "
              + ", ".join(f"{name} {counts[name]}" for name in ("direct", "buffer", "ties", "fallback")), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("probe", choices=("distances", "paths"))
    p.add_argument("--model", default="models/megactx-tiny")
    p.add_argument("--factors", default="16,32,64", help="distances: YaRN factors to try (comma-separated)")
    p.add_argument("--contexts", default=None, help="prompt lengths (default: 64k,128k,256k; paths: 1m)")
    p.add_argument("--trained-length", type=int, default=65536, help="distances: the trained length")
    p.add_argument("--rows", type=int, default=64, help="paths: the prompt's last rows (default 64)")
    args = p.parse_args()
    args.contexts = args.contexts or ("1m" if args.probe == "paths" else "64k,128k,256k")
    torch.set_grad_enabled(False)
    generator = needle_generator(args.model)
    {"distances": distances, "paths": paths}[args.probe](args, generator)


if __name__ == "__main__":
    main()
