# Shared by scripts/plant_*_bugs.sh (sourced after they set repo, python and scratch, and cd into the
# scratch worktree): plant() mutates one text in src/ and runs a pytest selection; plant_verify() runs
# `meshlm verify` with the mutant. Each prints caught / SURVIVED / BROKEN and counts survivors.
survivors=0

mutate() {  # file, old text, new text: the first occurrence replaced (the checkout restored first)
  git checkout -q -- src
  "$python" - "$1" "$2" "$3" <<'PY' || exit 2
import pathlib, sys
path, old, new = sys.argv[1:]
text = pathlib.Path(path).read_text()
if old not in text:
    sys.exit(f"the code to mutate moved: {old!r} not in {path}")
pathlib.Path(path).write_text(text.replace(old, new, 1))
PY
}

plant() {  # name, file, old text, new text, pytest selection (of either tier: -m "")
  mutate "$2" "$3" "$4"
  # shellcheck disable=SC2086
  PYTHONPATH="$scratch/src" "$python" -m pytest -q -x -p no:cacheprovider -m "" $5 >"$scratch/log" 2>&1
  case $? in
    1) echo "caught    $1  ($5: $(tail -n 1 "$scratch/log"))" ;;
    0) echo "SURVIVED  $1  ($5 passed)"; survivors=$((survivors + 1)) ;;
    *) echo "BROKEN    $1  ($5 did not run: $(tail -n 1 "$scratch/log"))"; survivors=$((survivors + 1)) ;;
  esac
}

# A classic bug that verify's old default shapes hid (issue 36): with the mutant, `meshlm verify` with
# the defaults must fail (exit 1: caught); the same command with the old shapes (HIDDEN_BY) shows what
# hid it (exit 0: "hidden by ...", informational). Exit 3 (a control crashed) or 2 is BROKEN.
plant_verify() {  # name, file, old text, new text, verify flags (new defaults), old-default extra flags
  mutate "$2" "$3" "$4"
  # shellcheck disable=SC2086
  PYTHONPATH="$scratch/src" "$python" -m meshlm verify $5 --no-collectives >"$scratch/log" 2>&1
  rc=$?
  old="no old shapes to compare"
  if [ -n "$6" ]; then
    # shellcheck disable=SC2086
    PYTHONPATH="$scratch/src" "$python" -m meshlm verify $5 $6 --no-collectives >"$scratch/log_old" 2>&1
    old="with the old shapes ($6): exit $?"
  fi
  case $rc in
    1) echo "caught    $1  (verify $5: $(grep -m1 -E 'FAIL|worst relative' "$scratch/log"); $old)" ;;
    0) echo "SURVIVED  $1  (verify $5 passed; $old)"; survivors=$((survivors + 1)) ;;
    *) echo "BROKEN    $1  (verify $5: exit $rc: $(tail -n 1 "$scratch/log"))"; survivors=$((survivors + 1)) ;;
  esac
}
