"""Properties of the reference model that transformers cannot check: the two MLA forms, IndexShare,
the router formula, the cache path, the FP8 indexer simulation and MTP drafting."""

import pytest
import torch

from megactx import ModelConfig
from megactx.model import build_model, draft
from megactx.model.attention import LayerCache, heads_out, select_topk
from megactx.model.moe import Experts, Router


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.from_pretrained("tiny").replace(vocab_size=256, index_topk=16)
    return build_model(cfg, seed=0)


def ids(batch=2, seqlen=40, vocab=256, seed=0):
    return torch.randint(0, vocab, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


def test_naive_and_absorbed_mla_agree(tiny):
    x = ids()
    tiny.set_attention(absorbed=False)
    naive = tiny(x)
    tiny.set_attention(absorbed=True)
    absorbed = tiny(x)
    tiny.set_attention(absorbed=False)
    assert (naive - absorbed).abs().max() < 1e-4 * naive.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_value_projection_of_the_heads_is_token_major_for_any_row_count(dtype):
    """heads_out: Σ_r o[t, h, r] w_uv[h, v, r] laid out [T, H·dv] (what o_proj reads), the batched
    GEMM outside autograd and the einsum inside it agreeing with a per-head reference."""
    g = torch.Generator().manual_seed(3)
    H, r, dv = 4, 64, 32
    w_uv = torch.randn(H, dv, r, generator=g).to(dtype)
    for T in (1, 4, 33):
        o = torch.randn(T, H, r, generator=g).to(dtype)
        want = torch.cat([o[:, h].float() @ w_uv[h].float().T for h in range(H)], dim=1)  # [T, H·dv]
        with torch.no_grad():
            got = heads_out(o, w_uv)
        assert got.shape == (T, H * dv) and got.is_contiguous() and got.dtype == dtype
        tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.float(), want, **tol)
        with_grad = heads_out(o.requires_grad_(), w_uv)
        torch.testing.assert_close(with_grad.detach().float(), got.float(), **tol)


def test_shared_layers_own_no_indexer_and_reuse_their_full_layers_topk(tiny):
    cfg = tiny.cfg
    owners = [i for i, layer in enumerate(tiny.model.layers) if layer.self_attn.indexer is not None]
    assert owners == cfg.full_layers == [0, 1, 2, 6]
    assert not any("indexer" in n for n, _ in tiny.model.layers[3].named_parameters())

    seen = {}
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out[1]))
             for i, layer in enumerate(tiny.model.layers)]
    tiny(ids())
    for h in hooks:
        h.remove()
    for i in range(cfg.num_hidden_layers):
        assert torch.equal(seen[i], seen[cfg.topk_source(i)])
    assert not torch.equal(seen[2], seen[6])  # full layers do pick their own keys


def test_select_topk_pads_short_rows_with_minus_one():
    scores = torch.tensor([[[1.0, float("-inf"), float("-inf")], [0.5, 2.0, float("-inf")], [3.0, 1.0, 2.0]]])
    idx = select_topk(scores, 2)
    assert idx[0, 0].tolist() == [0, -1]
    assert sorted(idx[0, 1].tolist()) == [0, 1]
    assert idx[0, 2].tolist() == [0, 2]
    assert select_topk(scores, 10).shape == (1, 3, 3)  # k above the row length keeps every key


def test_router_selects_on_biased_scores_and_weights_on_raw_scores():
    cfg = ModelConfig.from_pretrained("tiny").replace(n_routed_experts=4, num_experts_per_tok=2,
                                                      routed_scaling_factor=2.0)
    router = Router(cfg)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[:, 0] = torch.tensor([2.0, 1.0, 0.0, -1.0])  # raw preference 0 > 1 > 2 > 3
        router.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))  # bias pulls in expert 2
    x = torch.zeros(1, cfg.hidden_size)
    x[0, 0] = 1.0
    weights, experts = router(x)
    assert sorted(experts[0].tolist()) == [0, 2]
    raw = torch.tensor([2.0, 0.0]).sigmoid()
    expected = raw / raw.sum() * 2.0
    got = dict(zip(experts[0].tolist(), weights[0].tolist()))
    assert got[0] == pytest.approx(expected[0].item()) and got[2] == pytest.approx(expected[1].item())


def test_every_expert_on_every_token_equals_the_routed_loop():
    """The sync-free MoE form (CUDA for few experts, and under graph capture): each expert on every
    token at zero weight where unrouted gives the routed loop's output and gradients."""
    cfg = ModelConfig.from_pretrained("tiny")
    experts, router = Experts(cfg), Router(cfg)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.05)
    torch.nn.init.normal_(experts.down_proj, std=0.05)
    torch.nn.init.normal_(router.weight, std=0.05)
    assert experts.dense_on_cuda  # 8 experts of top-2: megactx-tiny takes this form on CUDA
    assert not Experts(cfg.replace(n_routed_experts=256, num_experts_per_tok=8)).dense_on_cuda
    x = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    results = []
    for dense_form in (False, True):
        experts.zero_grad()
        weights, ids = router(x)
        if dense_form:  # each expert's routing weight, 0 where not routed
            out = experts.forward_dense(x, torch.zeros(len(x), cfg.n_routed_experts).scatter(1, ids, weights))
        else:
            out = experts(x, weights, ids)
        out.square().sum().backward()
        results.append((out.detach(), experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()))
    for routed, dense in zip(*results):
        torch.testing.assert_close(dense, routed, rtol=1e-4, atol=1e-4 * routed.abs().max().item())  # summation order
    many = Experts(cfg.replace(n_routed_experts=20, num_experts_per_tok=4))  # 3 groups of at most EXPERT_GROUP
    torch.nn.init.normal_(many.gate_up_proj, std=0.05)
    torch.nn.init.normal_(many.down_proj, std=0.05)
    weights, ids = Router(cfg.replace(n_routed_experts=20, num_experts_per_tok=4))(x)
    routed, dense = many(x, weights, ids), many.forward_dense(x, torch.zeros(len(x), 20).scatter(1, ids, weights))
    torch.testing.assert_close(dense, routed, rtol=1e-4, atol=1e-4 * routed.abs().max().item())


def test_linear_into_adds_a_linear_in_place():
    """linear_into(x, w, into, bias) is into + F.linear(x, w, bias), written into `into` (a contiguous
    one through the GEMM itself, another through an add)."""
    from megactx.model.layers import linear_into

    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 5, 16, generator=gen), torch.randn(8, 16, generator=gen), torch.randn(8, generator=gen)
    for bias in (None, b):
        for into in (torch.randn(3, 5, 8, generator=gen), torch.randn(8, 5, 3, generator=gen).transpose(0, 2)):
            want = into + torch.nn.functional.linear(x, w, bias)
            got = linear_into(x, w, into, bias)
            assert got is into
            torch.testing.assert_close(got, want)


def test_moe_and_mlp_add_their_output_into_a_residual():
    """MLP / MoE(x, residual=r) return r + their output, in r's memory: the routed loop, the
    every-expert form (in groups of experts, each group's down GEMM adding into the sum) and the
    shared expert."""
    from megactx.model.moe import MLP, MoE

    cfg = ModelConfig.from_pretrained("tiny").replace(n_routed_experts=20, num_experts_per_tok=4)
    gen = torch.Generator().manual_seed(0)
    mlp, moe = MLP(cfg.hidden_size, 64), MoE(cfg)
    for p in [*mlp.parameters(), *moe.parameters()]:
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(1, 12, cfg.hidden_size, generator=gen)
    residual = torch.randn(x.shape, generator=gen)
    with torch.no_grad():
        for module in (mlp, moe):
            r = residual.clone()
            got = module(x, residual=r)
            assert got.data_ptr() == r.data_ptr()
            torch.testing.assert_close(got, residual + module(x), rtol=1e-5, atol=1e-5)
        flat, into = x.view(-1, cfg.hidden_size), residual.clone().view(-1, cfg.hidden_size)
        weights, ids = moe.gate(flat)
        dense = torch.zeros(len(flat), 20).scatter(1, ids, weights)  # 3 groups of at most EXPERT_GROUP
        got = moe.experts.forward_dense(flat, dense, into=into)
        assert got is into
        torch.testing.assert_close(got, residual.view_as(into) + moe.experts(flat, weights, ids), rtol=1e-5, atol=1e-5)


def test_group_limited_routing_never_leaves_the_chosen_groups():
    cfg = ModelConfig.from_pretrained("tiny").replace(n_routed_experts=8, n_group=4, topk_group=1,
                                                      num_experts_per_tok=2)
    router = Router(cfg)
    torch.nn.init.normal_(router.weight)
    _, experts = router(torch.randn(64, cfg.hidden_size))
    groups = experts // 2
    assert (groups[:, 0] == groups[:, 1]).all()


def test_incremental_forward_with_cache_equals_full_forward():
    # 16 indexer heads: an exact tie at ReLU's zero (all heads negative) becomes improbable, so the
    # top-k of the full and incremental forwards can be compared key for key.
    cfg = ModelConfig.from_pretrained("tiny").replace(vocab_size=256, index_topk=16, index_n_heads=16)
    tiny = build_model(cfg, seed=0)
    x = ids(seqlen=30)
    full = tiny.hidden_states(x)
    caches = [LayerCache() for _ in tiny.model.layers]
    first = tiny.hidden_states(x[:, :17], caches=caches)
    rest = [tiny.hidden_states(x[:, t:t + 1], caches=caches) for t in range(17, 30)]
    incremental = torch.cat([first, *rest], dim=1)
    assert (incremental - full).abs().max() < 1e-4


def test_fp8_indexer_tracks_the_exact_scores():
    cfg = ModelConfig.from_pretrained("glm-5.2")
    from megactx.model.attention import Indexer

    torch.manual_seed(0)
    indexer = Indexer(cfg.replace(hidden_size=256, q_lora_rank=128))
    q = torch.randn(1, 64, cfg.index_n_heads, cfg.index_head_dim)
    k = torch.randn(1, 4096, cfg.index_head_dim)
    w = torch.randn(1, 64, cfg.index_n_heads)
    exact = indexer.scores(q, w, k)
    fp8 = indexer.scores(q, w, k, fp8=True)
    corr = torch.corrcoef(torch.stack([exact.flatten(), fp8.flatten()]))[0, 1]
    assert corr >= 0.99
    top_exact = exact.topk(512, dim=-1).indices
    top_fp8 = fp8.topk(512, dim=-1).indices
    overlap = torch.tensor([len(set(a.tolist()) & set(b.tolist())) / 512
                            for a, b in zip(top_exact[0], top_fp8[0])]).mean()
    assert overlap >= 0.95


def _count_calls(monkeypatch, cls, name):
    calls = []
    original = getattr(cls, name)

    def wrapped(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls.append(out if name == "append_kv" else None)
        return out

    monkeypatch.setattr(cls, name, wrapped)
    return calls


@pytest.mark.parametrize("kv_share", [True, False])
def test_mtp_drafting_shares_topk_and_kv_only_under_indexshare(tiny, monkeypatch, kv_share):
    from megactx.model.attention import Indexer

    x, steps = ids(seqlen=24), 5
    appends = _count_calls(monkeypatch, LayerCache, "append_kv")
    index_queries = _count_calls(monkeypatch, Indexer, "queries")
    drafts = draft(tiny, x, steps, kv_share=kv_share)
    assert drafts.tokens.shape == (2, steps) and drafts.logits.shape == (2, steps, 256)
    mtp_appends = len(appends)  # the target forward uses no cache; every append is the MTP layer's
    mtp_index_runs = len(index_queries) - len(tiny.cfg.full_layers)  # minus the target's indexers
    if kv_share:
        assert mtp_appends == 1 and appends[0][0].shape[1] == 24  # step 1 writes; later steps read
        assert mtp_index_runs == 1
    else:
        assert mtp_appends == steps and appends[-1][0].shape[1] == 24 + steps - 1
        assert mtp_index_runs == steps


def test_first_draft_is_the_mtp_prediction_from_target_hidden_states(tiny):
    x = ids(seqlen=20)
    d = draft(tiny, x, 1)
    hidden = tiny.hidden_states(x)
    nxt = tiny.compute_logits(hidden[:, -1]).argmax(-1)
    mtp = tiny.mtp[0]
    pos = torch.arange(20)[None]
    cos, sin = tiny.rotary(pos, hidden.dtype)
    g, _ = mtp(hidden, tiny.embed(torch.cat([x[:, 1:], nxt[:, None]], 1)), cos, sin, pos)
    assert torch.equal(d.next_token, nxt)
    assert torch.allclose(d.logits[:, 0], tiny.compute_logits(mtp.shared_head.norm(g[:, -1])))


def test_bf16_model_keeps_router_and_indexer_weights_in_fp32():
    model = build_model("tiny", dtype=torch.bfloat16)
    layer = model.model.layers[6]
    assert layer.mlp.gate.weight.dtype == torch.float32
    assert layer.self_attn.indexer.weights_proj.weight.dtype == torch.float32
    assert layer.self_attn.q_a_proj.weight.dtype == torch.bfloat16
    logits = model(ids(vocab=4096, seqlen=8))
    assert torch.isfinite(logits).all()


def test_fuse_linears_makes_views_and_refuses_what_one_gemm_cannot_compute():
    from torch import nn
    from torch.nn import functional as F

    from megactx.model.layers import fuse_linears

    a, b = nn.Linear(8, 3, bias=False), nn.Linear(8, 5, bias=False)
    wa, wb = a.weight.detach().clone(), b.weight.detach().clone()
    fused = fuse_linears(a, b)
    assert fused.shape == (8, 8) and torch.equal(a.weight, wa) and torch.equal(b.weight, wb)  # values kept
    x = torch.randn(2, 8)
    qa, qb = F.linear(x, fused).split([3, 5], dim=-1)
    torch.testing.assert_close(qa, a(x))
    torch.testing.assert_close(qb, b(x))
    with torch.no_grad():
        a.weight.add_(1.0)  # an update in place reaches the fused weight: one memory
    assert torch.equal(fused[:3], a.weight)
    plain = nn.Linear(8, 2, bias=False)
    for other in (nn.Linear(8, 2), nn.Linear(8, 2, bias=False).double(), nn.Linear(4, 2, bias=False)):
        before = plain.weight
        assert fuse_linears(plain, other) is None and plain.weight is before  # a bias, a dtype, a width


def test_a_fused_moe_holds_its_shared_expert_as_one_more_expert():
    """MoE.fuse (the engine's, for models whose experts run densely on CUDA): the shared expert
    stored as expert E of one [E + 1] stack, the modules' weights views of it; the every-expert form
    over that stack, the shared expert at weight 1, computes what the routed experts plus the
    shared MLP do. On a CPU the model keeps computing the unfused way."""
    from megactx.model.moe import MoE

    cfg = ModelConfig.from_pretrained("tiny")
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(1, 24, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    before = {name: p.detach().clone() for name, p in moe.state_dict().items()}
    with torch.no_grad():
        want = moe(x)
        moe.fuse()
        moe.shared_experts.fuse()  # already one GEMM on the stack's memory: nothing more
        assert all(torch.equal(p, before[name]) for name, p in moe.state_dict().items())
        gate_up, down = moe.with_shared
        E = cfg.n_routed_experts
        assert gate_up.shape[0] == down.shape[0] == E + 1
        assert moe.experts.gate_up_proj.data_ptr() == gate_up.data_ptr()
        assert moe.shared_experts.down_proj.weight.data_ptr() == down[E].data_ptr()
        assert moe.shared_experts.gate_up.data_ptr() == gate_up[E].data_ptr()
        # the every-expert form's down GEMM reads the experts side by side, [D, (E + 1)·I], in place
        D, I = down.shape[1:]
        assert down.permute(1, 0, 2).reshape(D, (E + 1) * I).data_ptr() == down.data_ptr()
        torch.testing.assert_close(moe(x), want)  # a CPU: the routed loop and the shared MLP
        flat = x.view(-1, cfg.hidden_size)
        weights, ids = moe.gate(flat)
        dense = torch.cat([torch.zeros(len(flat), E).scatter(1, ids, weights), torch.ones(len(flat), 1)], dim=1)
        got = moe.experts.forward_dense(flat, dense, gate_up, down)
    torch.testing.assert_close(got.view_as(x), want, rtol=1e-4, atol=1e-5)


def test_the_router_fills_the_every_expert_weights_on_every_path():
    """Router(x, dense): the twin path (a CPU, autograd) fills the [N, E (+ 1)] weights as the
    routing kernel does, gradients flowing through them."""
    cfg = ModelConfig.from_pretrained("tiny")
    router = Router(cfg)
    torch.nn.init.normal_(router.weight, std=0.05)
    x = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    E = cfg.n_routed_experts
    dense = torch.empty(6, E + 1)
    weights, ids = router(x, dense, shared_column=True)
    assert torch.equal(dense[:, :E], torch.zeros(6, E).scatter(1, ids, weights.detach()))
    assert torch.equal(dense[:, E], torch.ones(6))
    (dense[:, :E] * torch.arange(E)).sum().backward()  # not the sum: normalised weights sum to a constant
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
