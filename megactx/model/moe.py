"""Dense SwiGLU MLP and the DeepSeek/GLM mixture of experts, in plain PyTorch.

Routing (`noaux_tc`): sigmoid scores; experts are *chosen* on score + e_score_correction_bias,
first keeping the `topk_group` best of `n_group` groups (a group's worth = sum of its two best
biased scores), then the best `num_experts_per_tok` experts inside them. The chosen experts are
*weighted* by their raw sigmoid scores, renormalised if `norm_topk_prob`, times
`routed_scaling_factor`. One always-on shared expert is added.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megactx.config import ModelConfig
from megactx.kernels import reference as ref
from megactx.model.layers import fuse_linears, linear_fp32, linear_into


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up: torch.Tensor | None = None  # [2I, D]: gate_proj's and up_proj's weights, fused

    def fuse(self) -> int:
        """Compute gate_proj and up_proj as one GEMM from now on (the engine's inference; the
        weights become views of one tensor). Returns the GEMMs a forward saves."""
        if self.gate_up is None:
            self.gate_up = fuse_linears(self.gate_proj, self.up_proj)
        return int(self.gate_up is not None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: [..., D] -> [..., D]; residual (x's shape, outside autograd): residual + the output,
        accumulated into residual in place by the down projection's GEMM (`linear_into`)."""
        if self.gate_up is not None:
            gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
            act = F.silu(gate) * up
        else:
            act = F.silu(self.gate_proj(x)) * self.up_proj(x)
        if residual is None:
            return self.down_proj(act)
        return linear_into(act, self.down_proj.weight, residual, self.down_proj.bias)


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        # Both stay fp32 whatever the model dtype (as in the published checkpoints).
        self.weight = nn.Parameter(torch.zeros(self.n_experts, cfg.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.n_experts, dtype=torch.float32),
                                                    requires_grad=False)
        self.fused = False  # route with the Triton kernel (fuse())

    def fuse(self) -> int:
        """Route with one Triton kernel on CUDA from now on, outside autograd (the engine's inference;
        ungrouped routing only). No GEMM saved: the count `Transformer.fuse_projections` returns."""
        self.fused = self.n_group == 1
        return 0

    def uses_kernel(self, x: torch.Tensor) -> bool:
        return self.fused and x.is_cuda and not torch.is_grad_enabled()

    def forward(self, x: torch.Tensor, dense: torch.Tensor | None = None,
                shared_column: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, D] -> (weights [N, top_k] fp32, expert ids [N, top_k] int64). dense: an [N, E]
        fp32 tensor to fill with every expert's weight, 0 where not routed (what the every-expert
        form reads); [N, E + 1] with shared_column, its last column 1 (the shared expert's)."""
        if self.uses_kernel(x):
            from megactx.kernels.moe_route import moe_route, moe_route_x, takes_x

            args = (self.e_score_correction_bias, self.top_k, self.scaling, self.norm_topk_prob, dense, shared_column)
            if takes_x(x, self.weight):  # a small router: its logits in the routing kernel too
                return moe_route_x(x, self.weight, *args)
            return moe_route(linear_fp32(x, self.weight.float()), *args)
        logits = linear_fp32(x, self.weight.float())  # [N, E] fp32 (x widened to fp32)
        weights, ids = ref.moe_route(logits, self.e_score_correction_bias, self.top_k, self.scaling,
                                     self.norm_topk_prob, self.n_group, self.topk_group)
        if dense is not None:
            dense.zero_()[:, : self.n_experts].scatter_(1, ids, weights)
            if shared_column:
                dense[:, self.n_experts] = 1.0
        return weights, ids


DENSE_EXPERTS_MAX_RATIO = 4  # on CUDA, every expert on every token while E <= this × top_k
EXPERT_GROUP = 8  # experts side by side in one GEMM of the every-expert form


class Experts(nn.Module):
    """Routed experts stacked: gate_up_proj [E, 2I, D] (gate rows then up rows), down_proj [E, D, I].

    Checkpoints store them one `experts.{e}.{gate,up,down}_proj.weight` a tensor; weights.py
    converts between the two."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, I))
        self.dense_on_cuda = E <= DENSE_EXPERTS_MAX_RATIO * cfg.num_experts_per_tok

    def runs_dense(self, x: torch.Tensor) -> bool:
        """Whether forward(x) computes every expert on every token (see forward)."""
        return x.is_cuda and (self.dense_on_cuda or torch.cuda.is_current_stream_capturing())

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [N, D], weights/ids: [N, top_k] -> [N, D]. Loops over the experts that got tokens.

        Asking which experts got tokens is a host sync per expert, which leaves a GPU idle while
        the host catches up. So on CUDA, for models with few experts (E <= 4 × top_k: megactx-tiny,
        8 of top-2) and always under CUDA-graph capture, every expert runs on every token with zero
        weight where unrouted: E / top_k times the expert FLOPs and no sync. The H200 dense stage of
        megactx-tiny (16 × 2048 tokens a step) took 0.107 s a step this way, 0.188 s routed. Not for
        GLM-5-size expert counts (256 of top-8), outside capture."""
        if self.runs_dense(x):
            dense = torch.zeros(x.shape[0], self.gate_up_proj.shape[0], dtype=torch.float32, device=x.device)
            dense.scatter_(1, ids, weights.float())  # [N, E] routing weight, 0 where not routed
            return self.forward_dense(x, dense)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = (ids == e).nonzero(as_tuple=True)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out

    def forward_dense(self, x: torch.Tensor, dense: torch.Tensor, gate_up: torch.Tensor | None = None,
                      down: torch.Tensor | None = None, kernel: bool | None = None,
                      into: torch.Tensor | None = None) -> torch.Tensor:
        """Every expert on every token, EXPERT_GROUP experts side by side in two GEMMs (a handful of
        kernels, where a loop over the experts launched ~7 an expert: most of a graphed decode
        step's kernels). Σ_e w[n, e] · down_e(a[n, e]) = [w[n, e] · a[n, e]]_e @ [down_e]_e.
        gate_up [E', 2I, D] / down [E', D, I], dense [N, E']: other experts than this module's (its
        own and the shared one: `MoE.fuse`). kernel: the weighted SwiGLU between the GEMMs as one
        Triton kernel (`megactx.kernels.swiglu`) rather than its four PyTorch ones; default on CUDA
        outside autograd (the kernel has no backward). into [N, D] (outside autograd): the output is
        accumulated into it in place and it is returned (each group's down GEMM adds into the sum so
        far, `linear_into`: no add kernels)."""
        gate_up = self.gate_up_proj if gate_up is None else gate_up
        down = self.down_proj if down is None else down
        E, two_i, D = gate_up.shape
        I = two_i // 2
        if kernel is None:
            kernel = x.is_cuda and not torch.is_grad_enabled()
        act = ref.swiglu_weighted
        if kernel:
            from megactx.kernels.swiglu import swiglu_weighted as act
        out = into
        for e0 in range(0, E, EXPERT_GROUP):  # groups bound the [N, G·2I] activations of many-expert models
            g = min(EXPERT_GROUP, E - e0)
            h = F.linear(x, gate_up[e0 : e0 + g].reshape(g * two_i, D)).view(-1, g, two_i)  # gate | up
            a = act(h, dense[:, e0 : e0 + g]).reshape(-1, g * I)  # [N, G·I]: w · silu(gate) · up
            w_down = down[e0 : e0 + g].permute(1, 0, 2).reshape(D, g * I)
            out = F.linear(a, w_down) if out is None else linear_into(a, w_down, out)  # [N, D]
        return out


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        n_shared = cfg.n_shared_experts
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * n_shared) if n_shared else None
        self.with_shared: tuple[torch.Tensor, torch.Tensor] | None = None  # fuse(): routed + shared experts

    def fuse(self) -> int:
        """Where the experts run densely (few of them) and the shared expert is one of their size:
        store it as one more expert (gate_up [E + 1, 2I, D], down [E + 1, D, I]; the modules'
        weights become views of these), so that on CUDA the every-expert form computes it in its
        two GEMMs at weight 1 (the routing kernel's last column) instead of an MLP of its own and
        an add. down lies expert-minor in memory ([D, E + 1, I], permuted): the every-expert form's
        down GEMM reads its experts side by side, [D, (E + 1)·I], as a view, where the expert-major
        stack was copied into that layout at every forward (a strided copy a MoE layer a step).
        No GEMM saved where the experts do not run densely (a CPU): returns 0."""
        shared, experts = self.shared_experts, self.experts
        if (self.with_shared is not None or shared is None or not experts.dense_on_cuda
                or shared.down_proj.weight.shape != experts.down_proj.shape[1:] or shared.gate_up is not None
                or len({p.dtype for p in (experts.gate_up_proj, experts.down_proj, shared.gate_proj.weight,
                                          shared.up_proj.weight, shared.down_proj.weight)}) != 1):
            return 0
        E = experts.gate_up_proj.shape[0]
        gate_up = torch.cat([experts.gate_up_proj.detach(),
                             torch.cat([shared.gate_proj.weight, shared.up_proj.weight]).detach()[None]])
        D, I = experts.down_proj.shape[1:]
        side = experts.down_proj.new_empty(D, E + 1, I)  # expert-minor
        side[:, :E] = experts.down_proj.detach().permute(1, 0, 2)
        side[:, E] = shared.down_proj.weight.detach()
        down = side.permute(1, 0, 2)  # [E + 1, D, I], a view
        for module, name, view in ((experts, "gate_up_proj", gate_up[:E]), (experts, "down_proj", down[:E]),
                                   (shared.gate_proj, "weight", gate_up[E, :I]),
                                   (shared.up_proj, "weight", gate_up[E, I:]), (shared.down_proj, "weight", down[E])):
            setattr(module, name, nn.Parameter(view, requires_grad=getattr(module, name).requires_grad))
        shared.gate_up = gate_up[E]  # its own forward (a CPU, autograd) as one GEMM too, on the same memory
        self.with_shared = (gate_up, down)
        return 0

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, S, D] -> [B, S, D]; residual (x's shape, outside autograd): residual + the output,
        accumulated into residual in place where it is contiguous (on the every-expert form by the
        down GEMMs themselves, `linear_into`: no add kernel)."""
        flat = x.reshape(-1, x.shape[-1])
        into = None if residual is None else residual.reshape(flat.shape)
        if self.experts.runs_dense(flat):
            # every expert's weight (from the routing kernel on the engine's CUDA path); the shared
            # expert as expert E at weight 1 where fuse() stacked it
            folded = self.with_shared is not None
            dense = torch.empty(flat.shape[0], self.gate.n_experts + folded, dtype=torch.float32, device=flat.device)
            self.gate(flat, dense, shared_column=folded)
            if folded:
                return self.experts.forward_dense(flat, dense, *self.with_shared, into=into).view_as(x)
            out = self.experts.forward_dense(flat, dense, into=into).view_as(x)
        else:
            weights, ids = self.gate(flat)
            out = self.experts(flat, weights, ids)
            out = (out if into is None else into.add_(out)).view_as(x)
        if self.shared_experts is None:
            return out
        return out + self.shared_experts(x) if residual is None else self.shared_experts(x, residual=out)
