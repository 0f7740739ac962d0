"""Graphviz dump of a model (the GraphDump analogue)."""
from __future__ import annotations

from .graph import HalModel, Subgraph
from .types import OperandLifeTime as L


def to_dot(model) -> str:
    """Graphviz text for ``model`` (an ``nnrt.Model`` after finish, or a HAL
    model). Operands are boxes (inputs green, outputs red, constants grey),
    operations ellipses; referenced subgraphs are drawn as clusters."""
    hal: HalModel = model.hal_model if hasattr(model, "hal_model") else model
    lines = ["digraph nnrt_model {", "  rankdir=TB;", '  node [fontname="monospace"];']
    _subgraph(lines, hal.main, "m", "  ")
    for k, sub in enumerate(hal.referenced):
        lines.append(f"  subgraph cluster_{k} {{")
        lines.append(f'    label="subgraph {k}";')
        _subgraph(lines, sub, f"s{k}_", "    ")
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


_STYLE = {
    L.SUBGRAPH_INPUT: 'style=filled, fillcolor="palegreen"',
    L.SUBGRAPH_OUTPUT: 'style=filled, fillcolor="lightpink"',
    L.CONSTANT_COPY: 'style=filled, fillcolor="lightgrey"',
    L.CONSTANT_REFERENCE: 'style=filled, fillcolor="lightgrey"',
    L.NO_VALUE: 'style=dashed',
    L.SUBGRAPH: 'style=filled, fillcolor="lightblue"',
    L.TEMPORARY_VARIABLE: '',
}


def _subgraph(lines: list[str], sub: Subgraph, prefix: str, indent: str) -> None:
    for i, o in enumerate(sub.operands):
        dims = "x".join(str(d) if d else "?" for d in o.dimensions) if o.dimensions else (
            "scalar" if o.type.is_scalar else "?rank")
        label = f"{i}: {o.type.name}\\n{dims}"
        if o.type.is_quantized and o.scale:
            label += f"\\nscale={o.scale:g} zp={o.zero_point}"
        if o.lifetime == L.SUBGRAPH and o.location is not None:
            label += f"\\n-> subgraph {o.location.offset}"
        style = _STYLE[o.lifetime]
        lines.append(f'{indent}{prefix}o{i} [shape=box, label="{label}"{", " + style if style else ""}];')
    for k, op in enumerate(sub.operations):
        lines.append(f'{indent}{prefix}op{k} [shape=ellipse, label="{k}: {op.type.name}"];')
        for pos, i in enumerate(op.inputs):
            lines.append(f'{indent}{prefix}o{i} -> {prefix}op{k} [label="{pos}"];')
        for pos, i in enumerate(op.outputs):
            lines.append(f'{indent}{prefix}op{k} -> {prefix}o{i} [label="{pos}"];')
