#!/usr/bin/env bash
# Plant each kind of verifier bug (issues 13, 22) in a scratch worktree of HEAD and show that a test fails.
# Usage: bash scripts/plant_verifier_bugs.sh [PYTHON]   (default: .venv/bin/python). A few minutes.
# Prints one line per mutant, "caught" when its test fails; exits non-zero if any mutant survives.
set -u
repo=$(git rev-parse --show-toplevel) || exit 2
given=${1:-$repo/.venv/bin/python}
python="$(cd "$(dirname "$given")" && pwd)/$(basename "$given")"  # absolute, links kept (a venv's python)
scratch=$(mktemp -d)/meshlm-mutants
git -C "$repo" worktree add -q --detach "$scratch" HEAD || exit 2
trap 'git -C "$repo" worktree remove --force "$scratch"' EXIT
cd "$scratch" || exit 2
# shellcheck source=scripts/plant_lib.sh
. "$repo/scripts/plant_lib.sh"

plant "reference computed by the sharded program" src/meshlm/proof/runs.py \
  "            self._ref_grads = self.problem.from_reference(program(*args))" \
  "            self._ref_grads = self.grads(self.problem.build_loss)" \
  "tests/test_core.py -k verify_ff_every_mesh_float32"
plant "controls always detected" src/meshlm/proof/control_runs.py \
  '        "detected": bool(bad),' \
  '        "detected": True,' \
  "tests/test_prover.py -k no_op"
plant "any exception in a control counts as detected" src/meshlm/proof/control_runs.py \
  "        if not is_vma_rejection(e):" \
  "        if False:" \
  "tests/test_prover.py -k crashing"
plant "z-loss summed over the shards" src/meshlm/model/layers.py \
  "        loss = loss + z_loss * jnp.square(log_sum + m)  # log Z = log_sum + m" \
  "        loss = loss + par.g(lax.pcast(z_loss * jnp.square(log_sum + m), 'mp', to='varying') if par.sharded else z_loss * jnp.square(log_sum + m))" \
  "tests/test_prover.py -k z_loss"
plant "wrong KV head when KV heads are replicated" src/meshlm/parallel/context.py \
  "        return self.shard_index() * heads_per_shard // (n_heads // n_kv_heads)" \
  "        return self.shard_index() % n_kv_heads" \
  "tests/test_prover.py -k kv_heads_replicated"
plant "a data-parallel shard builds another shard's rows" src/meshlm/data/device_batches.py \
  "        b = batcher.batch(step, shard=start // width, num_shards=total // width)" \
  "        b = batcher.batch(step, shard=(start // width + 1) % (total // width), num_shards=total // width)" \
  "tests/test_prover.py -k data_pipeline_rows"
plant "padded-logits control at zero padded weights (hidden by float32)" src/meshlm/proof/controls.py \
  "        params_change=large_padded_logits," \
  "" \
  "tests/test_controls_margin.py -k gpt2vocab"
plant "no exactness check (reference may be the sharded program)" src/meshlm/proof/independence.py \
  '    return [check_row("reference is not the sharded program", not exact, detail)]' \
  '    return [check_row("reference is not the sharded program", True, detail)]' \
  "tests/test_reference.py -k sharded_results_on_one_device"
plant "reference returns the sharded results moved to one device" src/meshlm/proof/runs.py \
  "            self._ref_grads = self.problem.from_reference(program(*args))" \
  "            self._ref_grads = jax.device_put(self.grads(self.problem.build_loss), self.device)" \
  "tests/test_reference.py -k correct_reference"
plant "reference train step not the checked program" src/meshlm/proof/runs.py \
  '    program = runs._checked(CheckedProgram("train step", step, *state, first))' \
  '    program = CheckedProgram("train step", step, *state, first)' \
  "tests/test_reference.py -k train_step"
plant "reference shares meshlm's clip and step" src/meshlm/proof/runs.py \
  "    return reference_step(reference_value_and_grad(ref_loss), ocfg, opt, part=part)" \
  "    return make_step(reference_value_and_grad(ref_loss), opt, ocfg, part=part)" \
  "tests/test_reference.py -k wrong_norm"
plant "reference shares the sharded run's remat policy" src/meshlm/proof/problem.py \
  '    plain = cfg.replace(remat="none", unroll=0)' \
  "    plain = cfg" \
  "tests/test_reference.py -k remat_path"
plant "any ValueError in a control counts as a rejection" src/meshlm/proof/control_runs.py \
  "        if not is_vma_rejection(e):" \
  "        if not isinstance(e, ValueError):" \
  "tests/test_control_errors.py"
plant "any JAX error in a control counts as a rejection" src/meshlm/proof/control_runs.py \
  "        if not is_vma_rejection(e):" \
  "        if not (is_vma_rejection(e) or type(e).__module__.startswith('jax')):" \
  "tests/test_control_errors.py"
plant "a varying-axis type error in the proven program is a traceback" src/meshlm/proof/prover.py \
  '        for name, explain in (("sharding rules", rule_mismatch), ("varying-axis types", vma_error)):' \
  '        for name, explain in (("sharding rules", rule_mismatch),):' \
  "tests/test_type_error_rows.py"
plant "accumulation rows reshaped row-major (1 row per shard hides it)" src/meshlm/data/device_batches.py \
  "        cache[key] = {k: v.reshape(width, accum, -1).transpose(1, 0, 2) for k, v in b.items()}" \
  "        cache[key] = {k: v.reshape(accum, width, -1) for k, v in b.items()}" \
  "tests/test_prover.py -k data_pipeline_rows"
plant "data check on verify's small batch (1 row per shard per micro-batch)" src/meshlm/proof/prover.py \
  "        rows += data_checks(runs.layout, seq_len=t, steps=data_steps, seed=seed)" \
  "        rows += data_checks(runs.layout, batch=runs.problem.batch['inputs'].shape[0], seq_len=t, steps=data_steps, seed=seed)" \
  "tests/test_data_check.py -k accumulation_reshape"
plant "val_bpb: end-of-document counted as 0 bytes" src/meshlm/data/hf_tokenizer.py \
  "                out[i] = 1 if i == self.eod_id else 0" \
  "                out[i] = 0" \
  "tests/test_data_check.py -k val_bpb"
plant "val_bpb: bytes of the inputs, not the targets" src/meshlm/train/run.py \
  'int(tok.token_bytes[b["targets"]].sum())' \
  'int(tok.token_bytes[b["inputs"]].sum())' \
  "tests/test_data_check.py -k val_bpb"
# Issue 36: bugs that verify's old default shapes hid
K=src/meshlm/model/blockwise.py
plant_verify "causal block skip off by one (hidden by block-aligned sequences)" $K \
  "needed = first_key <= jnp.max(qp, axis=-1)" "needed = first_key < jnp.max(qp, axis=-1)" \
  "--config tiny-llama --mesh 1x1 --devices 1 --attention blockwise" "--attn-block 16 --seq-len 64"
plant_verify "document-mask block skip off by one (hidden by two rows per data shard)" $K \
  "needed = needed & (last_key >= jnp.min(qs, axis=-1))" "needed = needed & (last_key > jnp.min(qs, axis=-1))" \
  "--config tiny-llama --mesh 1x1 --devices 1 --attention blockwise --doc-mask" "--batch-size 2"
plant_verify "window block-skip rule off by one (hidden by blocks of 21)" $K \
  "needed = needed & ((w == 0) | (last_key > first_query - w))" "needed = needed & ((w == 0) | (last_key > first_query - w + 1))" \
  "--config tiny-mistral-w10 --mesh 1x1 --devices 1 --attention blockwise" "--attn-block 21 --seq-len 64"
plant_verify "ring turns the wrong way (hidden by cp 2)" src/meshlm/parallel/cp.py \
  "[(i, (i + 1) % self.layout.cp) for i in range(self.layout.cp)]" "[(i, (i - 1) % self.layout.cp) for i in range(self.layout.cp)]" \
  "--config tiny-llama --mesh 1x1 --cp 3 --devices 3 --seq-len 24" "--cp 2 --seq-len 24"
plant_verify "reference returns the sharded results moved to one device, float64" src/meshlm/proof/runs.py \
  "            self._ref_grads = self.problem.from_reference(program(*args))" \
  "            self._ref_grads = jax.device_put(self.grads(self.problem.build_loss), self.device)" \
  "--config tiny-llama --mesh 1x2 --devices 2 --seq-len 16 --x64" ""
git checkout -q -- src
exit $((survivors > 0))
