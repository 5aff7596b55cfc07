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


def case_names() -> list[str]:
    """Every calibration case, "qwen3-0.6b/full/b4" (batch 4) or "qwen3-0.6b/full/b8a4" (batch 8 in
    4 micro-batches): mesh 1x1, 2048-token rows, bf16 compute."""
    plain = [f"{c}/{r}/b{b}" for c in CONFIGS for r in REMATS for b in BATCHES]
    return plain + [f"{c}/full/b8a{a}" for c in CONFIGS for a in ACCUMS]


def parse_case(name: str) -> tuple[str, str, int, int]:
    """ "qwen3-0.6b/full/b8a4" -> (config, remat, batch, accum_steps)."""
    config, remat, rows = name.split("/")
    batch, _, accum = rows[1:].partition("a")
    return config, remat, int(batch), int(accum or 1)


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


def fit(host: list[dict], chip: list[dict], name: str) -> Correction:
    """The correction of ``host``'s temporaries to ``chip``'s (the script's lines of the same cases):
    per remat policy, least squares of the chip's temporaries on the host's, its offset then raised
    until no case's corrected figure is below the chip's (an upper bound on every case)."""
    pairs: dict[str, list[tuple[int, int, int]]] = {}
    # a step the chip's compiler refused has no buffer plan to fit (its message's figure is not one)
    planned = lambda line: "temp" in line and "refused" not in line
    chip_of = {line["case"]: line for line in chip if planned(line)}
    for line in host:
        if planned(line) and line["case"] in chip_of:
            _, remat, _, accum = parse_case(line["case"])
            fixed = line["argument"] + line["output"] - line["alias"] + line["state_temp"]
            state = line["state_temp"]  # the host's line: its analytic state temporaries
            pairs.setdefault(policy(remat, accum), []).append(
                (line["temp"] - state, chip_of[line["case"]]["temp"] - state, fixed)
            )
    if not pairs:
        raise ConfigError("no case compiled on both the host and the chip: nothing to fit")
    scale, offset = {}, {}
    for remat, rows in pairs.items():
        a = _slope(rows)
        offset[remat] = max(c - a * h for h, c, _ in rows)
        scale[remat] = a
    over = [(scale[r] * h + offset[r] - c) / (c + fixed) for r, rows in pairs.items() for h, c, fixed in rows]
    n = len(over)
    error = (
        f"on its {n} calibration cases the corrected peak is {min(over):+.1%} to {max(over):+.1%} of "
        f"the chip's compiled peak (mean {sum(over) / n:+.1%})"
    )
    cases = ", ".join(sorted({line["case"] for line in host if planned(line) and line["case"] in chip_of}))
    return Correction(name, "cpu", scale, {r: math.ceil(b) for r, b in offset.items()}, cases, error)


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


# Fitted with ``fit`` (scripts/plan_calibration.py --fit) on XLA:CPU against XLA:TPU for compile-only
# v5e devices (libtpu 0.0.42.1: the chip's compiler, which gave 15.356 GiB for qwen3-0.6b batch 4
# here and 16.49 GB on the chip), scales rounded up. Provisional: qwen3-0.6b's remat-full cases alone
# (the 2-core host took 8-11 minutes a TPU compile; b4's TPU figure rounded to 1 MiB); the chip's run
# of every case refits it. Remat selective and none are not calibrated: refused, with the fix.
CORRECTIONS: dict[str, Correction] = {
    "v5e": Correction(
        chip="v5e",
        host="cpu",
        scale={"full": 0.587, "full+accum": 0.393},
        offset={"full": -3_411_860_110, "full+accum": -1_486_299_317},
        fitted="qwen3-0.6b, mesh 1x1, 2048-token rows, bf16, remat full: batch 1, 2, 4; batch 8 in 4 and "
        "8 micro-batches",
        error="on its 5 cases the corrected peak is +0.0% to +6.3% of the chip's compiled peak (mean "
        "+1.5%); batch 2 held out of a fit on 1 and 4: +5.9%; not measured on other models or meshes",
    ),
}
