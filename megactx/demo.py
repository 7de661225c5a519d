"""`megactx demo`: what megactx does today, in under a minute on a CPU.

Until the trained megactx-tiny model exists, the demo prints the per-token FLOPs / KV analysis of
GLM-5.2 against GLM-5.1 and runs the reference forward of a random GLM-5.2-shaped tiny model:
its IndexShare schedule, the top-k each shared layer reuses, the two MLA forms agreeing, greedy
MTP drafting with IndexShare + KVShare, and the engine (paged KV, prefix caching, speculative
decoding) producing the reference model's greedy tokens.
"""

from __future__ import annotations

import argparse
import time

import torch


def add_demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="FLOPs analysis + a forward pass of a tiny GLM-5.2-shaped model",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="preset or config.json for the random model (default: tiny)")
    p.add_argument("--context", default="32k,128k,1m", help="context lengths for the FLOPs table")
    p.add_argument("--seqlen", type=int, default=256, help="prompt length of the forward pass (default 256)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from megactx import ModelConfig
    from megactx.analysis.flops import format_table, parse_context, token_cost
    from megactx.model import build_model, draft

    contexts = parse_context(args.context)
    print("== Per-token cost of decoding, GLM-5.2 (IndexShare) vs GLM-5.1 (an indexer in every layer) ==\n")
    results = {name: [token_cost(ModelConfig.from_pretrained(name), c) for c in contexts]
               for name in ("glm-5.2", "glm-5.1")}
    print(format_table(results))

    cfg = ModelConfig.from_pretrained(args.model)
    torch.manual_seed(args.seed)
    model = build_model(cfg, seed=args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    schedule = "".join("F" if t == "full" else "S" for t in cfg.indexer_types)
    print(f"\n== Reference forward of a random {args.model} model ({n_params / 1e6:.1f}M parameters) ==")
    print(f"layers: {cfg.num_hidden_layers}, indexer schedule {schedule} (F = runs its indexer, "
          f"S = reuses the top-k of the nearest F below), top-k {cfg.index_topk}, "
          f"MTP layers: {cfg.num_nextn_predict_layers}")

    input_ids = torch.randint(0, cfg.vocab_size, (1, args.seqlen), generator=torch.Generator().manual_seed(args.seed))
    topk_seen = {}
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, out, i=i: topk_seen.__setitem__(i, out[1]))
             for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        t0 = time.perf_counter()
        logits = model(input_ids)
        naive_s = time.perf_counter() - t0
        model.set_attention(absorbed=True)
        t0 = time.perf_counter()
        absorbed = model(input_ids)
        absorbed_s = time.perf_counter() - t0
    for h in hooks:
        h.remove()
    print(f"logits {tuple(logits.shape)}: naive MLA {naive_s * 1e3:.0f} ms, absorbed MLA {absorbed_s * 1e3:.0f} ms, "
          f"max |difference| {(logits - absorbed).abs().max().item():.2e}")
    last = args.seqlen - 1
    for i in range(cfg.num_hidden_layers):
        src = cfg.topk_source(i)
        keys = topk_seen[i][0, last]
        keys = keys[keys >= 0]
        origin = "own indexer" if src == i else f"top-k of layer {src}"
        print(f"  layer {i:2d} [{schedule[i]}] last token attends to {keys.numel():4d} of {args.seqlen} keys "
              f"({origin})")

    steps = 4
    with torch.no_grad():
        shared = draft(model, input_ids, steps, kv_share=True)
        baseline = draft(model, input_ids, steps, kv_share=False)
    print(f"\nMTP greedy drafts ({steps} steps) after token {shared.next_token.item()}: "
          f"IndexShare+KVShare {shared.tokens[0].tolist()}, baseline {baseline.tokens[0].tolist()}")
    print("(random weights: the drafts mean nothing yet; the trained megactx-tiny model arrives with training)")
    _engine_demo(model, input_ids[0].tolist())
    return 0


def _engine_demo(model, prompt: list[int], new_tokens: int = 12) -> None:
    """The engine on the same model: two requests sharing the prompt (the second hits the prefix
    cache), the output checked against greedy decoding with the reference forward, then the same
    with MTP speculative decoding."""
    from megactx import LLM, SamplingParams

    print("\n== The engine (paged KV over the kernels' PyTorch twins on a CPU) ==")
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    want = ids[len(prompt):]
    for gamma in (0, 3):
        llm = LLM(model, device="cpu", dtype=torch.float32, max_model_len=len(prompt) + 64, max_num_seqs=4,
                  num_speculative_tokens=gamma)
        t0 = time.perf_counter()
        first = llm.generate([prompt], greedy, use_tqdm=False)[0]
        second = llm.generate([prompt[:-1] + [prompt[-1] ^ 1]], greedy, use_tqdm=False)[0]
        seconds = time.perf_counter() - t0
        label = "no speculation" if gamma == 0 else f"MTP speculation, γ = {gamma}"
        print(f"{label}: {new_tokens} tokens, equal to the reference's greedy tokens: {first.token_ids == want}; "
              f"second request reused {second.num_cached_tokens} cached prompt tokens; {seconds:.2f} s")
        if gamma:
            stats = llm.stats.spec_decode
            print(f"  mean acceptance length {stats.mean_acceptance_length:.2f} "
                  "(random MTP weights: drafts are rarely right)")
        else:
            print(f"  {llm.memory_report()}")
