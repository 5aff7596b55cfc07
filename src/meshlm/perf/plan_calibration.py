"""The calibration of XLA:CPU's plan against a chip's compiler: the cases (scripts/plan_calibration.py
compiles each and prints its figures as JSON lines, on any host and on the chip), the fit of a
correction from those pairs, and the corrections fitted, which ``meshlm plan --chip`` applies where
it cannot compile with the chip's own compiler (``perf.plan_target``).

A correction changes the temporaries alone: the arguments, outputs and aliases are the shapes' and
shardings' (the same on every compiler but for a TPU's padding of small arrays to its tiles: about
1 MiB of qwen3-0.6b's 6.66 GiB of arguments), while the temporaries are the compiler's buffer plan.
It is fitted to be an upper bound of the chip's figure on every calibration case, and its error on
them is in the report."""

from __future__ import annotations

import dataclasses
import json
import math

from meshlm.errors import ConfigError

GiB = 2**30
SEQ_LEN = 2048
CONFIGS = ("qwen3-0.6b", "llama3.2-1b")
REMATS = ("full", "selective", "none")
BATCHES = (1, 2, 4, 8)


ACCUMS = (4, 8)  # gradient accumulation's cases: batch 8 in 4 and 8 micro-batches, remat full
BF16_MOMENTS = ("llama3.2-1b/full/b2/bf16", "llama3.2-1b/full/b4/bf16")  # --opt-dtype bf16: the 1B's fit


def case_names() -> list[str]:
    """Every calibration case, "qwen3-0.6b/full/b4" (batch 4), "qwen3-0.6b/full/b8a4" (batch 8 in
    4 micro-batches) or "llama3.2-1b/full/b4/bf16" (AdamW's moments stored in bf16): mesh 1x1,
    2048-token rows, bf16 compute."""
    plain = [f"{c}/{r}/b{b}" for c in CONFIGS for r in REMATS for b in BATCHES]
    return plain + [f"{c}/full/b8a{a}" for c in CONFIGS for a in ACCUMS] + list(BF16_MOMENTS)


def parse_case(name: str) -> tuple[str, str, int, int, str]:
    """ "qwen3-0.6b/full/b8a4" -> (config, remat, batch, accum_steps, opt_dtype); a fourth part names
    the moments' dtype ("llama3.2-1b/full/b4/bf16"; float32 without)."""
    config, remat, rows, *opt = name.split("/")
    batch, _, accum = rows[1:].partition("a")
    return config, remat, int(batch), int(accum or 1), (opt or ["float32"])[0]


def policy(remat: str, accum_steps: int) -> str:
    """A correction's key: the remat policy, "+accum" with gradient accumulation (its running sum
    and micro-batch loop are buffers of their own on each compiler)."""
    return remat + ("+accum" if accum_steps > 1 else "")


@dataclasses.dataclass(frozen=True)
class Correction:
    """temp_chip <= state + scale[remat] x (temp_host - state) + offset[remat], fitted on ``fitted``'s
    cases; ``state``: the temporaries that are the state's bytes on every compiler (gradients, the
    accumulation's running sum, the old AdamW moments' copies, FSDP's gathered layer: the analytic
    figures, ``perf.plan.analytic``), so that only the rest, the compiler's activations and fusion
    buffers, is scaled."""

    chip: str
    host: str  # the compiler corrected: "cpu"
    scale: dict  # remat policy -> multiplier of the host's temporaries
    offset: dict  # remat policy -> bytes added
    fitted: str  # the cases and compilers it was fitted on
    error: str  # its measured error on them (peak, corrected against the chip's compiled)

    def apply(self, memory: dict, key: str, state: float) -> dict:
        """``memory`` (a compiled_memory dict) with the chip's estimated temporaries and peak; ``key``:
        ``policy(remat, accum_steps)``; ``state``: the state's temporaries (the class docstring)."""
        if key not in self.scale:
            remat, _, accum = key.partition("+")
            asked = f"--remat {remat}" + (" with --accum-steps" if accum else "")
            raise ConfigError(
                f"the {self.chip} correction is not calibrated for {asked} (only {', '.join(self.scale)}): "
                "pip install -e '.[tpu-plan]' to compile with the chip's compiler"
            )
        temp = state + self.scale[key] * max(memory["temp"] - state, 0) + self.offset[key]
        peak = memory["argument"] + memory["output"] - memory["alias"] + temp
        return {**memory, "temp": math.ceil(temp), "peak": math.ceil(peak)}  # an upper bound: round up

    def describe(self) -> dict:
        return {
            "name": f"{self.chip} from XLA:{self.host.upper()}",
            "rule": "state + (temp - state) x scale[remat] + offset[remat] (state: gradients, accumulation "
            "sum, moment copies, FSDP's gathered layer; an upper bound on every calibration case)",
            "scale": self.scale,
            "offset": self.offset,
            "fitted": self.fitted,
            "error": self.error,
        }


def fit(host: list[dict], chip: list[dict], name: str, held_out: tuple[str, ...] = ()) -> Correction:
    """The correction of ``host``'s temporaries to ``chip``'s (the script's lines of the same cases):
    per remat policy, least squares of the chip's temporaries on the host's, its offset then raised
    until no case's corrected figure is below the chip's (an upper bound on every case). Cases whose
    name starts with one of ``held_out`` are not fitted on: the error on them is stated apart."""
    fitted, kept = _pairs(host, chip, lambda case: not case.startswith(held_out))
    if not fitted:
        raise ConfigError("no case compiled on both the host and the chip: nothing to fit")
    scale, offset = {}, {}
    for remat, rows in fitted.items():
        a = _slope(rows)
        offset[remat] = max(c - a * h for h, c, _ in rows)
        scale[remat] = a
    over = _over(fitted, scale, offset)
    error = (
        f"on its {len(over)} calibration cases the corrected peak is {min(over):+.1%} to {max(over):+.1%} "
        f"of the chip's compiled peak (mean {sum(over) / len(over):+.1%})"
    )
    if held_out:  # each case's own figure: they are few
        figures = []
        for case in _pairs(host, chip, lambda case: case.startswith(held_out))[1]:
            (key, rows), *_ = _pairs(host, chip, lambda c, case=case: c == case)[0].items()
            figures.append(f"{case} {_over({key: rows}, scale, offset)[0]:+.1%}" if key in scale else case)
        error += "; held out of the fit: " + (", ".join(figures) or "none compiled on both")
    cases = ", ".join(sorted(kept))
    return Correction(name, "cpu", scale, {r: math.ceil(b) for r, b in offset.items()}, cases, error)


def _pairs(host: list[dict], chip: list[dict], keep) -> tuple[dict, list[str]]:
    """({policy: [(host temp - state, chip temp - state, fixed bytes)]}, the case names) of the cases
    ``keep`` admits that both compilers planned (a step the chip's compiler refused has no buffer plan
    to fit: its message's figure is not one)."""
    planned = lambda line: "temp" in line and "refused" not in line
    chip_of = {line["case"]: line for line in chip if planned(line)}
    pairs: dict[str, list[tuple[int, int, int]]] = {}
    names = []
    for line in host:
        if planned(line) and line["case"] in chip_of and keep(line["case"]):
            _, remat, _, accum, _ = parse_case(line["case"])
            fixed = line["argument"] + line["output"] - line["alias"] + line["state_temp"]
            state = line["state_temp"]  # the host's line: its analytic state temporaries
            pairs.setdefault(policy(remat, accum), []).append(
                (line["temp"] - state, chip_of[line["case"]]["temp"] - state, fixed)
            )
            names.append(line["case"])
    return pairs, names


def _over(pairs: dict, scale: dict, offset: dict) -> list[float]:
    """Each case's corrected peak over the chip's compiled peak, less 1 (in ``pairs``' order)."""
    return [(scale[r] * h + offset[r] - c) / (c + fixed) for r, rows in pairs.items() for h, c, fixed in rows]


def _slope(rows: list[tuple[int, int, int]]) -> float:
    """Least-squares slope of the chip's temporaries on the host's (1 case: their ratio)."""
    if len(rows) == 1:
        return rows[0][1] / rows[0][0]
    n = len(rows)
    mh, mc = sum(h for h, _, _ in rows) / n, sum(c for _, c, _ in rows) / n
    var = sum((h - mh) ** 2 for h, _, _ in rows)
    return sum((h - mh) * (c - mc) for h, c, _ in rows) / var if var else mc / mh


def read_lines(path) -> list[dict]:
    """A calibration run's JSON lines (``scripts/plan_calibration.py``'s output)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# Fitted with ``fit`` (scripts/plan_calibration.py --fit ... --held-out llama3.2-1b) on XLA:CPU against
# XLA:TPU for compile-only v5e devices (libtpu 0.0.42.1: the chip's compiler, whose figures are the
# chip's own: qwen3-0.6b's batch 4 at 16.49 GB compiled on both, before the changes below), 7 December
# 2026, with AdamW's moments updated in place (``perf.plan.MOMENT_COPIES`` 0), the target's logit
# picked from the logits and JAX's own matmul backward off CPU (``model.dense``), scales rounded up:
# qwen3-0.6b's remat-full cases; llama3.2-1b (bf16 moments) held out. Remat selective and none, and
# the named policies, are not calibrated: refused, with the fix.
CORRECTIONS: dict[str, Correction] = {
    "v5e": Correction(
        chip="v5e",
        host="cpu",
        scale={"full": 0.698, "full+accum": 0.538},
        offset={"full": -1_421_842_534, "full+accum": 1_301_273_899},
        fitted="qwen3-0.6b, mesh 1x1, 2048-token rows, bf16, remat full: batch 1, 2, 4; batch 8 in 4 and "
        "8 micro-batches",
        error="on its 5 cases the corrected peak is +0.0% to +3.6% of the chip's compiled peak (mean "
        "+0.8%); held out: batch 2 of a fit on 1 and 4 +3.4%, llama3.2-1b batch 2 with bf16 moments "
        "+19.5% (there it says no where the chip's compiler fits it at 15.32 GiB: an upper bound, loose "
        "on another model); the verdicts agree with the chip's compiler on qwen3-0.6b's 6 cases; not "
        "measured on meshes",
    ),
}
