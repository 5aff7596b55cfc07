"""Model FLOPs of one training step, the numerator of MFU.

Model FLOPs per step (PaLM, Chowdhery et al. 2022, appendix B; as in Chinchilla)::

    6 * N * tokens  +  12 * n_layers * T * d_model * tokens

N counts the weights of every matmul: attention Q/K/V/O, the MLP and the output projection (or the
embedding table when it is tied to the output); not the embedding lookup, norms or biases. Of a
mixture of experts' expert weights N counts the k of E experts a token is routed to (the active
parameters, ``model.accounting``): the model's FLOPs, not those of the dropless dispatch, which computes
every expert on every token (E / k times the routed feed-forward FLOPs: ``parallel.experts``). The
second term is attention's two T x T matmuls (QK^T and AV: 2 * 2 * T * d_model FLOPs per token per
layer forward, x3 with the backward), counting the full score matrix although causal masking makes
half of it unnecessary. Rematerialisation's recomputation is not counted: it is not model work.
MFU = model FLOPs per step / median step time / measured float32 matmul peak (``peak.py``).

LoRA (``--lora-rank``): the frozen base's weights get no gradient, so its backward computes the
activations' gradients through them (2 * N_base a token) and no weight gradient (the other 2 * N_base):
the base's matmuls count 4 * N_base * tokens, N_base counted as above. The adapters train: each A
[in, R] and B [R, out] counts 6 x its size a token (N_adapter, every adapter's parameters; the
adapters' dropout and scale are not counted, as norms are not). Attention's term is unchanged (its
score and value matmuls multiply activations: both backward products are needed). So

    (4 * N_base + 6 * N_adapter) * tokens  +  12 * n_layers * T * d_model * tokens
"""

from __future__ import annotations

from meshlm.model.accounting import active_size
from meshlm.model.config import ModelConfig
from meshlm.model.lora import is_adapter
from meshlm.model.params import flat_params, is_embedding, is_matmul_weight, leaf_name


def matmul_param_count(cfg: ModelConfig, params) -> int:
    """N of the FLOPs formula: weights used in matmuls, the experts' as a token uses them (see the
    module docstring); global sizes."""
    total = 0
    for path, p in flat_params(params).items():
        if is_embedding(path):  # the lookup is no matmul; the table is one when tied to the output
            total += p.size if cfg.tie_embeddings and leaf_name(path) == "embeddings" else 0
        elif is_matmul_weight(path):
            total += active_size(cfg, path, p.size)
    return int(total)


def model_flops_per_step(cfg: ModelConfig, params, batch_size: int, seq_len: int) -> float:
    """The formula above for a global batch of ``batch_size`` rows of ``seq_len`` tokens."""
    tokens = batch_size * seq_len
    attention = 12 * cfg.n_layers * seq_len * cfg.d_model if cfg.arch.attention else 0
    base = matmul_param_count(cfg, params)  # an adapter is no ``w*`` weight: the base's alone
    if not cfg.lora_rank:
        return float((6 * base + attention) * tokens)
    adapters = sum(p.size for path, p in flat_params(params).items() if is_adapter(path))
    return float((4 * base + 6 * adapters + attention) * tokens)
