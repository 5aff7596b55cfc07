"""Preference pairs for DPO: (prompt, chosen, rejected) records to rows of tokens and a completion mask.

Each record (JSONL, .jsonl.gz/.zst, Parquet or Arrow) has ``prompt``, ``chosen`` and ``rejected``
strings. A completion is rendered with its prompt by one rule:

* a tokenizer with a chat template (``--checkpoint`` or ``--tokenizer`` a directory that has one):
  the prompt as the user turn and the completion as the assistant turn (``data.chat``'s rendering,
  ``--train-on last``): the completion's tokens are the assistant turn's, its end-of-turn included;
* else plain concatenation: the prompt's ids, the completion's ids, then EOD (in the completion).

A completion row is ``seq_len + 1`` tokens padded with EOD: its inputs the first ``seq_len``, its
targets the last; ``completion_mask`` [T] is 1 on the targets that are completion tokens. A pair whose
chosen or rejected does not fit a row, or whose completion is empty, is dropped and counted (a cut
completion would teach a preference for text that stops mid-sentence). Pairs split into train and
validation by the sha1 of each record (``records.row_is_val``), at least one pair in each.

Batches hold whole pairs: rows 2i (chosen) and 2i + 1 (rejected) of pair i; the pairs of step s are
``default_rng([seed, s]).integers(0, pairs, B / 2)``, a pure function of (seed, step). With gradient
accumulation over A micro-batches, micro-batch a holds the step's rows [a B / A, (a + 1) B / A): whole
pairs (B / A even), as DPO's loss needs (``PairBatcher.batch`` orders a shard's rows so that
``data.device_batches`` deals them out so).

This module must not import jax: it runs before the CLI has chosen the devices.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshlm.data.chat_store import read_records
from meshlm.data.record_check import SHOWN, Problems, what
from meshlm.data.records import row_is_val
from meshlm.data.store import FORMAT as STORE_FORMAT
from meshlm.data.store import PAIR_FORMAT, index_format
from meshlm.errors import DataError

FIELDS = ("prompt", "chosen", "rejected")
KEYS = ("inputs", "targets", "completion_mask", "ref_logps")  # a DPO batch's entries
VAL_FRACTION = 0.1


class Renderer:
    """(prompt, completion) -> (ids int32 [n], 1 on the completion's tokens uint8 [n]) by the rule above."""

    def __init__(self, tok, template=None):
        self.tok, self.template = tok, template

    @property
    def rule(self) -> str:
        return (
            "chat template (user prompt, assistant completion)"
            if self.template
            else "prompt + completion + EOD"
        )

    def __call__(self, prompt: str, completion: str) -> tuple[np.ndarray, np.ndarray]:
        if self.template is not None:
            turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            return self.template.encode(turns, "last")
        head = np.asarray(self.tok.encode(prompt), np.int32)
        tail = np.append(np.asarray(self.tok.encode(completion), np.int32), np.int32(self.tok.eod_id))
        mask = np.concatenate([np.zeros(len(head), np.uint8), np.ones(len(tail), np.uint8)])
        return np.concatenate([head, tail]), mask


def renderer_for(tok) -> Renderer:
    """The chat template ``tok`` comes with (its files: a checkpoint's or a tokenizer directory's), else
    plain concatenation (the rule the run's ``data:`` line states). A template that is there but does
    not compile is an error, never a silent switch to concatenation."""
    from meshlm.data.chat_store import load_template
    from meshlm.data.tokenizer_files import chat_template_of

    if tok.kind == "hf" and chat_template_of(tok.files) is not None:
        return Renderer(tok, load_template(tok))
    return Renderer(tok)


@dataclass
class PairRows:
    """Pairs as rows: tokens [2N, T + 1] int32 and completion_mask [2N, T] uint8 (of the targets)."""

    tokens: np.ndarray
    mask: np.ndarray

    @property
    def pairs(self) -> int:
        return len(self.tokens) // 2

    def rows(self, index: np.ndarray, ref: np.ndarray | None) -> dict:
        out = {"inputs": self.tokens[index, :-1], "targets": self.tokens[index, 1:]}
        out["completion_mask"] = self.mask[index]
        if ref is not None:
            out["ref_logps"] = ref[index]
        return out


MAKE_PAIRS = (
    "--objective dpo trains on preference pairs: JSONL or Parquet records of `prompt`, `chosen` and "
    "`rejected` strings, or a store made from them by `meshlm data prepare --pairs --tokenizer DIR "
    "--data pairs.jsonl --seq-len N --out STORE`"
)


def read_pairs(paths) -> list[tuple[str, dict]]:
    """(where, record) of every pair in ``paths``, all checked before any is tokenized: data of another
    kind (a token or chat store, text, conversations) is one error naming the kind DPO needs and how to
    make it; bad records are one error naming each (``record_check.Problems``). Pairs whose chosen
    equals their rejected are counted in one warning (their loss is log 2 whatever the weights: no
    gradient, nothing learned)."""
    problems, out = Problems("records"), []
    for path in map(Path, paths):
        _check_pair_file(path)
        for where, row in read_records(path, problems, "--objective dpo reads"):
            problems.seen += 1
            problem = pair_problem(row)
            if problem is None:
                out.append((where, row))
            else:
                problems.add(where, problem)
    if not out:
        first = problems.found[0][1].split("; give it")[0] if problems.found else ""
        found = f" (at {problems.found[0][0]}: {first})" if problems.found else ""
        raise DataError(f"--data {' '.join(map(str, paths))} holds no preference pair{found}; {MAKE_PAIRS}")
    problems.check()
    same = [where for where, row in out if row["chosen"] == row["rejected"]]
    if same:
        at = ", ".join(same[:SHOWN]) + (f" and {len(same) - SHOWN} more" if len(same) > SHOWN else "")
        warnings.warn(
            f"{len(same)} of {len(out)} preference pairs have `chosen` equal to `rejected` ({at}): "
            "their DPO loss is constant, so they teach nothing; fix or leave them out",
            stacklevel=2,
        )
    return out


def pair_problem(row) -> str | None:
    """What is wrong with a record as a preference pair (each field's finding), or None."""
    if not isinstance(row, dict):
        return f"is {what(row)}, not an object with `prompt`, `chosen` and `rejected` strings"
    bad = [
        f"`{k}` is {what(row[k])}" if k in row else f"no `{k}`"
        for k in FIELDS
        if not isinstance(row.get(k), str)
    ]
    if not bad:
        return None
    kind = " (a conversation: SFT data, `data prepare --chat`)" if "messages" in row else ""
    fields = ", ".join(map(str, row)) or "none"
    return (
        f"not a preference pair{kind}: {', '.join(bad)} (its fields: {fields}); give it `prompt`, "
        "`chosen` and `rejected` strings"
    )


def _check_pair_file(path: Path) -> None:
    """A --data path that cannot hold pairs: a missing file, or a token or chat store (its kind named)."""
    if path.is_dir():
        kind = {
            STORE_FORMAT: "a token store (`meshlm data prepare`, with --chat a chat store)",
            PAIR_FORMAT: "a pair store: pass it alone as --data (`train --objective dpo --data STORE`)",
        }.get(index_format(path), "a directory")
        raise DataError(f"--data {path} is {kind}, not preference pairs; {MAKE_PAIRS}")
    if not path.is_file():
        raise DataError(f"--data {path}: no such file; {MAKE_PAIRS}")


def encode_pairs(records, render: Renderer, seq_len: int, eod: int) -> tuple[PairRows, PairRows, int]:
    """(train rows, validation rows, pairs dropped) of ``records`` (``read_pairs``)."""
    splits: dict[bool, list] = {False: [], True: []}
    dropped = 0
    problems = Problems("preference pairs")
    problems.seen = len(records)
    for where, row in records:
        try:
            encoded = [render(row["prompt"], row[k]) for k in ("chosen", "rejected")]
        except DataError as e:  # the chat template's refusal: every pair's found, then one error
            problems.add(where, str(e))
            continue
        if any(len(ids) > seq_len + 1 or not mask[1:].any() for ids, mask in encoded):
            dropped += 1
            continue
        key = json.dumps(row, sort_keys=True).encode("utf-8")
        splits[row_is_val(key, VAL_FRACTION)].append(encoded)
    problems.check()
    train, val = splits[False], splits[True]
    if len(train) + len(val) < 2:
        raise DataError(
            f"DPO needs at least 2 pairs that fit --seq-len {seq_len} (one to train, one to validate); "
            f"{dropped} of {len(records)} did not fit: raise --seq-len or add pairs"
        )
    if not val or not train:  # a tiny file: one pair moves over
        train, val = (train[:-1], train[-1:]) if not val else (val[-1:], val[:-1])
    return _rows(train, seq_len, eod), _rows(val, seq_len, eod), dropped


def _rows(pairs: list, seq_len: int, eod: int) -> PairRows:
    tokens = np.full((2 * len(pairs), seq_len + 1), eod, np.int32)
    mask = np.zeros((2 * len(pairs), seq_len), np.uint8)
    for r, (ids, m) in enumerate(row for pair in pairs for row in pair):
        tokens[r, : len(ids)] = ids
        mask[r, : len(ids) - 1] = m[1:]  # target t is token t + 1
    return PairRows(tokens, mask)


def check_pair_batch(global_batch: int) -> None:
    """A DPO step's rows are whole pairs (training's and its proof's one line: ``meshlm verify``)."""
    if global_batch % 2:
        raise DataError(
            f"--objective dpo takes pairs: --batch-size {global_batch} must be even (2 rows a pair)"
        )


class PairBatcher:
    """The step batches of pairs (module doc), in the text ``Batcher``'s interface (``device_batch``)."""

    def __init__(self, rows: PairRows, global_batch: int, seed: int, accum: int = 1):
        check_pair_batch(global_batch)
        if global_batch % (2 * accum):
            raise DataError(
                f"--objective dpo with --accum-steps {accum}: each micro-batch holds whole pairs, so "
                f"--batch-size {global_batch} must be a multiple of 2 x {accum}"
            )
        self.data, self.global_batch, self.seed, self.accum = rows, global_batch, seed, accum
        self.seq_len = rows.mask.shape[1]
        self.ref: np.ndarray | None = None  # the reference's per-target log-probs [2N, T] (``train.dpo_run``)
        self.keys = KEYS

    def index(self, step: int) -> np.ndarray:
        picked = np.random.default_rng([self.seed, step]).integers(0, self.data.pairs, self.global_batch // 2)
        return np.stack([2 * picked, 2 * picked + 1], axis=1).reshape(-1)

    def batch(self, step: int, shard: int = 0, num_shards: int = 1) -> dict:
        """A data shard's rows; with accumulation ``device_batch``'s order: the shard's row r·A + a is
        row r of its part of micro-batch a (the step's rows [a B / A, (a + 1) B / A): whole pairs)."""
        width = self.global_batch // num_shards
        index = self.index(step)
        if self.accum > 1:
            w = width // self.accum  # the shard's rows of each micro-batch
            index = index.reshape(self.accum, -1)[:, shard * w : (shard + 1) * w].T.reshape(-1)
            return self.data.rows(index, self.ref)
        return self.data.rows(index[shard * width : (shard + 1) * width], self.ref)

    def eval_batches(self, count: int) -> list[np.ndarray]:
        """Row indices of up to ``count`` batches covering every pair once (the last filled cyclically)."""
        n = -(-2 * self.data.pairs // self.global_batch)
        order = np.arange(n * self.global_batch) % (2 * self.data.pairs)
        return [order[i * self.global_batch : (i + 1) * self.global_batch] for i in range(min(n, count))]
