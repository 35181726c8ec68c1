"""The PNG plots of a report (matplotlib: the ``bench`` extra)."""

from __future__ import annotations

from typing import Sequence

from .report import BenchReport, PIPELINE, REUSE, TOPK, format_number


def require_matplotlib():
    """``matplotlib.pyplot`` on the Agg backend, or a RuntimeError that says how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install 'dsa-indexer[bench]'") from None
    return plt


def _by(rows, key) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault(key(r), []).append(r)
    return out


def streams_title(variants: Sequence[str], annotated: bool) -> str:
    """The pipeline plot's title, naming the strategies drawn (a CPU draws single stream only)."""
    strategies = sorted({v.removesuffix(REUSE) for v in variants})
    reuse = {v.endswith(REUSE) for v in variants}
    title = "indexer decode step: " + " vs ".join(strategies)
    if reuse == {True, False}:
        title += ", each without / with q_lora reuse"
    elif reuse == {True}:
        title += ", with q_lora reuse"
    return title + ("\n(bar labels: time relative to single stream)" if annotated else "")


def topk_k_text(contexts: Sequence[int]) -> str:
    """The k of the top-k rows: TOPK, capped by the context where a context is shorter (torch.topk's k there)."""
    return f"k=min({TOPK}, context)" if any(c < TOPK for c in contexts) else f"k={TOPK}"


def write_plots(report: BenchReport, folder) -> list[str]:
    """PNG plots of ``report`` into ``folder`` (created); returns the paths written, for the rows present:
    ``bench_decode.png`` latency vs context per implementation (median, bars p10-p90 where the spread was
    recorded), ``bench_floor.png`` each bandwidth-bound row's bytes / time as a percentage of the measured copy
    bandwidth (for the whole step those bytes are its floor), ``bench_streams.png`` the pipeline strategies' step
    time (those accepted here, with and without q_lora reuse), ``bench_topk.png`` top-k speedup over torch.topk,
    ``bench_prefill.png`` prefill latency. Needs matplotlib (the ``bench`` extra): RuntimeError otherwise."""
    plt = require_matplotlib()
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    title = f"{report.device} ({report.target})" + (", CPU numbers" if report.note else "")
    unstable = set(report.unstable_ceilings())
    written: list[str] = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        path = folder / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(str(path))

    decode = [r for r in report.rows if r.suite == "decode"]
    if decode:
        per_op = _by(decode, lambda r: r.op)
        fig, axes = plt.subplots(1, len(per_op), figsize=(7 * len(per_op), 4.5), squeeze=False)
        for ax, (op, rows) in zip(axes[0], per_op.items()):
            impls = sorted({r.implementation for r in rows})
            batches = sorted({r.shape["batch"] for r in rows})
            contexts = sorted({r.shape["context"] for r in rows})
            with_spread = all(r.spread for r in rows)
            for (impl, batch), mine in sorted(_by(rows, lambda r: (r.implementation, r.shape["batch"])).items()):
                mine = sorted(mine, key=lambda r: r.shape["context"])
                style = batches.index(batch)
                # p10-p90 bars around the median when every row has its spread (older reports have none)
                bars = ([[max(0.0, r.time_us - r.spread["p10"]) for r in mine],
                         [max(0.0, r.spread["p90"] - r.time_us) for r in mine]] if with_spread else None)
                ax.errorbar([r.shape["context"] for r in mine], [r.time_us for r in mine], yerr=bars,
                            color=f"C{impls.index(impl)}", marker="os^vD<>"[style % 7],
                            linestyle=("-", "--", ":", "-.")[style % 4], capsize=2 if bars else 0,
                            label=f"{impl} B={batch}")
            ax.set_xscale("log", base=2)
            ax.set_xticks(contexts, [f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in contexts])
            ax.minorticks_off()
            ax.set_yscale("log")
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("time (us): median, bars p10-p90" if with_spread else "time (us, median)")
            ax.set_title(f"{op}: latency vs context")
            ax.legend(fontsize=6)
        fig.suptitle(title, fontsize=9)
        save(fig, "bench_decode.png")

    bound = [r for r in report.rows if r.unit == "GB/s" and r.fraction_of_ceiling is not None]
    if bound:
        per_op = _by(bound, lambda r: r.op)
        fig, axes = plt.subplots(1, len(per_op), figsize=(6 * len(per_op), 4.5), squeeze=False)
        for ax, (op, rows) in zip(axes[0], per_op.items()):
            shapes = sorted({tuple(r.shape.values()) for r in rows})
            for impl, mine in _by(rows, lambda r: r.implementation).items():
                at = {tuple(r.shape.values()): r.fraction_of_ceiling for r in mine}
                xs = [i for i, s in enumerate(shapes) if s in at]
                ax.plot(xs, [100 * at[shapes[i]] for i in xs], marker="o", label=impl)
            # From 0: autoscaled, a single point (or equal ones) gets a range a millionth of its value wide.
            ax.set_ylim(0, 1.1 * max(100 * r.fraction_of_ceiling for r in rows) or 1.0)
            ax.set_xticks(range(len(shapes)), ["x".join(map(str, s)) for s in shapes], rotation=45, fontsize=7)
            ax.set_xlabel("B x context")
            ax.set_ylabel("bytes / time, % of the measured copy bandwidth")
            ax.set_title(f"{op}: bandwidth vs the copy ceiling" + (" (bytes: the step's floor)" if op == PIPELINE
                                                                    else ""), fontsize=9)
            ax.legend(fontsize=6)
        fig.suptitle(f"{title}; copy {format_number(report.ceilings.get('copy_GBps', 0))} GB/s" +
                     (" (UNSTABLE: its samples varied 10x or more)" if "copy_GBps" in unstable else ""), fontsize=9)
        save(fig, "bench_floor.png")

    steps = [r for r in report.rows if r.op == PIPELINE]  # the V3.2 step per strategy
    if steps:
        shapes = sorted({tuple(r.shape.values()) for r in steps})
        variants = sorted({r.implementation for r in steps}, key=lambda v: (v.endswith(REUSE), v))
        width = 0.8 / len(variants)
        fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(shapes)), 4.5))
        annotated = False
        for i, variant in enumerate(variants):
            at = {tuple(r.shape.values()): r for r in steps if r.implementation == variant}
            xs = [j for j, s in enumerate(shapes) if s in at]
            bars = ax.bar([j + (i - (len(variants) - 1) / 2) * width for j in xs],
                          [at[shapes[j]].time_us for j in xs], width, label=variant)
            for bar, j in zip(bars, xs):
                ratio = at[shapes[j]].details.get("time_vs_single_stream")
                if ratio is not None:
                    annotated = True
                    ax.annotate(f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(shapes)), ["x".join(map(str, s)) for s in shapes], fontsize=7)
        ax.set_xlabel("B x context")
        ax.set_ylabel("step time (us, median)")
        ax.set_title(streams_title(variants, annotated), fontsize=9)
        ax.legend(fontsize=7)
        fig.suptitle(title, fontsize=9)
        save(fig, "bench_streams.png")

    topk = [r for r in report.rows if r.suite == "topk" and "speedup_vs_torch_topk" in r.details]
    if topk:
        shapes = sorted({tuple(r.shape.values()) for r in topk})
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(shapes)), 4.5))
        for impl, mine in _by(topk, lambda r: r.implementation).items():
            at = {tuple(r.shape.values()): r.details["speedup_vs_torch_topk"] for r in mine}
            xs = [i for i, s in enumerate(shapes) if s in at]
            ax.plot(xs, [at[shapes[i]] for i in xs], marker="o", label=impl)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="torch.topk")
        ax.set_xticks(range(len(shapes)), ["x".join(map(str, s)) for s in shapes], rotation=45, fontsize=7)
        ax.set_xlabel("B x context")
        ax.set_ylabel("speedup over torch.topk (x, ratio of medians)")
        ax.set_title(f"top-k ({topk_k_text([r.shape['context'] for r in topk])}) vs torch.topk; {title}",
                     fontsize=9)
        ax.legend(fontsize=7)
        save(fig, "bench_topk.png")

    prefill = [r for r in report.rows if r.suite == "prefill"]
    if prefill:
        shapes = sorted({tuple(r.shape.values()) for r in prefill})
        impls = sorted({r.implementation for r in prefill})
        width = 0.8 / len(impls)
        fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(shapes)), 4.5))
        for i, impl in enumerate(impls):
            at = {tuple(r.shape.values()): r.time_us for r in prefill if r.implementation == impl}
            xs = [j for j, s in enumerate(shapes) if s in at]
            ax.bar([j + (i - (len(impls) - 1) / 2) * width for j in xs], [at[shapes[j]] for j in xs], width,
                   label=impl)
        ax.set_xticks(range(len(shapes)), ["x".join(map(str, s)) for s in shapes], fontsize=7)
        ax.set_yscale("log")
        ax.set_xlabel("queries x keys (causal)")
        ax.set_ylabel("time (us, median)")
        ax.set_title(f"ragged_mqa_logits (causal prefill logits); {title}", fontsize=9)
        ax.legend(fontsize=7)
        save(fig, "bench_prefill.png")
    return written
