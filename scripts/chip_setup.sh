# Source on the device machine (the repository root), before scripts/chip_report.py:
#   . scripts/chip_setup.sh
# Installs the wheels carried in .whl-tpu/ (what the chip's own package index lacks: dm-haiku, jmp,
# chex, tabulate, tensorboardX, optax and their small pure-Python needs) under /tmp/site, and
# orbax-checkpoint (which meshlm's CLI imports) from the machine's own index under /tmp/idx, both after
# the machine's own JAX on PYTHONPATH, and puts src/ first. How the wheels were fetched:
# docs/benchmarks.md, "The chip report".
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl-tpu/*.whl || return 1
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --no-compile \
    --index-url file:///opt/pypi/simple --target /tmp/idx orbax-checkpoint || return 1
# What `meshlm train`'s jobs need besides (scripts/int8_quality.py: a BPE trained with tokenizers, the
# loss curve drawn with matplotlib), from the same index; the other jobs run without them, so a failure
# here is a line, not the end of the set-up.
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --no-compile \
    --index-url file:///opt/pypi/simple --target /tmp/idx matplotlib tokenizers ||
    echo "chip_setup: matplotlib and tokenizers did not install: meshlm train's jobs will fail"
export PYTHONPATH="$PWD/src:${PYTHONPATH:+$PYTHONPATH:}/tmp/site:/tmp/idx" PYTHONUNBUFFERED=1
