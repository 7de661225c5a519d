"""Reports of `megactx bench kernels`: the layer-group figures and the issue's targets, derived from
the raw measurements, and the JSON + Markdown + PNG written from them.

Everything here reads only the results dict (`benchmarks.kernels.SCHEMA`), so a report can be
written again from a saved JSON (`megactx bench kernels --from-json FILE`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.common import (
    EXTRAPOLATED,
    MEASURED,
    SAMPLED,
    Ceilings,
    Measurement,
    ceilings_markdown,
    fmt_context,
    fmt_num,
    fmt_time,
    md_table,
    pyplot,
    save_figure,
    weakest_method,
    write_suite_reports,
)

# Targets of the issue (benchmark figures, not tests).
INDEXER_CEILING_FRACTION = 0.5  # indexer logits >= 50% of the measured FP8 matmul ceiling ...
INDEXER_TARGET_FROM = 32 << 10  # ... at contexts >= 32K
TOPK_OVERHEAD_MAX = 1.5  # logits + top-k within 1.5x of logits alone ...
TOPK_TARGET_FROM = 64 << 10  # ... at 64K and beyond
DEEPGEMM_TOPK_TFLOPS = 300.0  # DeepGEMM logits + torch.topk, 64 indexer heads, 64K, H200: to beat
SPARSE_PREFILL_TFLOPS = 350.0  # sparse MLA prefill, bf16 KV
DECODE_TFLOPS = 200.0  # sparse decode at batch 64, where compute bounds it ...
DECODE_COPY_FRACTION = 0.7  # ... or this fraction of the copy bandwidth, where memory does
GROUP_VS_EVERY = 2.5  # IndexShare group vs every layer its own indexer ...
GROUP_VS_DENSE = 10.0  # ... and vs dense SDPA ...
GROUP_TARGET_FROM = 128 << 10  # ... at 128K and beyond, the ratios growing with context

# Kernel table order, and the name a reader sees.
LABELS = {
    "write_kv.bf16": "KV write, bf16 cache (+ indexer keys)",
    "write_kv.fp8": "KV write, FP8 cache (+ indexer keys)",
    "write_kv.bf16.keys": "KV write, bf16 cache, keys made from the projections (norms, ropes, rotation)",
    "indexer.logits": "indexer logits, prefill",
    "indexer.logits+topk": "indexer logits + top-k, prefill",
    "indexer.decode.logits": "indexer logits, decode",
    "indexer.decode.logits+topk": "indexer logits + top-k, decode",
    "sparse_mla.prefill.bf16": "sparse MLA prefill, bf16 KV",
    "sparse_mla.prefill.fp8": "sparse MLA prefill, FP8 KV",
    "sparse_mla.decode.bf16": "sparse MLA decode, bf16 KV",
    "sparse_mla.decode.fp8": "sparse MLA decode, FP8 KV",
    "plain.indexer+topk": "peer: plain torch indexer + top-k, prefill",
    "plain.sparse.prefill": "peer: plain torch sparse attention, prefill",
    "plain.indexer.decode+topk": "peer: plain torch indexer + top-k, decode",
    "plain.sparse.decode": "peer: plain torch sparse attention, decode",
    "sdpa.prefill": "peer: dense SDPA, prefill",
    "bound.read.decode": "bound: read of the decode's rows alone (bf16 KV, no math)",
}
CEILING_LABELS = {"bf16_mm": "bf16 mm", "fp8_mm": "FP8 mm"}


class Figures:
    """The measurements of a results dict, looked up by (name, context)."""

    def __init__(self, results: dict[str, Any]):
        self.all = [Measurement.from_dict(d) for d in results["measurements"]]
        self._by_key = {(m.name, m.context): m for m in self.all}
        self.contexts = sorted({m.context for m in self.all})

    def get(self, name: str, context: int) -> Measurement | None:
        return self._by_key.get((name, context))

    def named(self, name: str) -> list[Measurement]:
        return sorted((m for m in self.all if m.name == name), key=lambda m: m.context)


# ------------------------------------------------------------------------------ derived figures
def layer_groups(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One layer group's prefill at each context, composed of the one-layer figures measured above:
    IndexShare = 1 × (indexer logits + top-k) + G × sparse MLA (bf16 KV); every layer its own
    indexer = G × (logits + top-k + sparse MLA); dense = G × SDPA; plain = the IndexShare group in
    plain PyTorch. G = layers a group (`geometry.group_layers`)."""
    fig, G = Figures(results), results["geometry"]["group_layers"]
    rows = []
    for L in fig.contexts:
        idx, sp = fig.get("indexer.logits+topk", L), fig.get("sparse_mla.prefill.bf16", L)
        if idx is None or sp is None:
            continue
        row: dict[str, Any] = {"context": L, "layers": G, "group_s": idx.time_s + G * sp.time_s,
                               "every_layer_s": G * (idx.time_s + sp.time_s),
                               "method": weakest_method([idx.method, sp.method])}
        row["every_over_group"] = row["every_layer_s"] / row["group_s"]
        dense = fig.get("sdpa.prefill", L)
        if dense is not None:
            row |= {"dense_s": G * dense.time_s, "dense_method": dense.method,
                    "dense_over_group": G * dense.time_s / row["group_s"]}
        pidx, psp = fig.get("plain.indexer+topk", L), fig.get("plain.sparse.prefill", L)
        if pidx is not None and psp is not None:
            plain = pidx.time_s + G * psp.time_s
            row |= {"plain_group_s": plain, "plain_method": weakest_method([pidx.method, psp.method]),
                    "plain_over_group": plain / row["group_s"]}
        rows.append(row)
    return rows


def _target(target: str, context: int | None, figure: str, needs: str, passed: bool | None,
            note: str = "") -> dict[str, Any]:
    return {"target": target, "context": context, "figure": figure, "needs": needs, "passed": passed, "note": note}


def decode_bound(m: Measurement, ceilings: Ceilings) -> str:
    """'memory' or 'compute': which ceiling bounds a kernel's time (the roofline: the larger of
    flops / matmul rate and bytes / copy bandwidth)."""
    t_compute = m.flops / (ceilings.bf16_mm * 1e12)
    t_memory = m.bytes / (ceilings.copy * 1e9)
    return "memory" if t_memory >= t_compute else "compute"


def evaluate_targets(results: dict[str, Any], groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, one row per (target, context) that the run covers; passed is None where
    a ceiling or a figure is missing, and a target with no context in the run gets one row saying so."""
    fig, c = Figures(results), Ceilings.from_dict(results["ceilings"])
    rows: list[dict[str, Any]] = []

    def not_run(target: str, needs: str, since: int) -> None:
        rows.append(_target(target, None, "–", needs, None, f"no context >= {fmt_context(since)} in this run"))

    t = f"indexer logits >= {INDEXER_CEILING_FRACTION:.0%} of the FP8 matmul ceiling"
    found = [m for m in fig.named("indexer.logits") if m.context >= INDEXER_TARGET_FROM]
    for m in found:
        frac = m.tflops / c.fp8_mm if c.fp8_mm else None
        rows.append(_target(t, m.context, f"{m.tflops:.0f} TFLOP/s = {fmt_num(frac and 100 * frac)}%",
                            f">= {INDEXER_CEILING_FRACTION * (c.fp8_mm or 0):.0f} TFLOP/s",
                            None if frac is None else frac >= INDEXER_CEILING_FRACTION))
    if not found:
        not_run(t, f">= {INDEXER_CEILING_FRACTION:.0%} of FP8 mm", INDEXER_TARGET_FROM)

    t1 = f"indexer logits + top-k within {TOPK_OVERHEAD_MAX}x of logits alone"
    t2 = f"indexer logits + top-k > {DEEPGEMM_TOPK_TFLOPS:.0f} TFLOP/s effective (DeepGEMM + torch.topk, 64 heads)"
    found = [m for m in fig.named("indexer.logits+topk") if m.context >= TOPK_TARGET_FROM]
    for m in found:
        logits = fig.get("indexer.logits", m.context)
        ratio = m.time_s / logits.time_s if logits else None
        rows.append(_target(t1, m.context, f"{fmt_num(ratio)}x", f"<= {TOPK_OVERHEAD_MAX}x",
                            None if ratio is None else ratio <= TOPK_OVERHEAD_MAX))
        rows.append(_target(t2, m.context, f"{m.tflops:.0f} TFLOP/s", f"> {DEEPGEMM_TOPK_TFLOPS:.0f} TFLOP/s",
                            m.tflops > DEEPGEMM_TOPK_TFLOPS))
    if not found:
        not_run(t1, f"<= {TOPK_OVERHEAD_MAX}x", TOPK_TARGET_FROM)
        not_run(t2, f"> {DEEPGEMM_TOPK_TFLOPS:.0f} TFLOP/s", TOPK_TARGET_FROM)

    t = f"sparse MLA prefill (bf16 KV) >= {SPARSE_PREFILL_TFLOPS:.0f} TFLOP/s"
    for m in fig.named("sparse_mla.prefill.bf16"):
        rows.append(_target(t, m.context, f"{m.tflops:.0f} TFLOP/s", f">= {SPARSE_PREFILL_TFLOPS:.0f} TFLOP/s",
                            m.tflops >= SPARSE_PREFILL_TFLOPS))

    for kind in ("bf16", "fp8"):
        t = (f"sparse decode ({kind} KV) >= {DECODE_TFLOPS:.0f} TFLOP/s or >= {DECODE_COPY_FRACTION:.0%} "
             "of copy bandwidth, whichever bound applies")
        for m in fig.named(f"sparse_mla.decode.{kind}"):
            if c.bf16_mm is None or c.copy is None:
                rows.append(_target(t, m.context, f"{m.tflops:.0f} TFLOP/s", "–", None, "a ceiling is missing"))
                continue
            bound = decode_bound(m, c)
            if bound == "memory":
                rows.append(_target(t, m.context, f"{m.gbps:.0f} GB/s = {100 * m.gbps / c.copy:.0f}% of copy",
                                    f">= {DECODE_COPY_FRACTION * c.copy:.0f} GB/s (memory-bound)",
                                    m.gbps >= DECODE_COPY_FRACTION * c.copy,
                                    _read_bound_note(fig.get("bound.read.decode", m.context), m, c)))
            else:
                rows.append(_target(t, m.context, f"{m.tflops:.0f} TFLOP/s",
                                    f">= {DECODE_TFLOPS:.0f} TFLOP/s (compute-bound)", m.tflops >= DECODE_TFLOPS))

    t1 = f"layer group (IndexShare) >= {GROUP_VS_EVERY}x faster than every layer with its own indexer"
    t2 = f"layer group (IndexShare) >= {GROUP_VS_DENSE:.0f}x faster than dense SDPA"
    late = [g for g in groups if g["context"] >= GROUP_TARGET_FROM]
    for g in late:
        every_bound, dense_bound = group_bound_notes(fig, c, g)
        passed = g["every_over_group"] >= GROUP_VS_EVERY
        rows.append(_target(t1, g["context"], f"{g['every_over_group']:.2f}x", f">= {GROUP_VS_EVERY}x", passed,
                            _joined(_method_note(g["method"]), "" if passed else every_bound)))
        if "dense_over_group" in g:
            passed = g["dense_over_group"] >= GROUP_VS_DENSE
            note = _method_note(weakest_method([g["method"], g["dense_method"]]))
            rows.append(_target(t2, g["context"], f"{g['dense_over_group']:.1f}x", f">= {GROUP_VS_DENSE:.0f}x",
                                passed, _joined(note, "" if passed else dense_bound)))
    if not late:
        not_run(t1, f">= {GROUP_VS_EVERY}x", GROUP_TARGET_FROM)
        not_run(t2, f">= {GROUP_VS_DENSE:.0f}x", GROUP_TARGET_FROM)

    for key, what in (("every_over_group", "every-layer-indexer / group"), ("dense_over_group", "dense / group")):
        series = [(g["context"], g[key]) for g in groups if key in g]
        if len(series) >= 2:
            grows = all(b[1] > a[1] for a, b in zip(series, series[1:]))
            text = " → ".join(f"{fmt_context(L)}: {r:.2f}x" for L, r in series)
            rows.append(_target(f"ratio {what} grows with context", None, text, "increasing", grows))
    return rows


def group_bound_notes(fig: Figures, c: Ceilings, g: dict[str, Any]) -> tuple[str, str]:
    """What bounds a layer group's two ratios at its context, by FLOPs against the ceilings of the
    run (the indexer's on the FP8 matmul ceiling, sparse MLA's and SDPA's on bf16): ('', '') where a
    figure or a ceiling is missing.

    every-layer / group = G (I + S) / (I + G S), I the indexer's time and S one sparse MLA's: it
    grows with I / S only, so with both kernels at the same fraction of their ceilings it is fixed by
    their FLOPs, and R needs I / S >= G (R - 1) / (G - R) (4 for R = 2.5, G = 4): a slower indexer,
    not faster kernels. dense / group compares times: with every kernel at its ceiling it would be
    the FLOP-time ratio; R needs the group's work done at R / that ratio of dense SDPA's efficiency."""
    L, G = g["context"], g["layers"]
    idx, sp, dn = fig.get("indexer.logits", L), fig.get("sparse_mla.prefill.bf16", L), fig.get("sdpa.prefill", L)
    if None in (idx, sp, c.fp8_mm, c.bf16_mm) or idx.flops is None or sp.flops is None:
        return "", ""
    i_min, s_min = idx.flops / (c.fp8_mm * 1e12), sp.flops / (c.bf16_mm * 1e12)  # seconds at the ceilings
    at_ceilings = G * (i_min + s_min) / (i_min + G * s_min)
    needs = G * (GROUP_VS_EVERY - 1) / (G - GROUP_VS_EVERY)
    every = (f"bound by FLOPs: logits / sparse MLA = {i_min / s_min:.2f} at their ceilings, so {at_ceilings:.2f}x "
             f"with both at the same fraction of them; {GROUP_VS_EVERY}x needs the indexer {needs:.0f}x as slow "
             "as a sparse MLA")
    if dn is None or dn.flops is None:
        return every, ""
    group_min, dense_min = i_min + G * s_min, G * dn.flops / (c.bf16_mm * 1e12)
    dense_eff, group_eff = dense_min / g["dense_s"], group_min / g["group_s"]  # fraction of the ceilings
    group_needs = GROUP_VS_DENSE * dense_eff * group_min / dense_min
    dense = (f"bound by FLOPs: at the ceilings dense x {G} takes {dense_min / group_min:.1f}x the group's time; "
             f"{GROUP_VS_DENSE:.0f}x needs the group at {100 * group_needs:.0f}% "
             f"of its ceilings (dense SDPA runs at {100 * dense_eff:.0f}%), it runs at {100 * group_eff:.0f}%")
    return every, dense


def _joined(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


def _read_bound_note(read: Measurement | None, m: Measurement, c: Ceilings) -> str:
    """What the rows' reading alone reaches, beside a memory-bound decode figure (the same bytes)."""
    if read is None or read.gbps is None or m.bytes != read.bytes:
        return ""
    return (f"a read of the same rows alone, no math: {read.gbps:.0f} GB/s = {100 * read.gbps / c.copy:.0f}% of "
            f"copy; the kernel takes {m.time_s / read.time_s:.2f}x its time")


def _method_note(method: str) -> str:
    return "" if method == MEASURED else f"from {method} figures"


# ------------------------------------------------------------------------------ Markdown
def _marked(seconds: float | None, method: str | None) -> str:
    if seconds is None:
        return "–"
    return fmt_time(seconds) + ("" if method in (None, MEASURED) else f" ({method})")


def _how(m: Measurement) -> str:
    """The method of a figure with what a reader needs to judge it (chunks timed, base context)."""
    d = m.detail
    if m.method == SAMPLED and "timed_chunks" in d:
        return f"{m.method} ({d['timed_chunks']}/{d['total_chunks']} chunks of {d.get('chunk_rows', '?')} rows)"
    if m.method == MEASURED and "chunk_rows" in d:
        return f"{m.method} (chunks of {d['chunk_rows']} rows)"
    if m.method == EXTRAPOLATED and "from_context" in d:
        return f"{m.method} from {fmt_context(d['from_context'])}"
    return m.method


def _speedup(peer: Measurement | None, ours: Measurement | None) -> str:
    if peer is None or ours is None:
        return "–"
    return f"{fmt_num(peer.time_s / ours.time_s)}x"


def render_markdown(results: dict[str, Any], groups: list[dict[str, Any]], targets: list[dict[str, Any]]) -> str:
    fig, c = Figures(results), Ceilings.from_dict(results["ceilings"])
    m, s, g = results["machine"], results["settings"], results["geometry"]
    device = m.get("gpu") or m["device"]
    out = [f"# megactx kernel benchmark: {device}\n"]
    versions = f"torch {m['torch']}, triton {m['triton']}" + (f", CUDA {m['cuda']}" if m.get("cuda") else "")
    out.append(f"{m['date']}; {versions}. Model geometry `{s['model']}`: {g['heads']} heads, kv_lora_rank "
               f"{g['kv_lora_rank']} + rope {g['rope_dim']}, indexer {g['index_heads']} x {g['index_dim']}, top-k "
               f"{g['topk']}, groups of {g['group_layers']} layers. Contexts "
               + ", ".join(fmt_context(L) for L in s["contexts"])
               + f"; {s['budget_s']} s of timed runs a figure; decode batch {s['batch']}"
               + (f"; whole run {results['wall_s']:.0f} s" if "wall_s" in results else "") + ".\n")
    ran = sorted({(m.name.rsplit(".", 1)[-1], m.detail["kernel"]) for m in fig.all
                  if m.name.startswith("sparse_mla.") and "kernel" in m.detail})
    if ran:
        out.append("Sparse MLA ran `sparse_mla`'s default kernel for each cache: "
                   + ", ".join(f"`{kernel}` ({cache})" for cache, kernel in ran) + ".\n")
    out.append("Times are of one layer: one kernel (or peer) over a whole causal prefill of L queries, or one "
               "decode step of the batch at context L. **Method**: *measured* = the whole work was timed; "
               "*sampled* = evenly spread query-row chunks were timed and scaled to the whole prefill by the exact "
               "FLOP ratio; *extrapolated* = not run at this size (memory or time), scaled from the largest run "
               "size at the same rate. FLOP and byte accounting: `benchmarks/README.md`.\n")
    if m["device"] != "cuda":
        out.append("**This is a CPU smoke run under the Triton interpreter: the figures measure nothing.**\n")

    out.append(ceilings_markdown(c))

    out.append("\n## Kernels and peers, one layer\n")
    rows = []
    for name in LABELS:
        for x in fig.named(name):
            ceil = c.tflops(x.ceiling)
            pct = f"{100 * x.tflops / ceil:.0f}% of {CEILING_LABELS[x.ceiling]}" if x.tflops and ceil else "–"
            copy = f"{100 * x.gbps / c.copy:.0f}%" if x.gbps and c.copy else "–"
            rows.append([LABELS[name], fmt_context(x.context), fmt_time(x.time_s), fmt_num(x.tflops), pct,
                         fmt_num(x.gbps), copy, _how(x)])
    out.append(md_table(["kernel", "context", "time", "TFLOP/s", "of ceiling", "GB/s", "of copy", "method"], rows))

    out.append("\n## Peers side by side, prefill of one layer\n")
    rows = []
    for L in fig.contexts:
        ti, pi = fig.get("indexer.logits+topk", L), fig.get("plain.indexer+topk", L)
        ts, ps = fig.get("sparse_mla.prefill.bf16", L), fig.get("plain.sparse.prefill", L)
        dn = fig.get("sdpa.prefill", L)
        rows.append([fmt_context(L), *(_marked(x and x.time_s, x and x.method) for x in (ti, pi)), _speedup(pi, ti),
                     *(_marked(x and x.time_s, x and x.method) for x in (ts, ps)), _speedup(ps, ts),
                     _marked(dn and dn.time_s, dn and dn.method)])
    out.append(md_table(["context", "indexer + top-k, Triton", "plain torch", "speed-up", "sparse MLA (bf16), Triton",
                         "plain torch", "speed-up", "dense SDPA"], rows))

    out.append(f"\n## Peers side by side, decode of a batch of {s['batch']}\n")
    rows = []
    for L in fig.contexts:
        ti, pi = fig.get("indexer.decode.logits+topk", L), fig.get("plain.indexer.decode+topk", L)
        ts, ps = fig.get("sparse_mla.decode.bf16", L), fig.get("plain.sparse.decode", L)
        rd = fig.get("bound.read.decode", L)
        rows.append([fmt_context(L), *(_marked(x and x.time_s, x and x.method) for x in (ti, pi)), _speedup(pi, ti),
                     *(_marked(x and x.time_s, x and x.method) for x in (ts, ps)), _speedup(ps, ts),
                     _marked(rd and rd.time_s, rd and rd.method), _speedup(ts, rd)])
    out.append(md_table(["context", "indexer + top-k, Triton", "plain torch", "speed-up", "sparse MLA (bf16), Triton",
                         "plain torch", "speed-up", "read of its rows alone", "sparse MLA / read"], rows))

    G = g["group_layers"]
    out.append(f"\n## One layer group: 1 full + {G - 1} shared layers, prefill\n")
    out.append(f"Composed of the one-layer figures above: IndexShare = indexer logits + top-k once + {G} sparse MLA "
               f"(bf16 KV); every layer its own indexer = {G} x (logits + top-k + sparse MLA); dense = {G} x SDPA; "
               "plain torch = the IndexShare group with the plain peers.\n")
    rows = []
    for row in groups:
        rows.append([fmt_context(row["context"]), _marked(row["group_s"], row["method"]),
                     _marked(row["every_layer_s"], row["method"]),
                     _marked(row.get("dense_s"), row.get("dense_method")),
                     _marked(row.get("plain_group_s"), row.get("plain_method")),
                     f"{fmt_num(row['every_over_group'])}x",
                     f"{fmt_num(row['dense_over_group'])}x" if "dense_over_group" in row else "–",
                     f"{fmt_num(row['plain_over_group'])}x" if "plain_over_group" in row else "–"])
    out.append(md_table(["context", "IndexShare group", "every layer its own indexer", f"dense SDPA x {G}",
                         "plain torch group", "every / group", "dense / group", "plain / group"], rows))

    out.append("\n## Targets\n")
    mark = {True: "pass", False: "**FAIL**", None: "n/a"}
    out.append(md_table(["target", "context", "figure", "needs", "result"],
                        [[t["target"], fmt_context(t["context"]) if t["context"] else "–", t["figure"], t["needs"],
                          mark[t["passed"]] + (f" ({t['note']})" if t["note"] else "")] for t in targets]))
    if results.get("skipped"):
        out.append("\n## Not run\n")
        out.append(md_table(["step", "context", "why"],
                            [[x["step"], fmt_context(x["context"]) if x["context"] else "all", x["reason"]]
                             for x in results["skipped"]]))
    return "\n".join(out)


# ------------------------------------------------------------------------------ PNG
def plot(results: dict[str, Any], groups: list[dict[str, Any]], path: Path) -> bool:
    """Three panels: layer-group time vs context (log-log; hollow markers = extrapolated); prefill
    kernel TFLOP/s vs context with the matmul ceilings; decode GB/s with the copy ceiling. False
    when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    fig_data, c = Figures(results), Ceilings.from_dict(results["ceilings"])
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(19, 5.5))

    def series(ax, xs, ys, methods, label, style):
        line, = ax.plot(xs, ys, style, label=label)
        hollow = [(x, y) for x, y, mt in zip(xs, ys, methods) if mt == EXTRAPOLATED]
        if hollow:  # extrapolated points: hollow markers over the line
            ax.plot(*zip(*hollow), "o", markerfacecolor="white", markeredgecolor=line.get_color(), markersize=9)

    G = results["geometry"]["group_layers"]
    for key, method_key, label, style in (("group_s", "method", "IndexShare group", "o-"),
                                          ("every_layer_s", "method", "every layer its own indexer", "s-"),
                                          ("dense_s", "dense_method", f"dense SDPA x {G}", "^--"),
                                          ("plain_group_s", "plain_method", "IndexShare group, plain torch", "d:")):
        rows = [r for r in groups if key in r]
        if rows:
            series(ax1, [r["context"] for r in rows], [r[key] for r in rows], [r[method_key] for r in rows], label,
                   style)
    ax1.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="seconds",
            title=f"One layer group (1 full + {G - 1} shared), prefill\nhollow markers: extrapolated")

    for name, style in (("indexer.logits", "o-"), ("indexer.logits+topk", "o--"), ("sparse_mla.prefill.bf16", "s-"),
                        ("sparse_mla.prefill.fp8", "s--"), ("sdpa.prefill", "^-"), ("plain.indexer+topk", "d:"),
                        ("plain.sparse.prefill", "x:")):
        ms = fig_data.named(name)
        if ms:
            series(ax2, [m.context for m in ms], [m.tflops for m in ms], [m.method for m in ms], LABELS[name], style)
    for value, label, style in ((c.bf16_mm, "bf16 matmul ceiling", "k--"), (c.fp8_mm, "FP8 matmul ceiling", "k:")):
        if value:
            ax2.axhline(value, color=style[0], linestyle=style[1:], label=label)
    ax2.set(xscale="log", xlabel="context (tokens)", ylabel="TFLOP/s", title="Prefill, one layer")

    for name, style in (("indexer.decode.logits", "o-"), ("sparse_mla.decode.bf16", "s-"),
                        ("sparse_mla.decode.fp8", "s--"), ("bound.read.decode", "k-."), ("write_kv.bf16", "v:"),
                        ("write_kv.fp8", "v--")):
        ms = [m for m in fig_data.named(name) if m.gbps is not None]
        if ms:
            series(ax3, [m.context for m in ms], [m.gbps for m in ms], [m.method for m in ms], LABELS[name], style)
    if c.copy:
        ax3.axhline(c.copy, color="k", linestyle="--", label="device copy ceiling")
    ax3.set(xscale="log", xlabel="context (tokens)", ylabel="GB/s",
            title=f"Memory-bound kernels (decode batch {results['settings']['batch']}; KV write)")
    contexts = fig_data.contexts
    for ax in (ax1, ax2, ax3):
        ax.set_xticks(contexts, [fmt_context(L) for L in contexts])
        ax.minorticks_off()
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    device = results["machine"].get("gpu") or results["machine"]["device"]
    fig.suptitle(f"megactx bench kernels: {device}, {results['settings']['model']} geometry")
    save_figure(fig, path)
    return True


# ------------------------------------------------------------------------------ writing
def write_reports(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Derive groups and targets, then write kernels-<device>.json (raw figures + derived), .md and
    .png (when matplotlib is installed) into out_dir. Returns the paths written."""
    groups = layer_groups(results)
    targets = evaluate_targets(results, groups)
    return write_suite_reports("kernels", results | {"groups": groups, "targets": targets}, out_dir,
                               lambda r: render_markdown(r, groups, targets), lambda r, path: plot(r, groups, path))
