"""How ``jaxpar plan`` shows its results: a plan as text (``format_plan``), and the candidates of a search as
a figure of memory and traffic per axis group (``candidates_figure``, ``plot_candidates``)."""

from __future__ import annotations


def format_plan(p) -> str:
    """The text ``jaxpar plan`` prints of a ``Plan``."""
    gb = 1e9
    lines = [
        f"{p.model} on {p.mesh} ({p.hardware}), batch {p.batch} × seq {p.seq}"
        + (f", {p.grad_accum} gradient-accumulation slices" if p.grad_accum > 1 else ""),
        f"memory per device: estimated {p.estimated_memory_bytes / gb:.2f} GB "
        f"({'fits' if p.fits else 'DOES NOT FIT'}): state {p.memory_parts['state'] / gb:.2f}, activations "
        f"{p.memory_parts['activations'] / gb:.2f} ({p.memory_parts['kept'] / gb:.2f} kept for the backward); "
        f"XLA:CPU compiled {p.per_device_memory_bytes / gb:.2f} GB",
        f"FLOPs per device {p.flops_per_device:.3e} (model FLOPs {p.model_flops_per_device:.3e})",
        "",
        f"{'axis group':<22}{'link':<6}{'measured GB':>13}{'minimum GB':>12}{'ratio':>8}",
    ]
    for key in sorted(set(p.bytes_by_axis) | set(p.analytic_min_bytes_by_axis)):
        got, want = p.bytes_by_axis.get(key, 0.0), p.analytic_min_bytes_by_axis.get(key, 0.0)
        ratio = f"{got / want:.2f}" if want else "—"
        flag = "  !" if key in p.flagged or not want else ""
        lines.append(f"{key:<22}{p.link_by_axis.get(key, ''):<6}{got / gb:>13.3f}{want / gb:>12.3f}{ratio:>8}{flag}")
    t = p.times
    lines += [
        "",
        f"compute {t['compute_s'] * 1e3:.1f} ms, memory {t['memory_s'] * 1e3:.1f} ms, exposed "
        f"communication {t['exposed_communication_s'] * 1e3:.1f} ms",
        *_pipeline_lines(p.pipeline, t),
    ]
    lines += [
        f"predicted step {p.predicted_step_s * 1e3:.1f} ms: {p.predicted_tokens_per_s:,.0f} tokens/s, "
        f"MFU {p.predicted_mfu:.1%} ({_model_line(p.assumptions)})"
    ]
    return "\n".join(lines)


def _model_line(a: dict) -> str:
    if a["model"] == "mechanisms":
        c = a["calibration"]
        return (
            f"step-time model from mechanisms; calibrated matmul share {c['matmul']}, link efficiency "
            f"{c['collective']}, DCN {c['dcn']}; attention {a['attention']}"
        )
    return f"roofline: efficiency {a['efficiency']}, overlap {a['overlap']}"


def _pipeline_lines(pipe, t) -> list[str]:
    if pipe is None:
        return []
    d, mem = pipe["durations"], pipe["memory"]
    return [
        f"pipeline {pipe['schedule']}: {pipe['stages']} stages × {pipe['microbatches']} microbatches"
        f"{f' × {v} virtual stages' if (v := pipe['virtual_stages']) > 1 else ''}, {pipe['ticks']} ticks "
        f"(F {d['F']:.2f}, B {d['B']:.2f}{f', W {w:.2f}' if (w := d.get('W')) else ''}"
        f"{f', head {h:.2f} with the last F' if (h := d.get('head')) else ''} chunk forwards; "
        f"{pipe['executor']})",
        f"  bubble: executor {pipe['executor_bubble_fraction']:.1%} (used: stretches compute to "
        f"{t['pipelined_s'] * 1e3:.1f} ms), lockstep {pipe['lockstep_bubble_fraction']:.1%}, ideal "
        f"{pipe['bubble_fraction']:.1%}; peak in flight {pipe['peak_in_flight']}",
        f"  stage sends: {pipe['sends']} per step of {pipe['stage_send_bytes'] / 1e6:.3f} MB "
        f"(analytic {pipe['stage_send_bytes_analytic'] / 1e6:.3f} MB), {pipe['send_ticks']} ticks on the "
        f"critical path: {pipe['stage_critical_path_bytes'] / 1e9:.3f} GB, exposed",
        f"  memory per device: state {mem['state'] / 1e9:.2f} GB, activations {mem['activations'] / 1e9:.2f} GB "
        f"(stage buffers {mem['stage_buffers'] / 1e9:.2f} GB)",
    ]


def plot_candidates(ranked, path: str, *, title: str) -> None:
    """``candidates_figure`` saved to ``path`` (the CLI's ``--plot``; no display needed)."""
    import matplotlib  # deferred: matplotlib is the optional `plot` extra

    matplotlib.use("Agg")

    candidates_figure(ranked, title=title).savefig(path)


def candidates_figure(ranked, *, title: str):
    """Memory and analytic traffic per axis group of each candidate, as two stacked bar charts (a matplotlib
    Figure, drawn with the current backend: a notebook shows it inline)."""
    import matplotlib.pyplot as plt  # deferred: matplotlib is the optional `plot` extra

    short = {"stage": "p"}  # s is sequence
    labels = [",".join(f"{short.get(a, a[0])}{n}" for a, n in c.mesh.items()) or "1" for c in ranked]
    groups = sorted({k for c in ranked for k in c.bytes_by_axis})
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6, len(ranked) * 0.45), 7), sharex=True)
    top.bar(
        labels, [c.memory_bytes / 1e9 for c in ranked], color=["tab:green" if c.fits else "tab:red" for c in ranked]
    )
    top.set_ylabel("memory per device (GB)")
    top.set_title(title)
    base = [0.0] * len(ranked)
    colors = plt.get_cmap("tab20").colors  # one colour per group for up to 20 groups
    for i, g in enumerate(groups):
        values = [c.bytes_by_axis.get(g, 0.0) / 1e9 for c in ranked]
        bottom.bar(labels, values, bottom=base, label=g, color=colors[i % len(colors)])
        base = [b + v for b, v in zip(base, values)]
    bottom.set_ylabel("minimum bytes sent per device per step (GB)")
    bottom.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, not over them
    bottom.tick_params(axis="x", rotation=90)
    fig.tight_layout()
    return fig
