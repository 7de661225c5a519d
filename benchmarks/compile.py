"""`megactx bench compile`: every Triton kernel launch of an engine run, compiled for a GPU without one.

Triton's interpreter, which runs the kernels on a CPU (CI, this command), accepts programs that the
GPU compiler refuses, and says nothing of registers, spills or shared memory. This command runs a
workload on the CPU under the interpreter, records each distinct launch as the JIT would specialize
it (the kernel, its arguments' types and 16-byte alignment, its constexprs, num_warps / num_stages),
and compiles each one for the target (default sm_90, the H200) with the ptxas that ships with
Triton, in a process without the interpreter: the launches a GPU run of the same workload makes,
compiled before any GPU is lent. Per launch it reports registers a thread and spill stack (from
cuobjdump, also shipped with Triton), shared memory against the target's limit, and any compile
error.

The workload is the engine on --model (default the shipped megactx-tiny; a preset such as glm-5.2
builds a random model of that geometry with small widths) in bf16 with the FP8 indexer cache, as on
a GPU: two prompts' chunked prefill, then a greedy and a sampled request decoded with MTP
speculation (draft, verify), once with each KV cache dtype the model takes (bf16, fp8); then direct
calls, recorded but not run, of what a short CPU run does not reach or the engine calls only on a
GPU (`call_long_rows`). The Gluon (Hopper-only) sparse MLA kernels, which the interpreter cannot
run, are not reached: `benchmarks/tune_sparse_mla.py --static` compiles those.

    megactx bench compile                                  # the shipped model, sm_90
    megactx bench compile --model glm-5.2 --arch 100 --out /tmp/c
    megactx bench compile --launches OLD.json --python VENV/bin/python   # the same launches, another Triton

Results: benchmarks/results/compile-<model>-sm<arch>.json and .md (a row a distinct compiled
launch). The figures are the compiling Triton's; the exit status is 1 when a launch does not
compile or does not fit.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, astuple, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import Progress, md_table, write_json

HELP = "compile every Triton launch of an engine run for a GPU (default sm_90) on a CPU: registers, spills, shared"
RESULTS = Path(__file__).resolve().parent / "results"
# By compute capability (the CUDA programming guide's tables): the shared memory a block may use,
# a multiprocessor's shared memory (1 KiB of it reserved a block) and its resident warps; every one
# has 64K registers, allocated a warp at a time in units of 256, and at most 32 resident blocks.
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024, 120: 99 * 1024}
SM_SHARED = {80: 164 * 1024, 86: 100 * 1024, 89: 100 * 1024, 90: 228 * 1024, 100: 228 * 1024, 120: 100 * 1024}
SM_WARPS = {80: 64, 86: 48, 89: 48, 90: 64, 100: 64, 120: 48}
OPTIONS = ("num_warps", "num_stages", "maxnreg")  # launch options a kernel call may pass
H200_SMS = 132  # the direct calls' launch plans are an H200's


# ------------------------------------------------------------------------------------- recording
@dataclass(frozen=True)
class Launch:
    """One kernel launch as the JIT specializes it. args: parameter name -> the value (constexprs),
    a stand-in with the same specialization (other ints: 1, or a multiple of 16 or not, 32 or 64
    bits), or a tensor's {"tensor": dtype, "aligned": 16-byte aligned} (a TMA descriptor's adds its
    shape, strides and block shape)."""

    kernel: str  # "module:function"
    args: dict[str, Any]
    options: dict[str, int] = field(default_factory=dict)

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def _stand_in(value: int) -> int:
    """An int of the same specialization: 1 stays (a constant to the JIT), others keep whether 16
    divides them and whether they need 64 bits."""
    if value == 1:
        return 1
    stand_in = 16 if value % 16 == 0 else 17
    return stand_in + (1 << 32) if not -(1 << 31) <= value < (1 << 31) else stand_in


def _encode(value: Any, constexpr: bool) -> Any:
    import torch
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."), "aligned": value.data_ptr() % 16 == 0}
    if isinstance(value, TensorDescriptor):
        return {"tensor": str(value.base.dtype).removeprefix("torch."), "aligned": True,
                "shape": [_stand_in(int(s)) for s in value.shape],
                "strides": [_stand_in(int(s)) for s in value.strides],
                "block_shape": [int(b) for b in value.block_shape]}
    if isinstance(value, tl.dtype):
        return {"tl": value.name}
    if isinstance(value, bool) or value is None or isinstance(value, (float, str)):
        return value
    if isinstance(value, int):
        return value if constexpr else _stand_in(value)
    raise TypeError(f"cannot record a kernel argument of type {type(value).__name__}")


def _is_constexpr(param: inspect.Parameter) -> bool:
    return "constexpr" in str(param.annotation)


class Recorder:
    """The distinct launches seen so far (key -> Launch). execute False: launches are recorded, not
    run (direct calls whose outputs nobody reads)."""

    def __init__(self) -> None:
        self.launches: dict[str, Launch] = {}
        self.execute = True


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
    """Record every kernel launch the interpreter (TRITON_INTERPRET=1) makes inside the block."""
    from triton.runtime.interpreter import InterpretedFunction

    recorder = Recorder()
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        signature = inspect.signature(fn)
        params = signature.parameters
        bound = signature.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in params})
        options = {k: int(kwargs[k]) for k in OPTIONS if kwargs.get(k) is not None}
        launch = Launch(f"{fn.__module__}:{fn.__name__}",
                        {name: _encode(value, _is_constexpr(params[name])) for name, value in bound.arguments.items()},
                        options)
        recorder.launches.setdefault(launch.key(), launch)
        if recorder.execute:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    try:
        yield recorder
    finally:
        InterpretedFunction.run = run


def as_on_gpu(launch: Launch) -> Launch:
    """The launch a GPU makes where the kernels choose differently under the interpreter: DOT_F32
    (`common.dot_f32`: the interpreter's bf16 tl.dot is wrong, so it upcasts; a GPU only for fp32) and
    the top-k's TILE_PIVOTS (1 on a GPU, more where the interpreter pays per operation). The
    interpreter's fp32 sparse MLA output (a GPU writes q's dtype) is kept: one store's type. Sparse
    MLA on Hopper at kv_lora_rank 512 (GLM, DeepSeek) runs the Gluon kernels instead
    (`sparse_mla.default_kernel`), which the interpreter cannot run: the Triton kernel's launches
    are then its fallback's."""
    import torch

    from megactx.kernels.common import dot_f32

    args = dict(launch.args)
    if "DOT_F32" in args:
        operands = [getattr(torch, args[name]["tensor"]) for name in ("q_ptr", "k_ptr", "kv_ptr")
                    if isinstance(args.get(name), dict)]
        args["DOT_F32"] = dot_f32(*operands, interpret=False)
    if launch.kernel.startswith("megactx.kernels.topk:") and "TILE_PIVOTS" in args:
        from megactx.kernels.topk import TopkConfig

        args["TILE_PIVOTS"] = TopkConfig().pivots_of_tile(interpret=False)
    return Launch(launch.kernel, args, launch.options)


# ------------------------------------------------------------------------------------- compiling
def _decode(value: Any) -> Any:
    import torch
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    if not isinstance(value, dict):
        return value
    if "tl" in value:
        return getattr(tl, value["tl"])
    dtype = getattr(torch, value["tensor"])
    base = torch.empty(32, dtype=dtype)  # fresh: 64-byte aligned
    if "block_shape" in value:
        return TensorDescriptor(base, value["shape"], value["strides"], value["block_shape"])
    return base if value["aligned"] else base[1:]  # one element on: not 16-byte aligned (itemsize < 16)


@dataclass
class Compiled:
    """What the compiler made of one launch (or why it could not)."""

    kernel: str
    constants: str  # the constexprs and options, short
    registers: int | None = None
    spill_bytes: int | None = None
    shared_bytes: int | None = None
    error: str | None = None
    warps: int | None = None

    def programs_per_sm(self, arch: int) -> int | None:
        """Programs of this launch resident on one multiprocessor of sm_<arch> at once, as registers,
        warps and shared memory allow (the occupancy that hides one program's loads behind another's
        work); None where unknown."""
        if self.registers is None or self.warps is None or self.shared_bytes is None or arch not in SM_WARPS:
            return None
        per_warp = -(-self.registers * 32 // 256) * 256
        by_registers = (65536 // per_warp) // self.warps
        by_shared = SM_SHARED[arch] // (self.shared_bytes + 1024)
        return min(by_registers, SM_WARPS[arch] // self.warps, by_shared, 32)


def compile_api_missing() -> str:
    """What `compile_launch` needs of Triton's internals that this Triton lacks ('' = nothing; they
    are there in 3.6 to 3.9)."""
    import triton.runtime.jit as jit

    missing = [] if hasattr(jit, "create_function_from_signature") else ["create_function_from_signature"]
    missing += [] if hasattr(jit.JITFunction, "_pack_args") else ["JITFunction._pack_args"]
    return ", ".join(missing)


def compile_launch(launch: Launch, arch: int) -> Compiled:
    """Compile one recorded launch for sm_<arch> exactly as the JIT would on that GPU (its own
    specialization and packing, Triton's internal API: it may need adjusting on other versions).
    Call it in a process without TRITON_INTERPRET: the interpreter replaces the kernels' helpers."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    from benchmarks.common import cubin_resource_usage

    module, name = launch.kernel.split(":")
    fn = getattr(importlib.import_module(module), name)
    args = {k: _decode(v) for k, v in launch.args.items()}
    constants = [f"{k}={v if not isinstance(v, dict) else v.get('tl')}" for k, v in launch.args.items()
                 if _is_constexpr(fn.signature.parameters[k])]
    row = Compiled(launch.kernel.split(":")[1], ", ".join(constants + [f"{k}={v}" for k, v in launch.options.items()]))
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kwargs = {**args, **launch.options}
    try:
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(**kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    except Exception as e:  # the report says which launch and why
        row.error = f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
        return row
    usage = cubin_resource_usage(compiled)
    row.registers = int(usage["REG"]) if "REG" in usage else None
    row.spill_bytes = int(usage["STACK"]) if "STACK" in usage else None
    row.shared_bytes = int(compiled.metadata.shared)
    row.warps = int(compiled.metadata.num_warps)
    return row


# ------------------------------------------------------------------------------------- workload
def shrunk(cfg):
    """cfg with the widths no kernel sees made small (hidden, MLP and vocabulary sizes, the query
    LoRA rank) and one layer group of layers, so that a random model of a big geometry (GLM-5.2:
    64 heads, a 512 + 64 latent, a 32 x 128 indexer, 256 experts) builds and runs on a CPU."""
    group = max(1, cfg.index_topk_freq)
    return cfg.replace(num_hidden_layers=group, first_k_dense_replace=min(cfg.first_k_dense_replace, 1),
                       hidden_size=min(cfg.hidden_size, 256), intermediate_size=min(cfg.intermediate_size, 512),
                       moe_intermediate_size=min(cfg.moe_intermediate_size, 64), vocab_size=min(cfg.vocab_size, 4096),
                       q_lora_rank=min(cfg.q_lora_rank or 256, 256))


def kv_cache_dtypes(cfg) -> list[str]:
    """The KV cache dtypes a model takes: bf16, and fp8 where its latent splits into 128-value groups."""
    from megactx.kernels.reference import SCALE_GROUP

    return ["bf16"] + (["fp8"] if cfg.kv_lora_rank % SCALE_GROUP == 0 else [])


def run_engine(model, kv_cache_dtype: str, prompt_tokens: int, gamma: int, log) -> None:
    """The engine's launches: a prompt prefilled in chunks, then greedy and sampled decoding, with
    MTP speculation where the model has an MTP layer (bf16, FP8 indexer cache, as on a GPU)."""
    import torch

    from megactx import LLM, SamplingParams

    has_mtp = model.cfg.num_nextn_predict_layers > 0
    llm = LLM(model, device="cpu", dtype=torch.bfloat16, backend="triton", kv_cache_dtype=kv_cache_dtype,
              index_cache_dtype="fp8", num_speculative_tokens=gamma if has_mtp else 0,
              max_num_seqs=4, max_num_batched_tokens=max(8, prompt_tokens // 2),
              num_blocks=4 * (prompt_tokens // 64 + 4), max_model_len=prompt_tokens + 2 * gamma + 8, cuda_graphs=False,
              warm_up=False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, model.cfg.vocab_size, (prompt_tokens + i,), generator=g).tolist() for i in range(2)]
    t0 = time.perf_counter()
    llm.generate(prompts, [SamplingParams(max_tokens=2 * gamma + 2, temperature=t, ignore_eos=True) for t in (0, 1)],
                 use_tqdm=False)
    log(f"engine, KV {kv_cache_dtype}: a greedy and a sampled request in {time.perf_counter() - t0:.1f} s")


def call_long_rows(cfg, gamma: int, vocab: int) -> None:
    """The launches that a short CPU run never reaches, or that the engine makes only on a GPU, from
    direct calls at GLM-scale sizes (recorded, not run; `record` plans them for an H200's 132 SMs):
    top-k's split plan over long rows and its fused plan over a prefill chunk, decode-shaped indexer
    logits over a long context, sparse MLA decode with split-K (bf16 and FP8 KV) and at batch 64,
    the norms of a fused projection's strided slices, a verify's few-row fp32 linears, the MoE
    every-expert form's activation and router, the speculative sampler's rejection rule and its
    random streams over `vocab` tokens."""
    import torch

    from megactx.kernels import linear, moe_route, norm, rejection, rng, sparse_mla, swiglu, topk
    from megactx.kernels.indexer import indexer_logits
    from megactx.kernels.reference import BLOCK_SIZE, FP8, SCALE_GROUP
    from megactx.model.layers import RMSNorm
    from megactx.model.moe import EXPERT_GROUP

    k, hi, di = cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim
    r, dr, heads = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_attention_heads
    keys = 1 << 18
    blocks = keys // BLOCK_SIZE
    for rows, length in ((4, keys), (64, 8192)):
        table = torch.zeros(rows, length // BLOCK_SIZE, dtype=torch.int32)
        topk.topk_rows(torch.empty(rows, length), k, torch.full((rows,), length, dtype=torch.int32),
                       block_table=table, seq_idx=torch.arange(rows, dtype=torch.int32))
    for batch in (1, 64):
        table = torch.zeros(batch, blocks, dtype=torch.int32)
        seq = torch.arange(batch, dtype=torch.int32)
        indexer_logits(torch.empty(batch, hi, di, dtype=FP8), torch.empty(batch, hi),
                       torch.empty(blocks, BLOCK_SIZE * (di + 4), dtype=torch.uint8), table, seq,
                       torch.full((batch,), keys, dtype=torch.int32), keys)
        q = torch.empty(batch, heads, r + dr, dtype=torch.bfloat16)
        slots = torch.zeros(batch, k, dtype=torch.int32)
        caches = [torch.empty(blocks, BLOCK_SIZE, r + dr, dtype=torch.bfloat16)]
        if r % SCALE_GROUP == 0:
            caches.append(torch.empty(blocks, BLOCK_SIZE, r + 4 * (r // SCALE_GROUP) + 2 * dr, dtype=torch.uint8))
        for cache in caches:
            sparse_mla.sparse_mla(q, cache, slots, 0.1, r)
    # the norms of the fused x projection's strided slices (q_a_layernorm, the indexer's k_norm, a
    # LayerNorm): the engine fuses a checkpoint's projections, the model recorded here is not fused
    q_lora = cfg.q_lora_rank or 0
    wide = torch.empty(gamma + 1, q_lora + r + dr + di, dtype=torch.bfloat16)
    with torch.no_grad():
        if q_lora:
            norm.norm_rows(wide[:, :q_lora], RMSNorm(q_lora).bfloat16())
        norm.norm_rows(wide[:, -di:], torch.nn.LayerNorm(di).bfloat16())
    experts = cfg.n_routed_experts
    # the few-row fp32 linears of a decode step and a verify (routers, indexer head weights) over the
    # model's bf16 rows, which linear_fp32 sends to the kernel only on a GPU
    for width in (experts, hi):
        for rows in (1, gamma + 1) if width else ():
            linear.linear_rows(torch.empty(rows, cfg.hidden_size, dtype=torch.bfloat16),
                               torch.empty(width, cfg.hidden_size))
    if experts:
        # the every-expert form's weighted SwiGLU, which runs only on CUDA
        group = min(EXPERT_GROUP, experts + 1)  # + 1: the shared expert, stacked by MoE.fuse
        swiglu.swiglu_weighted(torch.empty(gamma + 1, group, 2 * cfg.moe_intermediate_size, dtype=torch.bfloat16),
                               torch.empty(gamma + 1, group))
        logits, bias = torch.empty(64, experts), torch.zeros(experts)
        moe_route.moe_route(logits, bias, cfg.num_experts_per_tok, 1.0, True)
        moe_route.moe_route(logits, bias, cfg.num_experts_per_tok, 1.0, True, torch.empty(64, experts + 1), True)
        router = torch.empty(experts, cfg.hidden_size)
        for rows in (1, gamma + 1):  # a small router's logits in the routing kernel (a decode step, a verify)
            x = torch.empty(rows, cfg.hidden_size, dtype=torch.bfloat16)
            if moe_route.takes_x(x, router):
                moe_route.moe_route_x(x, router, bias, cfg.num_experts_per_tok, 1.0, True,
                                      torch.empty(rows, experts + 1), True)
    # a batch at the model's vocabulary, and one row of several vocabulary slices (a second launch)
    for batch, width in ((32, vocab), (1, 4 * rejection.MIN_SLICE_STEPS * rejection.BLOCK_V)):
        p = torch.empty(batch, gamma + 1, width)
        drafts = torch.zeros(batch, gamma, dtype=torch.long)
        for q in (torch.empty(batch, gamma, width), None):
            for num_drafts in (torch.full((batch,), gamma), None):
                rejection.rejection_rows(p, drafts, q, num_drafts, torch.empty(batch, gamma),
                                         torch.empty(batch, width), -1)
    batch = 32
    streams = torch.zeros(batch, dtype=torch.long)
    for exponential in (False, True):
        rng.row_random(streams, streams, vocab, exponential)
        rng.one_row_random(1, 0, vocab, exponential, torch.empty(vocab))


@contextlib.contextmanager
def multiprocessors(sms: int) -> Iterator[None]:
    """Launch plans inside the block count `sms` multiprocessors, as on that GPU (the interpreter's
    plans assume a few: the split counts of the top-k, the indexer and sparse MLA, and with them
    some constexprs, follow the count)."""
    from megactx.kernels import sparse_mla
    from megactx.kernels.topk import TopkConfig

    saved = sparse_mla.INTERPRET_NUM_SMS, TopkConfig.CPU_SMS
    sparse_mla.INTERPRET_NUM_SMS = TopkConfig.CPU_SMS = sms
    try:
        yield
    finally:
        sparse_mla.INTERPRET_NUM_SMS, TopkConfig.CPU_SMS = saved


def record(model_name: str, prompt_tokens: int, gamma: int, log) -> list[Launch]:
    """Run the workload on the CPU under the interpreter; the distinct launches, as on a GPU."""
    import torch

    from megactx import load_model
    from megactx.config import ModelConfig
    from megactx.model import build_model

    path = Path(model_name)
    cfg = ModelConfig.from_pretrained(model_name)
    vocab = cfg.vocab_size
    if path.is_dir() and any(path.glob("*.safetensors")):
        model = load_model(path, dtype=torch.bfloat16, backend="triton")
        log(f"loaded {path}")
    else:
        cfg = shrunk(cfg)
        model = build_model(cfg, dtype=torch.bfloat16)
        log(f"built a random {model_name} geometry of {cfg.num_hidden_layers} layers (shrunk widths: see shrunk())")
    with recording() as recorder:
        for kv_cache_dtype in kv_cache_dtypes(model.cfg):
            run_engine(model, kv_cache_dtype, prompt_tokens, gamma, log)
        recorder.execute = False
        with multiprocessors(H200_SMS):
            call_long_rows(model.cfg, gamma, vocab)
    launches = {}
    for launch in map(as_on_gpu, recorder.launches.values()):
        launches.setdefault(launch.key(), launch)
    return list(launches.values())


def _subprocess(args: list[str], interpret: bool, python: str = sys.executable, capture: bool = True):
    """Run `python -m benchmarks.compile ARGS` from the repository root, with or without the
    interpreter: Triton reads TRITON_INTERPRET when it is imported, so recording (interpreted) and
    compiling (not) each get a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    done = subprocess.run([python, "-m", "benchmarks.compile", *args], env=env, cwd=root, text=True,
                          stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None)
    if done.returncode != 0:
        raise RuntimeError(f"{python} -m benchmarks.compile {args[0]} failed"
                           + (f":\n{done.stderr[-3000:]}" if capture else " (its output is above)"))


def record_all(model: str, prompt_tokens: int, gamma: int) -> tuple[list[Launch], str]:
    """`record` in an interpreted process -> (the launches, its Triton version)."""
    with tempfile.TemporaryDirectory() as tmp:
        dst = Path(tmp) / "launches.json"
        _subprocess(["--record-only", str(dst), model, str(prompt_tokens), str(gamma)], interpret=True, capture=False)
        data = json.loads(dst.read_text())
        return [Launch(**x) for x in data["launches"]], data["triton"]


def compile_all(launches: list[Launch], arch: int, python: str) -> tuple[list[Compiled], str]:
    """Compile every launch for sm_<arch> in a process of `python` without the interpreter (a worker
    a core) -> (the rows in the launches' order, that Python's Triton version)."""
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "launches.json", Path(tmp) / "compiled.json"
        src.write_text(json.dumps([asdict(x) for x in launches]))
        _subprocess(["--compile-only", str(src), str(dst), str(arch)], interpret=False, python=python)
        data = json.loads(dst.read_text())
        return [Compiled(**row) for row in data["rows"]], data["triton"]


def _record_only(dst: str, model: str, prompt_tokens: str, gamma: str) -> int:
    import triton

    launches = record(model, int(prompt_tokens), int(gamma), Progress().log)
    Path(dst).write_text(json.dumps({"triton": triton.__version__, "launches": [asdict(x) for x in launches]}))
    return 0


def _compile_only(src: str, dst: str, arch: str) -> int:
    from concurrent.futures import ProcessPoolExecutor

    import triton

    launches = [Launch(**x) for x in json.loads(Path(src).read_text())]
    with ProcessPoolExecutor(max_workers=max(1, min(len(launches), os.cpu_count() or 1))) as pool:
        rows = list(pool.map(compile_launch, launches, [int(arch)] * len(launches)))
    Path(dst).write_text(json.dumps({"triton": triton.__version__, "rows": [asdict(r) for r in rows]}))
    return 0


# ------------------------------------------------------------------------------------- report
def problems(rows: list[Compiled], arch: int) -> list[str]:
    """What would fail on the GPU: a launch that does not compile, or needs more shared memory than
    a block of sm_<arch> gets."""
    limit = SHARED_LIMIT.get(arch)
    out = [f"{r.kernel} [{r.constants}]: {r.error}" for r in rows if r.error]
    if limit:
        out += [f"{r.kernel} [{r.constants}]: {r.shared_bytes} B of shared memory, above sm_{arch}'s {limit}"
                for r in rows if r.shared_bytes is not None and r.shared_bytes > limit]
    return out


def markdown(results: dict[str, Any]) -> str:
    arch, rows = results["arch"], [Compiled(**r) for r in results["rows"]]
    fmt = lambda x: "-" if x is None else str(x)  # noqa: E731
    # launches that differ only in their arguments' alignment or size class, compiled alike: one row
    same: dict[tuple, int] = {}
    for r in rows:
        key = astuple(r)
        same[key] = same.get(key, 0) + 1
    table = md_table(["kernel", "constexprs and options", "launches", "registers", "spill stack B", "shared KiB",
                      "programs / SM", "compiled"],
                     [[r.kernel, r.constants, n, fmt(r.registers), fmt(r.spill_bytes),
                       "-" if r.shared_bytes is None else f"{r.shared_bytes / 1024:.1f}", fmt(r.programs_per_sm(arch)),
                       "yes" if r.error is None else f"no: {r.error[:200]}"]
                      for r, n in ((Compiled(*key), n) for key, n in same.items())])
    found = problems(rows, arch)
    verdict = ("Every launch compiles and fits the target's shared memory." if not found else
               f"{len(found)} launch(es) would fail on the GPU:\n\n" + "\n".join(f"- {p}" for p in found))
    return (f"# Triton launches compiled for sm_{arch}\n\n"
            f"`megactx bench compile --model {results['model']} --arch {arch}`, {results['date']}: "
            f"{len(rows)} distinct launches of the engine on this model (bf16, FP8 indexer cache, KV "
            f"{' and '.join(results['kv_cache_dtypes'])}) and of direct calls at long-context sizes, recorded "
            f"under Triton's interpreter (Triton {results['triton_record']}) and compiled by Triton "
            f"{results['triton_compile']}'s compiler and ptxas, no GPU. Registers are a thread's; the spill "
            f"stack is cuobjdump's STACK; shared memory is the block's, against "
            f"{SHARED_LIMIT.get(arch, 0) // 1024} KiB; programs / SM: how many are resident on a multiprocessor "
            f"at once, as registers, warps and shared memory allow.\n\n{verdict}\n\n{table}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a checkpoint directory, or a preset / config.json whose geometry is built at random with "
                        "small widths (e.g. glm-5.2); default: the shipped megactx-tiny")
    p.add_argument("--arch", type=int, default=90, help="compute capability to compile for (default 90: Hopper)")
    p.add_argument("--prompt-tokens", type=int, default=96, help="the engine run's prompt length (default 96)")
    p.add_argument("--gamma", type=int, default=3, help="draft tokens a speculative step (default 3)")
    p.add_argument("--python", default=sys.executable,
                   help="the Python that compiles (default this one): one whose Triton is the GPU's compiles with it")
    p.add_argument("--launches", type=Path, default=None,
                   help="compile the launches of an earlier run's JSON instead of recording (no interpreter run)")
    p.add_argument("--out", type=Path, default=RESULTS, help="results folder (default benchmarks/results)")


def run(args: argparse.Namespace) -> int:
    from megactx.config import ConfigError, ModelConfig
    from megactx.models import shipped_model, shipped_model_missing

    progress = Progress()
    if args.launches is not None:
        try:
            saved = json.loads(args.launches.read_text())
            model, kv, triton_record = saved["model"], saved["kv_cache_dtypes"], saved["triton_record"]
            launches = [Launch(**x) for x in saved["launches"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"megactx bench compile: --launches {args.launches}: not the JSON of an earlier run "
                  f"({type(e).__name__}: {e})", file=sys.stderr)
            return 2
    else:
        model = args.model or (str(shipped_model()) if shipped_model() else None)
        if model is None:
            print(f"megactx bench compile: {shipped_model_missing()}; pass --model", file=sys.stderr)
            return 2
        try:
            kv = kv_cache_dtypes(ModelConfig.from_pretrained(model))
        except (ConfigError, OSError) as e:
            print(f"megactx bench compile: {e}", file=sys.stderr)
            return 2
    try:
        if args.launches is None:
            progress.log(f"recording the launches of {model} under the interpreter")
            launches, triton_record = record_all(model, args.prompt_tokens, args.gamma)
        progress.log(f"{len(launches)} distinct launches; compiling for sm_{args.arch} with {args.python}")
        rows, triton_compile = compile_all(launches, args.arch, args.python)
    except (OSError, RuntimeError) as e:  # a step's process failed (its output says why) or --python is wrong
        print(f"megactx bench compile: {e}", file=sys.stderr)
        return 2
    results = {"model": Path(model).name if Path(model).exists() else model, "arch": args.arch,
               "date": time.strftime("%Y-%m-%d"), "kv_cache_dtypes": kv, "triton_record": triton_record,
               "triton_compile": triton_compile, "launches": [asdict(x) for x in launches],
               "rows": [asdict(r) for r in rows]}
    stem = f"compile-{results['model']}-sm{args.arch}"  # a model's name may hold dots (glm-5.2)
    write_json(args.out / f"{stem}.json", results)
    (args.out / f"{stem}.md").write_text(markdown(results))
    found = problems(rows, args.arch)
    for line in found:
        print(f"megactx bench compile: {line}", file=sys.stderr)
    progress.log(f"wrote {args.out / stem}.json and .md; {len(found)} problem(s)")
    return 1 if found else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--record-only":
        sys.exit(_record_only(*sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "--compile-only":
        sys.exit(_compile_only(*sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
