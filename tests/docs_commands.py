"""What tests/test_docs_commands.py does with each `meshlm ...` command of README.md and docs/*.md.

Keyed by the command as the docs write it (one line; tests/docs_extract.py). Each is either run (``run``:
with the tiny substitutions it declares, each ``old => new`` on the docs' text, and flags it adds) or
shown only (``shown``: with the reason it is not run here). A command the docs gain without an entry
here, or an entry the docs lost, fails the test. Commands run in one workspace (its files: the test's
``workspace`` fixture); ``after`` names the commands whose outputs a command reads (run first, once).
"""

import functools
from dataclasses import dataclass

# A train run small enough for a test: the tiny-lm preset, 2 steps of 8 x 32, a checkpoint each step.
TINY = (
    "--config tiny-lm --steps 2 --batch-size 8 --seq-len 32 --warmup-steps 1 --eval-every 0 "
    "--eval-batches 1 --save-every 1 --sample-tokens 0"
)
CHAT_PREPARE = (
    "meshlm data prepare --chat --tokenizer chat-tokenizer --data examples/chat/conversations.jsonl "
    "--seq-len 64 --val-fraction 0.2 --out data/chat"
)
CHAT_TRAIN = (
    "meshlm train --data data/chat --tokenizer data/chat/tokenizer.json --config tiny-lm --seq-len 64 "
    "--out runs/chat-sft"
)
DPO_TRAIN = (
    "meshlm train --objective dpo --checkpoint runs/chat-sft --data examples/dpo/pairs.jsonl --seq-len 64 "
    "--batch-size 32 --dpo-beta 0.5 --lr 3e-3 --steps 12 --out runs/dpo"
)
FT_PREPARE = (
    "meshlm data prepare --chat --tokenizer qwen3-tiny --data examples/chat/conversations.jsonl "
    "--seq-len 128 --val-fraction 0.2 --out data/qwen3-chat"
)
FT_TRAIN = (
    "meshlm train --checkpoint runs/qwen3 --data data/qwen3-chat --lora-rank 8 --lora-alpha 16 "
    "--lora-targets q,k,v,o,gate,up,down --seq-len 128 --mesh 2x2 --out runs/qwen3-lora"
)
FT_DPO = (
    "meshlm train --objective dpo --checkpoint runs/qwen3-sft --lora-rank 8 --lora-alpha 16 "
    "--data examples/dpo/pairs.jsonl --seq-len 128 --batch-size 8 --dpo-beta 0.5 --out runs/qwen3-dpo"
)
FT_FAST = "--steps 2 --batch-size 8 --warmup-steps 1 --eval-every 0 --eval-batches 1 --sample-tokens 0"
LORA_TRAIN = (
    "meshlm train --checkpoint runs/llama-import --lora-rank 8 --lora-alpha 16 "
    "--lora-targets q,k,v,o,gate,up,down --data my.txt --out runs/lora"
)
MAIN = "meshlm train"  # the main job: its runs/main is read by generate, eval, verify, convert
OK = "OK: sharded == unsharded"
# 32 devices in a subprocess: 7 plans of the 7B model, 85 s of CPU; the same plans of a small model here
PP_PLAN = (
    "--config llama2-7b => --config tiny-deep",
    "--mesh 2x4 --devices 32 => --mesh 1x2 --devices 8",
    "--seq-len 2048 => --seq-len 32",
)
BENCH = "tests/test_bench.py::test_bench_json_schema_and_values"
BENCH_PP = "tests/test_bench.py::test_bench_pp_times_the_pipeline_against_no_pp"
QUANT_VERIFY = "tests/test_quant.py::test_verify_quant_int8_proves_tiny_llama_and_detects_its_controls"
SCHEDULES = "tests/test_bench.py::test_bench_compare_schedules_times_each_schedule_against_no_pp"
NO_RECOMPUTE = "tests/test_pipeline.py::test_no_chunk_forward_runs_twice"
TR_STEPS = "tests/test_transformer.py::test_transformer_training_steps_float64_on_2x2"
TR32 = "tests/test_transformer.py::test_transformer_float32"
CP = "tests/test_cp.py::test_loss_and_every_gradient_equal_the_unsharded_model"
CPCOMM = "tests/test_cp.py::test_communication_under_cp_with_fsdp_is_within_the_minimum"
MEM = "tests/test_memory_options.py::test_fsdp_and_sp_proven_with_every_new_control_detected"
GPT2 = "tests/test_controls_margin.py::test_padded_logits_control_is_seen_even_where_zero_padding_hides"
MARGIN = "tests/test_controls_margin.py::test_every_control_moves_the_result_by_100x_the_tolerance"
LAUNCH = "tests/test_multiprocess.py::test_launch_verify_spans_both_processes"
PP = "tests/test_pp_verify.py::test_verify_pp_proves_the_pipeline_and_detects_its_send_and_microbatch_faults"
F64 = "tests/test_core.py::test_verify_ff_every_mesh_float64_exact"
Z = "tests/test_prover.py::test_z_loss_is_proven_sharded_and_its_bug_is_caught"
DOC = "tests/test_doc_mask.py::test_verify_doc_mask_passes_and_its_controls_are_detected"
BW = "tests/test_blockwise.py::test_the_proof_compares_blockwise_with_plain_attention"
BW_ONE = "tests/test_blockwise.py::test_verify_blockwise_on_one_device_detects_both_kernel_controls"
CONFIGS = "tests/test_configs.py::test_configs_table_and_json_of_two_presets"
BPE_CLI = "tests/test_tokenizers.py::test_tokenizer_train_cli"
# the chip's --gen-batch decode commands on tiny-llama (docs/benchmarks.md, issue 64)
GEN_BATCH_SUBS = (
    "llama-100m => tiny-llama",
    "--batch-size 8 => --batch-size 2",
    "--gen-batch 1,8,32,64 => --gen-batch 1,2",
    "512 => 16",
    "--gen-tokens 65 => --gen-tokens 10",
    "8192 => 128",
)
QUANT_BENCH = "tests/test_quant.py::test_bench_times_int8_beside_the_float_step"
QUANT_MOE_VERIFY = "tests/test_quant_experts.py::test_verify_quant_int8_proves_tiny_qwen3_moe_over_ep"
QUANT_PP_VERIFY = (
    "tests/test_quant.py::test_int8_under_pp_equals_the_reference_of_its_micro_batches_and_its_control_shows"
)
QUANT_COMPARE = "tests/test_explain.py::test_compare_draws_both_runs_curves_each_labelled_with_its_run"
TOOL_DOC = "tests/test_docs_tool_commands.py::test_documented_tool_command_runs[{}]"  # a quick docs test's id


@functools.cache
def _first_shown() -> dict[str, str]:
    from docs_extract import doc_commands

    return {c.text: c.where for c in reversed(doc_commands())}


def tool_doc(shown: str) -> str:
    """The quick docs test of the one documented command containing ``shown``: its id is the page:line
    that first shows it, looked up here so that an edit above the command does not stale the pointer."""
    where = {w for text, w in _first_shown().items() if shown in text}
    if len(where) != 1:
        raise ValueError(f"tool_doc: {len(where)} documented commands contain {shown!r}, not one")
    return TOOL_DOC.format(where.pop())


QWEN3_FITS = "qwen3-0.6b --mesh 1x1 --device-memory 16GiB --batch-size 1 --seq-len 2048 --remat full --bf16"
LLAMA_FSDP_FITS = "llama3.2-1b --mesh 4x1 --devices 4 --fsdp"
PP_SWEEP = "llama2-7b --pp 4 --mesh 2x4 --devices 32 --microbatches $m"
GEMMA4_PLAN = tool_doc("meshlm plan --config gemma4-31b --mesh 2x4 --devices 8 --fsdp")
FLASH = "tests/test_flash.py::test_verify_proves_flash_with_its_controls_detected"
FLASH_KINDS = "tests/test_flash.py::test_flash_model_equals_plain_with_sinks_and_layer_kinds"
FLASH_RING = "tests/test_flash.py::test_flash_ring_equals_the_unsharded_plain_model"
FLASH_CP = (
    "meshlm verify --config tiny-llama --attention flash --mesh 1x2 --cp 2 --devices 4 --steps 1 --seq-len 64"
)
MP_CKPT = "tests/test_multiprocess.py::test_two_processes_train_like_one_and_checkpoint_restores_in_one"
CK = "tests/test_multiprocess.py::test_two_processes_train_like_one_and_checkpoint_restores_in_one"
MATRIX = "tests/test_prover.py::test_matrix_rows_and_table"
ONE_SET_PP = (
    "meshlm verify --config tiny-qwen2 --mesh 2x2 --pp 2 --devices 8 --fsdp --sp --steps 2 --x64 --seq-len 8"
)
ROUTING = "tests/test_moe.py::test_routing_metrics_of_the_statistics"
CAPACITY = "tests/test_moe.py::test_capacity_proven_under_sp_with_its_control_detected"
ONE_SET = "tests/test_control_set.py::test_the_controls_with_a_path_of_their_own_under_pp_are_detected"
AXES_MATRIX = "tests/test_prover.py::test_matrix_axes_cells_prove_or_refuse_with_the_layouts_reason"
QK = MARGIN  # its tiny-qwen3, tiny-olmo2, tiny-gemma softcap and tiny-gemma3 cases
PPCP = "tests/test_pipeline_model.py::test_pp_with_cp_and_with_the_document_mask_equals_the_unsharded_model"
WINDOW_KERNEL = "tests/test_windows.py::test_both_window_off_by_ones_are_caught"
WINDOW_CP = "tests/test_windows.py::test_cp_with_a_window_equals_the_unsharded_model"
WBENCH = "meshlm bench --config tiny-mistral --attention blockwise --seq-len "
W10 = "meshlm verify --config tiny-mistral-w10 --attention blockwise --attn-block 8 --seq-len 64 "
PHI3 = MARGIN  # its tiny-mistral case: tiny-phi3 is the same blocks and window (its own is the converter's)
SOFTCAP = "tests/test_softcap.py::test_softcap_proven_blockwise_under_the_cp_ring_with_its_controls_detected"
SOFTCAP_BW = (
    "meshlm verify --config tiny-gemma-softcap --attention blockwise --attn-block 8 "
    "--seq-len 64 --x64 --steps 2"
)
EP = "tests/test_ep.py::test_ep_with_fsdp_and_sp_equals_the_unsharded_model_and_its_faults_show"
MOE = "tests/test_moe.py::test_moe_proven_sharded_with_its_sharding_controls_detected"
EP_PP = "tests/test_ep.py::test_ep_under_pp_equals_the_unsharded_model"
LINEAR = "tests/test_deltanet.py::test_verify_proves_linear_attention_and_detects_its_sharding_controls"
LINEAR_2X2 = (
    "meshlm verify --config tiny-qwen3.5 --mesh 2x2 --fsdp --sp --doc-mask --devices 4 --steps 2 --x64"
)
LINEAR_CP = "tests/test_deltanet.py::test_verify_proves_linear_attention_under_cp"
EP_PP_CMD = "meshlm verify --config tiny-mixtral --pp 2 --mesh 2x1 --ep 2 --devices 4 --steps 2 --x64"
ROUTER = "tests/test_router_proof.py::test_router_proven_on_ep_with_its_bias_bitwise"
SINKS = "tests/test_sinks.py::test_verify_proves_sinks_under_the_cp_ring"
CHUNKS = "tests/test_chunked.py::test_verify_proves_chunks_and_nope_layers_under_the_cp_ring"
SPEC_TRAIN = (
    "meshlm train --config tiny-deepseek-v3 --tokenizer bpe-300 --steps 400 --batch-size 16 --seq-len 64 "
    "--out runs/deepseek"
)
SPEC_GENERATE = (
    "meshlm generate --checkpoint runs/deepseek --prompt 'self.' --prompt 'if x' --speculative mtp --json"
)
MTP_TRAIN = "tests/test_mtp.py::test_trains_and_resumes_bitwise_with_the_depth_losses_in_metrics"
SPEC_CLI = "tests/test_speculative.py::test_cli_runs_the_documented_command_and_refuses_bad_input"
GEN_CP = "tests/test_generate_cp.py::test_cli_generate_with_cp_equals_without"
# every control that applies, traced on a cell of the preset's family (SmolLM3's NoPE layers)
FITS, NO_FIT = "device memory 16.00 GiB: fits", "device memory 16.00 GiB: does NOT fit"
LORA_BF16_STEP = (
    "tests/test_lora_base_dtype.py::test_the_compiled_lora_step_computes_no_frozen_weight_gradient"
)
LORA_BF16_VERIFY = (
    "tests/test_lora_base_dtype.py::test_verify_proves_a_bf16_base_in_float64_and_the_controls_are_detected"
)
EVERY = "tests/test_every_control.py::test_every_applicable_control_runs_and_changes_its_program"
GMM_KERNEL = "tests/test_gmm.py::test_the_kernel_in_shard_map_equals_the_reference"
GMM_PROOF = "tests/test_gmm.py::test_gmm_is_proven_in_float64_on_cpu_with_its_controls"
GEN_BATCH = "tests/test_bench.py::test_bench_generation_at_several_batch_sizes_in_bf16"
DECODE_BENCH = "meshlm bench --config llama-100m --mesh 1x1 --batch-size "


@dataclass(frozen=True)
class Run:
    subs: tuple[tuple[str, str], ...] = ()  # (docs' text, what runs instead); each must occur
    add: str = ""  # flags appended (argparse: a later flag wins)
    code: int = 0  # the exit code the docs promise
    expect: tuple[str, ...] = ()  # text the output must hold
    after: tuple[str, ...] = ()  # commands (table keys, or workspace-only commands) run first
    each: tuple[tuple[tuple[str, str], ...], ...] = ((),)  # a shell loop: one run per substitution set
    costly: str = ""  # over the budget: run only with MESHLM_DOCS_ALL=1; the test that proves its path
    slow: str = ""  # run in the slow tier (``-m slow``): the quick test that proves its code path


@dataclass(frozen=True)
class Shown:
    why: str


def run(*subs: str, add="", code=0, expect=(), after=(), each=((),), costly="", slow="") -> Run:
    pairs = tuple(tuple(part.strip() for part in s.split("=>")) for s in subs)
    return Run(pairs, add, code, tuple(expect), tuple(after), each, costly, slow)


def verify(*subs: str, costly: str, expect=(OK,), **kw) -> Run:
    """A proof: 20-60 s of CPU each (every control compiles a program of its own), over this file's
    4-minute budget for all of them; the suite proves the same code path in ``costly`` (a library call
    on smaller shapes). MESHLM_DOCS_ALL=1 runs it as written."""
    return run(*subs, expect=expect, costly=costly, **kw)


def _names(why: str, *texts: str) -> dict[str, Shown]:
    return {t: Shown(why) for t in texts}


NAMES = "names the command (or one of its flags) in prose: not a command line; its runnable forms are run"
COMMANDS: dict[str, Run | Shown] = {
    **_names(
        NAMES,
        "meshlm verify",
        "meshlm generate",
        "meshlm eval",
        "meshlm convert",
        "meshlm data prepare",
        "meshlm tokenizer train",
        "meshlm tokenizer",
        "meshlm bench",
        "meshlm plan",
        "meshlm memory",
        "meshlm launch",
        "meshlm configs",
        "meshlm verify --pp",
        "meshlm train --doc-mask",
        "meshlm tokenizer train --data",
        "meshlm bench --memory-options",
        "meshlm bench --compare-linear",
        "meshlm plan --pp",
        "meshlm generate --temperature 0",
        "meshlm verify --attention blockwise",
        "meshlm train --pp",
        "meshlm bench --pp",
        "meshlm plan --schedule-png",
        "meshlm verify --doc-mask",
        "meshlm bench --ep 2",
        "meshlm plan --lora-rank",
        "meshlm convert --merge runs/qwen3-lora --out DIR",
        "meshlm convert --to-hf DIR",
    ),
    **_names(
        "a placeholder, not a value (DIR, N, ring|allgather, ...): the forms with values are run",
        "meshlm train --data DIR",
        "meshlm bench --attention blockwise --compare-window W",
        "meshlm bench --pp N",
        "meshlm verify --cp N --cp-strategy ring|allgather",
        "meshlm eval --cp N",
        "meshlm bench --pp N --compare-schedules",
        "meshlm train --pp 2 --mesh 1x2 --devices 4 ...",
        "meshlm train --pp 2 --cp 2 --mesh 1x1 --devices 4 ...",
        "meshlm data prepare --pairs --tokenizer DIR --data pairs.jsonl --seq-len N --out STORE",
    ),
    **_names(
        "prose or a quoted message that starts with 'meshlm', not a command",
        "meshlm converts ['gemma', 'gptj', 'llama', 'mistral']",
        "meshlm data prepare was interrupted or failed)",
        "meshlm data prepare into a new or empty --out",
        "meshlm data prepare (no index.json)",
        "meshlm train --help)",  # reliability.md: "(see meshlm train --help)" inside a quoted error
    ),
    # docs/quantization.md
    **_names(NAMES, "meshlm bench --quant int8", "meshlm verify --quant int8"),
    # slow: the int8 step's code path runs quick in tests/test_quant.py (its bench test trains a step)
    "meshlm train --quant int8 --out runs/int8": run(add=TINY, expect=("done",), slow=QUANT_BENCH),
    "meshlm verify --config tiny-llama --quant int8 --mesh 2x2 --devices 4 --x64": verify(
        costly=QUANT_VERIFY
    ),
    "meshlm verify --config tiny-qwen3-moe --quant int8 --mesh 2x2 --ep 2 --devices 4 --x64": verify(
        costly=QUANT_MOE_VERIFY
    ),
    "meshlm verify --config tiny-qwen3-moe --quant int8 --mesh 4x2 --ep 2 --fsdp --sp --devices 8 --x64 "
    "--seed 1": verify(costly=QUANT_MOE_VERIFY),
    "meshlm verify --config tiny-llama --quant int8 --pp 2 --mesh 2x1 --devices 4 --x64": verify(
        costly=QUANT_PP_VERIFY
    ),
    # slow: --compare's figure is tested quick in tests/test_explain.py (the int8 step: as above)
    "meshlm train --quant int8 --out runs/int8 --compare runs/main": run(
        add=TINY, after=(MAIN,), expect=("done",), slow=QUANT_COMPARE
    ),
    "meshlm bench --config llama-100m --mesh 1x1 --batch-size 8 --seq-len 512 --bf16 --gen-tokens 0 "
    "--peak-n 8192 --impls meshlm,meshlm-int8 --quant int8 --json": run(
        "llama-100m => tiny-llama",
        "--batch-size 8 => --batch-size 2",
        "512 => 32",
        "8192 => 128",
        add="--warmup 0",
        expect=('"impls": ["meshlm", "meshlm-int8"]', '"meshlm-int8/meshlm"'),
        slow=QUANT_BENCH,
    ),
    # README.md
    MAIN: run(add=f"--data code --tokenizer bpe-300 --mesh 2x2 {TINY}", expect=("next:",)),
    "meshlm verify --config tiny-llama --mesh 2x2 --devices 4 --x64 --steps 3": verify(costly=TR_STEPS),
    "meshlm generate --checkpoint runs/main --prompt 'def parse(' --max-new-tokens 60": run(
        "60 => 8", after=(MAIN,)
    ),
    # run as "meshlm verify --checkpoint runs/main --mesh 2x2" (docs/training.md, below): the same proof
    "meshlm verify --checkpoint runs/main --mesh 2x2 --devices 4": verify(after=(MAIN,), costly=MP_CKPT),
    "meshlm verify --config tiny-llama --mesh 1x2 --cp 2 --devices 4 --seq-len 64 --x64": verify(costly=CP),
    "meshlm verify --config tiny-llama --attention flash --mesh 1x2 --devices 2 --steps 1": verify(
        costly=FLASH
    ),
    "meshlm verify --config tiny-gpt-oss --attention flash --mesh 2x2 --devices 4 --steps 1": verify(
        costly=FLASH_KINDS
    ),
    FLASH_CP: verify(costly=FLASH_RING),
    "meshlm plan --config llama2-7b --mesh 2x4 --devices 8 --batch-size 8 --seq-len 2048 --fsdp --sp "
    "--remat selective --device-memory 80GiB": run(expect=("fits (",)),
    # docs/benchmarks.md
    "meshlm bench --config small --mesh 1x4 --devices 4 --json --out bench-out --seq-len 256": run(
        "small => tiny-lm", "256 => 32 --batch-size 4 --gen-tokens 2 --warmup 0", costly=BENCH
    ),
    "meshlm bench --config cpu --mesh 1x1 --devices 1 --batch-size 1 --seq-len 1024 --attention blockwise "
    "--gen-tokens 0": run("cpu => tiny-llama", "1024 => 64 --attn-block 16 --warmup 0", costly=BENCH),
    "meshlm bench --config cpu --mesh 1x1 --devices 4 --cp 4 --batch-size 1 --seq-len 1024 --attention "
    "blockwise --gen-tokens 0": run(
        "cpu => tiny-llama", "1024 => 64 --attn-block 16 --warmup 0", costly=BENCH
    ),
    "meshlm bench --config small --mesh 1x4|2x2 --devices 4 --json --gen-tokens 0 --seq-len 256": run(
        "small => tiny-lm", "1x4|2x2 => 2x2", "256 => 32 --batch-size 4 --warmup 0", costly=BENCH
    ),
    "meshlm bench --config cpu --vocab-size 1024 --mesh 2x2 --devices 4 --batch-size 32 --seq-len 128 "
    "--gen-tokens 0 --json": run("cpu => tiny-lm", "32 => 4", "128 => 32 --warmup 0", costly=BENCH),
    # the accelerator section: the chip's command on tiny-llama (its own flags, its JSON's fields)
    "meshlm bench --config qwen3-0.6b --mesh 1x1 --impls meshlm --bf16 --remat selective --batch-size 2 "
    "--seq-len 2048 --gen-tokens 0 --peak-n 8192 --json": run(
        "qwen3-0.6b => tiny-llama",
        "2048 => 64",
        "8192 => 128",
        add="--warmup 0",
        expect=('"compute_dtype": "bfloat16"', '"remat": "selective"', '"batch_size": 2'),
    ),
    "meshlm bench --config qwen3-0.6b --mesh 1x1 --impls meshlm --bf16 --remat full --batch-size 1 "
    "--seq-len 2048 --gen-tokens 0 --peak-n 8192 --json": run(
        "qwen3-0.6b => tiny-llama",
        "2048 => 64",
        "8192 => 128",
        add="--warmup 0",
        expect=('"impls": ["meshlm"]', '"compute_dtype": "bfloat16"', '"remat": "full"', '"mfu_spec": null'),
    ),
    # docs/finetuning.md: the LoRA step of qwen3-1.7b on a bf16 base, on tiny-llama (a random base)
    "meshlm bench --config qwen3-1.7b --mesh 1x1 --impls meshlm --lora-rank 16 --bf16 --remat full "
    "--batch-size 2 --seq-len 2048 --gen-tokens 0 --peak-n 8192 --json": run(
        "qwen3-1.7b => tiny-llama",
        "2048 => 64",
        "8192 => 128",
        add="--warmup 0",
        expect=('"lora": {"rank": 16', '"base_dtype": "bf16"', '"impls": ["meshlm"]'),
    ),
    # the chip's meshlm-against-plain command (docs/benchmarks.md "On a TPU chip") on tiny-llama
    "meshlm bench --config llama-100m --mesh 1x1 --batch-size 8 --seq-len 512 --gen-tokens 0 --peak-n 8192 "
    "--steps 10 --json --attention plain --impls meshlm,plain": run(
        "llama-100m => tiny-llama",
        "--batch-size 8 => --batch-size 2",
        "512 => 32",
        "8192 => 128",
        "--steps 10 => --steps 5 --warmup 0",
        expect=('"impls": ["meshlm", "plain"]', '"meshlm/plain"'),
    ),
    # the chip's attention sweep (docs/benchmarks.md "Choosing --attention auto") on tiny-llama: the same
    # bench path as the command above, so slow
    "meshlm bench --config llama-100m --mesh 1x1 --bf16 --attention plain --batch-size 16 --seq-len 512 "
    "--steps 8 --gen-tokens 0 --peak-n 8192 --impls meshlm --json": run(
        "llama-100m => tiny-llama",
        "--batch-size 16 => --batch-size 2",
        "512 => 32",
        "8192 => 128",
        "--steps 8 => --steps 5 --warmup 0",
        expect=('"compute_dtype": "bfloat16"',),
        slow="tests/test_docs_tool_commands.py",
    ),
    # the chip's decode-roofline command (docs/benchmarks.md "Decode: chunks of steps") on tiny-llama: a
    # CPU's generation report has the step's time and no roofline
    "meshlm bench --config llama-100m --mesh 1x1 --batch-size 8 --seq-len 512 --gen-tokens 64 --peak-n 8192 "
    "--impls meshlm --json": run(
        "llama-100m => tiny-llama",
        "--batch-size 8 => --batch-size 2",
        "512 => 16",
        "--gen-tokens 64 => --gen-tokens 10",
        "8192 => 128",
        add="--warmup 0",
        expect=('"decode_step_ms"', '"roofline_ms": null'),
    ),
    # issue 64's chip commands (docs/benchmarks.md "Issue 64 on the chip"), on tiny models here: the MoE
    # dispatches side by side (gmm in interpret mode: slow), decode at several batch sizes in bf16
    "meshlm bench --config qwen3-moe-100m --mesh 1x1 --batch-size 8 --seq-len 512 --bf16 --gen-tokens 0 "
    "--peak-n 8192 --impls ragged_dot-dispatch,gmm-dispatch,dense-eq --json": run(
        "qwen3-moe-100m => tiny-qwen3-moe",
        "--batch-size 8 => --batch-size 2",
        "512 => 16",
        "8192 => 128",
        add="--warmup 0",
        expect=('"gmm-dispatch/dense-eq"', '"ragged_dot-dispatch/dense-eq"'),
        slow=GMM_KERNEL,
    ),
    "meshlm bench --config qwen3-moe-a3b-chip --mesh 1x1 --batch-size 8 --seq-len 512 --bf16 --gen-tokens 0 "
    "--peak-n 8192 --impls ragged_dot-dispatch,gmm-dispatch,dense-eq --json": run(
        "qwen3-moe-a3b-chip => tiny-qwen3-moe",
        "--batch-size 8 => --batch-size 2",
        "512 => 16",
        "8192 => 128",
        add="--warmup 0",
        expect=('"gmm-dispatch/dense-eq"',),
        slow=GMM_KERNEL,
    ),
    DECODE_BENCH + "8 --seq-len 512 --gen-tokens 65 --gen-batch 1,8,32,64 --peak-n 8192 --impls meshlm "
    "--bf16 --json": run(
        *GEN_BATCH_SUBS,
        add="--warmup 0",
        expect=('"generation_by_batch"', '"dtype": "bfloat16"', '"roofline_ms": null'),
        slow=GEN_BATCH,
    ),
    DECODE_BENCH + "8 --seq-len 512 --gen-tokens 65 --gen-batch 1,8,32,64 --peak-n 8192 --impls meshlm "
    "--json": run(
        *GEN_BATCH_SUBS,
        add="--warmup 0",
        expect=('"generation_by_batch"', '"dtype": "float32"'),
        slow=GEN_BATCH,
    ),
    DECODE_BENCH + "1 --seq-len 4096 --gen-tokens 65 --gen-batch 1,8 --peak-n 8192 --impls meshlm --bf16 "
    "--json": run(
        "llama-100m => tiny-llama",
        "--gen-batch 1,8 => --gen-batch 1,2",
        "4096 => 48",
        "--gen-tokens 65 => --gen-tokens 10",
        "8192 => 128",
        add="--warmup 0",
        expect=('"generation_by_batch"', '"prompt_len": 48'),
        slow=GEN_BATCH,
    ),
    "meshlm bench --config tiny-llama --mesh 1x1 --impls meshlm,jax": run(
        code=2, expect=("no implementation jax for this model and mesh; valid: meshlm,unsharded,gspmd,plain",)
    ),
    "meshlm plan --config cpu --mesh 1x1 --seq-len 16384 --batch-size 1": run(),
    # qwen3-moe-a3b-chip's memory (docs/benchmarks.md "Issue 64"): 45 s of CPU to compile its step; the
    # same plan of the MoE path on a tiny preset here
    # the experts' fixed and per-token parts (docs/benchmarks.md): the same bench, twice the tokens
    "meshlm bench --config qwen3-moe-a3b-chip --mesh 1x1 --batch-size 16 --seq-len 512 --bf16 --gen-tokens 0 "
    "--peak-n 8192 --impls ragged_dot-dispatch,dense-eq --json": run(
        "qwen3-moe-a3b-chip => tiny-qwen3-moe",
        "--batch-size 16 => --batch-size 2",
        "512 => 16",
        "8192 => 128",
        add="--warmup 0",
        expect=('"ragged_dot-dispatch/dense-eq"',),
        slow="tests/test_bench.py::test_moe_against_the_dense_model_of_equal_active_parameters",
    ),
    "meshlm plan --config qwen3-moe-a3b-chip --mesh 1x1 --batch-size 8 --seq-len 512 "
    "--moe-dispatch ragged_dot --bf16": run(
        "qwen3-moe-a3b-chip => tiny-qwen3-moe", "--batch-size 8 => --batch-size 2", "512 => 16"
    ),
    WBENCH + "4096 --compare-window 1024 --batch-size 1 --steps 5 --mesh 1x1": run(
        "4096 --compare-window 1024 => 32 --compare-window 10 --attn-block 8 --warmup 0",
        expect=("window 10",),
    ),
    WBENCH + "16384 --compare-window 1024 --batch-size 1 --steps 5 --warmup 0 --mesh 1x1": Shown(
        "the same path as the 4096 line (run, on 32 tokens); a step takes minutes at 16384"
    ),
    "meshlm bench --config tiny-qwen3.5 --attention blockwise --seq-len 16384 --compare-linear "
    "--batch-size 1 --steps 5 --warmup 0 --mesh 1x1 --devices 1": run(
        "16384 => 32 --attn-block 8",
        expect=("linear/full",),
        costly="tests/test_bench.py::test_bench_compare_linear_times_both_mixers_at_three_lengths",
    ),
    # docs/training.md: chat SFT
    CHAT_PREPARE: run(),
    CHAT_TRAIN: run(
        add="--steps 2 --batch-size 8 --warmup-steps 1 --eval-every 0 --eval-batches 1 --save-every 1 "
        "--sample-tokens 0",
        after=(CHAT_PREPARE,),
    ),
    "meshlm eval --checkpoint runs/chat-sft --data data/chat": run(after=(CHAT_TRAIN,)),
    "meshlm verify --objective sft --config tiny-qwen3 --mesh 2x2 --x64": verify(
        costly="tests/test_chat_sft.py::test_verify_sft_loss_equal_unsharded_and_its_controls_detected"
    ),
    # docs/training.md: DPO (after the chat SFT run, whose checkpoint it fine-tunes)
    DPO_TRAIN: run("--steps 12 => --steps 2", add="--eval-batches 1 --sample-tokens 0", after=(CHAT_TRAIN,)),
    "meshlm verify --objective dpo --config tiny-llama --mesh 2x2 --x64": verify(
        costly="tests/test_dpo.py::test_verify_dpo_equal_unsharded_and_its_controls_detected"
    ),
    "meshlm verify --objective dpo --config tiny-llama --mesh 2x2 --devices 4 --x64 --steps 2": verify(
        costly="tests/test_dpo.py::test_verify_dpo_proves_k_adamw_steps"
    ),
    # docs/proof.md: issue 59's LoRA proof, its q/k norm control skipped with its reason
    "meshlm verify --config tiny-qwen3 --objective sft --lora-rank 4 --mesh 2x2 --devices 4 "
    "--seq-len 32 --x64": verify(
        costly="tests/test_control_skips.py::"
        "test_a_fault_only_frozen_weights_show_and_an_inert_one_are_skipped_with_their_reasons"
    ),
    "meshlm verify --config tiny-llama --mesh 2x2 --devices 4 --x64 --lora-rank 4 --steps 2": verify(
        costly="tests/test_lora.py::test_verify_lora_proves_k_adamw_steps_of_the_adapters_and_the_base_kept"
    ),
    # docs/data.md
    "meshlm data prepare --data 'shards/*.parquet' --text-field content --out data/web": run(),
    "meshlm train --data data/web --config small --out runs/web": run(
        "--config small => " + TINY,
        after=("meshlm data prepare --data 'shards/*.parquet' --text-field content --out data/web",),
    ),
    "meshlm data prepare --data dump.jsonl.zst --out data/dump": run(),
    "meshlm data prepare --data my_dataset/ --tokenizer tok.json --out data/ds": run(),
    "meshlm train --data notes.jsonl.gz --text-field body --config tiny-lm": run(
        "--config tiny-lm => " + TINY + " --out runs/notes"  # runs/main, its default, is the main job's
    ),
    "meshlm data prepare --data 'corpus/**/*.txt' --tokenizer tok/tokenizer.json --out data/corpus": run(),
    "meshlm train --data data/corpus --tokenizer data/corpus/tokenizer.json --out runs/big": run(
        add=TINY,
        after=(
            "meshlm data prepare --data 'corpus/**/*.txt' --tokenizer tok/tokenizer.json --out data/corpus",
        ),
    ),
    "meshlm data prepare --data my.txt --out data/my": run(),
    "meshlm train --data data/my --config tiny-lm --out runs/my": run(
        "--config tiny-lm => " + TINY, after=("meshlm data prepare --data my.txt --out data/my",)
    ),
    # in the slow tier (12 s of CPU: a BPE trained on the 8 MB stdlib, then a run with it): the same CLI
    # on a small corpus, and a run with a trained BPE, are quick
    "meshlm tokenizer train --vocab-size 1024 --out bpe1024.json": run(slow=BPE_CLI),
    "meshlm tokenizer train --data 'docs/**/*.md' --vocab-size 8000 --out docs-bpe.json": run("8000 => 1000"),
    "meshlm train --tokenizer bpe1024.json --out runs/bpe": run(
        add="--data code " + TINY,
        after=("meshlm tokenizer train --vocab-size 1024 --out bpe1024.json",),
        slow=BPE_CLI,
    ),
    # docs/evaluation.md
    "meshlm eval --checkpoint runs/main --data runs/main-store --split val": run(
        expect=("bits/byte",),
        after=(
            MAIN,
            "meshlm data prepare --data code --tokenizer runs/main/tokenizer.json --out runs/main-store",
        ),
    ),
    "meshlm eval --checkpoint runs/imported --data wiki.test.jsonl --tokenizer hf/tokenizer.json "
    "--mesh 2x2": run(
        "--mesh 2x2 => --seq-len 32 --mesh 2x2",
        expect=("bits/byte",),
        after=("meshlm convert --from-hf path/to/hf-model --out runs/imported",),
    ),
    "meshlm eval --checkpoint runs/main --data 'held_out/*.py' --seq-len 128 --json": run(
        "128 => 32", expect=('"bits_per_byte"',), after=(MAIN,)
    ),
    "meshlm data prepare --tokenizer runs/main/tokenizer.json --out runs/main-valdata": run(
        add="--data code",
        after=(MAIN,),  # the docs' stdlib corpus: 8 MB, 30 s; a small corpus here
    ),
    "meshlm eval --checkpoint runs/main --data runs/main-valdata --mesh 2x2": run(
        "--mesh 2x2 => --seq-len 32 --mesh 2x2",
        expect=("bits/byte",),
        after=(MAIN, "meshlm data prepare --tokenizer runs/main/tokenizer.json --out runs/main-valdata"),
    ),
    "meshlm eval --help": run(expect=("usage: meshlm eval",)),
    # docs/memory.md
    "meshlm plan --config cpu --mesh 1x1 --cp 4 --attention blockwise --seq-len 16384 --batch-size 1": run(
        "16384 => 2048"
    ),
    "meshlm plan --config llama2-7b --mesh 1x8 --devices 8 --batch-size 8 --seq-len 2048 "
    "--device-memory 80GiB": Shown(
        "same code path as tests/test_plan.py::test_llama2_7b_on_one_by_eight (these settings; the search "
        "compiles three 7B steps: 28 s of CPU)"
    ),
    "meshlm plan --config llama3.1-70b --mesh 8x8 --devices 64 --fsdp --sp --remat selective "
    "--device-memory 80GiB": run(),
    "meshlm plan --config deepseek-v3 --mesh 8x8 --ep 8 --pp 4 --fsdp --sp --devices 256": Shown(
        "same code path as tests/test_pp_uneven.py::"
        "test_plan_holds_the_padded_stack_and_counts_the_real_layers (uneven stages' padded stack, on cpu's "
        "4 layers on pp 3); this one compiles the 671B pipelined step on 256 fake devices: 33-68 s of CPU"
    ),
    "meshlm verify --config cpu --pp 3 --mesh 1x1 --devices 3 --x64 --steps 1": verify(
        costly="tests/test_pp_uneven.py::test_a_dense_model_with_an_odd_layer_count_is_proven"
    ),
    "meshlm memory --config llama2-7b --mesh 1x8 --devices 8": run(expect=("3.139 GiB",)),
    # docs/memory.md: presets that fill one 16 GiB chip (each one compile of the real step, 5-15 s); the
    # verdict, not the figures (the model code's speed work moves XLA's buffer plan by a little)
    # Each verdict's path quick once (fits: qwen3-0.6b; no fit: llama3.2-1b; fits with fsdp: llama3.2-1b);
    # the other presets' same verdicts in the slow tier
    "meshlm plan --config smollm2-360m --mesh 1x1 --device-memory 16GiB --batch-size 4 --seq-len 2048 "
    "--remat full --bf16": run(expect=(FITS,), slow=tool_doc(QWEN3_FITS)),
    "meshlm plan --config qwen3-0.6b --mesh 1x1 --device-memory 16GiB --batch-size 1 --seq-len 2048 "
    "--remat full --bf16": run(expect=(FITS,)),
    # docs/memory.md's --loss-chunk: batch 2 fits only in chunks
    "meshlm plan --config qwen3-0.6b --mesh 1x1 --device-memory 16GiB --batch-size 2 --seq-len 2048 "
    "--remat full --bf16 --loss-chunk 512": run(expect=(FITS,)),
    "meshlm verify --config tiny-qwen3 --mesh 2x2 --sp --loss-chunk 7 --x64": verify(
        costly="tests/test_chunked_xent.py::test_verify_x64_proves_chunked_sharded_against_the_whole_loss_and_detects_the_fault"
    ),
    "meshlm plan --config llama3.2-1b --mesh 1x1 --device-memory 16GiB --batch-size 1 --seq-len 2048 "
    "--remat full --bf16 --max-compiles 1": run(code=1, expect=(NO_FIT,)),
    "meshlm plan --config qwen3-1.7b --mesh 1x1 --device-memory 16GiB --batch-size 1 --seq-len 2048 "
    "--remat full --bf16 --max-compiles 1": run(
        code=1, expect=(NO_FIT,), slow=tool_doc("llama3.2-1b --mesh 1x1 --device-memory 16GiB --batch-size 1")
    ),
    "meshlm plan --config llama3.2-1b --mesh 4x1 --devices 4 --fsdp --device-memory 16GiB --batch-size 4 "
    "--seq-len 2048 --remat full --bf16": run(expect=(FITS,)),
    "meshlm plan --config qwen3-1.7b --mesh 4x1 --devices 4 --fsdp --device-memory 16GiB --batch-size 4 "
    "--seq-len 2048 --remat full --bf16": run(expect=(FITS,), slow=tool_doc(LLAMA_FSDP_FITS)),
    # docs/memory.md, --chip: in CI (no libtpu) XLA:CPU with the v5e correction, three qwen3-0.6b compiles
    "meshlm plan --config qwen3-0.6b --mesh 1x1 --seq-len 2048 --batch-size 8 --bf16 --remat full "
    "--chip v5e": run(
        expect=("compiler for v5e", "recommended: --remat full --accum-steps 8"),
        slow="tests/test_plan_target.py::test_chip_sets_the_memory_and_plans_with_the_v5e_correction",
    ),
    "meshlm verify --fsdp --sp --remat selective --steps 3 --x64": verify(costly=MEM),
    # one compile of the 1.7B step (20-60 s of CPU); the plan's LoRA bf16-base path is
    # tests/test_lora_base_dtype.py's compiled step (quick)
    "meshlm plan --config qwen3-1.7b --lora-rank 16 --base-dtype bf16 --bf16 --seq-len 2048 --batch-size 2 "
    "--remat full --mesh 1x1 --device-memory 16GiB --max-compiles 1": run(
        expect=(FITS,), slow=LORA_BF16_STEP
    ),
    "meshlm verify --config tiny-llama --mesh 2x2 --devices 4 --x64 --lora-rank 4 --base-dtype bf16 "
    "--steps 2": verify(costly=LORA_BF16_VERIFY),
    "meshlm bench --config small --mesh 2x2 --devices 4 --memory-options --gen-tokens 0 --seq-len 256": run(
        "small => tiny-lm", "256 => 32 --batch-size 4 --warmup 0", costly=BENCH
    ),
    # docs/models.md
    "meshlm verify --config tiny-qwen3 --mesh 2x2 --devices 4 --steps 2 --x64": verify(costly=QK),
    "meshlm verify --config tiny-olmo2 --mesh 2x2 --devices 4 --steps 2 --x64": verify(costly=QK),
    "meshlm verify --config tiny-phi3 --x64 --steps 2": verify(costly=PHI3),
    "meshlm verify --config tiny-phi3 --mesh 1x2 --x64 --steps 2": verify(costly=PHI3),
    SOFTCAP_BW: verify(costly=SOFTCAP),
    f"{SOFTCAP_BW} --mesh 1x2 --cp 2 --devices 4": verify(costly=SOFTCAP),
    f"{SOFTCAP_BW} --mesh 1x2 --cp 2 --devices 4 --cp-strategy allgather": verify(costly=SOFTCAP),
    "meshlm verify --config tiny-gemma2 --x64 --steps 2": verify(costly=QK),
    "meshlm verify --config tiny-gemma2 --x64 --steps 2 --mesh 1x2": verify(costly=QK),
    "meshlm verify --config tiny-gemma3 --x64 --steps 2": verify(costly=QK),
    "meshlm verify --config tiny-gemma3 --mesh 1x1 --pp 2 --devices 2 --pp-schedule 1f1b "
    "--steps 2 --x64": verify(costly=PP),
    "meshlm verify --config tiny-mixtral --mesh 2x2 --devices 4 --steps 3 --x64": verify(costly=MOE),
    "meshlm train --config cpu --seq-len 4096 --mesh 1x1 --cp 4 --devices 4 --attention blockwise "
    "--batch-size 1 "
    "--steps 3 --warmup-steps 1 --eval-every 0 --save-every 0 --sample-tokens 40 --out runs/long": run(
        "cpu => tiny-lm", "4096 => 64 --attn-block 16 --data code", "--steps 3 => --steps 2", "40 => 8"
    ),
    "meshlm generate --checkpoint runs/long": run(
        after=(
            "meshlm train --config cpu --seq-len 4096 --mesh 1x1 --cp 4 --devices 4 --attention blockwise "
            "--batch-size 1 --steps 3 --warmup-steps 1 --eval-every 0 --save-every 0 --sample-tokens 40 "
            "--out runs/long",
        ),
        add="--prompt 'def ' --max-new-tokens 8",  # the prose leaves the prompt out
    ),
    # in the slow tier: generate --cp 2 from a checkpoint, equal to generate without, is quick in GEN_CP
    "meshlm generate --checkpoint runs/main --prompt-file long.txt --mesh 1x2 --cp 2": run(
        "--prompt-file long.txt => --prompt 'def parse('",
        add="--max-new-tokens 8",
        after=(MAIN,),
        slow=GEN_CP,
    ),
    "meshlm generate --checkpoint runs/main --prompt 'def parse(' --max-new-tokens 100": run(
        "100 => 8", after=(MAIN,)
    ),
    "meshlm generate --checkpoint runs/main/600 --prompt 'import ' --prompt 'class ' --temperature 0 "
    "--json": run("runs/main/600 => runs/main/2", add="--max-new-tokens 8", after=(MAIN,)),
    "meshlm convert --from-hf path/to/hf-model --out runs/imported": run(),
    "meshlm convert --to-hf runs/main --out exported-hf": run(after=(MAIN,)),
    # in the slow tier (17 s of CPU: every preset traced for its counts): the command on two presets is quick
    "meshlm configs --json": run(expect=('"name": "llama2-7b"',), slow=CONFIGS),
    "meshlm verify --config tiny-gpt2vocab --mesh 1xN --devices 8 --x64 --steps 2": verify(
        "1xN => 1x8", costly=GPT2
    ),
    "meshlm plan --config gemma-7b --mesh 2x4 --devices 8 --batch-size 8 --seq-len 2048 --fsdp --sp --remat "
    "selective --device-memory 80GiB": run(),
    # Gemma 4's real sizes, as written (an AOT compile of the split stack: ~15 s of CPU each)
    "meshlm plan --config gemma4-31b --mesh 2x4 --devices 8 --fsdp": run(expect=("1/8.0",)),
    # in the slow tier: the same plan of Gemma 4's other preset (the 31B's, the line above, is quick)
    "meshlm plan --config gemma4-e4b --mesh 2x4 --devices 8 --fsdp": run(
        expect=("gemma4-e4b on mesh 2x4",), slow=GEMMA4_PLAN
    ),
    # docs/multiprocess.md
    "meshlm launch -n 2 --devices-per-process 2 -- verify --mesh 2x2 --json": verify(
        costly=LAUNCH, expect=('"ok": true',)
    ),
    "meshlm launch -n 2 --devices-per-process 2 -- train --mesh 2x2 --out runs/mp": run(
        "-- train => -- train --data code " + TINY, costly=MP_CKPT
    ),
    **_names(
        "two hosts with 8 GPUs each (10.0.0.1); the same flags on one host: tests/test_multiprocess.py",
        "meshlm train --mesh 2x8 --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0 --out "
        "/shared/run",
        "meshlm train --mesh 2x8 --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 1 --out "
        "/shared/run",
    ),
    # docs/pipeline.md
    "meshlm verify --config tiny-llama --mesh 1x2 --pp 2 --devices 4 --pp-schedule 1f1b --steps 3 "
    "--x64": verify(costly=PP),
    "meshlm verify --config tiny-deep --mesh 2x2 --pp 2 --devices 8 --pp-schedule interleaved "
    "--virtual-stages 2 "
    "--fsdp --steps 2 --x64": verify(costly=PP),
    "meshlm verify --config tiny-deep --pp 2 --mesh 2x2 --devices 8 --fsdp --sp --pp-schedule $s "
    "--steps 2 --x64": verify(
        costly=PP, each=((("$s", "1f1b"),), (("$s", "gpipe"),), (("$s", "interleaved --virtual-stages 2"),))
    ),
    "meshlm plan --config llama2-7b --pp 4 --mesh 2x4 --devices 32 --microbatches $m --pp-schedule $s "
    "--batch-size $((2 * m)) --seq-len 2048": run(
        *PP_PLAN,
        each=tuple(  # one plan per schedule (the loop's six are 26 s of the suite; the same code path)
            (("$m", str(m)), ("$s", s), ("$((2 * m))", str(2 * m))) for s, m in (("1f1b", 32), ("gpipe", 8))
        ),
    ),
    # in the slow tier: the pipeline plan of the loop above (quick) with --sp (the pp step with sp compiles
    # quick in tests/test_pp_verify.py)
    "meshlm plan --config llama2-7b --pp 4 --mesh 2x4 --devices 32 --microbatches 8 --pp-schedule 1f1b "
    "--batch-size 16 --seq-len 2048 --sp": run(*PP_PLAN, slow=tool_doc(PP_SWEEP)),
    "meshlm bench --config tiny-deep --pp 2 --mesh 1x1 --devices 2 --microbatches 4 --batch-size 8 "
    "--seq-len 32 "
    "--steps 5 --gen-tokens 0": run(expect=("pipeline (1f1b, pp=2, M=4)",), costly=BENCH_PP),
    "meshlm bench --config cpu-deep --pp $pp --mesh 1x1 --devices $pp --microbatches $m --batch-size $m "
    "--seq-len 64 --steps 10 --gen-tokens 0 --compare-schedules": run(
        each=tuple(  # each substitution replaces one occurrence: $pp and $m appear twice
            (
                ("--pp $pp --mesh 1x1 --devices $pp", f"--pp {pp} --mesh 1x1 --devices {pp}"),
                ("--microbatches $m --batch-size $m", f"--microbatches {m} --batch-size {m}"),
            )
            for pp, m in ((2, 4), (4, 8))
        ),
        costly=SCHEDULES,
    ),
    "meshlm verify --config tiny-deep --pp 2 --mesh 1x2 --devices 4 --steps 2 --x64 --pp-schedule 1f1b "
    "--microbatches 4": verify(costly=NO_RECOMPUTE),
    "meshlm verify --config tiny-deep --pp 2 --mesh 1x2 --devices 4 --steps 2 --x64 --pp-schedule 1f1b "
    "--microbatches 4 --remat full": verify(costly=NO_RECOMPUTE),
    "meshlm verify --config tiny-deep --pp 2 --mesh 1x2 --devices 4 --steps 2 --x64 --microbatches 4 "
    "--pp-schedule interleaved --virtual-stages 2 --remat selective": verify(costly=NO_RECOMPUTE),
    "meshlm verify --config tiny-deep --pp 2 --cp 2 --mesh 1x2 --devices 8 --seq-len 64 --steps 2 --x64 "
    "--pp-schedule $s --cp-strategy $c": verify(
        costly=PPCP,
        each=tuple(
            (("$s", s), ("$c", c)) for s in ("1f1b", "gpipe", "interleaved") for c in ("ring", "allgather")
        ),
    ),
    "meshlm verify --config tiny-deep --pp 2 --doc-mask --x64 --steps 2": verify(costly=PPCP),
    # in the slow tier: pipeline plans with remat (the pp plans of pipeline.md's 7B table are quick, and
    # so is a plan with remat: tests/test_plan.py::test_fsdp_sp_and_selective_remat_are_planned)
    "meshlm plan --config small --pp 4 --mesh 1x1 --devices 4 --microbatches $m --pp-schedule 1f1b "
    "--batch-size $((2 * m)) --seq-len 256 --remat $r": run(
        "--seq-len 256 => --seq-len 64",
        slow="tests/test_plan.py::test_fsdp_sp_and_selective_remat_are_planned",
        each=tuple(  # two of the loop's four plans, each remat and each micro-batch count (the same path)
            (("$m", str(m)), ("$((2 * m))", str(2 * m)), ("$r", r)) for r, m in (("none", 4), ("full", 8))
        ),
    ),
    # docs/proof.md
    "meshlm verify --config seed --mesh 1x4 --devices 4": Shown(
        "same code path as tests/test_core.py::test_cli_verify_seed_1x4_json (this command with --json)"
    ),
    "meshlm verify --config seed --mesh 1x4 --devices 4 --x64": verify(costly=F64),
    "meshlm verify --config tiny-llama --mesh 2x2 --steps 5": verify(costly=TR32),
    "meshlm verify --checkpoint runs/main --mesh 2x2 --json": Shown(
        "same code path as README.md:75's test here (this proof of runs/main; --json prints it as one object)"
    ),
    "meshlm verify --config tiny-gqa --mesh 1x4 --z-loss 1e-3 --x64": verify(costly=Z),
    "meshlm verify --matrix --devices 8 --md": verify(costly=MATRIX),
    "meshlm verify --matrix --axes pp,cp": verify(costly=AXES_MATRIX),
    ONE_SET_PP: verify(costly=ONE_SET),
    "meshlm verify --config tiny-gpt2vocab --mesh 1x8 --devices 8 --x64": verify(costly=GPT2),
    "meshlm verify --config tiny-llama3 --mesh 2x2 --devices 4 --x64 --steps 2": verify(costly=MARGIN),
    "meshlm verify --config tiny-qwen2 --mesh 2x2 --devices 4 --x64 --steps 2": verify(costly=MARGIN),
    "meshlm verify --config tiny-llama --mesh 2x2 --devices 4 --x64 --fsdp --sp --doc-mask": verify(
        costly=DOC
    ),
    "meshlm verify --checkpoint /tmp/bw-ckpt --mesh 2x2 --devices 4 --x64 --steps 2": verify(
        "/tmp/bw-ckpt => bw-ckpt",
        costly=BW,  # the workspace's: the docs' snippet, run by the fixture
    ),
    "meshlm verify --config tiny-llama --mesh 1x2 --cp 2 --devices 4 --seq-len 64 --steps 3 --x64": verify(
        costly=CP
    ),
    "meshlm verify --config tiny-llama --mesh 2x2 --cp 2 --devices 8 --seq-len 64 --fsdp --sp "
    "--steps 2 --x64": verify(costly=CPCOMM),
    "meshlm verify --config tiny-llama --mesh 2x2 --cp 2 --cp-strategy allgather --devices 8 "
    "--seq-len 64 --fsdp "
    "--sp --steps 2 --x64": verify(costly=CPCOMM),
    "meshlm verify --config tiny-gpt-oss --mesh 1x4 --devices 4 --steps 2 --x64": verify(costly=SINKS),
    "meshlm verify --config tiny-llama4 --mesh 2x2 --devices 4 --steps 2 --x64": verify(costly=CHUNKS),
    "meshlm verify --config tiny-gpt-oss --mesh 2x2 --devices 4 --steps 2 --x64": verify(costly=SINKS),
    "meshlm verify --config tiny-gpt-oss --mesh 1x2 --cp 2 --attention blockwise --devices 4 --steps 2 "
    "--x64": verify(costly=SINKS),
    "meshlm verify --config tiny-gpt-oss --mesh 2x2 --ep 2 --devices 4 --steps 2 --x64": verify(costly=EP),
    "meshlm verify --config tiny-llama4 --mesh 1x4 --devices 4 --steps 2 --x64": verify(costly=CHUNKS),
    "meshlm verify --config tiny-llama4 --mesh 1x2 --cp 2 --attention blockwise --devices 4 --steps 2 "
    "--x64": verify(costly=CHUNKS),
    "meshlm verify --config tiny-llama4 --mesh 2x2 --ep 2 --devices 4 --steps 2 --x64": verify(costly=EP),
    "meshlm verify --config tiny-olmo3 --mesh 1x4 --devices 4 --steps 2 --x64": verify(costly=MARGIN),
    "meshlm verify --config tiny-olmo3 --mesh 2x2 --devices 4 --steps 2 --x64": verify(costly=MARGIN),
    "meshlm verify --config tiny-smollm3 --mesh 1x4 --devices 4 --steps 2 --x64": verify(costly=EVERY),
    "meshlm verify --config tiny-smollm3 --mesh 2x2 --devices 4 --steps 2 --x64": verify(costly=EVERY),
    "meshlm verify --config tiny-gemma4 --mesh 1x4 --devices 4 --steps 2 --x64": verify(costly=MARGIN),
    "meshlm verify --config tiny-gemma4 --mesh 2x2 --devices 4 --steps 2 --x64": verify(costly=MARGIN),
    "meshlm verify --config tiny-mixtral --mesh 2x2 --ep 2 --devices 4 --steps 3 --x64": verify(costly=EP),
    "meshlm verify --config tiny-mixtral --mesh 4x1 --ep 4 --devices 4 --steps 3 --x64": verify(costly=EP),
    "meshlm verify --config tiny-qwen2-moe --mesh 2x2 --ep 2 --devices 4 --steps 3 --x64": verify(costly=MOE),
    "meshlm verify --config tiny-qwen2-moe --mesh 2x2 --devices 4 --fsdp --sp --remat full --steps 2 "
    "--x64": verify(costly=MOE),
    "meshlm verify --config tiny-mixtral --mesh 4x2 --ep 2 --devices 8 --fsdp --sp --steps 2 --x64": verify(
        costly=EP
    ),
    "meshlm verify --config tiny-qwen3-moe --mesh 2x2 --ep 2 --devices 4 --steps 3 --x64": verify(costly=EP),
    "meshlm verify --config tiny-mixtral --mesh 2x2 --ep 2 --devices 4 --x64 --moe-dispatch gmm": verify(
        costly=GMM_PROOF
    ),
    "meshlm verify --config tiny-olmoe --mesh 2x2 --ep 2 --devices 4 --steps 3 --x64": verify(costly=EP),
    "meshlm verify --config cpu-moe --mesh 2x2 --ep 2 --devices 4 --steps 3 --x64": verify(costly=ROUTER),
    "meshlm verify --config tiny-qwen3.5 --mesh 1x4 --devices 4 --steps 2 --x64": verify(costly=LINEAR),
    LINEAR_2X2: verify(costly=LINEAR),
    "meshlm verify --config tiny-qwen3.5 --mesh 1x2 --cp 2 --devices 4 --x64 --steps 2": verify(
        costly=LINEAR_CP
    ),
    "meshlm verify --config tiny-qwen3.5 --mesh 1x1 --cp 4 --devices 4 --x64 --steps 2": verify(
        costly=LINEAR_CP
    ),
    **{
        f"meshlm verify --config tiny-mixtral --mesh {mesh} --devices {n} --steps 2 --x64 "
        "--moe-capacity-factor 0.5": verify(costly=CAPACITY)
        for mesh, n in (("2x2 --ep 2", 4), ("4x1 --ep 4", 4), ("2x2 --fsdp --sp", 4), ("1x1 --cp 2", 2))
    },
    "meshlm convert --from-hf nt-hf --out nt --mesh 1x1": Shown(
        "needs the transformers model that scripts/near_tie_mixtral.py builds (torch); "
        "tests/test_hf_mixtral.py "
        "converts a tiny Mixtral the same way"
    ),
    "meshlm verify --checkpoint nt --mesh 2x2 --ep 2 --devices 4": Shown(
        "its checkpoint needs scripts/near_tie_mixtral.py (torch) and a 4.5-min float32 proof; "
        "tests/test_routing_flips.py counts planted flips through the same probe"
    ),
    EP_PP_CMD: verify(costly=EP_PP),
    # issue 43's MTP under pp: the preset (dense prefix, MTP on the last stage) on pp 2 x mp 2
    "meshlm verify --config tiny-deepseek-v3 --pp 2 --mesh 1x2 --devices 4 --steps 2 --x64": verify(
        costly="tests/test_pp_mixed.py::test_mixed_stack_through_the_pipeline_is_proven"
    ),
    "meshlm verify --config tiny-gemma4-moe --mesh 2x2 --ep 2 --devices 4 --steps 2 --x64": verify(
        costly="tests/test_gemma4_moe.py::test_moe_block_proven_on_ep2_with_controls"
    ),
    # issue 45's hybrid under pp: the preset's two periods, a linear and a full layer per stage (1F1B)
    "meshlm verify --config tiny-qwen3.5 --pp 2 --mesh 1x2 --devices 4 --steps 2 --x64": verify(
        costly="tests/test_pp_mixed.py::test_mixed_stack_through_the_pipeline_is_proven"
    ),
    EP_PP_CMD + " --pp-schedule gpipe": verify(costly=EP_PP),
    "meshlm verify --config tiny-mixtral --mesh 2x2 --ep 2 --devices 4 --fsdp --sp --steps 2 --x64": verify(
        costly=EP
    ),
    "meshlm verify --config tiny-mixtral --mesh 4x1 --ep 4 --devices 4 --fsdp --steps 2 --x64": verify(
        costly=EP
    ),
    "meshlm verify --config tiny-llama --mesh 2x2 --remat save_qkv_mlp_in --x64": verify(
        costly="tests/test_remat_names.py::test_a_named_policy_saves_its_names_and_changes_no_value"
    ),
    "meshlm verify --config tiny --mesh 2x2 --steps 3 --x64 --opt-dtype bf16": verify(
        costly="tests/test_optim_memory.py::test_verify_proves_bf16_moments_sharded_equal_unsharded"
    ),
    "meshlm train --config tiny-lm --steps 300 --batch-size 8 --seq-len 64 --eval-every 100 --eval-batches 4 "
    "--tokenizer bytes --mesh 1x1 --sample-tokens 0 --opt-dtype bf16 --out runs/bf16-moments": run(
        "--steps 300 => --steps 2",
        "--eval-every 100 => --eval-every 0",
        "--eval-batches 4 => --eval-batches 1",
    ),
    "meshlm train --config tiny-mixtral --ep 2 --mesh 2x1 --devices 2": Shown(
        "a measurement (a run on the default data: its tokenizer alone takes minutes); the ep step's path: "
        + EP
    ),
    "meshlm train --config tiny-mixtral --steps 30 --batch-size 8 --seq-len 64 --mesh 2x1 --ep 2 --devices 2 "
    "--moe-capacity-factor 1.0 --eval-every 0 --sample-tokens 0 --out runs/moe": Shown(
        "the run behind docs/images/expert-load.png (a BPE tokenizer trained first: minutes); the routing "
        "metrics' path: " + ROUTING
    ),
    "meshlm train --config cpu-moe --steps 40 --batch-size 8 --seq-len 64 --eval-every 0 --sample-tokens 0 "
    "--log-every 1 --save-every 20 --moe-bias-rate 0.01 --out runs/cpu-moe": Shown(
        "the run behind the bias-balancing table and figure (26.9M parameters: ~15 s a step here); the "
        "bias's SIGKILL resume: tests/test_resume.py::test_moe_bias_balancing_sigkill_then_resume_is_bitwise_"
        "identical (which also runs scripts/expert_load_cv.py's table and figure on its metrics)"
    ),
    "meshlm bench --config tiny-mixtral --mesh 2x1 --ep 2 --devices 2 --steps 5": Shown(
        "a measurement (5 implementations compiled and timed, ~1 min of CPU); bench's path: " + BENCH
    ),
    "meshlm bench --config cpu-moe --json --gen-tokens 0": run(
        "cpu-moe => tiny-cpu-moe", "--gen-tokens 0 => --gen-tokens 0 --seq-len 16 --warmup 0", costly=BENCH
    ),
    "meshlm bench --config cpu-moe --mesh 2x1 --ep 2 --devices 2 --json --gen-tokens 0": run(
        "cpu-moe => tiny-cpu-moe", "--gen-tokens 0 => --gen-tokens 0 --seq-len 16 --warmup 0", costly=BENCH
    ),
    "meshlm plan --config qwen3-30b-a3b --mesh 8x8 --ep 8 --devices 64 --fsdp --sp": run(
        "--config qwen3-30b-a3b => --config tiny-qwen3-moe",
        "--mesh 8x8 --ep 8 --devices 64 => --mesh 2x2 --ep 2 --devices 4",
        expect=("ep=2",),
    ),
    # in the slow tier: the same ep plan as the qwen3-30b-a3b line above (quick), of another tiny MoE
    "meshlm plan --config mixtral-8x7b --mesh 8x8 --ep 8 --devices 64 --fsdp --sp": run(
        "--config mixtral-8x7b => --config tiny-mixtral",
        "--mesh 8x8 --ep 8 --devices 64 => --mesh 2x2 --ep 2 --devices 4",
        expect=("ep=2",),
        slow=tool_doc("qwen3-30b-a3b --mesh 8x8 --ep 8"),
    ),
    "meshlm convert --from-hf HF_DIR --out ck": run(),
    "meshlm verify --checkpoint ck --mesh 1x4 --devices 4": verify(
        costly=CK, after=("meshlm convert --from-hf HF_DIR --out ck",)
    ),
    "meshlm verify --checkpoint ck --mesh 1x4 --devices 4 --x64": verify(
        costly=CK, after=("meshlm convert --from-hf HF_DIR --out ck",)
    ),
    "meshlm verify --help": run(expect=("usage: meshlm verify",)),
    "meshlm launch -n 2 -- verify": verify(costly=LAUNCH),
    "meshlm verify --config tiny-mistral --mesh 2x2 --devices 4 --x64 --steps 2": verify(costly=MARGIN),
    "meshlm verify --config tiny-mistral --mesh 2x2 --devices 4 --sp --fsdp": verify(costly=MEM),
    W10 + "--x64 --steps 2": verify(costly=WINDOW_KERNEL),
    W10.replace("-w10", "") + "--x64 --steps 2": verify(costly=WINDOW_KERNEL),
    W10 + "--x64 --steps 2 --mesh 1x2 --cp 2 --devices 4": verify(costly=WINDOW_CP),
    W10 + "--x64 --steps 2 --mesh 1x2 --cp 2 --cp-strategy allgather --devices 4": verify(costly=WINDOW_CP),
    "meshlm verify --config tiny-llama --mesh 2x2 --devices 4 --x64 --fsdp --sp --remat selective": verify(
        costly=MEM
    ),
    "meshlm verify --config tiny-gqa --mesh 1x2 --cp 2 --cp-strategy allgather --devices 4 --seq-len "
    "64 --steps 1 "
    "--x64": verify(costly=CP),
    "meshlm verify --config tiny-gqa --mesh 1x2 --cp 4 --devices 8 --seq-len 64 --steps 1 --x64 "
    "--attn-block 8": verify(costly=CP),
    # issue #36: a control crashed here (exit 3) before proof/cp_controls.py's plants forwarded new arguments
    # the same proof as the --steps 2 command below, run as written, less one training step
    "meshlm verify --config tiny-llama --mesh 1x1 --devices 1 --attention blockwise --attn-block 16 "
    "--seq-len 64 "
    "--steps 1 --x64": verify(costly=BW),
    # in the slow tier (18 s of CPU): the one-device blockwise proof with both kernel controls is quick
    "meshlm verify --config tiny-llama --mesh 1x1 --devices 1 --attention blockwise --attn-block 16 "
    "--seq-len 64 --steps 2 --x64": run(expect=(OK, "detected"), slow=BW_ONE),
    # docs/training.md
    "meshlm train --data 'docs/**/*.md' --config small --mesh 2x2 --steps 2000 --out runs/docs": run(
        "--config small => " + TINY, "--steps 2000 =>"
    ),
    # issue #36: refused (the run's model config comes from --config) until fine-tuning takes the checkpoint's
    "meshlm train --checkpoint runs/llama-import --data my.txt --out runs/ft": run(
        add=TINY.replace("--config tiny-lm ", "")
    ),
    "meshlm convert --from-hf path/to/hf-model --out runs/llama-import": Shown(
        "the workspace fixture runs this very conversion (of HF_DIR, a copy of path/to/hf-model) before "
        "any command"
    ),
    "meshlm eval --checkpoint runs/ft --data my.txt": run(
        add="--seq-len 32",
        expect=("bits/byte",),
        after=("meshlm train --checkpoint runs/llama-import --data my.txt --out runs/ft",),
    ),
    "meshlm generate --checkpoint runs/ft --prompt 'def '": run(
        add="--max-new-tokens 8",
        after=("meshlm train --checkpoint runs/llama-import --data my.txt --out runs/ft",),
    ),
    # docs/finetuning.md: the walk-through (the workspace's qwen3-tiny: a transformers Qwen3 with ChatML)
    "meshlm convert --from-hf qwen3-tiny --out runs/qwen3": run(),
    FT_PREPARE: run(),
    FT_TRAIN: run(add=FT_FAST, after=("meshlm convert --from-hf qwen3-tiny --out runs/qwen3", FT_PREPARE)),
    "meshlm eval --checkpoint runs/qwen3-lora --data data/qwen3-chat": run(after=(FT_TRAIN,)),
    "meshlm convert --to-peft runs/qwen3-lora --out runs/qwen3-peft": run(after=(FT_TRAIN,)),
    "meshlm convert --merge runs/qwen3-lora --out runs/qwen3-sft": run(
        after=(FT_TRAIN,),
        expect=("(with its chat template)",),  # the tokenizer DPO then renders with
    ),
    "meshlm convert --to-hf runs/qwen3-lora --out runs/qwen3-hf": run(
        after=(FT_TRAIN,), expect=("the LoRA adapters merged", "(with its chat template)")
    ),
    FT_DPO: run(
        add=FT_FAST,
        after=(FT_TRAIN, "meshlm convert --merge runs/qwen3-lora --out runs/qwen3-sft"),
        expect=("rendered as chat template",),  # the merged checkpoint's tokenizer and template, not bytes
    ),
    "meshlm convert --to-peft runs/qwen3-dpo --out runs/qwen3-dpo-peft": run(
        after=(FT_TRAIN, "meshlm convert --merge runs/qwen3-lora --out runs/qwen3-sft", FT_DPO)
    ),
    # docs/training.md: LoRA
    LORA_TRAIN: run(add=TINY.replace("--config tiny-lm ", "")),
    "meshlm generate --checkpoint runs/lora --prompt 'def '": run(
        add="--max-new-tokens 4", after=(LORA_TRAIN,)
    ),
    "meshlm convert --to-peft runs/lora --out runs/lora-peft": run(after=(LORA_TRAIN,)),
    "meshlm convert --merge runs/lora --out runs/lora-merged": run(after=(LORA_TRAIN,)),
    "meshlm plan --config tiny-llama --mesh 2x2 --batch-size 8 --seq-len 32 --lora-rank 8": run(),
    "meshlm verify --config tiny-llama --mesh 2x2 --x64 --lora-rank 4 --lora-dropout 0.1": verify(
        costly="tests/test_lora.py::test_verify_lora_sft_equal_unsharded_and_its_controls_detected"
    ),
    "meshlm verify --lora-rank 4 --objective sft --config tiny-llama --mesh 2x2 --x64": verify(
        costly="tests/test_lora.py::test_verify_lora_sft_equal_unsharded_and_its_controls_detected"
    ),
    "meshlm train --settings runs/main/settings.toml": run(after=(MAIN,)),
    "meshlm train --settings runs/main/settings.toml --steps 560": run("560 => 3", after=(MAIN,)),
    "meshlm train --settings runs/main/settings.toml --out runs/again": run(expect=("done",), after=(MAIN,)),
    "meshlm generate --checkpoint runs/main --prompt 'def '": run(add="--max-new-tokens 8", after=(MAIN,)),
    "meshlm verify --checkpoint runs/main --mesh 2x2": run(
        expect=(OK,),
        after=(MAIN,),
        slow="tests/test_verify_compiles.py::test_a_checkpoints_proof_compiles_each_program_once_and_"
        "concurrently_the_same",
    ),
    "meshlm train --data 'docs/*.jsonl' --doc-mask --out runs/masked": run(add=TINY),
    "meshlm train --help": run(expect=("usage: meshlm train",)),
    "meshlm train --tokenizer bpe-2048": run("bpe-2048 => bpe-2048 --data code --out runs/bpe2048 " + TINY),
    **_names(  # issue 43: each 4-15 min of CPU with every control (MoE's and MLA's compile a program each)
        "the tiny-deepseek-v3 proof with every control; tests/test_mla.py proves MLA with its four controls "
        "on 2x2 FSDP+SP and cp 2 (all-gather, blockwise), tests/test_hf_deepseek_v3.py the conversion",
        "meshlm verify --config tiny-deepseek-v3 --mesh 1x4 --steps 2 --x64",
        "meshlm verify --config tiny-deepseek-v3 --mesh 2x2 --ep 2 --x64 --steps 2",
        "meshlm verify --config tiny-deepseek-v3 --mesh 2x2 --fsdp --sp --x64 --steps 2",
        "meshlm plan --config deepseek-v3 --mesh 8x8 --ep 8 --fsdp --sp --devices 64",
    ),
    **_names(  # issue 43's multi-token prediction: the preset's proof with every control, 15-40 min of CPU
        "the tiny-deepseek-v3 proof with every control; tests/test_mtp.py proves MTP with its two controls "
        "on 2x2 FSDP+SP and 1x2 x cp 2, and trains and resumes it bit for bit",
        "meshlm verify --config tiny-deepseek-v3 --mesh 1x2 --cp 2 --steps 2 --x64",
        "meshlm train --config tiny-deepseek-v3 --mtp-weight 0.3",
    ),
    # generate --speculative mtp: the train step of MLA + MoE + MTP compiles for ~40 s; the generate
    # command itself runs, exactly, on a saved tiny-deepseek-v3 of the same vocabulary in SPEC_CLI
    SPEC_TRAIN: run("--steps 400 => --steps 2", add="--eval-every 0 --sample-tokens 0", costly=MTP_TRAIN),
    SPEC_GENERATE: run(add="--max-new-tokens 8", after=(SPEC_TRAIN,), costly=SPEC_CLI),
}
