"""`LLM`: the offline engine — requests in, completions out, one scheduler step at a time.

    llm = LLM("path/to/checkpoint")
    outs = llm.generate(["def fib(n):"], SamplingParams(temperature=0.0, max_tokens=64))
    for delta in llm.stream("def fib(n):", SamplingParams(max_tokens=64)): print(delta.text, end="")

A step: the scheduler picks chunks (decodes first, prefill chunks under the token budget), the
model runner computes them over the paged caches, the sampler turns the logits of the chunks that
reached their sequence's end into tokens (one host sync a step), and each request's detokenizer
and stop rule turn tokens into text and finish reasons. `step()` returns what changed, which is
what `generate`, `stream` and the HTTP server build on.

Overlapped steps (`async_scheduling`, the default on CUDA without speculative decoding): a small
model's step is mostly host work (scheduling, filling the inputs, detokenizing, stop checks), so
the engine does not wait for a step's tokens before it schedules the next. Each sampled token goes
into its sequence as PENDING_TOKEN; the next step reads the real one from the device (`DeviceTokens`)
while the host copy travels, and `step()` emits the tokens of the step before, once launched the
next. The scheduler counts pending tokens, so a sequence ended by count is not scheduled past its
end; one ended by a token it cannot see yet (EOS, a stop string) computes one token more, dropped.

With `num_speculative_tokens` = γ > 0 a step also drafts: each decoding sequence's last token is
verified together with up to γ tokens the checkpoint's MTP layer drafted in the step before, one
target forward for all of them, and emits the accepted drafts plus one more token (greedy
acceptance, or rejection sampling: the output is distributed as the target's alone). The parts are
in megactx.engine.spec_decode; `stats.spec_decode` and each RequestOutput's `spec_decode` count
drafted and accepted tokens.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megactx.engine.block_manager import BlockManager
from megactx.engine.model_runner import CacheConfig, DeviceTokens, ModelRunner, plan_num_blocks
from megactx.engine.outputs import CompletionOutput, Delta, EngineStats, RequestOutput, TokenLogprobs
from megactx.engine.rejection_sampler import VerifyResult
from megactx.engine.sampler import (
    EXPONENTIAL,
    UNIFORM,
    RowGenerator,
    Sampler,
    SamplerOutput,
    SamplingBatch,
    SamplingTensorsCache,
    draw_rows,
    make_generator,
    pad_token_ids,
)
from megactx.engine.sampling_params import SamplingParams
from megactx.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput
from megactx.engine.sequence import Sequence as Seq
from megactx.engine.sequence import SequenceStatus
from megactx.engine.spec_decode import (
    DRAFT_ACCEPTANCE,
    MTP_MODES,
    SpecConfig,
    SpecDecoder,
    SpecDecodeStats,
    TargetPass,
)
from megactx.engine.steplog import StepLog, device_wait, phase
from megactx.engine.tokenizer import CompletionText, Tokenizer
from megactx.kernels.reference import BLOCK_SIZE
from megactx.model.paged import HostCopy, cache_bytes_per_token, resolve_cache_dtype
from megactx.model.transformer import Transformer

log = logging.getLogger("megactx")

Prompt = str | list[int]


PENDING_TOKEN = -1  # a sampled token not on the host yet (`LLM.async_scheduling`)


@dataclass
class _Pending:
    """A step whose sampled tokens are still on the device: their copies to the host are queued
    behind it, and the next step reads them from `tokens`."""

    seqs: list[Seq]  # the sequences that sampled, in row order
    rows: dict[int, int]  # seq_id -> row
    tokens: torch.Tensor  # [S] int64, on the device
    host: HostCopy  # tokens (+ chosen logprobs, top logprobs, top ids) on their way to the host
    positions: dict[int, int] = field(default_factory=dict)  # seq_id -> where its PENDING_TOKEN sits

    @classmethod
    def launch(cls, seqs: list[Seq], result) -> _Pending:
        values = [result.tokens]
        if result.logprobs is not None:
            values += [result.logprobs, result.top_logprobs, result.top_token_ids]
        return cls(seqs, {seq.seq_id: row for row, seq in enumerate(seqs)}, result.tokens, HostCopy(*values))

    def fetch(self) -> tuple[list[int], list[float] | None, list[list[float]] | None, list[list[int]] | None]:
        """Wait for the copies -> tokens, and if any row asked: chosen logprobs, top logprobs, top ids."""
        lists = self.host.lists()
        return (lists[0], None, None, None) if len(lists) == 1 else tuple(lists)


class _Completion:
    """The streaming state of one completion of a request: its output, its text (None: token ids
    only) and the time of its last token."""

    __slots__ = ("output", "text", "last_token_time")

    def __init__(self, output: CompletionOutput, text: CompletionText | None):
        self.output = output
        self.text = text
        self.last_token_time: float | None = None


class _Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 seqs: list[Seq], tokenizer: Tokenizer | None, eos_token_ids: Sequence[int]):
        self.output = RequestOutput(request_id, prompt, prompt_ids,
                                    [CompletionOutput(i, logprobs=[] if params.logprobs is not None else None)
                                     for i in range(len(seqs))], arrival_time=time.perf_counter())
        self.params = params
        self.seqs = seqs
        self.completions = [_Completion(out, CompletionText.of(tokenizer, prompt_ids, params))
                            for out in self.output.outputs]
        # the tokens that end it (stop token ids, and EOS unless ignore_eos)
        self.stop_token_ids = frozenset(params.stop_token_ids) | frozenset(() if params.ignore_eos else eos_token_ids)


class _Progress:
    """generate()'s progress bar counts requests; its postfix says what a long prompt's wait is made
    of: prompt tokens in the KV cache (of all; a preempted sequence's go back to 0), output tokens,
    and their rates since the call, every PERIOD_S at most."""

    PERIOD_S = 0.5

    def __init__(self, llm: LLM, seqs: list[Seq]):
        self.llm, self.seqs = llm, seqs
        self.prompt_total = sum(seq.num_prompt_tokens for seq in seqs)
        self.generated_before = llm.stats.generation_tokens
        self.start = self.last = time.perf_counter()

    def due(self) -> bool:
        now = time.perf_counter()
        if now - self.last < self.PERIOD_S:
            return False
        self.last = now
        return True

    def prompt_done(self) -> int:
        """Prompt tokens in the cache (a finished sequence's blocks are freed: its count with them)."""
        return sum(seq.num_prompt_tokens if seq.is_finished else min(seq.num_computed_tokens, seq.num_prompt_tokens)
                   for seq in self.seqs)

    def line(self) -> str:
        """e.g. 'prompt 524,288/1,048,576 tok (11,203 tok/s), output 0 tok'"""
        seconds = max(time.perf_counter() - self.start, 1e-9)

        def rate(n: int) -> str:
            return f" ({n / seconds:,.0f} tok/s)" if n else ""

        prompt = self.prompt_done()
        output = self.llm.stats.generation_tokens - self.generated_before
        return f"prompt {prompt:,}/{self.prompt_total:,} tok{rate(prompt)}, output {output:,} tok{rate(output)}"


class LLM:
    """The paged-KV inference engine (continuous batching, chunked prefill, prefix caching).

    model: a checkpoint directory, or a `Transformer` already built (tests, benchmarks).
    hf_overrides: config fields changed before a checkpoint directory's model is built
    (`megactx.config.apply_overrides`), e.g. {"rope_parameters": {"factor": 32}} to serve a model
    past its trained context with a larger YaRN factor.
    tokenizer: a directory with tokenizer.json (default: the checkpoint's, if it has one); without
    one, prompts must be token ids and outputs carry no text.
    device / dtype: default CUDA + bf16 when available, else CPU + fp32. backend: "triton" on CUDA,
    "torch" (the kernels' twins) on a CPU. kv_cache_dtype: "auto" (= dtype), "bf16", "fp8";
    index_cache_dtype: the indexer cache, "fp8" on CUDA by default (what production runs), "auto"
    (exact) on a CPU. max_model_len: the longest prompt + output of a sequence (default: the model's
    max_position_embeddings, lowered with a warning to what the KV cache holds; a given one that does
    not fit is refused). cuda_graphs: replay CUDA graphs for decode steps, and in a speculative
    engine for the verify and draft steps of steps that only decode (CUDA with the Triton
    kernels; see megactx.engine.model_runner).

    num_speculative_tokens: γ, tokens the checkpoint's MTP layer drafts a step (0: no speculative
    decoding; `megactx serve` drafts 7 by default). It stays 0 here: on the shipped megactx-tiny on
    an H200, speculation does not pay (0.9-1.0x at batch 1, γ = 1-3; 0.6-0.8x at batch 32;
    benchmarks/results/spec-nvidia-h200.md).
    mtp_mode: "kvshare" (IndexShare + KVShare: draft steps >= 2 reuse step 1's top-k and KV),
    "baseline" (every draft step indexes and writes its own KV), "auto" (the checkpoint's
    index_share_for_mtp_iteration). draft_acceptance: "rejection" (drafts sampled from the MTP
    distribution, rejection sampling) or "target-only" (greedy drafts accepted with probability
    p(x), an ablation); greedy requests accept greedily under both.

    async_scheduling: overlap each step's host work (emitting the last step's tokens: detokenizing,
    stop checks; scheduling and filling in the next) with the device's work on the step in flight,
    which reads its input tokens from the device (default: on CUDA without speculative decoding).
    A sequence that a token ends (EOS, a stop string) then computes one token more, dropped.
    With speculative decoding (off unless asked for): a step of graphed decodes with KVShare drafts
    launches the next verify before its host sync, where each sequence will stand known on the
    device alone (`SpecDecoder.launch_next`); the host emits and schedules while it runs. Outputs
    are the same as without it. A sequence that ended meanwhile leaves its rows of the launched
    verify unused; a launch that a waiting request could join is dropped, the step scheduled anew;
    a batch with a sequence within two verifies of its max_tokens or max_model_len is not overlapped.

    warm_up: before the first request, run the step shapes that serving meets (see `warm_up`), so
    that no request waits for a CUDA graph capture or a Triton compile (default: on CUDA).
    step_log: a file that gets a JSON line for every step (megactx.engine.steplog).
    fuse: a checkpoint's model computes the linears that read one input as one GEMM and routes MoE
        tokens with one kernel (`Transformer.fuse_projections`); False keeps its modules as loaded
        (to measure what fusing saves). A model passed in is never changed.
    seed: the random streams of requests without a seed of their own (drawn in arrival order), so a
    run of the engine is reproducible as a whole.
    """

    def __init__(self, model: str | Path | Transformer, *, tokenizer: str | Path | None = None,
                 device: str | None = None, dtype: torch.dtype | None = None, backend: str | None = None,
                 kv_cache_dtype: str = "auto", index_cache_dtype: str | None = None, max_model_len: int | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 8192, gpu_memory_utilization: float = 0.9,
                 cpu_cache_bytes: int = 4 << 30, num_blocks: int | None = None, enable_prefix_caching: bool = True,
                 chunked_prefill: bool = True, cuda_graphs: bool = True, num_speculative_tokens: int = 0,
                 mtp_mode: str = "auto", draft_acceptance: str = "rejection", seed: int = 0,
                 async_scheduling: bool | None = None, warm_up: bool | None = None,
                 step_log: str | Path | None = None, hf_overrides: dict | None = None, fuse: bool = True):
        if not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be an int >= 0 (0 = no speculative decoding), "
                             f"got {num_speculative_tokens!r}")
        if mtp_mode not in MTP_MODES:
            raise ValueError(f"mtp_mode must be one of {', '.join(MTP_MODES)}, got {mtp_mode!r}")
        if draft_acceptance not in DRAFT_ACCEPTANCE:
            raise ValueError(f"draft_acceptance must be one of {', '.join(DRAFT_ACCEPTANCE)}, got {draft_acceptance!r}")
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization is the fraction of the GPU's memory the engine may use, in "
                             f"(0, 1]; got {gpu_memory_utilization}")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        on_cuda = torch.device(device).type == "cuda"
        dtype = dtype or (torch.bfloat16 if on_cuda else torch.float32)
        self.backend = backend or ("triton" if on_cuda else "torch")
        if isinstance(model, Transformer):
            if hf_overrides:
                raise ValueError("hf_overrides applies to a checkpoint directory; this model is already built")
            self.model = model.to(device).eval()
            source = None
        else:
            from megactx.model.weights import load_model

            self.model = load_model(model, device=device, dtype=dtype, hf_overrides=hf_overrides)
            if fuse:  # a model of its own: GEMMs that read one input become one
                self.model.fuse_projections()
            source = Path(model)
        self.cfg = self.model.cfg
        self.hf_overrides = dict(hf_overrides or {})
        tok_dir = Path(tokenizer) if tokenizer else source
        self.tokenizer = Tokenizer(tok_dir) if tok_dir and (tok_dir / "tokenizer.json").is_file() else None
        self.eos_token_ids = list(self.cfg.eos_token_id)
        spec = (SpecConfig.create(self.cfg, num_speculative_tokens, mtp_mode, draft_acceptance)
                if num_speculative_tokens else None)

        self.max_model_len = max_model_len or self.cfg.max_position_embeddings
        if self.max_model_len > self.cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                             f"{self.cfg.max_position_embeddings}")
        kv_dtype = resolve_cache_dtype(kv_cache_dtype, self.model.dtype)
        index_dtype = resolve_cache_dtype(index_cache_dtype or ("fp8" if on_cuda else "auto"), self.model.dtype)
        if num_blocks is None:
            num_blocks = plan_num_blocks(self.model, kv_dtype, index_dtype, max_model_len=self.max_model_len,
                                         max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                         gpu_memory_utilization=gpu_memory_utilization,
                                         cpu_cache_bytes=cpu_cache_bytes, backend=self.backend,
                                         cuda_graphs=cuda_graphs, shrink_to_fit=max_model_len is None)
            if num_blocks * BLOCK_SIZE < self.max_model_len:  # no max_model_len given: the longest that fits
                log.warning("megactx engine: the model's %d positions do not fit the KV cache; max_model_len = %d "
                            "(pass max_model_len, a smaller max_num_seqs or more memory to choose)",
                            self.max_model_len, num_blocks * BLOCK_SIZE)
                self.max_model_len = num_blocks * BLOCK_SIZE
        self.runner = ModelRunner(self.model, CacheConfig(kv_dtype, index_dtype, num_blocks), self.backend,
                                  max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
                                  max_num_batched_tokens=max_num_batched_tokens, cuda_graphs=cuda_graphs)
        self.block_manager = BlockManager(num_blocks, enable_prefix_caching=enable_prefix_caching,
                                          recompute_last_hit_block=spec is not None)
        self.scheduler = Scheduler(SchedulerConfig(max_model_len=self.max_model_len, max_num_seqs=max_num_seqs,
                                                   max_num_batched_tokens=max_num_batched_tokens,
                                                   chunked_prefill=chunked_prefill,
                                                   num_speculative_tokens=num_speculative_tokens,
                                                   num_lookahead_slots=spec.num_lookahead_slots if spec else 0),
                                   self.block_manager)
        self.device = torch.device(device)
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(seed))
        self.requests: dict[str, _Request] = {}
        self._seqs: dict[int, tuple[_Request, int]] = {}  # seq_id -> (request, completion index)
        self._generators: dict[int, RowGenerator] = {}  # seq_id -> its random stream
        self._seed = seed
        self._stream_seeds = random.Random(seed)  # the streams of requests without a seed
        self._ids = itertools.count()
        self._sampling = SamplingTensorsCache()
        self._pending: _Pending | None = None  # a step whose tokens are on their way to the host
        self.async_scheduling = (on_cuda and spec is None) if async_scheduling is None else async_scheduling
        # speculative decoding with async_scheduling: the next verify, launched before this step's host sync
        self._overlapped: tuple[list[Seq], TargetPass] | None = None
        self.stats = EngineStats()
        self.spec: SpecDecoder | None = None
        if spec is not None:
            self.spec = SpecDecoder(self.runner, spec, self.cfg.vocab_size, self.eos_token_ids, self.sampler.generator)
            self.stats.spec_decode = self.spec.stats
        log.info("megactx engine: %s", self.memory_report())
        self.step_log = StepLog(step_log) if step_log is not None else None
        self._last_schedule: SchedulerOutput | None = None
        self._device_wait_s = 0.0  # the step's wait for the device's tokens (for the step log)
        if on_cuda if warm_up is None else warm_up:
            self.warm_up()

    # ---------------------------------------------------------------------------- reports
    def memory_report(self) -> str:
        """KV blocks, cache bytes, and what IndexShare saves against an indexer in every layer."""
        cfg, cache = self.cfg, self.runner.cache
        per_token = cache_bytes_per_token(cfg, cache.kv_dtype, cache.index_dtype)
        every = cache_bytes_per_token(cfg, cache.kv_dtype, cache.index_dtype, indexer_in_every_layer=True)
        return (f"{cache.num_blocks} KV blocks = {cache.num_blocks * 64} tokens, {self.runner.cache_bytes / 2**20:.1f} "
                f"MiB; {per_token} B a token ({len(cfg.full_layers)} of {cfg.num_hidden_layers} layers keep an "
                f"indexer cache; an indexer in every layer would take {every} B a token)")

    def warm_up(self) -> None:
        """Run, on dummy requests, the step shapes that traffic meets, then forget them: steps of
        every row bucket of the mixed graphs up to the token budget; steps of the whole budget (eager
        where it exceeds the largest row bucket), once with every length a multiple of 16 and once odd
        (Triton compiles a kernel again for each class of its integer arguments: 1, multiples of 16,
        others); and a decode step of every batch bucket, greedy, and in a speculative engine also
        sampled at temperature 1 (its draft loop is a graph of its own, and the rejection rule a
        kernel to compile; top-k / top-p / min-p requests' loops are captured when first met).
        Without it the first step of each new shape waits for a CUDA graph capture or a Triton
        compile (tens of ms to seconds), which a server meets again and again as requests arrive
        apart. Contexts past the token budget still capture their key buckets' graphs, and compile
        the variants of their sizes, when first met."""
        if self.max_model_len < 2:
            return  # no request fits: one prompt token and one generated
        start = time.perf_counter()
        budget = self.scheduler.config.max_num_batched_tokens
        gamma = self.spec.config.num_speculative_tokens if self.spec else 0
        # tokens each request makes: room for verify steps with all γ drafts (a one-token prompt must fit)
        new_tokens = max(1, min(3 + 2 * gamma, self.max_model_len - 1))
        longest = self.max_model_len - new_tokens  # the longest prompt that leaves room for them
        graphs = self.runner.graphs
        rows = {r for r in (graphs.row_buckets if graphs else ()) if r <= budget} | {budget, budget - 1}
        rows = sorted(r for r in rows if 0 < r <= self.max_num_seqs * longest)
        vocab = self.cfg.vocab_size
        waves = []  # prompts added together: a step of r prefill rows, then decodes
        for r in rows:
            # r and the prompts' lengths (the step's key count) all multiples of 16, or r odd and the
            # longest prompt odd: the two classes of Triton's integer specialization the eager path meets
            size = max(1, longest // 16 * 16 if r % 16 == 0 else longest - 1 + longest % 2)
            sizes = [size] * (r // size) + ([r % size] if r % size else [])
            waves.append([[(len(waves) + j + t) % vocab for t in range(n)] for j, n in enumerate(sizes)])
        batches = graphs.batch_buckets if graphs else [1, self.max_num_seqs]
        decodes = [[[(3 * i + 1) % vocab] for i in range(b)] for b in batches]  # decodes of b sequences
        greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        waves = [(prompts, greedy) for prompts in waves + decodes]
        if gamma:
            waves += [(prompts, SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True))
                      for prompts in decodes]
        for w, (prompts, params) in enumerate(waves):
            for i, prompt in enumerate(prompts):
                self.add_request(prompt, params, request_id=f"warm-up-{w}-{i}")
            while self.has_unfinished():
                self.step()
        self.block_manager.reset_prefix_cache()
        if self.device.type == "cuda":  # the random streams' kernels compile now, not at the first sampled request
            for kind in (UNIFORM, EXPONENTIAL):
                for rows in (1, 2):
                    draw_rows(torch.empty(rows, self.cfg.vocab_size, device=self.device), kind,
                              [make_generator(row) for row in range(rows)], None)
        self._stream_seeds = random.Random(self._seed)  # the warm-up's requests took none of the requests' streams
        spec_stats = self.stats.spec_decode
        if spec_stats is not None:
            vars(spec_stats).update(vars(SpecDecodeStats(spec_stats.num_speculative_tokens)))
        self.stats = EngineStats(spec_decode=spec_stats)
        log.info("megactx engine: warmed up %d step shapes (%d CUDA graphs) in %.1f s", len(waves),
                 len(graphs.graphs) if graphs else 0, time.perf_counter() - start)

    # ---------------------------------------------------------------------------- requests
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, detokenize: bool = True) -> str:
        """Queue a prompt (text, or token ids); returns the request id. Raises ValueError for a
        prompt that cannot be served (empty, too long, or text without a tokenizer).

        detokenize=False: the engine handles the request's token ids only — its outputs and
        deltas carry no text, and its stop strings are the caller's to apply (CompletionText, then
        `abort(request_id, index)`): what `megactx serve` does, in its own process."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: give the prompt as token ids")
            text, prompt_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, prompt_ids = None, [int(t) for t in prompt]
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if any(t < 0 or t >= self.cfg.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.cfg.vocab_size})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; this engine's context is {self.max_model_len} "
                             "(prompt + at least one generated token)")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens {params.max_tokens} does not fit: the prompt has {len(prompt_ids)} "
                             f"tokens and the context is {self.max_model_len}, so at most "
                             f"{self.max_model_len - len(prompt_ids)} tokens can be generated")
        if params.stop and self.tokenizer is None and detokenize:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids")
        seqs = [Seq(next(self._ids), prompt_ids, params, request_id) for _ in range(params.n)]
        for seq in seqs:
            self.scheduler.add(seq)  # may refuse (a request the cache can never hold): then none is added
        request = _Request(request_id, text, prompt_ids, params, seqs, self.tokenizer if detokenize else None,
                           self.eos_token_ids)
        if self.spec is not None:
            request.output.spec_decode = SpecDecodeStats(self.spec.config.num_speculative_tokens)
        self.requests[request_id] = request
        for i, seq in enumerate(seqs):
            self._seqs[seq.seq_id] = (request, i)
            # completion i of a seeded request draws from seed + i; the others from a seed of the
            # engine's (every request has a stream: a batch's draws are then one launch, and the
            # sampled draft loop a graph)
            stream_seed = params.seed + i if params.seed is not None else self._stream_seeds.getrandbits(64)
            self._generators[seq.seq_id] = make_generator(stream_seed)
        self.stats.prompt_tokens += len(prompt_ids) * params.n
        return request_id

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Stop a request now and free its blocks (a client went away); with `index`, only that one
        of its completions (a stop string the caller found). Unknown ids are ignored."""
        request = self.requests.get(request_id)
        if request is None:
            return
        outputs = request.output.outputs
        if index is not None and not 0 <= index < len(outputs):
            return
        for i in range(len(outputs)) if index is None else [index]:
            if outputs[i].finish_reason is None:  # else its sequence is finished and gone already
                self.scheduler.finish(request.seqs[i])
                self._forget(request.seqs[i])
                outputs[i].finish_reason = "abort"
        if request.output.finished:
            del self.requests[request_id]

    @property
    def max_num_seqs(self) -> int:
        """Sequences the engine runs at once."""
        return self.scheduler.config.max_num_seqs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._pending is not None

    def _forget(self, seq: Seq) -> None:
        self._seqs.pop(seq.seq_id, None)
        self._generators.pop(seq.seq_id, None)
        if self.spec is not None:
            self.spec.forget(seq.seq_id)

    # ---------------------------------------------------------------------------- one step
    def step(self) -> list[Delta]:
        """Run one scheduler step; returns a Delta for every completion that got tokens (one, or
        with speculative decoding the accepted drafts and the token after them). With overlapped
        steps (`async_scheduling`) the deltas are those of the step before, whose tokens reached
        the host while this one ran on the device."""
        if self.step_log is None:
            return self._step()
        start = time.perf_counter()
        self._last_schedule, self._device_wait_s = None, 0.0
        deltas = self._step()
        out = self._last_schedule
        if out is not None and not out.is_empty:
            graphs = self.runner.graphs
            self.step_log.record(start, time.perf_counter(), out.scheduled, out.num_batched_tokens,
                                 self.scheduler.num_running, self.scheduler.num_waiting,
                                 len(graphs.graphs) if graphs else 0, None if self.spec else self._device_wait_s)
        if not self.has_unfinished():
            self.step_log.flush()  # idle now: the lines so far are on disk for whoever reads them
        return deltas

    @torch.inference_mode()
    def _step(self) -> list[Delta]:
        if self.spec is not None:
            return self._spec_step(self.spec)
        with phase("schedule"):
            out = self._last_schedule = self.scheduler.schedule()
        self.stats.preemptions += len(out.preempted)
        if out.is_empty:
            return self._resolve()  # the last step's tokens
        self.stats.steps += 1
        fed = None
        if (pending := self._pending) is not None:  # decodes whose input is the last step's token
            ends = itertools.accumulate(item.num_tokens for item in out.scheduled)  # past each chunk's last token
            last = [(end - 1, pending.rows[item.seq.seq_id]) for end, item in zip(ends, out.scheduled)
                    if item.samples and item.seq.token_ids[-1] == PENDING_TOKEN and item.seq.seq_id in pending.rows]
            if last:  # gathered from the last step's tokens in the copy that takes the step's inputs
                fed = DeviceTokens([t for t, _ in last], pending.tokens, [r for _, r in last])
        with phase("forward"):
            logits = self.runner.execute(out.scheduled, fed)  # [R, V]
        seqs = [item.seq for item in out.scheduled if item.samples]
        deltas = None
        with phase("sample"):
            if seqs and self._sampling.argmax_only(seqs, self.cfg.vocab_size, self.eos_token_ids):
                launched = _Pending.launch(seqs, SamplerOutput(logits.argmax(dim=-1)))  # what the sampler would do
            elif seqs:
                tensors = self._sampling.get(seqs, self.device, self.cfg.vocab_size, self.eos_token_ids)
                batch = SamplingBatch(tensors, generators=[self._generators.get(seq.seq_id) for seq in seqs])
                if tensors.any_penalties or tensors.any_min_tokens:  # they read the outputs on the host
                    deltas = self._resolve()
                    batch.prompt_token_ids = pad_token_ids([s.token_ids[: s.num_prompt_tokens] for s in seqs],
                                                           self.device)
                    batch.output_token_ids = pad_token_ids([s.output_token_ids for s in seqs], self.device)
                launched = _Pending.launch(seqs, self.sampler(logits, batch))
        if deltas is None:
            with phase("emit"):
                deltas = self._resolve()  # the step before: on the host by now, or soon
        # each sampling chunk's token is known to come: scheduling counts it from now on
        self.scheduler.postprocess(out, {seq.seq_id: PENDING_TOKEN for seq in seqs})
        if seqs:
            launched.positions = {seq.seq_id: seq.num_tokens - 1 for seq in seqs if not seq.is_finished}
            self._pending = launched
            if not self.async_scheduling:
                with phase("emit"):
                    deltas += self._resolve()
        return deltas

    def _resolve(self) -> list[Delta]:
        """Wait for the pending step's tokens, put them in place of their sequences' PENDING_TOKEN,
        and emit them (finishing the sequences they end)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return []
        waiting = time.perf_counter()
        with device_wait():
            tokens, logprobs, top_lps, top_ids = pending.fetch()
        now = time.perf_counter()
        self._device_wait_s += now - waiting
        deltas = []
        for row, (seq, token) in enumerate(zip(pending.seqs, tokens)):
            position = pending.positions.get(seq.seq_id)
            if position is not None and position < seq.num_tokens:
                seq.token_ids[position] = token
            owner = self._seqs.get(seq.seq_id)
            if owner is None or seq.is_finished:
                continue  # aborted, or finished by the step before (this token was computed in vain)
            request, index = owner
            lps = None
            if request.params.logprobs is not None:
                k = request.params.logprobs
                lps = [TokenLogprobs(token, logprobs[row], dict(zip(top_ids[row][:k], top_lps[row][:k])))]
            deltas.append(self._emit(request, index, seq, [token], lps, now))
        return deltas

    def _spec_step(self, spec: SpecDecoder) -> list[Delta]:
        """One step of the speculative engine: schedule with the drafts held, target forward over
        known tokens and drafts, verify, record, MTP KV + next drafts, emit."""
        with phase("schedule"):
            out, target = self._overlapped_step(spec)  # a verify launched in the step before, if it holds
            if out is None:
                out = self.scheduler.schedule(spec.draft_lengths())
            self._last_schedule = out
        self.stats.preemptions += len(out.preempted)
        for seq in out.preempted:
            spec.forget(seq.seq_id)  # its KV is gone; it drafts again after its recompute
        if out.is_empty:
            return []
        self.stats.steps += 1
        with phase("forward"):
            if target is None:
                target = spec.forward(out.scheduled)
        with phase("verify"):  # its one host sync waits for the forward
            emitted = spec.verify(out.scheduled, target, self._generators,
                                  before_sync=lambda result: self._launch_next(spec, out, result))
        self.scheduler.postprocess(out, {seq_id: e.tokens for seq_id, e in emitted.items()})
        wanted = {item.seq.seq_id: self.scheduler.max_draft_tokens(item.seq) for item in out.scheduled if item.samples}
        with phase("propose"):
            spec.propose(out.scheduled, target, wanted, self._generators)

        now = time.perf_counter()
        deltas = []
        with phase("emit"):
            for item in out.scheduled:
                if not item.samples:
                    continue
                seq, e = item.seq, emitted[item.seq.seq_id]
                request, index = self._seqs[seq.seq_id]
                if e.num_drafts:
                    request.output.spec_decode.record(e.num_drafts, e.num_accepted)
                logprobs = None
                if request.output.outputs[index].logprobs is not None:
                    k = request.params.logprobs
                    logprobs = [TokenLogprobs(token, lp, dict(itertools.islice(top.items(), k)))
                                for token, (lp, top) in zip(e.tokens, e.logprobs)]
                deltas.append(self._emit(request, index, seq, e.tokens, logprobs, now))
        return deltas

    def _launch_next(self, spec: SpecDecoder, out: SchedulerOutput, result: VerifyResult) -> None:
        """With async_scheduling, before this step's host sync: the next step's verify, where it
        can be launched without the host (see `async_scheduling`): every sequence of this graphed
        verify drafts γ and verifies them next whatever it accepts now (its limits leave room), no
        waiting request could join the batch, and each one's blocks already cover, or get without
        preempting, the next verify's positions."""
        sched = self.scheduler
        if not self.async_scheduling or self._may_admit():
            return
        gamma = spec.config.num_speculative_tokens
        if len(out.scheduled) * (gamma + 1) > sched.config.max_num_batched_tokens:
            return
        # room for this step's γ + 1 tokens and the next step's γ drafts (max_draft_tokens then)
        if any(item.num_draft_tokens != gamma or sched.draft_room(item.seq) < 2 * gamma + 1 for item in out.scheduled):
            return
        worst = 2 * gamma + 2  # positions from this verify's first: its own, then the next's after all accepted
        if not all(sched.reserve_ahead(item.seq, worst) for item in out.scheduled):
            return
        target = spec.launch_next(out.scheduled, result)
        if target is not None:
            self._overlapped = ([item.seq for item in out.scheduled], target)

    def _may_admit(self) -> bool:
        """Whether the next schedule() could admit a waiting request (the batch has room for one)."""
        return bool(self.scheduler.num_waiting) and self.scheduler.num_running < self.scheduler.config.max_num_seqs

    def _overlapped_step(self, spec: SpecDecoder) -> tuple[SchedulerOutput | None, TargetPass | None]:
        """The step a verify launched before the last step's host sync computes (`_launch_next`),
        and its forward, if it still holds: no waiting request could join, and the sequences of it
        that run on (those that ended or were aborted meanwhile leave their rows, computed in vain)
        each hold γ drafts. (None, None) otherwise: the step is scheduled anew, and the KV that
        verify wrote past each sequence's computed positions is written again."""
        launched, self._overlapped = self._overlapped, None
        if launched is None:
            return None, None
        seqs, target = launched
        gamma, held = spec.config.num_speculative_tokens, spec.draft_lengths()
        going = [(b, seq) for b, seq in enumerate(seqs) if seq.status is SequenceStatus.RUNNING]
        if not going or self._may_admit() or any(
                held.get(seq.seq_id) != gamma or seq.num_tokens - seq.num_computed_tokens != 1 for _, seq in going):
            spec.overlapped_discarded += 1
            return None, None
        if len(going) < len(seqs):  # sequence b's rows stay where the launch put them: from row b·q
            target = dataclasses.replace(target, first_rows=[b * target.q for b, _ in going])
        return SchedulerOutput([ScheduledSeq(seq, seq.num_tokens - 1, 1, gamma) for _, seq in going], [],
                               len(going) * (gamma + 1)), target

    def _emit(self, request: _Request, index: int, seq: Seq, tokens: list[int], logprobs: list[TokenLogprobs] | None,
              now: float) -> Delta:
        """Add a step's tokens (logprobs: one entry a token, or None) to a completion in order, until
        one of them finishes it (the rest are dropped), and return what became visible. (Runs for
        every sequence every step: the state it touches is in locals.)"""
        state = request.completions[index]
        completion = state.output
        last_time = state.last_token_time
        if last_time is None and request.output.first_token_time is None:
            request.output.first_token_time = now
            request.output.num_cached_tokens = seq.num_cached_tokens
            self.stats.time_to_first_token.append(now - request.output.arrival_time)
        state.last_token_time = now

        params, token_ids = request.params, completion.token_ids
        # the token rules: a stop token (after min_tokens), max_tokens, the context's end
        stop_ids, max_tokens, min_tokens = request.stop_token_ids, params.max_tokens, params.min_tokens
        room = self.max_model_len - seq.num_prompt_tokens  # outputs that fill the context
        taken, reason = 0, None
        for token in tokens:
            token_ids.append(token)
            taken += 1
            if token in stop_ids and len(token_ids) >= min_tokens:
                reason = "stop"
                break
            if len(token_ids) >= max_tokens or len(token_ids) >= room:
                reason = "length"
                break
        delta_text = ""
        if state.text is not None:  # the text rules (stop strings) may end it at an earlier token
            delta_text, kept, reason = state.text.add(tokens[:taken], reason)
            if kept < taken:
                del token_ids[kept - taken:]
                taken = kept
        self.stats.generation_tokens += taken
        if last_time is not None:
            # a step that emits several tokens (speculative decoding) spreads its gap over them
            gap = (now - last_time) / taken
            if taken == 1:
                self.stats.inter_token_latency.append(gap)
            else:
                self.stats.inter_token_latency.extend([gap] * taken)
        if logprobs is not None:
            logprobs = logprobs[:taken]
            completion.logprobs.extend(logprobs)
        if reason is not None:
            completion.finish_reason = reason
            self.scheduler.finish(seq)
            self._forget(seq)
            if request.output.finished:
                request.output.finish_time = now
                self.requests.pop(request.output.request_id, None)
        if delta_text:
            completion._pieces.append(delta_text)
        return Delta(request.output.request_id, index, delta_text, tokens[:taken], logprobs, completion.finish_reason)

    # ---------------------------------------------------------------------------- front ends
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt (text or token ids); outputs in the prompts' order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        outputs = {rid: self.requests[rid].output for rid in ids}
        from tqdm import tqdm

        unfinished = {rid for rid, o in outputs.items() if not o.finished}
        progress = _Progress(self, [seq for rid in ids for seq in self.requests[rid].seqs])
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while unfinished:
                for delta in self.step():
                    rid = delta.request_id
                    if delta.finish_reason is not None and rid in unfinished and outputs[rid].finished:
                        unfinished.discard(rid)
                        bar.update(1)
                if not bar.disable and progress.due():
                    bar.set_postfix_str(progress.line())
            if not bar.disable:
                bar.set_postfix_str(progress.line())
        return [outputs[rid] for rid in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               prefill_progress: bool = False) -> Iterator[Delta]:
        """Yield the request's deltas as they come (other queued requests advance too).
        prefill_progress: until the first delta, a progress bar on stderr of the prompt tokens in
        the cache (a long prompt's wait), cleared when the text starts."""
        from tqdm import tqdm

        request_id = self.add_request(prompt, params)
        progress = _Progress(self, self.requests[request_id].seqs)
        bar = tqdm(total=progress.prompt_total, desc="prefill", unit="tok", leave=False, disable=not prefill_progress,
                   mininterval=0, miniters=1)  # progress.due() paces it
        try:
            while request_id in self.requests:
                for delta in self.step():
                    if delta.request_id == request_id:
                        bar.close()
                        yield delta
                if not bar.disable and progress.due():
                    bar.update(progress.prompt_done() - bar.n)
        finally:
            bar.close()
            self.abort(request_id)
