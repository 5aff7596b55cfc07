"""Flags every command shares, and the start-up order: devices, distributed runtime, mesh.

No JAX import at module level: ``--devices`` must set ``XLA_FLAGS`` before JAX starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

from meshlm.parallel.axes import CP, PP
from meshlm.parallel.layout import Layout, devices_layout, early_layout
from meshlm.parallel.mesh import DEFAULT_DEVICES, MAX_HOST_DEVICES, force_host_devices, parse_mesh
from meshlm.ranges import (
    NON_NEGATIVE_FLOAT,
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    PROBABILITY,
    Range,
)
from meshlm.settings import CLI_FLAG, CLI_HIDDEN, FLASH_UNDER_CP, WITHOUT, MeshFlags, flag_name


def arg_type(valid: Range) -> Callable[[str], int | float]:
    """An argparse ``type=`` accepting only values in ``valid``: a bad flag is one line naming the flag
    and the range ("argument --lr: must be a finite number > 0, got -1.0"), exit code 2, before any work.
    """

    def parse(text: str) -> int | float:
        try:
            value = valid.kind(text)
        except ValueError:
            # argparse would otherwise print "invalid parse value", naming this function.
            raise argparse.ArgumentTypeError(f"must be {valid.describe()}, got {text!r}") from None
        if not valid.contains(value):
            raise argparse.ArgumentTypeError(f"must be {valid.describe()}, got {value!r}")
        return value

    parse.__name__ = valid.kind.__name__
    return parse


positive_int = arg_type(POSITIVE_INT)
non_negative_int = arg_type(NON_NEGATIVE_INT)
non_negative_float = arg_type(NON_NEGATIVE_FLOAT)
probability = arg_type(PROBABILITY)
# More fake devices than this is a typo: XLA would try to create them all and appear to hang.
device_count = arg_type(Range(int, 1, MAX_HOST_DEVICES))


def add_common(p: argparse.ArgumentParser, config: str | None = None, config_help: str = "") -> None:
    if config is not None:
        p.add_argument(
            "--config", default=config, help=config_help or "model preset name (see `meshlm configs`)"
        )
    p.add_argument("--mesh", default=None, help="DPxMP, e.g. 1x4 or 2x2 (default: 1 x all devices)")
    p.add_argument(
        "--devices",
        type=device_count,
        default=None,
        help=f"fake host CPU devices (default {DEFAULT_DEVICES}; ignored on accelerators)",
    )
    p.add_argument("--seed", type=non_negative_int, default=0, help="random seed")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--coordinator", default=None, help="multi-process: HOST:PORT of process 0")
    p.add_argument("--num-processes", type=positive_int, default=None, help="multi-process: process count")
    p.add_argument(
        "--process-id", type=non_negative_int, default=None, help="multi-process: this process's index"
    )
    p.add_argument(
        "--init-timeout",
        type=positive_int,
        default=60,
        help="multi-process: seconds to wait for every process to join (and heartbeat timeout)",
    )


# The end of a refusal by a command that reads checkpoints (eval, generate).
ANY_MESH = " (a checkpoint written under any mesh options loads on any mesh)"


def refuse_options(args, flags: MeshFlags, command: str, refused: tuple[str, ...], hint: str = "") -> None:
    """One line for the first mesh option ``command`` runs without (``refused``) that is given, ending
    in ``hint``; for --pp it names the mesh to use instead (the same devices as dp x mp)."""
    from meshlm.errors import ConfigError

    if "pp" in refused and flags.on(PP):
        dp, mp = parse_mesh(args.mesh) if args.mesh else (1, None)
        mesh = f"{dp}x{flags.pp * mp}" if mp else f"1x{flags.pp} (or any DPxMP)"
        raise ConfigError(
            f"meshlm {command} has no pipeline (--pp {flags.pp}); a checkpoint trained with --pp loads on "
            f"any mesh: drop --pp and use --mesh {mesh}"
        )
    for f in dataclasses.fields(MeshFlags):
        if f.name in refused and f.name in flags.given():
            value = getattr(flags, f.name)
            given = flag_name(f) if isinstance(value, bool) else f"{flag_name(f)} {value}"
            raise ConfigError(f"meshlm {command} runs without {WITHOUT[f.name]} ({given}); drop it{hint}")


def argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` (raising ValueError with a message) as an argparse ``type=``: a bad value is one line
    naming the flag and the message, exit code 2."""

    def wrapped(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    wrapped.__name__ = parse.__name__
    return wrapped


def add_flags(
    p: argparse.ArgumentParser, settings_cls, command: str = "", refused: tuple[str, ...] = ()
) -> None:
    """A flag for each field of the settings dataclass ``settings_cls`` built with ``meshlm.settings.setting``
    (those marked CLI_FLAG): the field name in kebab case, its value under the field's own name.

    ``refused``: mesh options (``MeshFlags``) the command runs without, accepted as flags so that
    ``refuse_options`` can say in one line what to do instead; their help says so."""
    for f in dataclasses.fields(settings_cls):
        if f.metadata["cli"] == CLI_FLAG:
            refusal = f"refused: {command} runs without {WITHOUT[f.name]}" if f.name in refused else None
            _add_flag(p, f, refusal)


def _add_flag(p: argparse.ArgumentParser, f: dataclasses.Field, help: str | None = None) -> None:
    """``help``: instead of the field's own (with its default)."""
    switch = f.metadata["switch"]
    if switch is not None:
        # Under the field's own dest, like every other flag, so `settings_from` needs no special case.
        p.add_argument(switch.flag, dest=f.name, action="store_const", const=switch.value, help=switch.help)
        p.set_defaults(**{f.name: f.default})
        return
    flag, dest, text = flag_name(f), f.name, help or _help(f)
    if isinstance(f.default, bool):
        # --x and --no-x: a value a --settings file (or a later default) turned on can be turned off.
        p.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=f.default, help=text)
    elif isinstance(f.default, tuple):
        p.add_argument(flag, dest=dest, nargs="+", default=f.default, help=text)
    else:
        valid, parse = f.metadata["valid"], f.metadata["parse"]
        kind = (
            argparse_type(parse)
            if parse
            else (arg_type(valid) if valid is not None else str if f.default is None else type(f.default))
        )
        choices = f.metadata["choices"]
        p.add_argument(flag, dest=dest, type=kind, default=f.default, choices=choices, help=text)


def _help(f: dataclasses.Field) -> str:
    """The field's help, with its default unless that is empty (or a flag without a value)."""
    shown = f.metadata["shown_default"]
    if shown is None and f.default not in ("", (), None) and not isinstance(f.default, bool):
        shown = f.default
    text = f.metadata["help"] if shown is None else f"{f.metadata['help']} (default: {shown})"
    return text.replace("%", "%%")  # argparse formats help with %


def settings_from(args: argparse.Namespace, settings_cls, **given):
    """The ``settings_cls`` the flags describe (each field not CLI-hidden is in ``args`` under its
    name; ``given`` fills or overrides fields)."""
    values = {}
    for f in dataclasses.fields(settings_cls):
        if f.metadata["cli"] != CLI_HIDDEN:
            value = getattr(args, f.name)
            values[f.name] = tuple(value) if isinstance(f.default, tuple) else value
    return settings_cls(**{**values, **given})


def flag_layout(args, flags: MeshFlags | None = None) -> Layout | None:
    """The Layout that --mesh and ``flags`` (--fsdp, --sp, --pp and its schedule, --cp) describe, before
    any device exists, for a command's early checks; ``setup`` then uses this same Layout (built once).
    None without --mesh: the mesh then depends on the device count, known after ``setup``; with --pp a
    Layout of dp=1 is built to check the pipeline's options early."""
    options = flags.layout_options() if flags is not None else {}
    cp_allgather = flags is not None and flags.on(CP) and flags.cp_strategy == "allgather"
    if getattr(flags, "attention", "") == "flash" and cp_allgather:
        from meshlm.errors import ConfigError

        raise ConfigError(FLASH_UNDER_CP)
    if args.mesh:
        return Layout(*parse_mesh(args.mesh), **options)
    return early_layout(options)  # the options' own rules (e.g. --microbatches without --pp), no devices


def setup(
    args,
    flags: MeshFlags | None = None,
    planned: Layout | None = None,
    default_dp: int = 1,
    model: Callable[[], Any] | None = None,
    replicated: bool = False,
) -> Layout:
    """Devices, distributed runtime, mesh, in that order, before anything touches a device. A signal
    meanwhile is delivered once they are ready (``deferred_signals``).

    Returns the Layout: with --mesh ``planned`` (what ``flag_layout`` returned), its mesh now built;
    else default_dp x (all devices / default_dp), or 1 x (all devices) when default_dp does not divide
    the device count, with ``flags``' options (pp: the outermost axis, the mesh then pp x dp x mp and
    1 x (devices / pp); cp: dp x cp x mp, mp = devices / (dp x cp)). Without --mesh, ``model`` (the
    command's ModelConfig, read once the devices exist) makes that default fit the model
    (``sharding.fit``: a smaller mp, with a note); ``replicated`` (convert: no computation) splits no
    model dimension: 1 x 1 in one process, (all devices) x 1 over several.
    """
    from meshlm.train.stop import deferred_signals

    with deferred_signals():
        return _setup(args, flags, planned, default_dp, model, replicated)


def checkpoint_model(path):
    """The ModelConfig of the checkpoint at ``path`` (for ``setup``'s ``model``)."""
    from meshlm.io.model_io import read_config

    return read_config(path)[0]


def _default_layout(flags, default_dp: int, model, replicated: bool) -> Layout:
    """The Layout without --mesh (``setup``'s doc)."""
    import jax

    options = flags.layout_options() if flags is not None else {}
    if replicated:
        return Layout(dp=1 if jax.process_count() == 1 else jax.device_count(), mp=1)
    if model is None:
        return devices_layout(jax.device_count(), options, default_dp)
    from meshlm.parallel.distributed import print0
    from meshlm.sharding.fit import fitted_layout

    layout, note = fitted_layout(model(), jax.device_count(), options, default_dp)
    if note:
        print0(note, file=sys.stderr)
    return layout


def _setup(
    args, flags: MeshFlags | None, planned: Layout | None, default_dp: int, model, replicated
) -> Layout:
    from meshlm.parallel import watchdog

    watchdog.check_settings()  # a bad MESHLM_STALL_TIMEOUT: one line before any work
    force_host_devices(args.devices if args.devices is not None else DEFAULT_DEVICES)
    if args.coordinator or args.num_processes:
        # Seen here: with a persistent compilation cache, processes of one job can disagree on
        # which programs they load or compile and deadlock in a collective. Compile afresh instead.
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    from meshlm.parallel import distributed

    distributed.initialize(
        args.coordinator, args.num_processes, args.process_id, init_timeout_s=args.init_timeout
    )

    from meshlm.parallel.mesh import accelerator_note

    if args.devices is not None and (note := accelerator_note()):
        print(note, file=sys.stderr)
    if args.mesh:
        layout = planned if planned is not None else flag_layout(args, flags)
    else:
        layout = _default_layout(flags, default_dp, model, replicated)
    layout.mesh  # noqa: B018 -- built now (a device-count error before any work)
    return layout
