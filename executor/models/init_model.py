"""`harts init-model`: write a randomly initialised model as an ordinary Hugging Face directory.

The weights come from transformers' own classes and initialisers (nothing is
downloaded), so the directory loads with `from_pretrained` anywhere. Presets:

* `tiny`: a few hundred thousand parameters, for tests and the demo on CPU;
* `small`: a few million, for CPU benchmarks.

Both keep the paper's architecture: Kimi Linear interleaves KDA linear
attention with MLA full attention (3:1), the first layer dense and the rest
MoE with group-limited top-k routing and a shared expert. Qwen3-Next
interleaves Gated DeltaNet with gated full attention (3:1, partial RoPE,
grouped kv heads), the first layer dense and the rest MoE (softmax top-k with
a sigmoid-gated shared expert).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from harts.progress import quiet_library_progress

ARCHITECTURES = ("kimi_linear", "qwen3_next")
PRESETS = ("tiny", "small")


def kimi_linear_config(preset: str, vocab_size: int):
    from transformers import KimiLinearConfig

    size = {"tiny": dict(hidden=64, layers=4, heads=2, head_dim=32, experts=8, moe_inter=32, inter=128, lora=32),
            "small": dict(hidden=256, layers=8, heads=4, head_dim=64, experts=16, moe_inter=128, inter=512, lora=128)}[preset]
    layers = size["layers"]
    return KimiLinearConfig(
        vocab_size=vocab_size,
        hidden_size=size["hidden"],
        intermediate_size=size["inter"],
        moe_intermediate_size=size["moe_inter"],
        num_hidden_layers=layers,
        num_attention_heads=size["heads"],
        num_key_value_heads=size["heads"],
        kv_lora_rank=size["lora"],
        q_lora_rank=None,
        qk_rope_head_dim=size["head_dim"] // 4,
        qk_nope_head_dim=size["head_dim"] // 2,
        v_head_dim=size["head_dim"] // 2,
        linear_head_dim=size["head_dim"],
        linear_num_heads=size["heads"],
        linear_conv_kernel_dim=4,
        num_local_experts=size["experts"],
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        routed_scaling_factor=2.446,
        # 3:1 KDA:MLA as in the paper's Tiny; the first layer dense, the rest MoE.
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
        mlp_layer_types=["dense" if i == 0 else "sparse" for i in range(layers)],
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )


def qwen3_next_config(preset: str, vocab_size: int):
    from transformers import Qwen3NextConfig

    size = {"tiny": dict(hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, k_heads=2, v_heads=4, linear_dim=16,
                         experts=8, moe_inter=32, inter=128),
            "small": dict(hidden=256, layers=8, heads=8, kv_heads=2, head_dim=32, k_heads=4, v_heads=8, linear_dim=32,
                          experts=16, moe_inter=128, inter=512)}[preset]
    layers = size["layers"]
    return Qwen3NextConfig(
        vocab_size=vocab_size,
        hidden_size=size["hidden"],
        intermediate_size=size["inter"],
        num_hidden_layers=layers,
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"],
        head_dim=size["head_dim"],
        partial_rotary_factor=0.25,
        linear_conv_kernel_dim=4,
        linear_num_key_heads=size["k_heads"],
        linear_num_value_heads=size["v_heads"],
        linear_key_head_dim=size["linear_dim"],
        linear_value_head_dim=size["linear_dim"],
        num_experts=size["experts"],
        num_experts_per_tok=2,
        moe_intermediate_size=size["moe_inter"],
        shared_expert_intermediate_size=size["moe_inter"],
        norm_topk_prob=True,
        decoder_sparse_step=1,
        # 3:1 Gated DeltaNet : gated attention as in Qwen3-Next; the first layer dense, the rest MoE.
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
        mlp_only_layers=[0],
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )


def init_model(arch: str, preset: str, out: str | Path, *, vocab_size: int = 512, seed: int = 0):
    """Build, initialise and save a model; returns it (float32, eval mode)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} is not supported yet; use one of {ARCHITECTURES}")
    quiet_library_progress()
    if arch == "qwen3_next":
        from transformers import Qwen3NextForCausalLM

        torch.manual_seed(seed)
        model = Qwen3NextForCausalLM(qwen3_next_config(preset, vocab_size)).float().eval()
        model.save_pretrained(out)
        return model
    from transformers import KimiLinearForCausalLM

    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(kimi_linear_config(preset, vocab_size)).float().eval()
    with torch.no_grad():
        # The initialiser zeroes the score-correction bias; a non-zero one exercises
        # the bias-adjusted expert choice as a trained model would.
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.normal_(0.0, 0.05)
    model.save_pretrained(out)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="harts init-model", description="Write a random model as a Hugging Face directory.")
    parser.add_argument("--arch", choices=ARCHITECTURES, default="kimi_linear", help="model family (default kimi_linear)")
    parser.add_argument("--preset", choices=PRESETS, default="tiny", help="model size (default tiny)")
    parser.add_argument("--vocab-size", type=int, default=512, help="vocabulary size (default 512)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed (default 0)")
    parser.add_argument("-o", "--output", required=True, help="directory to write (config.json + safetensors)")
    args = parser.parse_args(argv)
    model = init_model(args.arch, args.preset, args.output, vocab_size=args.vocab_size, seed=args.seed)
    params = sum(p.numel() for p in model.parameters())
    print(f"harts init-model: {args.arch} ({args.preset}), {params:,} parameters -> {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
