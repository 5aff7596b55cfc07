"""The chip report's jobs (``scripts/chip_report.py``): each group of measurements a list of ``Job``s, a
``meshlm`` command line (or a script's ``main``) with its CPU smoke twin and environment. What each group
measures and why is in its function's docstring; the figures they produce are docs/benchmarks.md's
chip tables. Kept apart from the report's runner so that adding a measurement touches this file only.
"""

from __future__ import annotations

from dataclasses import dataclass

# llama-100m (vocab 16384, d 768, 8 layers), 8192 tokens a step: the attention rule's sweep (issue 63, 4)
ATTN_SEQS = (256, 512, 1024, 2048, 4096, 8192)
ATTN_KINDS = ("plain", "flash", "blockwise")
BENCH = ("bench", "--mesh", "1x1", "--gen-tokens", "0", "--peak-n", "8192", "--json", "--impls", "meshlm")
INT8 = "meshlm-int8"  # bench's int8 implementation (``perf.bench_settings.INT8``)
SCATTER = (("MESHLM_KV_WRITE", "scatter"),)  # decode's cache writes by XLA's scatter (``model.cache_kernel``)
COMBINE_SCATTER = (("MESHLM_MOE_COMBINE", "scatter"),)  # experts' rows by scatter-adds (``grouped_gather``)


@dataclass(frozen=True)
class Job:
    """One measurement: a meshlm command line whose stdout's last line is its JSON."""

    group: str
    name: str
    argv: tuple[str, ...]
    smoke: tuple[str, ...] = ()  # the same job on CPU at a tiny shape (--cpu-smoke); () = none
    env: tuple[tuple[str, str], ...] = ()  # environment variables set while the job runs


def _attention_jobs() -> list[Job]:
    jobs = []
    for seq in ATTN_SEQS:
        for kind in ATTN_KINDS:
            if kind == "plain" and seq > 4096:
                continue  # [B, H, T, T] scores: 48 GB of temporaries at 8192 (docs/benchmarks.md)
            argv = (*BENCH, "--config", "llama-100m", "--bf16", "--steps", "8", "--attention", kind)
            argv += ("--batch-size", str(8192 // seq), "--seq-len", str(seq))
            if kind == "blockwise":
                argv += ("--attn-block", str(min(512, seq)))
            smoke = (*BENCH, "--config", "tiny-llama", "--peak-n", "256", "--attention", kind)
            smoke += ("--batch-size", "2", "--seq-len", "64", "--steps", "5")
            jobs.append(Job("attention", f"{kind} T={seq}", argv, smoke if seq == ATTN_SEQS[0] else ()))
    auto = (*BENCH, "--config", "llama-100m", "--bf16", "--steps", "8", "--attention", "auto")
    jobs += [
        Job("attention", f"auto T={s}", auto + ("--batch-size", str(8192 // s), "--seq-len", str(s)))
        for s in ATTN_SEQS
    ]
    return jobs


def _plan_jobs() -> list[Job]:
    """The chip compiler's verdicts for the one-chip presets (issue 63 item 3's calibration pairs)."""
    jobs = []
    for config in ("qwen3-0.6b", "llama3.2-1b"):
        for remat in ("full", "selective"):
            for batch in (1, 2, 4, 8):
                argv = ("plan", "--config", config, "--mesh", "1x1", "--seq-len", "2048", "--bf16")
                argv += ("--batch-size", str(batch), "--remat", remat, "--json", "--max-compiles", "1")
                smoke = ("plan", "--config", "tiny-llama", "--mesh", "1x1", "--seq-len", "64")
                smoke += ("--batch-size", "2", "--remat", remat, "--json", "--max-compiles", "1")
                jobs.append(Job("plan", f"{config} remat={remat} batch={batch}", argv, smoke))
    return jobs


def _one_chip_jobs() -> list[Job]:
    """Issue 63 item 1: the real-size presets at seq 2048, bf16, AdamW, the batches that fit."""
    jobs = []
    for config, batch, remat in (("qwen3-0.6b", 2, "selective"), ("qwen3-0.6b", 4, "full")):
        argv = (*BENCH, "--config", config, "--bf16", "--remat", remat, "--steps", "5")
        argv += ("--batch-size", str(batch), "--seq-len", "2048")
        jobs.append(Job("one-chip", f"{config} b={batch} remat={remat}", argv))
    f32 = (*BENCH[:-1], "meshlm,plain", "--config", "llama-100m", "--attention", "plain", "--steps", "10")
    f32 += ("--batch-size", "8", "--seq-len", "512")
    jobs.append(Job("one-chip", "llama-100m f32 vs plain 8x512", f32))
    # the same with XLA:CPU's 2-D matmul backward (``model.dense``): which backward is the faster here
    two_d = (("MESHLM_DENSE_BACKWARD", "2d"),)
    jobs.append(Job("one-chip", "llama-100m f32 vs plain 8x512 2d backward", f32, env=two_d))
    return jobs


def _kernel_jobs() -> list[Job]:
    """Issue 64: the experts' dispatches side by side against dense-eq; decode against its roofline at
    serving batch sizes, float32 and bf16, and at a 4096-token prompt; the decode step's profile."""
    moe = ("--batch-size", "8", "--seq-len", "512", "--bf16", "--steps", "5")
    impls = ("--impls", "ragged_dot-dispatch,gmm-dispatch,dense-eq")
    base = (*BENCH[:-2], *impls)
    jobs = [
        Job("kernels", f"experts {c}", (*base, "--config", c, *moe))
        for c in ("qwen3-moe-100m", "qwen3-moe-a3b-chip")
    ]
    # what the experts add that does not grow with the tokens (AdamW over E / k times dense-eq's MLP
    # state) against what does (dispatch, grouped matmuls): a3b with 16-bit moments, then at 2x the tokens
    pair = (*BENCH[:-2], "--impls", "ragged_dot-dispatch,dense-eq", "--config", "qwen3-moe-a3b-chip")
    jobs.append(Job("kernels", "experts a3b b8", (*pair, *moe)))
    jobs.append(Job("kernels", "experts a3b bf16 moments", (*pair, *moe, "--opt-dtype", "bf16")))
    b16 = ("--batch-size", "16", *moe[2:])
    jobs.append(Job("kernels", "experts a3b b16", (*pair, *b16)))
    jobs.append(Job("kernels", "experts a3b b16 bf16 moments", (*pair, *b16, "--opt-dtype", "bf16")))
    scatter = (*base, "--config", "qwen3-moe-100m", *moe)  # the rows' moves the old way: beside the gathers
    jobs.append(Job("kernels", "experts qwen3-moe-100m scatter combine", scatter, env=COMBINE_SCATTER))
    gen = (
        *BENCH[:2],
        "1x1",
        "--peak-n",
        "8192",
        "--json",
        "--impls",
        "meshlm",
        "--config",
        "llama-100m",
        "--steps",
        "5",
    )
    # 65 new tokens: the first from the prefill, then 8 chunks of 8 steps: two programs a batch size
    # (prefill, chunk), no single-step one to compile (``generator.bench_generation``)
    batches = ("--batch-size", "8", "--seq-len", "512", "--gen-tokens", "65", "--gen-batch", "1,8,32,64")
    # the decode step's cache write alone, XLA's scatter against the Pallas kernel (``model.cache_kernel``)
    write = ("scripts/kv_write.py",)
    jobs.append(Job("kernels", "kv write scatter vs kernel", write, (*write, "--cpu-smoke")))
    jobs.append(Job("kernels", "decode f32 prompt 512", (*gen, *batches)))
    jobs.append(Job("kernels", "decode bf16 prompt 512", (*gen, *batches, "--bf16")))  # the kernel's writes
    jobs.append(Job("kernels", "decode scatter bf16 prompt 512", (*gen, *batches, "--bf16"), env=SCATTER))
    long = ("--batch-size", "1", "--seq-len", "4096", "--gen-tokens", "65", "--gen-batch", "1,8", "--bf16")
    jobs.append(Job("kernels", "decode bf16 prompt 4096", (*gen, *long)))
    profile = ("scripts/decode_profile.py", "--bf16")
    jobs.append(Job("kernels", "decode profile bf16", profile, ("scripts/decode_profile.py", "--cpu-smoke")))
    jobs.append(Job("kernels", "decode profile bf16 scatter", profile, env=SCATTER))
    # batch 1's step against its floor: the same programs at widths that read ~nothing (``--shrink``):
    # what the op count costs a step whatever the bytes
    script = profile[:1]
    for b in ("1", "8"):
        jobs.append(Job("kernels", f"decode floor b{b}", (*script, "--batch", b, "--shrink")))
    jobs.append(Job("kernels", "decode profile f32 b1", (*script, "--batch", "1")))
    jobs.append(Job("kernels", "decode profile bf16 b1", (*profile, "--batch", "1")))
    # chunk lengths, each dispatched before the one before is read (``scripts/decode_chunks.py``, the
    # same tokens): which length hides the host's work behind the device's
    chunks = ("scripts/decode_chunks.py", "--config", "llama-100m", "--prompt", "512", "--new", "65")
    chunks += ("--chunks", "16,8,32,64", "--bf16", "--reps", "3")
    smoke = ("scripts/decode_chunks.py", "--config", "tiny-llama", "--batch", "2", "--prompt", "8")
    smoke += ("--new", "17", "--reps", "1", "--chunks", "8,16", "--bf16")
    jobs.append(Job("kernels", "decode chunks 16 8 32 64 bf16 b1", (*chunks, "--batch", "1"), smoke))
    jobs.append(Job("kernels", "decode chunks 16 8 32 64 bf16 b8", (*chunks, "--batch", "8")))
    # batch 1's values' matmul kept apart from its head selection (``attention._flat_out``, the default)
    # against matmul and selection fused (the program before), which at batch 1 copied each layer's values
    # transposed every step (compile-only). A pair a case, one after the other; chunks of 16, each beside
    # its single steps (decode_chunks.py's reference), 3 repetitions
    values = (*chunks[:3], "--new", "65", "--chunks", "16", "--reps", "3", "--batch", "1")
    for case, extra in (
        ("bf16 4096", ("--bf16", "--prompt", "4096")),
        ("bf16 512", ("--bf16", "--prompt", "512")),
    ):
        for mode in ("apart", "fused"):
            env = (("MESHLM_FLAT_VALUES", mode),)
            jobs.append(Job("kernels", f"decode values {mode} {case} b1", (*values, *extra), smoke, env=env))
    for mode in ("apart", "fused"):
        env = (("MESHLM_FLAT_VALUES", mode),)
        jobs.append(Job("kernels", f"decode values {mode} f32 512 b1", (*values, "--prompt", "512"), env=env))
    jobs += _vmem_jobs(values[:-2])
    return jobs


# The decode programs' compiler options against the default (``programs.MESHLM_DECODE_XLA_OPTIONS``):
# compile-only, every decode missing issue 64's target moves its whole stacked cache into the v5e's VMEM
# and back each step, none meeting it does; the copies' overlap ratio at 10 stops that at bf16 batch 8
# and float32 batch 1, VMEM assignment off everywhere
VMEM_OPTIONS = {
    "default": "",
    "overlap10": '{"xla_vf_vmem_min_overlap_to_async_copy_ratio": 10}',
    "off": '{"xla_vf_vmem_memory_space_assignment": false}',
}
VMEM_CASES = {
    "bf16 512 b8": ("--bf16", "--prompt", "512", "--batch", "8"),
    "bf16 4096 b1": ("--bf16", "--prompt", "4096", "--batch", "1"),
    "bf16 512 b1": ("--bf16", "--prompt", "512", "--batch", "1"),
    "f32 512 b1": ("--prompt", "512", "--batch", "1"),
}


def _vmem_jobs(decode: tuple) -> list[Job]:
    """Each case's three programs one after another (decode_chunks.py, chunks of 16 beside single steps).
    No CPU smoke: the options are the v5e compiler's, and XLA:CPU rejects them."""
    jobs = []
    for case, extra in VMEM_CASES.items():
        for name, options in VMEM_OPTIONS.items():
            env = (("MESHLM_DECODE_XLA_OPTIONS", options),)
            jobs.append(Job("kernels", f"decode vmem {name} {case}", (*decode, *extra), env=env))
    return jobs


def _real_size_jobs() -> list[Job]:
    """Issue 63 items 1 and 2 with the memory cuts: the head's loss in chunks, AdamW in place (always),
    bf16 moments where the state alone would fill the chip, LoRA on a bf16 base for qwen3-1.7b. The
    chunked loss computes the head's gradients in its forward (three head matmuls, as the whole loss;
    the recomputing backward before it did four, measured 948.2 ms at batch 8 full on 7 December 2026):
    "b=4 only full" and "b=4 full whole loss" are the same step in chunks and whole, one run apart."""
    at = ("--seq-len", "2048", "--bf16", "--steps", "5")
    chunked = ("--loss-chunk", "512")
    q, bf16 = ("--config", "qwen3-0.6b"), ("--opt-dtype", "bf16")
    runs = (
        ("qwen3-0.6b b=8 full", ("--config", "qwen3-0.6b", "--batch-size", "8", "--remat", "full")),
        # the largest batch a policy fits at without the compiler's own remat (scripts/chip_fit.py,
        # compile-only XLA:TPU, docs/benchmarks.md): the q/k/v kept at batch 8, also the MLP's input at 4
        ("qwen3-0.6b b=8 save_qkv_proj", (*q, "--batch-size", "8", "--remat", "save_qkv_proj")),
        (
            "qwen3-0.6b b=8 save_qkv_proj bf16 moments",
            (*q, "--batch-size", "8", "--remat", "save_qkv_proj", *bf16),
        ),
        ("qwen3-0.6b b=4 save_qkv_mlp_in", (*q, "--batch-size", "4", "--remat", "save_qkv_mlp_in")),
        # q/k/v and the flash kernel's output kept (no attention recomputed): 13.6 GiB compiled with bf16
        # moments; XLA:TPU's cost model, which leaves the kernels out, puts it behind full remat
        # (scripts/remat_cost.py, docs/benchmarks.md): the chip says what the kernel's forward saves
        (
            "qwen3-0.6b b=8 save_qkv_attn bf16 moments",
            (*q, "--batch-size", "8", "--remat", "save_qkv_attn", *bf16),
        ),
        ("qwen3-0.6b b=4 selective bf16 moments", (*q, "--batch-size", "4", "--remat", "selective", *bf16)),
        # the layers as straight-line code: no scan stack for the saved residuals to be written into and
        # copied out of (XLA:TPU's cost model: 540 -> 446 ms, scripts/remat_cost.py, docs/benchmarks.md)
        (
            "qwen3-0.6b b=4 selective bf16 moments unrolled",
            (*q, "--batch-size", "4", "--remat", "selective", *bf16, "--unroll", "28"),
        ),
        ("qwen3-0.6b b=4 selective", ("--config", "qwen3-0.6b", "--batch-size", "4", "--remat", "selective")),
        (
            "llama3.2-1b b=4 full bf16 moments",
            ("--config", "llama3.2-1b", "--batch-size", "4", "--remat", "full", "--opt-dtype", "bf16"),
        ),
        (
            "qwen3-1.7b LoRA r16 b=4 full",
            (
                "--config",
                "qwen3-1.7b",
                "--batch-size",
                "4",
                "--remat",
                "full",
                "--lora-rank",
                "16",
                "--base-dtype",
                "bf16",
            ),
        ),
    )
    runs += (
        (
            "qwen3-0.6b b=2 save_qkv_mlp_in",
            ("--config", "qwen3-0.6b", "--batch-size", "2", "--remat", "save_qkv_mlp_in"),
        ),
        ("qwen3-0.6b b=2 none", ("--config", "qwen3-0.6b", "--batch-size", "2", "--remat", "none")),
        ("qwen3-0.6b b=4 only full", ("--config", "qwen3-0.6b", "--batch-size", "4", "--remat", "full")),
    )
    runs = tuple((name, (*argv, *chunked)) for name, argv in runs)
    whole = ("--config", "qwen3-0.6b", "--batch-size", "4", "--remat", "full", "--loss-chunk", "0")
    runs += (("qwen3-0.6b b=4 full whole loss", whole),)
    # 8 chunks of 2048 rows, not 32 of 512: the head's weight gradient is accumulated in float32 once a
    # chunk (1.24 GB read and written each time); XLA:TPU's cost model: -41.7 ms a step (remat_cost.py)
    big = ("--config", "qwen3-0.6b", "--batch-size", "8", "--remat", "full", "--loss-chunk", "2048")
    runs += (("qwen3-0.6b b=8 full loss chunk 2048", big),)
    # the best of the cost model: q/k/v kept, the layers unrolled (no scan stack), 8 loss chunks
    # (predicted ~772 ms, 0.46 of spec without the flash kernels' ~35 ms)
    best = ("--config", "qwen3-0.6b", "--batch-size", "8", "--remat", "save_qkv_proj", "--unroll", "28")
    runs += (
        ("qwen3-0.6b b=8 save_qkv_proj unrolled", (*best, *chunked)),
        ("qwen3-0.6b b=8 save_qkv_proj unrolled loss chunk 2048", (*best, "--loss-chunk", "2048")),
    )
    # after splash's fused backward (7 December 2026, 15:03 UTC: b=8 full, loss chunk 2048, MFU 0.498;
    # save_qkv_attn bf16 moments at chunk 512, 0.499): the two together, and llama3.2-1b with 8 chunks
    attn = ("--config", "qwen3-0.6b", "--batch-size", "8", "--remat", "save_qkv_attn", "--opt-dtype", "bf16")
    runs += (
        ("qwen3-0.6b b=8 save_qkv_attn bf16 moments loss chunk 2048", (*attn, "--loss-chunk", "2048")),
        (
            "llama3.2-1b b=4 full bf16 moments loss chunk 2048",
            ("--config", "llama3.2-1b", "--batch-size", "4", "--remat", "full", "--opt-dtype", "bf16")
            + ("--loss-chunk", "2048"),
        ),
    )
    smoke = (*BENCH, "--config", "tiny-llama", "--peak-n", "256", "--batch-size", "2", "--seq-len", "64")
    smoke += ("--bf16", "--steps", "5", "--loss-chunk", "48", "--remat", "full", "--opt-dtype", "bf16")
    return [
        Job("real-size", name, (*BENCH, *at, *argv), smoke if i == 0 else ())
        for i, (name, argv) in enumerate(runs)
    ]


OUT = "{out}"  # in a job's arguments: the report's --out (a script writing its small files beside it)
ALONE = " alone: "  # an int8-group job timing one implementation by itself ("NAME alone: IMPL")


def _int8_jobs() -> list[Job]:
    """Issue 65 item 3: the int8 step beside the bf16 one in one bench run each (``--impls
    meshlm,meshlm-int8``: the same parameters and batch, interleaved; their ratio and the int8 row's MFU
    over the spec int8 peak), at llama-100m 8 x 512 and a mixture of experts (qwen3-moe-100m, XLA's
    ragged_dot dispatch). qwen3-0.6b 8 x 2048 (the loss in chunks, full remat: 13.1 GB alone) does not
    fit twice on a v5e (two models' weights and AdamW state), so it is two bench runs in this one
    call, each implementation alone, and the report's ratio row divides their medians (unpaired:
    ``_alone_ratios``)."""
    pair = (*BENCH[:-1], f"meshlm,{INT8}", "--quant", "int8", "--bf16")
    llama = ("--config", "llama-100m", "--batch-size", "8", "--seq-len", "512", "--steps", "10")
    moe = ("--config", "qwen3-moe-100m", "--batch-size", "8", "--seq-len", "512", "--steps", "5")
    qwen = ("--config", "qwen3-0.6b", "--batch-size", "8", "--seq-len", "2048", "--steps", "5")
    qwen += ("--remat", "full", "--loss-chunk", "512", "--quant", "int8", "--bf16")
    smoke = (*pair, "--config", "tiny-qwen3-moe", "--peak-n", "256", "--batch-size", "2", "--seq-len", "32")
    smoke += ("--steps", "5", "--warmup", "0", "--moe-dispatch", "ragged_dot")
    return [
        Job("int8", "llama-100m 8x512", (*pair, *llama), smoke),
        *(
            Job("int8", f"qwen3-0.6b 8x2048 full{ALONE}{impl}", (*BENCH[:-1], impl, *qwen))
            for impl in ("meshlm", INT8)
        ),
        Job("int8", "qwen3-moe-100m 8x512 ragged_dot", (*pair, *moe, "--moe-dispatch", "ragged_dot")),
        # item 4: 300 steps of qwen3-0.6b at 4 x 512, bf16 then int8, their loss ratio and both curves
        # in one PNG into --out (scripts/int8_quality.py: ~200 s, the run directories in /tmp)
        Job(
            "int8",
            "qwen3-0.6b quality 300 steps bf16 vs int8",
            ("scripts/int8_quality.py", "--out", OUT),
            ("scripts/int8_quality.py", "--out", OUT, "--cpu-smoke"),
        ),
    ]


def _profile_jobs() -> list[Job]:
    """Issues 63 and 64: where the step's time goes, from a device profile (``scripts/step_profile.py``:
    bench as it is, then a few traced steps of each implementation): the experts against their dense
    equivalent, and Qwen3-0.6B at its best measured setting."""
    script = ("scripts/step_profile.py", "--steps", "2", "--")
    moe = ("--mesh", "1x1", "--batch-size", "8", "--seq-len", "512", "--bf16", "--steps", "5")
    moe += ("--gen-tokens", "0", "--impls", "ragged_dot-dispatch,dense-eq", "--peak-n", "8192")
    qwen = ("--config", "qwen3-0.6b", "--mesh", "1x1", "--batch-size", "8", "--seq-len", "2048", "--bf16")
    qwen += ("--steps", "5", "--remat", "full", "--loss-chunk", "2048", "--impls", "meshlm")
    qwen += ("--gen-tokens", "0")
    # llama3.2-1b at its best measured setting (0.460 of spec, 7 December 2026): where its step goes
    llama = ("--config", "llama3.2-1b", "--mesh", "1x1", "--batch-size", "4", *qwen[6:])
    llama += ("--opt-dtype", "bf16")
    smoke = ("scripts/step_profile.py", "--cpu-smoke")
    moe_step = (*script, "--config", "qwen3-moe-100m", *moe)
    return [
        Job("profile", "step qwen3-moe-100m", moe_step, smoke),
        Job("profile", "step qwen3-moe-100m scatter combine", moe_step, env=COMBINE_SCATTER),
        # the real expert shape (qwen3-30b-a3b's widths, fewer layers and experts): where its 1.6x goes
        Job("profile", "step qwen3-moe-a3b-chip", (*script, "--config", "qwen3-moe-a3b-chip", *moe)),
        Job("profile", "step qwen3-0.6b b=8 full", (*script, *qwen, "--peak-n", "8192")),
        Job("profile", "step llama3.2-1b b=4 full", (*script, *llama, "--peak-n", "8192")),
    ]


GROUPS = {
    "int8": _int8_jobs,
    "real-size": _real_size_jobs,
    "plan": _plan_jobs,
    "attention": _attention_jobs,
    "one-chip": _one_chip_jobs,
    "kernels": _kernel_jobs,
    "profile": _profile_jobs,
}
