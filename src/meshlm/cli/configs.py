"""meshlm configs: the model presets as a table (family, layers, width, heads, vocabulary, parameters and
active parameters), or with --json one JSON object per preset: {"name", "params", "active_params",
"config"}. Active: the parameters one token uses (a mixture of experts' k of E experts; = the total for
a dense model), counted by ``model.accounting``; a model's multi-token prediction depths (``model.mtp``)
are counted and shown beside its layers ("61+1": 61 layers and one MTP depth)."""

from __future__ import annotations

import functools
import json


def add_parser(sub) -> None:
    p = sub.add_parser("configs", help="list the model presets (a table; --json: one object per line)")
    p.add_argument("--json", action="store_true", help="one JSON object per preset instead of the table")
    p.set_defaults(fn=run)


@functools.cache
def counts(cfg):
    """Total and active parameters of the real model (``model.accounting.param_counts``)."""
    from meshlm.model.accounting import param_counts

    return param_counts(cfg)


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def rows() -> list[dict]:
    from meshlm.model.config import PRESETS

    return [
        {"name": name, "params": n.total, "active_params": n.active, "config": cfg.to_dict()}
        for name, cfg in PRESETS.items()
        for n in [counts(cfg)]
    ]


def table(entries: list[dict]) -> str:
    head = ("preset", "family", "layers", "d_model", "heads/KV", "vocab", "parameters", "active")
    lines = [head]
    for e in entries:
        c = e["config"]
        heads = f"{c['n_heads']}/{c['n_kv_heads'] or c['n_heads']}" if c["n_heads"] else "-"
        extra = " tied" if c["tie_embeddings"] else ""
        lines.append(
            (
                e["name"],
                c["family"],
                str(c["n_layers"]) + (f"+{c['mtp_layers']}" if c.get("mtp_layers") else ""),
                str(c["d_model"]),
                heads,
                str(c["vocab_size"]),
                _human(e["params"]),
                _human(e["active_params"]) + extra,
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(f"{v:<{w}}" for v, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def run(args) -> int:
    entries = rows()
    print("\n".join(json.dumps(e, sort_keys=True) for e in entries) if args.json else table(entries))
    return 0
