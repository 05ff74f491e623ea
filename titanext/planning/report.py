"""The planner's outputs: the memory picture (SVG) and the layout names in its tables."""

from __future__ import annotations

from collections.abc import Sequence

from titanext.planning.estimate import Plan
from titanext.planning.hardware import GB

__all__ = ["layout_name", "memory_svg"]


_COLOURS = {"params (fp32 master)": "#4c78a8", "grads (fp32)": "#f58518",
            "optimizer (Adam)": "#54a24b", "optimizer (Muon + AdamW)": "#54a24b",
            "gathered params": "#b279a2", "activations": "#e45756",
            "unsharded grads (pp)": "#ff9da6", "loss backward": "#9d755d",
            "pipeline buffers": "#72b7b2", "backward transients": "#bab0ac",
            "expert copies (step)": "#eeca3b",
            "optimizer step": "#f2cf5b"}


def memory_svg(plans: Sequence[Plan], labels: Sequence[str], hbm: float) -> str:
    """A stacked bar per plan (the busiest rank's memory by category), with the HBM line."""
    width, bar, gap, top, height = 160 + 90 * len(plans), 48, 42, 30, 260
    scale = height / max(hbm, max(pl.memory_total for pl in plans))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + 120}" '
           'font-family="sans-serif" font-size="11">',
           '<text x="10" y="18" font-size="13">Memory per rank (GB), busiest rank</text>']
    for i, (pl, label) in enumerate(zip(plans, labels)):
        x, y = 60 + i * (bar + gap), top + height
        for cat, value in pl.memory.items():
            h = value * scale
            y -= h
            out.append(f'<rect x="{x}" y="{y:.1f}" width="{bar}" height="{h:.1f}" '
                       f'fill="{_COLOURS[cat]}"><title>{cat}: {value / GB:.1f} GB</title></rect>')
        out.append(f'<text x="{x + bar / 2}" y="{y - 4:.1f}" text-anchor="middle">'
                   f'{pl.memory_total / GB:.1f}</text>')
        out.append(f'<text x="{x + bar / 2}" y="{top + height + 14}" text-anchor="middle">'
                   f'{label}</text>')
    hy = top + height - hbm * scale
    out.append(f'<line x1="50" x2="{width - 10}" y1="{hy:.1f}" y2="{hy:.1f}" stroke="black" '
               f'stroke-dasharray="4 3"/><text x="{width - 10}" y="{hy - 4:.1f}" '
               f'text-anchor="end">HBM {hbm / GB:.0f} GB</text>')
    for j, (cat, colour) in enumerate(_COLOURS.items()):
        y = top + height + 34 + 14 * j
        out.append(f'<rect x="60" y="{y - 9}" width="10" height="10" fill="{colour}"/>'
                   f'<text x="76" y="{y}">{cat}</text>')
    out.append("</svg>")
    return "\n".join(out)


def layout_name(lo: dict) -> str:
    ep = f" ep{lo['ep']}" if lo["ep"] > 1 else ""
    return (f"dp{lo['dp_shard']} tp{lo['tp']} cp{lo['cp']} pp{lo['pp']}{ep} {lo['ac']} "
            f"mb{lo['local_batch_size']}")
