"""``MESHLM_DECODE_XLA_OPTIONS`` (``programs.decode_xla_options``): compiler options for generation's
decode programs, a measurement's (on a v5e, one that keeps the compiler from moving the whole KV cache
into VMEM and back every step; docs/benchmarks.md "Decode: the values apart"). Read as sorted pairs,
part of the program cache's key, passed to the decode programs' compile (the compiler rejects a name it
does not know), and a bad value is one line."""

import json

import pytest
from test_generate import PROMPTS, host_params

from meshlm.errors import ConfigError
from meshlm.generate import programs
from meshlm.generate.generator import Generator
from meshlm.model.config import get_config
from meshlm.parallel.mesh import make_mesh

ENV = programs.XLA_OPTIONS_ENV


def test_options_are_read_as_sorted_pairs_and_a_bad_value_is_one_line(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert programs.decode_xla_options() == ()
    monkeypatch.setenv(ENV, json.dumps({"b_option": 10, "a_option": False}))
    assert programs.decode_xla_options() == (("a_option", False), ("b_option", 10))
    for bad in ("{not json", "[1, 2]", '{"a": [1]}'):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ConfigError, match="MESHLM_DECODE_XLA_OPTIONS=.*give a JSON object of compiler"):
            programs.decode_xla_options()


def test_the_decode_programs_are_compiled_with_the_options(monkeypatch):
    """XLA:CPU takes ``xla_cpu_enable_fast_math`` (off: the tokens stay the default program's) and
    rejects a name it does not know: the options reach the compile."""
    cfg, params, mesh = get_config("tiny-llama"), host_params("tiny-llama"), make_mesh(1, 2)
    monkeypatch.delenv(ENV, raising=False)
    base = Generator(cfg, params, mesh, eod=None)
    want = [r.tokens for r in base.generate(PROMPTS, 9)]
    monkeypatch.setenv(ENV, json.dumps({"xla_cpu_enable_fast_math": False}))
    gen = Generator(cfg, params, mesh, eod=None)
    assert gen._prog is not base._prog and gen._prog.xla_options == (("xla_cpu_enable_fast_math", False),)
    assert [r.tokens for r in gen.generate(PROMPTS, 9)] == want
    monkeypatch.setenv(ENV, json.dumps({"xla_no_such_option_anywhere": 1}))
    with pytest.raises(Exception, match="xla_no_such_option_anywhere"):
        Generator(cfg, params, mesh, eod=None).generate(PROMPTS, 9)
