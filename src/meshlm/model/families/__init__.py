"""The registry of families: one module each (``ff``, ``gptj``, ``llama``, ``qwen2``, ``mistral``,
``gemma``, ``qwen3``, ``olmo2``, ``phi3``, ``gemma2``, ``gemma3``, ``mixtral``, ``qwen2_moe``,
``qwen3_moe``, ``olmoe``, ``smollm3``, ``olmo3``, ``gpt_oss``, ``llama4``),
each holding its ``Family`` record (``model.family``), its Hugging Face names with the config.json
reader and writer (``HFNames``: pure dict translation; the files are ``io.hf_config``'s) and its presets
(``ModelConfig`` fields). Everything else finds a family here: ``FAMILIES`` by name, ``by_model_type`` by
transformers' model_type, ``preset_fields`` for the presets.

A new family is a module here and one line in ``MODULES``. This package must not import JAX.
"""

from __future__ import annotations

import meshlm.model.families.deepseek_v3 as deepseek_v3
import meshlm.model.families.ff as ff
import meshlm.model.families.gemma as gemma
import meshlm.model.families.gemma2 as gemma2
import meshlm.model.families.gemma3 as gemma3
import meshlm.model.families.gemma4 as gemma4
import meshlm.model.families.gpt_oss as gpt_oss
import meshlm.model.families.gptj as gptj
import meshlm.model.families.llama as llama
import meshlm.model.families.llama4 as llama4
import meshlm.model.families.mistral as mistral
import meshlm.model.families.mixtral as mixtral
import meshlm.model.families.olmo2 as olmo2
import meshlm.model.families.olmo3 as olmo3
import meshlm.model.families.olmoe as olmoe
import meshlm.model.families.phi3 as phi3
import meshlm.model.families.qwen2 as qwen2
import meshlm.model.families.qwen2_moe as qwen2_moe
import meshlm.model.families.qwen3 as qwen3
import meshlm.model.families.qwen3_5 as qwen3_5
import meshlm.model.families.qwen3_5_moe as qwen3_5_moe
import meshlm.model.families.qwen3_moe as qwen3_moe
import meshlm.model.families.qwen3_next as qwen3_next
import meshlm.model.families.smollm3 as smollm3
from meshlm.errors import ConfigError
from meshlm.model.family import Family

# One line per family, in the order messages list them.
MODULES = (
    ff, gptj, llama, qwen2, mistral, gemma, qwen3, olmo2, phi3, gemma2, gemma3, mixtral, qwen2_moe,
    qwen3_moe, olmoe, deepseek_v3,
    smollm3, olmo3, gpt_oss, llama4, qwen3_5,
    qwen3_5_moe, qwen3_next,
    gemma4,
)  # fmt: skip

# A module's ``MORE``: further records of its family (DeepSeek-V3's all-dense one), found by name only.
FAMILIES: dict[str, Family] = {f.name: f for m in MODULES for f in (m.FAMILY, *getattr(m, "MORE", ()))}

# The order ``meshlm configs`` (and an unknown preset's message) lists the presets in, kept from before
# families were modules; a preset not named here follows these, in ``MODULES`` order.
LISTED = (
    "seed",
    "tiny",
    "tiny-gptj",
    "tiny-llama",
    "tiny-lm",
    "cpu",
    "small",
    "gptj-6b",
    "llama2-7b",
    "tiny-llama3",
    "tiny-qwen2",
    "llama3-8b",
    "llama3.1-70b",
    "qwen2.5-7b",
    "tiny-deep",
    "tiny-gqa",
    "tiny-mistral",
    "tiny-gemma",
    "mistral-7b",
    "gemma-7b",
    "tiny-gpt2vocab",
)


def preset_fields() -> dict[str, dict]:
    """Every family's presets: name -> ``ModelConfig`` fields, ``family`` included (a module's presets
    are of its family), in the listing order (``LISTED``, then the rest)."""
    found: dict[str, dict] = {}
    for m in MODULES:
        for name, fields in m.PRESETS.items():
            own = {f.name for f in getattr(m, "MORE", ())}  # a preset may name one of its module's records
            if name in found or fields.get("family", m.FAMILY.name) not in own | {m.FAMILY.name}:
                raise ConfigError(
                    f"preset {name!r} of model.families.{m.__name__.rsplit('.', 1)[-1]} is defined twice or "
                    "names another module's family; give each preset one module, the one of its family"
                )
            found[name] = {"family": m.FAMILY.name, **fields}
    missing = [name for name in LISTED if name not in found]
    if missing:
        raise ConfigError(f"LISTED names presets no family module defines: {missing}; remove them")
    return {**{name: found[name] for name in LISTED}, **found}


def by_model_type() -> dict[str, Family]:
    """The families transformers can express, by config.json ``model_type``."""
    return {m.FAMILY.hf.model_type: m.FAMILY for m in MODULES if m.FAMILY.hf is not None}
