"""A tiny random transformers Mixtral whose experts 0 and 1 nearly tie in every layer's router: router
row 1 is row 0 times (1 + 1e-6 noise), as the copied experts of an upcycled checkpoint start. Routing in
float32 then flips between ``meshlm verify``'s sharded and unsharded runs on some tokens (their k-th
place is a near-tie that rounding decides): the "routing flips" row counts them (docs/proof.md, expert
parallelism). Needs torch and transformers (the test extra); no download.

    python scripts/near_tie_mixtral.py nt-hf [--noise 1e-6]
    meshlm convert --from-hf nt-hf --out nt --mesh 1x1
    meshlm verify --checkpoint nt --mesh 2x2 --ep 2 --devices 4
"""

from __future__ import annotations

import argparse

import torch
import transformers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the Hugging Face model directory to write")
    ap.add_argument("--noise", type=float, default=1e-6, help="relative noise between router rows 0 and 1")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=280, hidden_size=32, num_hidden_layers=2, intermediate_size=32, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}, bos_token_id=0, eos_token_id=0,
        router_aux_loss_coef=0.02,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.mlp.gate.weight  # [E, D]: the router
            w[1] = w[0] * (1 + args.noise * torch.randn_like(w[0]))
    model.save_pretrained(args.out)


if __name__ == "__main__":
    main()
