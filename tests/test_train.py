"""The training library: the losses against their formulas, the training forward against the
reference model and against inference-time MTP drafting, which parameters each stage trains, the
LR schedule and the expert-bias rule, exact resume, two gloo processes against one, the code data
source, and the smoke recipe end to end (its checkpoint loads with load_model and transformers).

Models are micro (hidden 48, 4 layers, top-k 16 under 40–96-token sequences, so selection is
real). Where a test compares selections, weights are drawn at unit scale with 8 indexer heads so
that the indexer scores have no ties (ReLU zeros in every head) that two correct top-k
implementations could break differently."""

from __future__ import annotations

import json
import math
import os
import socket

import pytest
import torch
import torch.nn.functional as F

from megactx import load_model
from megactx.model import build_model, draft
from megactx.model.moe import Router
from megactx.train.losses import (
    IGNORE,
    AttentionTarget,
    LossConfig,
    Objective,
    TrainingAttention,
    _gather_rows,
    expected_accept_length,
    indexer_warmup_loss,
    lm_loss,
    mtp_cross_entropy,
    mtp_hidden,
    multi_layer_distillation_loss,
    tv_loss,
)
from megactx.train.recipe import (
    Stage,
    adapt_model,
    loss_config,
    retrieval_warning,
    set_trainable,
    smoke_recipe,
    stage_model,
    stage_model_config,
)
from megactx.train.trainer import (
    ExpertBalancer,
    RandomTokens,
    TrainConfig,
    Trainer,
    init_distributed,
    lr_factor,
)

VOCAB = smoke_recipe().model.vocab_size


# tiny models on a shared CPU: one torch thread (see conftest.one_torch_thread)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def micro_config(**overrides):
    return smoke_recipe().model.replace(index_n_heads=8, **overrides)


def tie_free_model(cfg, seed: int = 0):
    """A model whose every matrix is drawn at scale fan_in^-1/2 (and norms around 1): attention
    and indexer scores spread out, so top-k sets have no ties at their boundary."""
    model = build_model(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
            elif not name.endswith("bias"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
    return model


def token_ids(batch: int, seqlen: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


def stage_index(kind: str) -> int:
    return [s.kind for s in smoke_recipe().stages].index(kind)


def stage_setup(kind: str, seed: int = 0):
    """The smoke recipe's model (fresh weights), trainable set and objective for stage `kind`."""
    recipe = smoke_recipe()
    model = build_model(stage_model_config(recipe, stage_index(kind)), seed=seed)
    set_trainable(model, kind)
    return model, Objective(model, loss_config(recipe, kind))


# ---------------------------------------------------------------------------------------------
# Loss formulas
# ---------------------------------------------------------------------------------------------
def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    keep = p > 0
    return float((p[keep] * (p[keep] / q[keep]).log()).sum())


def test_warmup_loss_is_the_kl_from_head_summed_attention_to_the_indexer():
    B, H, S = 2, 3, 6
    gen = torch.Generator().manual_seed(0)
    allowed = torch.ones(S, S, dtype=torch.bool).tril().expand(B, S, S)
    scores = torch.randn(B, H, S, S, generator=gen).masked_fill(~allowed[:, None], float("-inf"))
    probs = scores.softmax(-1)
    index = torch.randn(B, S, S, generator=gen)
    expected = []
    for b in range(B):
        for t in range(S):
            p = probs[b, :, t, : t + 1].sum(0)
            p = p / p.sum()
            q = index[b, t, : t + 1].softmax(-1)
            expected.append(_kl(p, q))
    got = indexer_warmup_loss(probs, index, allowed)
    assert got.item() == pytest.approx(sum(expected) / len(expected), rel=1e-5)


def test_distillation_loss_is_the_mean_kl_of_the_served_layers():
    B, H, S, K, layers = 2, 2, 5, 4, 3
    gen = torch.Generator().manual_seed(1)
    valid = torch.rand(B, S, K, generator=gen) > 0.3
    valid[..., 0] = True  # every query keeps at least one key
    probs = [torch.randn(B, H, S, K, generator=gen).masked_fill(~valid[:, None], float("-inf")).softmax(-1)
             for _ in range(layers)]
    index = torch.randn(B, S, K, generator=gen, requires_grad=True)

    loss = multi_layer_distillation_loss(probs, index, valid)
    per_layer = []
    for pr in probs:
        kls = []
        for b in range(B):
            for t in range(S):
                keep = valid[b, t]
                p = pr[b, :, t, keep].sum(0)
                kls.append(_kl(p / p.sum(), index[b, t, keep].detach().softmax(-1)))
        per_layer.append(sum(kls) / len(kls))
    assert loss.item() == pytest.approx(sum(per_layer) / layers, rel=1e-5)

    # the gradient is that of the KL to the mean attention of the served layers
    (grad,) = torch.autograd.grad(loss, index)
    mean_probs = torch.stack([p.sum(1) / H for p in probs]).mean(0)  # [B, S, K]
    log_q = torch.log_softmax(index.masked_fill(~valid, float("-inf")), -1).masked_fill(~valid, 0)
    (grad_mean,) = torch.autograd.grad(-(mean_probs * log_q).sum(-1).mean(), index)
    torch.testing.assert_close(grad, grad_mean, rtol=1e-5, atol=1e-7)


def test_streaming_attention_target_equals_the_formula():
    """The training forward never keeps a layer's attention: AttentionTarget sums them chunk by
    chunk; the loss it yields is still the formula's."""
    B, H, S, K = 2, 2, 7, 5
    gen = torch.Generator().manual_seed(2)
    valid = torch.ones(B, S, K, dtype=torch.bool)
    probs = [torch.randn(B, H, S, K, generator=gen).softmax(-1) for _ in range(2)]
    index = torch.randn(B, S, K, generator=gen)
    target = AttentionTarget((B, S, K), torch.device("cpu"))
    for pr in probs:
        target.layers += 1
        for r0 in range(0, S, 3):  # chunks of 3 rows
            target.add(r0, pr[:, :, r0 : r0 + 3].mean(1))
    cross = sum(target.cross_entropy(r0, index[:, r0 : r0 + 4], valid[:, r0 : r0 + 4]) for r0 in range(0, S, 4))
    streamed = (target.neg_entropy - cross) / (B * S * target.layers)
    assert streamed[0].item() == pytest.approx(multi_layer_distillation_loss(probs, index, valid).item(), rel=1e-5)

    # the focus rows' sums, kept apart, are the formula over those rows alone
    focus = torch.zeros(B, S, dtype=torch.bool)
    focus[0, 2], focus[1, 5], focus[1, 6] = True, True, True
    target = AttentionTarget((B, S, K), torch.device("cpu"), focus)
    for pr in probs:
        target.layers += 1
        target.add(0, pr.mean(1))
    kl = (target.neg_entropy - target.cross_entropy(0, index, valid)) / (focus.sum() * target.layers)
    per_layer = [sum(_kl(pr.mean(1)[focus][i], index[focus][i].softmax(-1)) for i in range(3)) / 3 for pr in probs]
    assert kl[1].item() == pytest.approx(sum(per_layer) / len(per_layer), rel=1e-5)


def test_tv_loss_is_one_minus_normalised_expected_acceptance_with_the_target_detached():
    N, gamma, V = 3, 4, 6
    gen = torch.Generator().manual_seed(3)
    target = torch.randn(N, gamma, V, generator=gen, requires_grad=True)
    drafts = torch.randn(N, gamma, V, generator=gen, requires_grad=True)
    loss = tv_loss(target, drafts)

    expected = 0.0
    for n in range(N):
        alphas = [1 - 0.5 * (target[n, j].softmax(-1) - drafts[n, j].softmax(-1)).abs().sum().item()
                  for j in range(gamma)]
        expected += 1 - sum(math.prod(alphas[: j + 1]) for j in range(gamma)) / gamma
    assert loss.item() == pytest.approx(expected / N, rel=1e-6)

    loss.backward()
    assert target.grad is None, "p must be detached: the drafter learns to match the target, not the reverse"
    assert drafts.grad.abs().sum() > 0
    alpha = 1 - 0.5 * (target.softmax(-1) - drafts.softmax(-1)).abs().sum(-1)
    assert expected_accept_length(alpha.detach()).mean().item() == pytest.approx(gamma * (1 - loss.item()), rel=1e-5)


def test_mtp_cross_entropy_and_lm_loss_ignore_unlabelled_positions():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 5, generator=gen)
    labels = torch.tensor([[1, 2, IGNORE], [0, IGNORE, 4]])
    picked = [-logits[n, j].log_softmax(-1)[labels[n, j]] for n in range(2) for j in range(3) if labels[n, j] >= 0]
    assert mtp_cross_entropy(logits, labels).item() == pytest.approx(torch.stack(picked).mean().item(), rel=1e-6)

    model = build_model(micro_config(), seed=0)
    hidden = torch.randn(2, 9, model.cfg.hidden_size, generator=gen)
    labels = token_ids(2, 9).masked_fill(torch.rand(2, 9, generator=gen) > 0.6, IGNORE)
    full = F.cross_entropy(model.compute_logits(hidden).flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
    chunked = lm_loss(model, hidden, labels, chunk_bytes=3 * 2 * VOCAB * 4 * 3)  # 3 rows a chunk
    assert chunked.item() == pytest.approx(full.item(), rel=1e-5)


# ---------------------------------------------------------------------------------------------
# The training forward
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode, seqlen", [("dense", 16), ("sparse", 40)])
@pytest.mark.parametrize("chunk_bytes", [6_000, 1 << 30])
def test_training_forward_equals_the_reference_forward(mode, seqlen, chunk_bytes):
    """Dense (S <= top-k, where the reference attends to every key) and sparse (top-k 16 of 40),
    in many chunks or one: the logits of the reference model."""
    model = tie_free_model(micro_config())
    ids = token_ids(2, seqlen)
    dense = set(range(model.cfg.num_hidden_layers)) if mode == "dense" else set()
    attention = TrainingAttention(model, dense, set(), chunk_bytes)
    with torch.no_grad():
        ref = model(ids)
        with attention.installed(model):
            ours = model.compute_logits(model.hidden_states(ids))
    assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_fp8_selection_in_training_is_the_fp8_indexer_of_inference():
    """select_fp8 (`megactx train --select-fp8`): the training forward selects as the reference does
    with its FP8-simulated indexer (what the engine's FP8 indexer cache computes), not as with the
    exact one."""
    model = tie_free_model(micro_config())
    ids = token_ids(2, 40)  # top-k 16 of 40: selection matters
    outs = {}
    for fp8 in (False, True):
        attention = TrainingAttention(model, set(), set(), 6_000, select_fp8=fp8)
        with torch.no_grad(), attention.installed(model):
            outs[fp8] = model.compute_logits(model.hidden_states(ids))
    try:
        model.set_attention(indexer_fp8=True)
        with torch.no_grad():
            ref = model(ids)
    finally:
        model.set_attention(indexer_fp8=False)
    assert (outs[True] - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert (outs[False] - ref).abs().max() > 1e-3 * ref.abs().max(), "FP8 selected the exact keys: no test"


def _reference_attention(attn, x, cos, sin, positions, topk):
    """The reference layer's attention probabilities at its top-k slots: [B, H, S, K]."""
    from megactx.model.attention import causal_mask, topk_mask

    _, q_nope, q_pe = attn.project_q(x, cos, sin)
    c, k_pe = attn.project_kv(x, cos, sin)
    B, S, H, _ = q_nope.shape
    k_nope, _ = attn.kv_b_proj(c).view(B, S, H, -1).split([attn.dn, attn.dv], dim=-1)
    scores = (torch.einsum("bshd,bthd->bhst", q_nope, k_nope) + torch.einsum("bshd,btd->bhst", q_pe, k_pe))
    allowed = causal_mask(positions, S) & topk_mask(topk, S)
    probs = (scores * attn.softmax_scale).masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
    return probs.gather(-1, topk.clamp(min=0)[:, None].expand(-1, H, -1, -1)) * (topk >= 0)[:, None]


def _attention_calls(model, ids) -> dict[int, tuple[tuple, torch.Tensor]]:
    """layer -> (the arguments of its attention module's call, the top-k it returned) in model(ids)."""
    seen = {}
    hooks = [layer.self_attn.register_forward_hook(lambda m, args, out, i=i: seen.__setitem__(i, (args, out[1])))
             for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return seen


@torch.no_grad()
def _indexer_scores(attn, x, cos, sin) -> torch.Tensor:
    """The full layer `attn`'s exact indexer scores [B, S, S] for its input x."""
    q_resid, _, _ = attn.project_q(x, cos, sin)
    q, w = attn.indexer.queries(x, q_resid, cos, sin)
    return attn.indexer.scores(q, w, attn.indexer.keys(x, cos, sin))


@pytest.mark.parametrize("attention,seqlen", [("sparse", 40), ("dense", 16)])
def test_each_full_indexer_learns_the_mean_attention_of_the_layers_it_serves(attention, seqlen):
    """IndexShare pattern FSFS: layer 0's indexer learns layers 0 and 1, layer 2's layers 2 and 3,
    over its selection (sparse: 40 tokens, top-k 16) or over every causal key (the dense warm-up;
    16 tokens, so that the reference forward's top-k is every causal key too). The training
    forward's KL equals the formula on the reference model's own attention."""
    model = tie_free_model(micro_config())
    cfg = model.cfg
    assert cfg.indexer_types == ["full", "shared", "full", "shared"]
    assert (seqlen <= cfg.index_topk) == (attention == "dense")
    ids = token_ids(2, seqlen)
    seen = _attention_calls(model, ids)

    expected = []
    for full in cfg.full_layers:
        served = [i for i in range(cfg.num_hidden_layers) if cfg.topk_source(i) == full]
        with torch.no_grad():
            probs = [_reference_attention(model.model.layers[i].self_attn, *seen[i][0][:4], seen[i][1])
                     for i in served]
            topk = seen[full][1]
            index_at = _indexer_scores(model.model.layers[full].self_attn, *seen[full][0][:3]).gather(
                -1, topk.clamp(min=0))
        expected.append(multi_layer_distillation_loss(probs, index_at, topk >= 0))

    objective = Objective(model, LossConfig(lm=False, attention=attention, indexers="backbone", chunk_bytes=8_000))
    _, metrics = objective(ids)
    assert metrics["indexer_kl"].item() == pytest.approx(torch.stack(expected).mean().item(), rel=1e-4)


def test_kl_candidates_widen_the_indexer_kl_but_not_the_attention():
    """kl_candidates C > K: each full layer's KL spans the top-C keys by its indexer's score, against
    the attention its served layers would have there; the layers still attend to the top-K, so the
    model's outputs do not move, and a key ranked just outside the top-K gets an indexer gradient."""
    from megactx.model.attention import causal_mask, select_topk

    model = tie_free_model(micro_config())
    cfg, C = model.cfg, 24
    ids = token_ids(2, 40)  # top-k 16, 24 candidates of up to 40 keys
    seen = {i: args for i, (args, _) in _attention_calls(model, ids).items()}

    expected = []
    for full in cfg.full_layers:
        scores = _indexer_scores(model.model.layers[full].self_attn, *seen[full][:3])
        wide = select_topk(scores.masked_fill(~causal_mask(seen[full][3], 40), float("-inf")), C)  # [B, S, C]
        served = [i for i in range(cfg.num_hidden_layers) if cfg.topk_source(i) == full]
        with torch.no_grad():
            probs = [_reference_attention(model.model.layers[i].self_attn, *seen[i][:4], wide) for i in served]
        expected.append(multi_layer_distillation_loss(probs, scores.gather(-1, wide.clamp(min=0)), wide >= 0))

    outs = {}
    for candidates in (0, C):
        objective = Objective(model, LossConfig(lm=True, attention="sparse", indexers="backbone", chunk_bytes=8_000,
                                                kl_candidates=candidates))
        model.zero_grad()
        loss, outs[candidates] = objective(ids)
        loss.backward()
        outs[candidates]["grad"] = model.model.layers[0].self_attn.indexer.wk.weight.grad.clone()
    assert outs[C]["indexer_kl"].item() == pytest.approx(torch.stack(expected).mean().item(), rel=1e-4)
    assert outs[C]["lm"].item() == pytest.approx(outs[0]["lm"].item(), rel=1e-6)
    assert outs[C]["indexer_kl"].item() != pytest.approx(outs[0]["indexer_kl"].item(), rel=1e-3)
    assert not torch.allclose(outs[C]["grad"], outs[0]["grad"])


def test_compiled_blocks_train_as_eager():
    """--compile (trainer.compile_blocks): the compiled MLP / MoE blocks and attention projections
    give the eager loss and gradients (sparse attention with its indexer KL and the MTP objective on
    top), and the expert balancer's load counts (a hook the compiled router calls)."""
    from megactx.train.trainer import ExpertBalancer, compile_blocks

    cfg = micro_config(index_share_for_mtp_iteration=True)
    ids = token_ids(2, 40)
    runs = []
    for compiled in (False, True):
        model = tie_free_model(cfg)  # no ties among the router's expert scores
        if compiled:
            compile_blocks(model)
        balancer = ExpertBalancer(model, speed=1e-3)
        objective = Objective(model, LossConfig(attention="sparse", indexers="backbone", mtp_steps=2,
                                                chunk_bytes=8_000))
        loss, metrics = objective(ids)
        loss.backward()
        runs.append((metrics, {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
                     [load.tolist() for load in balancer.loads.values()]))
    (eager, g_eager, loads), (comp, g_comp, comp_loads) = runs
    assert comp_loads == loads and sum(map(sum, loads)) > 0
    for name in eager:
        assert comp[name].item() == pytest.approx(eager[name].item(), rel=1e-5), name
    assert g_eager.keys() == g_comp.keys()
    for name, grad in g_eager.items():
        torch.testing.assert_close(g_comp[name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item(),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_gather_rows_and_its_gradient_are_advanced_indexings():
    """The sparse layers' row gather: the forward reads t[b, idx[b, q, k]], and the backward sums
    the gradient of every read of a row into that row, repeats included."""
    g = torch.Generator().manual_seed(0)
    t = torch.randn(2, 9, 3, 4, generator=g, requires_grad=True)
    idx = torch.randint(0, 9, (2, 5, 6), generator=g)  # repeats: 60 reads of 18 rows
    grad_out = torch.randn(2, 5, 6, 3, 4, generator=g)
    out = _gather_rows(t, idx)
    (grad,) = torch.autograd.grad(out, t, grad_out)
    ref_t = t.detach().clone().requires_grad_()
    ref = ref_t[torch.arange(2)[:, None, None], idx]
    (ref_grad,) = torch.autograd.grad(ref, ref_t, grad_out)
    assert torch.equal(out, ref)
    torch.testing.assert_close(grad, ref_grad)
    with torch.no_grad():
        assert torch.equal(_gather_rows(t, idx), ref)


def test_mtp_training_steps_are_the_inference_drafts_under_indexshare_and_kvshare():
    """Teacher-forced on the tokens `draft` itself chose, training step j at the last context row
    gives the logits that `mtp.draft` (the inference semantics) gives for draft j: same top-k
    reuse, same step-1 KV, same rope positions."""
    gamma = 4
    model = tie_free_model(micro_config(index_share_for_mtp_iteration=True))
    prefix = token_ids(2, 30, seed=5)
    with torch.no_grad():
        drafts = draft(model, prefix, gamma)
        ids = torch.cat([prefix, drafts.next_token[:, None], drafts.tokens[:, : gamma - 1]], dim=1)
        attention = TrainingAttention(model, set(), set(), chunk_bytes=6_000)
        with attention.installed(model):
            hidden = model.hidden_states(ids)
            outs = mtp_hidden(model, ids, hidden, gamma, share=True)
        norm = model.mtp[0].shared_head.norm
        ours = torch.stack([model.compute_logits(norm(g[:, prefix.shape[1] - 1])) for g in outs], dim=1)
    assert (ours - drafts.logits).abs().max() <= 1e-4 * drafts.logits.abs().max()


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}


def test_warmup_stage_trains_only_the_indexers():
    model, objective = stage_setup("warmup")
    assert model.cfg.indexer_types == ["full", "shared", "full", "shared"]  # IndexShare from the warm-up on
    loss, metrics = objective(token_ids(2, 40))
    assert set(metrics) == {"indexer_kl", "loss"}
    loss.backward()
    grads = _grads(model)
    indexer_params = {n for n, _ in model.named_parameters() if ".indexer." in n and not n.startswith("mtp.")}
    assert set(grads) == indexer_params


def test_sparse_stage_detaches_the_indexer_inputs():
    """The KL reaches only the indexers; the LM loss reaches everything but the indexers."""
    model, _ = stage_setup("sparse")
    recipe = smoke_recipe()
    indexer_params = {n for n, _ in model.named_parameters() if ".indexer." in n and not n.startswith("mtp.")}
    assert {n.split(".self_attn")[0] for n in indexer_params} == {"model.layers.0", "model.layers.2"}

    kl_only = Objective(model, LossConfig(lm=False, attention="sparse", indexers="backbone",
                                          chunk_bytes=recipe.chunk_bytes))
    kl_only(token_ids(2, 40))[0].backward()
    assert set(_grads(model)) == indexer_params
    model.zero_grad(set_to_none=True)

    lm_only = Objective(model, dataclass_replace(loss_config(recipe, "sparse"), indexer_weight=0.0))
    loss, metrics = lm_only(token_ids(2, 40))
    assert metrics["indexer_kl"] > 0
    loss.backward()
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not set(_grads(model)) & indexer_params
    assert {n for n in trained - indexer_params if "mlp.experts" not in n} <= set(_grads(model))


def dataclass_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


def test_mtp_stage_trains_only_the_mtp_layer_with_its_indexer():
    model, objective = stage_setup("mtp")
    assert model.cfg.index_share_for_mtp_iteration  # the checkpoint drafts as it was trained
    loss, metrics = objective(token_ids(2, 40))
    assert {"mtp_ce", "mtp_accept", "indexer_kl"} <= set(metrics)
    assert 0 <= metrics["mtp_accept"] <= objective.cfg.mtp_steps
    loss.backward()
    grads = _grads(model)
    assert grads and all(n.startswith("mtp.0.") for n in grads)
    assert any(".indexer." in n for n in grads)


@pytest.mark.parametrize("mtp_loss", ["ce", "tv", "ce+tv"])
def test_mtp_terms_in_anchor_chunks_equal_the_formulas_on_the_stacked_logits(mtp_loss):
    """The MTP stage's heads run over anchor-row chunks (never the [B·A, γ, V] logits): its terms,
    acceptance metric and gradients equal mtp_cross_entropy / tv_loss on the stacked logits."""
    model, objective = stage_setup("mtp")
    B, S, V = 2, 41, model.cfg.vocab_size
    rows, gamma = 5, objective.cfg.mtp_steps
    cfg = dataclass_replace(objective.cfg, indexers="none", mtp_loss=mtp_loss,
                            chunk_bytes=rows * B * gamma * V * 24 + 7)  # 5 anchors a chunk
    objective = Objective(model, cfg)
    anchors = S - gamma - 1
    assert anchors % rows and anchors > 2 * rows  # several chunks, the last one short
    ids = token_ids(B, S, seed=3)
    params = [p for p in model.parameters() if p.requires_grad]

    loss, metrics = objective(ids)
    grads = torch.autograd.grad(loss, params, allow_unused=True)

    with objective.attention.installed(model):
        with torch.no_grad():
            hidden = model.hidden_states(ids)
            target = model.compute_logits(hidden)
        outs = mtp_hidden(model, ids, hidden, gamma, cfg.mtp_share)
        objective.attention.finish()
    norm = model.mtp[0].shared_head.norm
    drafts = torch.stack([model.compute_logits(norm(g[:, :anchors])) for g in outs], dim=2).flatten(0, 1)
    targets = torch.stack([target[:, j : j + anchors] for j in range(1, gamma + 1)], dim=2).flatten(0, 1)
    labels = torch.stack([ids[:, j + 1 : j + 1 + anchors] for j in range(1, gamma + 1)], dim=2).flatten(0, 1)
    ref_terms = {}
    if "ce" in mtp_loss:
        ref_terms["mtp_ce"] = mtp_cross_entropy(drafts, labels)
    if "tv" in mtp_loss:
        ref_terms["mtp_tv"] = tv_loss(targets, drafts)
    ref_grads = torch.autograd.grad(sum(ref_terms.values()), params, allow_unused=True)

    assert set(ref_terms) <= set(metrics)
    for name, value in ref_terms.items():
        assert metrics[name].item() == pytest.approx(value.item(), rel=1e-5)
    alpha = 1 - 0.5 * (targets.softmax(-1) - drafts.detach().softmax(-1)).abs().sum(-1)
    assert metrics["mtp_accept"].item() == pytest.approx(expected_accept_length(alpha).mean().item(), rel=1e-5)
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
    for g, ref in zip(grads, ref_grads, strict=True):
        if ref is None:
            assert g is None or not g.any()
        else:
            torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-6)


def test_indexshare_conversion_keeps_the_full_layers_indexers_and_drops_the_others():
    recipe = smoke_recipe()
    every = build_model(stage_model_config(recipe, stage_index("dense")), seed=0)
    shared = adapt_model(every, stage_model_config(recipe, stage_index("warmup")))
    assert [layer.self_attn.indexer is not None for layer in shared.model.layers] == [True, False, True, False]
    before = every.state_dict()
    for name, t in shared.state_dict().items():
        assert torch.equal(t, before[name]), name
    with pytest.raises(ValueError, match="turns full"):
        adapt_model(shared, every.cfg)


def test_a_warmup_gives_the_layers_that_turn_full_new_indexers():
    """An indexer in every layer of an IndexShare model (`--attention dsa --init`): the layers that
    turn full get seeded new indexers, every other tensor is the model's."""
    recipe = smoke_recipe()
    shared = adapt_model(build_model(stage_model_config(recipe, stage_index("dense")), seed=0),
                         stage_model_config(recipe, stage_index("warmup")))
    every_cfg = shared.cfg.replace(index_topk_pattern="F" * shared.cfg.num_hidden_layers)
    every = adapt_model(shared, every_cfg, fresh_indexers=True, seed=3)
    assert all(layer.self_attn.indexer is not None for layer in every.model.layers)
    kept = shared.state_dict()
    new = [name for name in every.state_dict() if name not in kept]
    assert new and all(".layers.1." in name or ".layers.3." in name for name in new)
    for name, t in every.state_dict().items():
        if name in kept:
            assert torch.equal(t, kept[name]), name
        elif t.dim() == 2:  # a projection: random, and the seed's
            assert t.std() > 0.01
            assert torch.equal(t, adapt_model(shared, every_cfg, fresh_indexers=True, seed=3).state_dict()[name])


def test_the_yarn_stage_stretches_the_rotary_positions_from_there_on():
    recipe = smoke_recipe()  # extend: rows of 96 after 48, yarn on
    assert stage_model_config(recipe, stage_index("sparse")).rope_parameters["rope_type"] == "default"
    for kind in ("extend", "mtp"):  # the MTP stages train the model the extend stage left
        rope = stage_model_config(recipe, stage_index(kind)).rope_parameters
        assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 2.0, 48)
    sparse = build_model(stage_model_config(recipe, stage_index("sparse")), seed=0)
    extend = adapt_model(sparse, stage_model_config(recipe, stage_index("extend")))
    ids = token_ids(1, 40)
    with torch.no_grad():  # same weights, other positions: a different function of the same text
        assert not torch.allclose(sparse(ids), extend(ids))
    with pytest.raises(ValueError, match="yarn"):
        dataclass_replace(recipe, stages=[dataclass_replace(recipe.stages[0], yarn=True), *recipe.stages[1:]])


def test_a_yarn_factor_gives_the_extended_stages_position_headroom():
    recipe = dataclass_replace(smoke_recipe(), yarn_factor=4.0)  # rows of 96 after 48, positions for 192
    assert stage_model_config(recipe, stage_index("sparse")).rope_parameters["rope_type"] == "default"
    for kind in ("extend", "indexers", "mtp"):
        rope = stage_model_config(recipe, stage_index(kind)).rope_parameters
        assert (rope["factor"], rope["original_max_position_embeddings"]) == (4.0, 48)
    with pytest.raises(ValueError, match="at least the stretch of the yarn stages' rows, 2"):
        dataclass_replace(recipe, yarn_factor=1.5)  # would leave trained rows past the stretched positions
    with pytest.raises(ValueError, match="needs a stage with yarn on"):
        dataclass_replace(recipe, stages=[dataclass_replace(s, yarn=False) for s in recipe.stages])


def test_yarn_headroom_scales_the_stretch_of_the_extended_rows():
    from megactx.cli import build_parser
    from megactx.train.cli import build_recipe
    from megactx.train.recipe import tiny_recipe

    recipe = dataclass_replace(smoke_recipe(), yarn_headroom=2.0)  # rows of 96 after 48: factor 2 x 2
    assert stage_model_config(recipe, stage_index("extend")).rope_parameters["factor"] == 4.0
    with pytest.raises(ValueError, match="yarn_headroom must be at least 1"):
        dataclass_replace(recipe, yarn_headroom=0.5)

    def factor(*argv):
        recipe = build_recipe(build_parser().parse_args(["train", "--recipe", "tiny", *argv]))
        return stage_model_config(recipe, recipe.stage_index("extend")).rope_parameters["factor"]

    # megactx-tiny trains its 64K rows at positions for 128K, and a longer --context keeps the headroom
    assert tiny_recipe().yarn_headroom == 2.0 and factor() == 32.0
    assert factor("--context", "262144") == 128.0 and factor("--yarn-factor", "20") == 20.0


def test_init_accepts_a_model_whose_yarn_this_stage_stretches_further():
    from megactx.train.recipe import further_stretch

    rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    assert further_stretch(rope, rope | {"factor": 32.0})
    assert not further_stretch(rope, rope)  # equal: matched as it is, not stretched
    assert not further_stretch(rope | {"factor": 32.0}, rope)  # a shorter stretch
    assert not further_stretch(rope, rope | {"factor": 32.0, "original_max_position_embeddings": 2048})
    assert not further_stretch({"rope_type": "default", "rope_theta": 1e6}, rope)  # not this rule: a whole run's


# ---------------------------------------------------------------------------------------------
# Trainer mechanics
# ---------------------------------------------------------------------------------------------
def test_lr_schedule_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    factors = [lr_factor(s, warmup_steps=4, total_steps=14, min_ratio=0.1) for s in range(15)]
    assert factors[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert factors[4] == pytest.approx(1.0)
    assert factors[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert factors[14] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[3:], factors[4:]))


def test_expert_bias_moves_toward_the_underloaded_experts():
    model = build_model(micro_config(), seed=0)
    router = next(m for m in model.modules() if isinstance(m, Router))
    balancer = ExpertBalancer(model, speed=0.01)
    flat = torch.randn(64, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0)).abs()
    with torch.no_grad():
        router.weight[0] += 1.0  # expert 0 takes most tokens
        _, ids = router(flat)
    load = torch.bincount(ids.flatten(), minlength=router.n_experts).float()
    before = router.e_score_correction_bias.clone()
    balancer.update()
    balancer.close()
    expected = 0.01 * torch.sign(load.mean() - load)
    torch.testing.assert_close(router.e_score_correction_bias - before, expected)
    assert expected[0] < 0


class SameBatch:
    """A TokenSource that repeats one batch: a working loss, backward and optimizer memorise it."""

    def examples(self, start: int, count: int, seq_len: int) -> dict[str, torch.Tensor]:
        return RandomTokens(VOCAB, copy=False).examples(0, count, seq_len)


def test_sparse_stage_training_memorises_a_repeated_batch(tmp_path):
    _, objective = stage_setup("sparse")
    cfg = TrainConfig(steps=24, seq_len=48, global_batch=4, micro_batch=4, lr=1e-2, warmup_steps=2)
    history = Trainer(objective, SameBatch(), cfg, tmp_path, ctx=init_distributed("cpu"), progress=False).fit().history
    assert history[0]["loss"] == pytest.approx(math.log(VOCAB), rel=0.02)  # uniform predictions at init
    assert history[-1]["loss"] < 0.3 * history[0]["loss"]


def small_trainer(out_dir, steps: int = 4, kind: str = "sparse", ctx=None, parallel: str = "auto",
                  micro_batch: int = 2, save_every: int = 0, data_workers: int | None = None) -> Trainer:
    _, objective = stage_setup(kind)
    cfg = TrainConfig(steps=steps, seq_len=40, global_batch=4, micro_batch=micro_batch, lr=3e-3, warmup_steps=1,
                      parallel=parallel, save_every=save_every, data_workers=data_workers)
    # on the CPU even where there is a GPU: exact comparisons need its deterministic kernels
    return Trainer(objective, RandomTokens(VOCAB), cfg, out_dir, ctx=ctx or init_distributed("cpu"), progress=False)


def _trajectory(history):
    """step, loss and lr of every row, flat (timings are not compared)."""
    return [value for row in history for value in (row["step"], row["loss"], row["lr"])]


def test_resume_continues_the_uninterrupted_loss_trajectory(tmp_path):
    """Also with the batches built ahead by a DataLoader worker (the split run): the same batches."""
    whole = small_trainer(tmp_path / "whole", data_workers=0).fit()
    first = small_trainer(tmp_path / "split", data_workers=1).fit(max_steps=2)
    assert first.step == 2 and not first.finished
    # a new process: fresh weights, replaced by the checkpoint
    resumed = small_trainer(tmp_path / "split", data_workers=1)
    assert resumed.step == 2
    rest = resumed.fit()
    assert rest.finished
    assert _trajectory(rest.history) == pytest.approx(_trajectory(whole.history), rel=1e-6)
    for name, t in load_model(whole.checkpoint).state_dict().items():
        torch.testing.assert_close(load_model(rest.checkpoint).state_dict()[name], t, rtol=1e-6, atol=1e-7)
    lines = (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]
    assert (tmp_path / "split" / "loss.png").stat().st_size > 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# (wrapper, stage): FSDP2 on the sparse stage (IndexShare, distillation, MoE bias) and on the MTP
# stage (one layer run γ times, frozen backbone), DDP on the warm-up (only the indexers train)
GLOO_CASES = [("fsdp", "sparse"), ("fsdp", "mtp"), ("ddp", "warmup")]


def _gloo_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    ctx = init_distributed("cpu")
    try:
        for parallel, kind in GLOO_CASES:
            small_trainer(f"{out_dir}/{parallel}-{kind}", steps=3, kind=kind, ctx=ctx, parallel=parallel).fit()
    finally:
        torch.distributed.destroy_process_group()


def test_two_gloo_processes_match_one_process_on_the_same_global_batch(tmp_path):
    """Rank r's micro-batch is the single process's micro-step r: the losses and the weights after
    three optimizer steps agree up to the order of floating-point sums."""
    import torch.multiprocessing as mp

    mp.spawn(_gloo_worker, args=(2, _free_port(), str(tmp_path / "two")), nprocs=2)
    for parallel, kind in GLOO_CASES:
        one = small_trainer(tmp_path / "one" / kind, steps=3, kind=kind).fit()  # 2 micro-steps of 2
        rows = (tmp_path / "two" / f"{parallel}-{kind}" / "metrics.jsonl").read_text().splitlines()
        two = [json.loads(line) for line in rows]
        assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one.history], rel=1e-5), kind
        theirs = load_model(tmp_path / "two" / f"{parallel}-{kind}" / "checkpoint").state_dict()
        for name, t in load_model(one.checkpoint).state_dict().items():
            torch.testing.assert_close(theirs[name], t, rtol=1e-4, atol=1e-5, msg=name)  # vs updates ~lr = 3e-3


def test_code_source_feeds_packed_code_and_needle_tasks(tmp_path):
    from megactx.train.corpus import Corpus
    from megactx.train.data import prepare_data
    from megactx.train.recipe import CodeSource

    stdlib = Corpus.from_stdlib()
    files = [f.path for f in stdlib.split("held_out")[:2]] + [f.path for f in stdlib.split("train")[::80]]
    small = stdlib.subset(files)
    data = prepare_data(tmp_path, corpus=small, vocab_size=320)
    source = CodeSource(data, seed=0, needle_fraction=0.5)
    batch = source.examples(0, 4, 600)
    assert batch["input_ids"].shape == (4, 600) and batch["loss_mask"].shape == (4, 599)
    assert torch.equal(source.examples(0, 4, 600)["input_ids"], batch["input_ids"])
    needle, code = batch["loss_mask"][0], batch["loss_mask"][1]  # example 0 is a needle task, 1 is code
    assert code.all() and 0 < needle.sum() < 20 and needle[-1]
    assert batch["needle_rows"].tolist() == [True, False, True, False]
    model = build_model(micro_config(vocab_size=320), seed=0)
    ids, mask = batch["input_ids"][:, -64:], batch["loss_mask"][:, -63:]  # the needle rows' answers are at the end
    objective = Objective(model, LossConfig(needle_weight=0.5))
    loss, metrics = objective(ids, mask, batch["needle_rows"])
    # the needle rows' loss is weighed apart from the code rows': each is its own rows' mean
    _, code = objective(ids[1::2], mask[1::2])
    _, needles = objective(ids[0::2], mask[0::2])
    torch.testing.assert_close(metrics["lm"], code["lm"])
    torch.testing.assert_close(metrics["needle"], needles["lm"])
    torch.testing.assert_close(loss, code["lm"] + 0.5 * needles["lm"])
    # a batch without needle rows (or without code rows) reports that term as NaN, adds nothing
    loss, metrics = objective(ids[1::2], mask[1::2], batch["needle_rows"][1::2])
    assert metrics["needle"].isnan() and loss == metrics["lm"] == code["lm"]
    # the indexer KL over the needle answers alone (indexer_needle_weight), a term beside its mean
    # over every query; NaN and nothing added in a batch without needle rows
    weighed = Objective(model, LossConfig(attention="sparse", indexers="backbone", indexer_needle_weight=2.0))
    loss, metrics = weighed(ids, mask, batch["needle_rows"])
    assert metrics["indexer_kl_needle"].isfinite() and metrics["indexer_kl_needle"] != metrics["indexer_kl"]
    torch.testing.assert_close(loss, metrics["lm"] + metrics["needle"] + metrics["indexer_kl"]
                               + 2.0 * metrics["indexer_kl_needle"])
    loss, metrics = weighed(ids[1::2], mask[1::2], batch["needle_rows"][1::2])
    assert metrics["indexer_kl_needle"].isnan()
    torch.testing.assert_close(loss, metrics["lm"] + metrics["indexer_kl"])
    # the same term in the dense warm-up's KL (every key the target), the answers' mean apart
    warmup = Objective(model, LossConfig(lm=False, attention="dense", indexers="backbone", indexer_needle_weight=2.0))
    loss, metrics = warmup(ids, mask, batch["needle_rows"])
    assert metrics["indexer_kl_needle"].isfinite() and metrics["indexer_kl_needle"] != metrics["indexer_kl"]
    torch.testing.assert_close(loss, metrics["indexer_kl"] + 2.0 * metrics["indexer_kl_needle"])

    # the trainer means each metric over the micro-batches that had it: steps of one needle row and
    # one code row (micro-batches of 1) report each row's own loss, not half of it
    class Rows:
        def examples(self, start: int, count: int, seq_len: int) -> dict[str, torch.Tensor]:
            rows = slice(start % 2, start % 2 + count)
            return {"input_ids": ids[rows], "loss_mask": mask[rows], "needle_rows": batch["needle_rows"][rows]}

    cfg = TrainConfig(steps=1, seq_len=64, global_batch=2, micro_batch=1, lr=0.0)
    row = Trainer(objective, Rows(), cfg, tmp_path / "rows", ctx=init_distributed("cpu"), progress=False).train_step()
    assert row["needle"] == pytest.approx(float(objective(ids[0:1], mask[0:1])[1]["lm"]), rel=2e-3)  # train mode
    assert row["lm"] == pytest.approx(float(objective(ids[1:2], mask[1:2])[1]["lm"]), rel=2e-3)

    # copy rows: every other code row ends with code of its own repeated, scored on the repeat;
    # copy rows alternate: the first half twice, then a window of 150 of the 600 tokens from a
    # start drawn per row
    mixed = CodeSource(data, seed=0, needle_fraction=0.5, copy_fraction=0.5)
    batch = mixed.examples(0, 32, 600)
    assert batch["needle_rows"].tolist() == [True, False] * 16
    assert batch["copy_rows"].tolist() == [False, True, False, False] * 8
    starts = set()
    for k, n in enumerate(range(1, 32, 4)):
        ids, mask = batch["input_ids"][n], batch["loss_mask"][n]
        code = source.examples(n, 1, 600)["input_ids"][0]  # the same code row, plain
        w = 300 if k % 2 == 0 else 150
        assert torch.equal(ids[: 600 - w], code[: 600 - w])
        a = next(a for a in range(600 - 2 * w + 1) if torch.equal(ids[600 - w :], code[a : a + w]))
        if k % 2:
            starts.add(a)
        else:
            assert a == 0
        assert not mask[: 600 - w].any() and mask[600 - w :].all()  # from the repeat's second token on
    assert len(starts) > 1  # the windows' distance back varies: no fixed-offset head predicts them
    assert torch.equal(mixed.examples(0, 32, 600)["input_ids"], batch["input_ids"])  # deterministic
    halves = CodeSource(data, seed=0, needle_fraction=0.5, copy_fraction=0.5, copy_forms=("half",)).examples(0, 32, 600)
    for n in range(1, 32, 4):  # one form: every copy row repeats its first half
        assert torch.equal(halves["input_ids"][n, 300:], halves["input_ids"][n, :300])
    with pytest.raises(ValueError, match="copy_forms"):
        dataclass_replace(smoke_recipe(), copy_forms=("halves",))
    objective = Objective(model, LossConfig(copy_weight=2.0))
    loss, metrics = objective(batch["input_ids"][:4, -64:], batch["loss_mask"][:4, -63:], batch["needle_rows"][:4],
                              batch["copy_rows"][:4])
    _, alone = objective(batch["input_ids"][1:2, -64:], batch["loss_mask"][1:2, -63:])
    torch.testing.assert_close(metrics["copy"], alone["lm"])
    torch.testing.assert_close(loss, metrics["lm"] + metrics["needle"] + 2.0 * metrics["copy"])

    packed = CodeSource(data, seed=0, needle_fraction=1.0, needle_len=400)
    row = packed.examples(0, 1, 1200)
    ids, mask = row["input_ids"][0], row["loss_mask"][0]
    tasks = [packed._needle_task(i, 400) for i in range(3)]  # row 0 packs tasks 0, 1, 2
    assert torch.equal(ids, torch.cat([t["input_ids"] for t in tasks]))
    assert mask.sum() == sum(int(t["loss_mask"].sum()) for t in tasks)
    assert not mask[[399, 799]].any()  # no target across a task boundary
    assert mask[398] and mask[798] and mask[-1]  # every task ends with its scored answer
    # lengths cycled by needle row: one task across the row, then three of 400 tokens, then again
    cycled = CodeSource(data, seed=0, needle_fraction=1.0, needle_len=(1200, 400))
    rows = cycled.examples(0, 3, 1200)
    assert torch.equal(rows["input_ids"][0], cycled._needle_task(0, 1200)["input_ids"])
    assert torch.equal(rows["input_ids"][1], torch.cat([cycled._needle_task(i, 400)["input_ids"] for i in (3, 4, 5)]))
    assert rows["loss_mask"][1].sum() == sum(int(cycled._needle_task(i, 400)["loss_mask"].sum()) for i in (3, 4, 5))
    assert torch.equal(rows["input_ids"][2], cycled._needle_task(6, 1200)["input_ids"])
    with pytest.raises(ValueError, match="needle_len"):
        Stage("dense", TrainConfig(steps=1, seq_len=64, global_batch=1, micro_batch=1), needle_len=(512, 0))


# ---------------------------------------------------------------------------------------------
# The smoke recipe, end to end through the command line
# ---------------------------------------------------------------------------------------------
def test_smoke_recipe_runs_every_stage_and_its_checkpoints_load(tmp_path, capsys):
    from megactx.cli import main

    out = tmp_path / "run"
    assert main(["train", "--smoke", "--out", str(out), "--no-progress", "--export", str(tmp_path / "model")]) == 0
    recipe = smoke_recipe()
    names = [recipe.stage_name(i) for i in range(len(recipe.stages))]
    assert names == ["dense", "warmup", "sparse", "extend", "indexers", "mtp-warmup-ce-share", "mtp-ce-share"]
    for name in names:
        rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        assert all(math.isfinite(r["loss"]) for r in rows)
        assert (out / name / "loss.png").exists()

    final = load_model(tmp_path / "model")
    assert final.cfg.indexer_types == ["full", "shared", "full", "shared"]
    assert final.cfg.index_share_for_mtp_iteration and len(final.mtp) == 1
    assert final.cfg.max_position_embeddings >= max(s.train.seq_len for s in recipe.stages)
    assert draft(final, token_ids(1, 20), 7).tokens.shape == (1, 7)
    every = load_model(out / "dense" / "checkpoint")
    assert all(layer.self_attn.indexer is not None for layer in every.model.layers)
    assert load_model(out / "warmup" / "checkpoint").cfg.indexer_types == final.cfg.indexer_types
    extended, indexed = (load_model(out / name / "checkpoint").state_dict() for name in ("extend", "indexers"))
    moved = {name for name in extended if not torch.equal(extended[name], indexed[name])}
    assert moved and all(".indexer." in name for name in moved)  # the indexers stage trains them alone

    transformers = pytest.importorskip("transformers")
    theirs = transformers.GlmMoeDsaForCausalLM.from_pretrained(out / "mtp-ce-share" / "checkpoint",
                                                               attn_implementation="eager").float().eval()
    ours = load_model(out / "mtp-ce-share" / "checkpoint")
    ids = token_ids(2, 16)  # <= top-k: both attend to every key
    with torch.no_grad():
        assert (theirs(ids).logits - ours(ids)).abs().max() <= 1e-4

    capsys.readouterr()
    assert main(["train", "--smoke", "--out", str(out), "--no-progress"]) == 0  # all finished: nothing reruns
    assert capsys.readouterr().out.count("skipped") == len(names)

    # more steps of one stage on a finished model (--init): it starts from that model's weights, notes
    # them, and refuses to be resumed from other ones
    more = tmp_path / "more"
    assert main(["train", "--smoke", "--out", str(more), "--no-progress", "--stages", "extend",
                 "--init", str(tmp_path / "model")]) == 0
    noted = json.loads((more / "extend" / "init.json").read_text())
    assert noted["init"] == str(tmp_path / "model") and len(noted["weights_sha256"]) == 64
    extended, shipped = load_model(more / "extend" / "checkpoint").state_dict(), final.state_dict()
    assert all(torch.equal(t, shipped[n]) for n, t in extended.items() if n.startswith("mtp."))  # frozen in extend
    assert any(not torch.equal(t, shipped[n]) for n, t in extended.items() if not n.startswith("mtp."))
    # ...and an MTP warm-up started from the shipped model starts from the recipe's seeded MTP layer,
    # as in a whole run (where no backbone stage trains that layer), not from the model's trained one
    seeded = {n: t for n, t in build_model(stage_model_config(recipe, 0), seed=recipe.seed).state_dict().items()
              if n.startswith("mtp.")}
    assert all(torch.equal(t, seeded[n]) for n, t in every.state_dict().items() if n.startswith("mtp."))
    start = stage_model(recipe, stage_index("mtp_warmup"), more, init=tmp_path / "model").state_dict()
    assert all(torch.equal(start[n], t) for n, t in seeded.items())
    assert any(not torch.equal(shipped[n], t) for n, t in seeded.items())
    assert main(["train", "--smoke", "--out", str(more), "--no-progress", "--stages", "extend",
                 "--max-steps", "1", "--stage-steps", "extend=3"]) == 0  # resumed as it began
    assert main(["train", "--smoke", "--out", str(more), "--no-progress", "--stages", "extend",
                 "--stage-steps", "extend=4", "--init", str(out / "sparse" / "checkpoint")]) == 2
    assert "was started from" in capsys.readouterr().err
    for options in (["--context", "64"], ["--topk", "8"]):  # shorter YaRN positions, another top-k: refused
        assert main(["train", "--smoke", "--out", str(tmp_path / "other"), "--no-progress", "--stages", "extend",
                     "--init", str(tmp_path / "model"), *options]) == 2
        assert "does not match stage extend" in capsys.readouterr().err
    # ...a further YaRN stretch of the same model is trained on, its positions now the larger factor's
    assert main(["train", "--smoke", "--out", str(tmp_path / "stretched"), "--no-progress", "--stages", "extend",
                 "--max-steps", "1", "--yarn-factor", "4", "--init", str(tmp_path / "model")]) == 0
    stretched = load_model(tmp_path / "stretched" / "extend" / "checkpoint").cfg.rope_parameters
    assert stretched == final.cfg.rope_parameters | {"factor": 4.0}
    assert main(["train", "--smoke", "--out", str(tmp_path / "other"), "--no-progress", "--yarn-factor", "1.5"]) == 2
    assert "--yarn-factor: yarn_factor must be at least the stretch" in capsys.readouterr().err
    # ...but a model the stage before would leave is adapted, as in a whole run: `extend` from `sparse`
    assert main(["train", "--smoke", "--out", str(tmp_path / "from-sparse"), "--no-progress", "--stages", "extend",
                 "--max-steps", "1", "--init", str(out / "sparse" / "checkpoint")]) == 0
    extended = load_model(tmp_path / "from-sparse" / "extend" / "checkpoint")
    assert extended.cfg.rope_parameters == final.cfg.rope_parameters

    # the held-out-loss ablations: warm-up and sparse stage with an indexer in every layer, and dense
    # (which has no warm-up: it starts from `dense`)
    for variant in ("dsa", "dense"):
        assert main(["train", "--smoke", "--out", str(out), "--no-progress", "--stages", "warmup,sparse",
                     "--attention", variant]) == 0
        ablation = load_model(out / f"sparse-{variant}" / "checkpoint")
        assert ablation.cfg.indexer_types == ["full"] * 4
        assert ablation.cfg.index_topk == (16 if variant == "dsa" else ablation.cfg.max_position_embeddings)
        trained = {n for n, t in ablation.state_dict().items() if not torch.equal(t, every.state_dict()[n])}
        assert any(".indexer." in n for n in trained) == (variant == "dsa")
        assert any(".indexer." not in n for n in trained)


def test_a_stage_that_has_not_learnt_the_needles_is_named_with_what_to_do():
    """Over the last 10% of steps (NaN: a step without needle rows): a needle loss near chance
    warns, naming the stage's --stage-steps; a learnt one, or a stage without needles, does not."""
    nan = float("nan")
    unlearnt = [{"needle": 2.0}] * 90 + [{"needle": 1.6}, {"needle": nan}] * 5
    warning = retrieval_warning("sparse-dsa", "sparse", unlearnt)
    assert warning and "1.60" in warning and "--stage-steps sparse=N" in warning
    assert retrieval_warning("dense", "dense", [{"needle": 2.0}] * 90 + [{"needle": 0.03}] * 10) is None
    assert retrieval_warning("mtp-tv-share", "mtp", [{"mtp_tv": 0.9}] * 20) is None
    assert retrieval_warning("dense", "dense", []) is None


def test_an_mtp_layer_moves_to_another_model_of_the_same_backbone(tmp_path):
    from safetensors.torch import load_file

    from megactx.model import save_pretrained
    from megactx.train.recipe import export_mtp_layer, with_mtp_layer

    cfg = micro_config()
    source, target = build_model(cfg.replace(index_share_for_mtp_iteration=False), seed=1), build_model(cfg, seed=2)
    save_pretrained(source, tmp_path / "source")
    save_pretrained(target, tmp_path / "target", dtype=torch.bfloat16)
    layer = export_mtp_layer(tmp_path / "source", tmp_path / "mtp.safetensors")
    assert all(name.startswith(f"model.layers.{cfg.num_hidden_layers}.") for name in load_file(layer))
    merged = load_model(with_mtp_layer(tmp_path / "target", layer, tmp_path / "merged"))
    assert merged.cfg.index_share_for_mtp_iteration is False
    theirs, ours = source.state_dict(), load_model(tmp_path / "target").state_dict()
    for name, t in merged.state_dict().items():
        want = theirs[name] if name.startswith("mtp.") else ours[name]
        torch.testing.assert_close(t, want, rtol=1e-2, atol=1e-2, msg=name)  # bf16 in the files
        if not name.startswith("mtp."):
            assert torch.equal(t, ours[name]), name
    other = build_model(cfg.replace(num_hidden_layers=3, index_topk_pattern="FSF"), seed=3)
    save_pretrained(other, tmp_path / "other")
    with pytest.raises(ValueError, match="does not fit"):
        with_mtp_layer(tmp_path / "other", layer, tmp_path / "bad")


# ---------------------------------------------------------------------------------------------
# On the GPU
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_64k_token_sparse_step_of_the_tiny_model_fits_in_memory():
    """Stage 4 (extend) at 64K tokens: one bf16 forward + backward of the tiny preset (IndexShare,
    distillation KL) without any [heads, S, S] tensor: peak memory near the module docstring's
    ~0.2 MB a token (13 GB), far below the 139 GB of an H200."""
    from megactx.train.recipe import tiny_recipe

    recipe = tiny_recipe()
    index = [s.kind for s in recipe.stages].index("extend")
    seq_len = recipe.stages[index].train.seq_len
    assert seq_len >= 65536
    model = build_model(stage_model_config(recipe, index), seed=0)
    set_trainable(model, "extend")
    objective = Objective(model, loss_config(recipe, "extend")).cuda()
    ids = RandomTokens(model.cfg.vocab_size).examples(0, 1, seq_len)["input_ids"].cuda()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, metrics = objective(ids)
    loss.backward()
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(f"64K sparse training step: peak {peak:.1f} GiB, lm {metrics['lm']:.3f}, kl {metrics['indexer_kl']:.4f}")
    assert torch.isfinite(loss)
    assert peak < 40, f"peak {peak:.1f} GiB"
    indexers = [p for n, p in model.named_parameters() if ".indexer." in n and not n.startswith("mtp.")]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in indexers)


@pytest.mark.gpu
def test_gpu_bf16_autocast_loss_tracks_fp32():
    """The trainer's bf16 autocast changes the dense stage's loss by rounding only (dense: no
    top-k boundary that bf16 scores could move)."""
    recipe = smoke_recipe()
    model = tie_free_model(stage_model_config(recipe, stage_index("dense"))).cuda()
    objective = Objective(model, loss_config(recipe, "dense"))
    ids = token_ids(4, 96).cuda()
    with torch.no_grad():
        fp32, _ = objective(ids)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            bf16, _ = objective(ids)
    assert abs(bf16.item() - fp32.item()) <= 0.02 * fp32.item()


def test_train_cli_overrides_reach_the_recipe():
    from megactx.cli import build_parser
    from megactx.train.cli import build_recipe
    from megactx.train.recipe import tiny_recipe

    parse = build_parser().parse_args
    recipe = build_recipe(parse(["train", "--recipe", "tiny", "--topk", "256", "--seed", "3", "--copy-forms", "half"]))
    assert (recipe.model.index_topk, recipe.seed, recipe.copy_forms) == (256, 3, ("half",))
    assert recipe.model.indexer_types == tiny_recipe().model.indexer_types  # the pattern is kept
    assert build_recipe(parse(["train", "--smoke", "--compile"])).compile and not smoke_recipe().compile
    recipe = build_recipe(parse(["train", "--recipe", "tiny", "--chunk-mb", "2048"]))
    assert recipe.chunk_bytes == 2 << 30 and loss_config(recipe, "sparse").chunk_bytes == 2 << 30
    with pytest.raises(ValueError, match="--chunk-mb"):
        build_recipe(parse(["train", "--smoke", "--chunk-mb", "0"]))
    with pytest.raises(ValueError, match="--topk"):
        build_recipe(parse(["train", "--smoke", "--topk", "0"]))
    recipe = build_recipe(parse(["train", "--recipe", "tiny", "--pattern", "FSFSSSSSFSSSSSSF"]))
    assert recipe.model.full_layers == [0, 2, 8, 15] and recipe.model.index_topk == tiny_recipe().model.index_topk
    recipe = build_recipe(parse(["train", "--recipe", "tiny", "--steps-scale", "0.5",
                                 "--stage-steps", "extend=120, mtp=7"]))
    steps = {s.kind: s.train.steps for s in recipe.stages}
    assert (steps["extend"], steps["mtp"], steps["dense"]) == (120, 7, 1500)  # named stages exact, the rest scaled
    for bad in ("extend=0", "extnd=5", "extend"):
        with pytest.raises(ValueError, match="--stage-steps"):
            build_recipe(parse(["train", "--recipe", "tiny", "--stage-steps", bad]))
    with pytest.raises(ValueError, match="--pattern.*16 letters"):
        build_recipe(parse(["train", "--recipe", "tiny", "--pattern", "FSS"]))
    # another depth: the layer schedules follow it, the other fields stay the recipe's
    recipe = build_recipe(parse(["train", "--recipe", "tiny", "--pattern", "FSSSSSSF", "--hf-overrides",
                                 '{"num_hidden_layers": 8, "n_routed_experts": 8, "rope_parameters": {"factor": 8}}']))
    cfg, tiny = recipe.model, tiny_recipe().model
    assert (cfg.num_hidden_layers, cfg.n_routed_experts, cfg.full_layers) == (8, 8, [0, 7])
    assert len(cfg.mlp_layer_types) == 8 and cfg.hidden_size == tiny.hidden_size
    assert cfg.rope_parameters == {**tiny.rope_parameters, "factor": 8}
    with pytest.raises(ValueError, match="did you mean 'num_hidden_layers'"):
        build_recipe(parse(["train", "--recipe", "tiny", "--hf-overrides", '{"num_layers": 16}']))
    recipe = build_recipe(parse(["train", "--recipe", "tiny", "--select-fp8"]))
    assert recipe.select_fp8 and all(loss_config(recipe, kind).select_fp8 for kind in ("sparse", "extend", "mtp"))
    assert not loss_config(tiny_recipe(), "sparse").select_fp8
    from megactx.train.recipe import stage_loss_config

    tiny = tiny_recipe()
    assert [(s.kind, stage_loss_config(tiny, i).kl_candidates, stage_loss_config(tiny, i).indexer_needle_weight)
            for i, s in enumerate(tiny.stages) if s.kind in ("sparse", "indexers")] == [
        ("sparse", 0, 0.0), ("indexers", 512, 1.0)]
    recipe = build_recipe(parse(["train", "--recipe", "tiny", "--kl-candidates", "1024", "--indexer-needle-weight", "2",
                                 "--context", "32768"]))
    for i, stage in enumerate(recipe.stages):
        wide = stage.kind in ("warmup", "sparse", "extend", "indexers")  # the stages that train the indexers by a KL
        cfg = stage_loss_config(recipe, i)
        assert (cfg.kl_candidates, cfg.indexer_needle_weight) == ((1024, 2.0) if wide else (0, 0.0)), stage.kind
        assert (stage.train.seq_len == 32768) == (stage.kind in ("extend", "indexers"))
    with pytest.raises(ValueError, match="--kl-candidates"):
        build_recipe(parse(["train", "--smoke", "--kl-candidates", "-1"]))
