#!/usr/bin/env bash
# Plant bugs in the pipeline engine (issue 23) in a scratch worktree of HEAD and show that a test fails.
# Usage: bash scripts/plant_pipeline_bugs.sh [PYTHON]   (default: .venv/bin/python). A few minutes.
# Prints one line per mutant, "caught" when its test fails; exits non-zero if any mutant survives.
# (The engine's own hooks are broken by the controls in meshlm.proof.pipeline_proof; these are bugs in
# the code around them: the schedule arithmetic, buffers, scales, reductions.)
set -u
repo=$(git rev-parse --show-toplevel) || exit 2
given=${1:-$repo/.venv/bin/python}
python="$(cd "$(dirname "$given")" && pwd)/$(basename "$given")"  # absolute, links kept (a venv's python)
scratch=$(mktemp -d)/meshlm-pipeline-mutants
git -C "$repo" worktree add -q --detach "$scratch" HEAD || exit 2
trap 'git -C "$repo" worktree remove --force "$scratch"' EXIT
cd "$scratch" || exit 2
# shellcheck source=scripts/plant_lib.sh
. "$repo/scripts/plant_lib.sh"

S=src/meshlm/parallel/pipeline_schedule.py
E=src/meshlm/parallel/pipeline_engines.py
B="tests/test_pipeline.py -k nan_bubbles"
plant "backward slots one tick late" $S \
  "_decode(cfg, t - (cfg.chunks - 1) - (cfg.pp - 1 - d))" "_decode(cfg, t - cfg.chunks - (cfg.pp - 1 - d))" "$B"
plant "1F1B stash ring one slot short" $S \
  "return min(2 * self.chunks - 1," "return min(2 * self.chunks - 2," "$B"
plant "1F1B cotangent not scaled by 1/M" $E \
  "scale = pipe.loss_scale() / job.n_dp" "scale = 1.0 / job.n_dp" "$B"
plant "input gradient written by every stage" $E \
  "jnp.where(valid & first, gx," "jnp.where(valid, gx," "$B"
plant "head run on the first stage, not the last" $E \
  "_only_if(lax.axis_index(PP) == job.pipe.config.pp - 1," "_only_if(lax.axis_index(PP) == 0," "$B"
plant "FSDP gradients summed over dp again" $E \
  "return lax.psum(g, cast) if cast else g" "return lax.psum(g, axes)" \
  "tests/test_pipeline_model.py -k fsdp"
plant "stated bubble without the fill" $S \
  "bubble_fraction=(p - 1) / (v * m + p - 1)" "bubble_fraction=(p - 1) / (v * m)" \
  "tests/test_pipeline.py -k bubble_fraction"
# --pp wired into meshlm (the Layout, the model's pieces, checkpoints, the CLI's checks)
plant "the embedding's gradient taken in every backward slot" $E \
  "_only_if(valid & first, partial(_embed_grad" "_only_if(valid, partial(_embed_grad" \
  "tests/test_pipeline_model.py -k fsdp"
plant "the tied head's gradient not added to the embedding's" src/meshlm/sharding/pipelined.py \
  "g_embed = jax.tree.map(jnp.add, g_embed," "g_embed = jax.tree.map(lambda a, b: a, g_embed," \
  "tests/test_pp_verify.py"
plant "the stacked layers stored unsplit over pp" src/meshlm/sharding/rules.py \
  "P(PP, *spec[1:]) if is_stacked" "spec if is_stacked" "tests/test_resume.py -k pp"
plant "the batch check ignoring the micro-batches" src/meshlm/parallel/layout.py \
  "m = layout.microbatches if layout.pp > 1 else 1" "m = 1" "tests/test_pp_cli.py"

# Issue 36: bugs that verify --pp's old defaults hid (M = pp; interleaved with V = pp = 2)
P=src/meshlm/parallel/pipeline.py
plant_verify "1F1B stash ring one slot short (hidden by M = pp)" $S \
  "return min(2 * self.chunks - 1," "return min(2 * self.chunks - 2," \
  "--config tiny-llama --pp 2 --devices 2 --seq-len 8" "--microbatches 2"
plant_verify "interleaved chunk permutation where its inverse belongs (hidden by pp = V = 2)" $P \
  "else flat[order]" "else flat[ids]" \
  "--config tiny-deep --pp 2 --pp-schedule interleaved --devices 2 --seq-len 8" "--virtual-stages 2"
echo "$survivors mutant(s) survived"
[ "$survivors" -eq 0 ]
