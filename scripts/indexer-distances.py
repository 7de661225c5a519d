"""Where layer 0's indexer sends the last prompt token's top-k, by distance, at several contexts and
YaRN factors: the probe behind docs/megactx-tiny.md's "Past the trained length" (CPU, ~10 s).

    python scripts/indexer-distances.py [--model models/megactx-tiny] [--factors 16,32,64]

For each context L (a single-needle prompt, needle at half depth) and factor, it prints the share of
the top-k that lies farther than the trained length (64K), within 1K tokens, and within 8K.
"""

from __future__ import annotations

import argparse

import torch

from megactx import load_model
from megactx.train.data import needle_generator
from megactx.train.evaluate import parse_contexts
from megactx.train.needles import NeedleTask


def share(mask: torch.Tensor) -> str:
    return f"{mask.float().mean().item():.0%}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/megactx-tiny")
    p.add_argument("--factors", default="16,32,64", help="YaRN factors to try (comma-separated)")
    p.add_argument("--contexts", default="64k,128k,256k")
    p.add_argument("--trained-length", type=int, default=65536)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    generator = needle_generator(args.model)
    for factor in map(float, args.factors.split(",")):
        model = load_model(args.model, hf_overrides={"rope_parameters": {"factor": factor}})
        layer = model.model.layers[0]
        attn, indexer = layer.self_attn, layer.self_attn.indexer
        for length in parse_contexts(args.contexts):
            ids = torch.tensor(generator.case(NeedleTask(), length, 0.5, "probe").input_ids)[None]  # [1, T]
            cos, sin = model.rotary(torch.arange(ids.shape[1])[None], torch.float32)
            x = layer.input_layernorm(model.embed(ids))  # [1, T, D]
            keys = indexer.keys(x, cos, sin)  # [1, T, DI]
            q_resid = attn.project_q(x[:, -1:], cos[:, -1:], sin[:, -1:])[0]
            q, w = indexer.queries(x[:, -1:], q_resid, cos[:, -1:], sin[:, -1:])
            top = indexer.scores(q, w, keys)[0, -1].topk(indexer.topk).indices  # [K]
            distance = ids.shape[1] - 1 - top
            print(f"factor {factor:g}, {length // 1024}K: farther than {args.trained_length // 1024}K "
                  f"{share(distance > args.trained_length)}, within 1K {share(distance < 1024)}, "
                  f"within 8K {share(distance < 8192)}", flush=True)


if __name__ == "__main__":
    main()
