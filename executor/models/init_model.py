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
import contextlib
import os
import re
import secrets
import sys
from pathlib import Path

import torch

from harts.progress import quiet_library_progress
from harts.schema.atomic import check_can_create_under
from harts.schema.errors import HartsError, OutputError, UsageError

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


# pad, bos and eos are token ids 0, 1 and 2 (see the configs above): a smaller
# vocabulary would hold ids the embedding has no row for.
MIN_VOCAB = 3
# Random models are for tests and benchmarks; real vocabularies (Kimi 163,840,
# Qwen3 151,936) are far below this, and a larger one only exhausts memory
# (two vocab x hidden float32 matrices).
MAX_VOCAB = 2**20
MAX_SEED = 2**64 - 1       # torch.manual_seed's range
# What save_pretrained writes for these models; a folder holding only these
# (and a config.json of a supported family) is an earlier init-model output.
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")
# ... and, for a large model (a critic started from a policy: `--from`), its weights in shards.
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def check_arguments(arch: str, preset: str, vocab_size: int, seed: int) -> None:
    """Refuse values the model cannot be built from; ValueError naming the flag and the fix."""
    if arch not in ARCHITECTURES:
        raise UsageError(f"--arch {arch}: not supported; fix: use one of {', '.join(ARCHITECTURES)}")
    if preset not in PRESETS:
        raise UsageError(f"--preset {preset}: unknown preset; fix: use one of {', '.join(PRESETS)}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise UsageError(f"--vocab-size {vocab_size}: must be an int in [{MIN_VOCAB}, {MAX_VOCAB:,}] (token ids "
                         "0, 1, 2 are pad, bos, eos); fix: pass the vocabulary size of your tokenizer or plan")
    check_seed(seed)


def check_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise UsageError(f"--seed {seed}: must be an int in [0, 2**64 - 1]; fix: pass a non-negative seed, e.g. 0")


def _is_earlier_model(folder: Path) -> bool:
    """True when `folder` holds only files init-model writes and a config.json of a supported family."""
    import json

    names = {f.name for f in folder.iterdir()}
    if "config.json" not in names or not all(name in MODEL_FILES or SHARD.fullmatch(name) for name in names):
        return False
    try:
        return json.loads((folder / "config.json").read_text()).get("model_type") in ARCHITECTURES
    except (OSError, ValueError, AttributeError):
        return False


def check_model_dir(out: str | os.PathLike, *, replace: bool = False) -> Path:
    """Refuse, before any work, a target init-model must not or cannot write; returns it as a Path.

    Accepted: a path that does not exist (its missing parents are created), an
    empty folder, and with `replace` a folder holding an earlier init-model
    output (`_is_earlier_model`). Refused with OutputError: a file, a path
    under a file, an unwritable parent, any other non-empty folder (it may
    hold a real model or someone's work; random weights must never replace
    it silently), and an earlier model without `replace`.
    """
    text = os.fspath(out)
    if not text:
        raise OutputError("''", "the model folder path is empty", "give a folder name, e.g. -o model")
    target = Path(text)
    if target.exists() and not target.is_dir():
        raise OutputError(text, "it is a file, not a folder", "give a new folder name, e.g. -o model")
    if target.is_dir() and any(target.iterdir()):
        if not _is_earlier_model(target):
            raise OutputError(text, "the folder is not empty and is not an earlier harts init-model output",
                              "give a new or empty folder")
        if not replace:
            raise OutputError(text, "the folder already holds a model", "pass --replace to replace it, "
                              "or give a new folder")
    check_can_create_under(text, target.parent)
    return target


def build_model(arch: str, preset: str, vocab_size: int, seed: int, critic: bool = False):
    """A randomly initialised model (float32, eval mode); the same arguments give the same weights. `critic`:
    the family's token-classification model with one label (a value head, `harts run --loss value`) and no
    dropout before it, instead of a causal LM (`harts.executor.models.critics`)."""
    quiet_library_progress()
    torch.manual_seed(seed)
    config = (kimi_linear_config if arch == "kimi_linear" else qwen3_next_config)(preset, vocab_size)
    if critic:
        from harts.executor.models.critics import critic_class

        config.num_labels, config.classifier_dropout = 1, 0.0
        model = critic_class(arch)(config).float().eval()
    elif arch == "qwen3_next":
        from transformers import Qwen3NextForCausalLM

        model = Qwen3NextForCausalLM(config).float().eval()
    else:
        from transformers import KimiLinearForCausalLM

        model = KimiLinearForCausalLM(config).float().eval()
    if arch == "kimi_linear":
        with torch.no_grad():
            # The initialiser zeroes the score-correction bias; a non-zero one exercises
            # the bias-adjusted expert choice as a trained model would.
            for layer in model.model.layers:
                gate = getattr(layer.mlp, "gate", None)
                if gate is not None:
                    gate.e_score_correction_bias.normal_(0.0, 0.05)
    return model


def _give_default_modes(folder: Path) -> None:
    """Mode 0o666 less the umask for every file, as any new file gets: safetensors writes its weights 0o600,
    which another account (a trainer reading the model) could not open, beside a world-readable config.json."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.iterdir():
        if path.is_file():
            os.chmod(path, 0o666 & ~umask)


def save_atomically(model, target: Path) -> None:
    """save_pretrained into a temporary sibling folder, then rename it to `target`.

    The target never holds a partial model: a failure removes the temporary
    folder and leaves whatever was there before. Replacing an earlier model
    takes two renames (old aside, new in, then the old one removed), so for
    an instant the name is absent, but it never names a mixture of the two.
    """
    import shutil

    target = target.absolute()
    stem = f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}"
    staging, old = target.parent / f"{stem}.tmp", target.parent / f"{stem}.old"
    moved_aside = False
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(staging)
        _give_default_modes(staging)
        if target.is_dir() and any(target.iterdir()):
            os.rename(target, old)
            moved_aside = True
        elif target.is_dir():
            target.rmdir()      # an empty folder: rename cannot replace it on every platform
        os.rename(staging, target)
    except OSError as err:
        raise OutputError(target, err.strerror or type(err).__name__,
                          "free disk space, or check that the folder is writable") from None
    finally:
        # Also on an interrupt: the earlier model goes only once the new one is in place.
        if moved_aside and target.exists():
            shutil.rmtree(old, ignore_errors=True)
        elif moved_aside:
            with contextlib.suppress(OSError):
                os.rename(old, target)
        shutil.rmtree(staging, ignore_errors=True)


def init_model(arch: str, preset: str, out: str | Path, *, vocab_size: int = 512, seed: int = 0,
               replace: bool = False, critic: bool = False):
    """Build, initialise and save a model to the folder `out`; returns it (float32, eval mode).

    Every argument and the target are checked before any work (ValueError,
    OutputError: one line each); the folder appears only when complete.
    """
    check_arguments(arch, preset, vocab_size, seed)
    target = check_model_dir(out, replace=replace)
    model = build_model(arch, preset, vocab_size, seed, critic)
    save_atomically(model, target)
    return model


def critic_from_policy_folder(policy: str | Path, out: str | Path, *, seed: int = 0, replace: bool = False):
    """Write a critic started from the causal-LM folder `policy` (`harts init-model --critic --from`): its
    backbone, in its dtype, and a new one-output `score` seeded by `seed` (`critics.critic_from_policy`).

    Refused before any weights load, one line each: a policy folder that is not a causal LM of a family HARTS
    runs, `out` naming the policy's folder, and any target `check_model_dir` refuses."""
    import json

    from harts.executor.models.critics import critic_from_policy
    from harts.executor.models.registry import config_architectures

    check_seed(seed)   # the family and size are the policy's
    if not os.fspath(policy):
        raise UsageError("--from: the policy folder path is empty; fix: pass the policy's Hugging Face folder")
    source = Path(policy)
    try:
        config = json.loads((source / "config.json").read_text())
    except (OSError, ValueError) as err:
        why = "no such folder" if not source.exists() else f"cannot read its config.json ({type(err).__name__})"
        raise UsageError(f"--from {policy}: {why}; fix: pass the policy's Hugging Face folder") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in ARCHITECTURES:
        raise UsageError(f"--from {policy}: model type {model_type!r} is not supported; fix: use a policy of "
                         f"{' or '.join(ARCHITECTURES)}")
    names = config_architectures(config)
    if names and not any(name.endswith("ForCausalLM") for name in names):   # none listed: model_type decides
        raise UsageError(f"--from {policy}: not a causal LM (architectures {', '.join(names)}); fix: pass the "
                         "policy's folder, whose backbone the critic starts from")
    if Path(out).absolute().resolve() == source.absolute().resolve():
        raise UsageError(f"-o {out}: it is the --from folder; fix: write the critic to another folder")
    target = check_model_dir(out, replace=replace)
    quiet_library_progress()
    torch.manual_seed(seed)
    from harts.executor.cli import load_errors

    try:
        model = critic_from_policy(source, local_files_only=True, dtype="auto")
    except UsageError:
        raise   # its own line (weights lacking a backbone tensor); UsageError is a ValueError, caught below
    except load_errors() as err:
        first = (str(err).strip().splitlines() or [""])[0]
        raise UsageError(f"--from {policy}: cannot load its weights ({type(err).__name__}: {first}); fix: pass a "
                         "complete causal-LM folder") from None
    save_atomically(model.eval(), target)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="harts init-model",
        description="Write a random model, or a critic started from a policy (--critic --from), as a Hugging Face "
                    "directory.",
        epilog="The output folder must be new or empty; an earlier init-model output there is replaced only with "
               "--replace, and any other non-empty folder is refused. The folder appears only when complete "
               "(written beside it, then renamed).")
    parser.add_argument("--arch", choices=ARCHITECTURES, default=None, help="model family (default kimi_linear)")
    parser.add_argument("--preset", choices=PRESETS, default=None, help="model size (default tiny)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help=f"vocabulary size, {MIN_VOCAB} to {MAX_VOCAB:,} (default 512)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed, >= 0 (default 0)")
    parser.add_argument("-o", "--output", required=True,
                        help="folder to write (config.json + safetensors): new, empty, or an earlier init-model "
                             "output with --replace")
    parser.add_argument("--critic", action="store_true",
                        help="write a critic instead: the family's token-classification model with one label, for "
                             "harts run --loss value")
    parser.add_argument("--from", dest="policy", metavar="POLICY",
                        help="with --critic: start the critic from this causal-LM folder (its backbone and dtype; "
                             "a new value head seeded by --seed) instead of random weights")
    parser.add_argument("--replace", action="store_true",
                        help="replace an earlier harts init-model output at -o (never any other folder)")
    args = parser.parse_args(argv)
    shape_flags = [flag for flag, value in (("--arch", args.arch), ("--preset", args.preset),
                                            ("--vocab-size", args.vocab_size)) if value is not None]
    conflict = None
    if args.policy is not None and not args.critic:
        conflict = "--from is read with --critic only; fix: pass --critic to start a critic from that policy"
    elif args.policy is not None and shape_flags:
        conflict = (f"{shape_flags[0]} does not apply with --from: the critic takes the policy's family and size; "
                    f"fix: drop {shape_flags[0]}")
    if conflict:
        print(f"harts init-model: {conflict}", file=sys.stderr)
        return 2
    arch, preset = args.arch or "kimi_linear", args.preset or "tiny"
    try:
        if args.policy is not None:
            model = critic_from_policy_folder(args.policy, args.output, seed=args.seed, replace=args.replace)
        else:
            vocab_size = 512 if args.vocab_size is None else args.vocab_size
            model = init_model(arch, preset, args.output, vocab_size=vocab_size, seed=args.seed,
                               replace=args.replace, critic=args.critic)
    except HartsError as err:
        print(f"harts init-model: {err}", file=sys.stderr)
        return err.exit_code
    params = sum(p.numel() for p in model.parameters())
    if args.policy is not None:
        what = f"{model.config.model_type} critic from {args.policy}"
    else:
        what = f"{arch} ({preset}{', critic' if args.critic else ''})"
    print(f"harts init-model: {what}, {params:,} parameters -> {args.output}", file=sys.stderr)
    return 0

if __name__ == "__main__":
    sys.exit(main())
