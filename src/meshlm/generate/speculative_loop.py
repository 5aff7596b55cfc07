"""The host side of ``generate --speculative mtp`` (the programs: ``generate.speculative``): prefill, then
one verify step at a time until every row has finished, each step committing a row's accepted drafts
and the main model's own next token; and what it reports per row (``SpecStats``).

A row that has finished (EOD, a stop string, its token budget) stops advancing: it is fed its last
step's inputs again (the batch's shapes are fixed), so its positions stay within the caches' slots.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import numpy as np

from meshlm.generate.inputs import check_budget, check_stops, pad_prompts
from meshlm.generate.speculative import check_speculative, spec_programs_for
from meshlm.generate.streaming import OnToken, OutputRow, make_stream
from meshlm.parallel.placement import to_host
from meshlm.sharding.rules import model_specs


@dataclass
class SpecStats:
    """One row's speculation: main-model forwards (the prefill and each verify step while the row ran),
    drafts proposed (D per verify step) and accepted (those of its output: the main model's own)."""

    depths: int
    forwards: int = 1
    proposed: int = 0
    accepted: int = 0
    tokens: int = 0

    def to_json(self) -> dict:
        rate = self.accepted / self.proposed if self.proposed else 0.0
        return {
            "method": "mtp",
            "depths": self.depths,
            "drafts_proposed": self.proposed,
            "drafts_accepted": self.accepted,
            "acceptance_rate": round(rate, 4),
            "main_forwards": self.forwards,
            "tokens_per_forward": round(self.tokens / self.forwards, 4),
        }


def _push(row: OutputRow, stats: SpecStats, new, max_new: int) -> int:
    """Give ``row`` its step's committed tokens until it finishes; returns how many it took."""
    for used, token in enumerate(new, start=1):
        stats.tokens += 1
        row.push(int(token), stats.tokens == max_new)
        if row.finish is not None:
            return used
    return len(new)


def advance(first, k: int):
    """A row's next first fed position after committing ``k`` tokens: the newest committed one (not yet
    fed), whose slot and the stale ones after it the next step writes before it attends."""
    return first + k


def generate_speculative(
    gen, prompts, max_new_tokens: int, stop=None, on_token: OnToken | None = None, record=None
):
    """Greedy generation of ``gen`` (a ``Generator``) with the MTP depths' drafts verified by the main
    model: (results as ``Generator.generate``'s, one ``SpecStats`` per prompt). ``record``: a list that
    gets (row, the draft's position, its logits [D, V]) for each running row at each step (tests)."""
    cfg = gen.cfg
    check_speculative(cfg, gen.params, 0.0, gen.prefill_cp)
    ids = [gen.encode_prompt(i, p) for i, p in enumerate(prompts)]
    check_budget(ids, max_new_tokens, gen.max_len)
    stops = check_stops(stop)
    rows = [OutputRow(i, make_stream(gen.tokenizer), stops, gen.eod, on_token) for i in range(len(ids))]
    stats = [SpecStats(cfg.mtp_layers) for _ in ids]
    tokens, lengths = pad_prompts(ids, gen.dp, gen.max_len + cfg.mtp_layers)  # global [B', S + D], [B']
    specs = model_specs(cfg, gen.params, gen.layout)
    prog = spec_programs_for(cfg, gen.layout, specs, gen.max_len, gen.params)
    run, put = prog.executables(gen.params, len(tokens)), partial(_put, gen)
    t0 = time.perf_counter()
    made, _, drafts, logits, cache = run["prefill"](gen.params, put(tokens, None), put(lengths))
    last, drafts = np.array(to_host(made)[:, 0]), np.array(to_host(drafts))  # writable: rows advance
    t1 = time.perf_counter()
    first = lengths.astype(np.int64)  # each row's next first fed position, n - 1
    _record(record, rows, first - 1, logits)
    for r, s in zip(rows, stats, strict=True):
        _push(r, s, last[r.index : r.index + 1], max_new_tokens)
    while any(r.finish is None for r in rows):
        fed = np.concatenate([last[:, None], drafts], axis=1)
        made, count, new_drafts, logits, cache = run["verify"](gen.params, put(fed, None), put(first), cache)
        made, count, new_drafts = to_host(made), to_host(count), to_host(new_drafts)
        _record(record, rows, first + count - 1, logits)
        for r, s in zip(rows, stats, strict=True):
            b, k = r.index, int(count[r.index])
            if r.finish is None and _step(r, s, made[b, :k], max_new_tokens) is None:
                first[b], last[b], drafts[b] = advance(first[b], k), made[b, k - 1], new_drafts[b]
    t2 = time.perf_counter()
    decoded = sum(s.tokens - 1 for s in stats)
    rates = (sum(map(len, ids)) / (t1 - t0), decoded / (t2 - t1) if decoded else 0.0)
    return [r.result(p, rates) for p, r in zip(prompts, rows, strict=True)], stats


def _put(gen, x, *dims):
    """Host ids [B'] (``dims`` after the rows' "batch": [B', ...]) on the mesh, rows over the data shards."""
    return gen._put(np.asarray(x, np.int32), gen.layout.spec("batch", *dims))


def _step(row: OutputRow, stats: SpecStats, new, max_new: int):
    """One verify step of a running row: its committed tokens ``new`` (the accepted drafts, then the
    main model's own) pushed and counted; returns the row's finish reason (None: it runs on, advancing;
    a finished row keeps its inputs, so its positions stay within the slots)."""
    used = _push(row, stats, new, max_new)
    stats.forwards, stats.proposed = stats.forwards + 1, stats.proposed + stats.depths
    stats.accepted += min(len(new) - 1, used)  # drafts that became output
    return row.finish


def _record(record, rows, positions, logits) -> None:
    if record is not None:
        logits = to_host(logits)
        record.extend((r.index, int(positions[r.index]), logits[r.index]) for r in rows if r.finish is None)
