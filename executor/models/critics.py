"""Critic classes: every family HARTS runs, as a token-classification model with one label (a value head).

RL frameworks load a PPO critic as the family's `*ForTokenClassification`
with `num_labels=1`: the backbone under `model`, a `dropout`, then `score`,
a Linear from the hidden size to one value. transformers has that class for
Qwen3-Next but none for Kimi Linear, so HARTS defines the missing one the way
transformers defines the others: `GenericForTokenClassification` over the
family's `PreTrainedModel`, nothing added. Its weights therefore have the
layout of every transformers token-classification model (the causal LM's
backbone keys under `model.`, plus `score.weight` and `score.bias`), and
`register_critics()` makes `AutoModelForTokenClassification` load such a
folder like any other.

A critic is usually started from the policy: `critic_from_policy(policy_dir)`
keeps the policy's backbone and gives `score` fresh weights with no dropout
before it (the class's `from_pretrained(policy_dir, num_labels=1)` alone would
keep transformers' default dropout of 0.1 for Kimi Linear, whose config has no
`classifier_dropout`).
"""
from __future__ import annotations

from transformers.modeling_layers import GenericForTokenClassification
from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearPreTrainedModel


class KimiLinearForTokenClassification(GenericForTokenClassification, KimiLinearPreTrainedModel):
    """Kimi Linear's backbone, dropout and a `score` Linear: the critic transformers does not ship."""


# model_type -> the class HARTS adds for a family transformers has no token-classification class for.
ADDED_CRITICS = {"kimi_linear": (KimiLinearConfig, KimiLinearForTokenClassification)}


def register_critics() -> None:
    """Let `AutoModelForTokenClassification` load and build the critics HARTS adds (idempotent)."""
    from transformers import AutoModelForTokenClassification

    for config_class, model_class in ADDED_CRITICS.values():
        AutoModelForTokenClassification.register(config_class, model_class, exist_ok=True)


def critic_class(model_type: str) -> type:
    """The token-classification (critic) class of a family; KeyError when there is none."""
    if model_type in ADDED_CRITICS:
        return ADDED_CRITICS[model_type][1]
    import transformers

    return getattr(transformers, MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES[model_type])


def critic_from_policy(policy_dir, **from_pretrained):
    """A critic started from a policy's folder (a causal LM of a family HARTS runs): the policy's backbone,
    a new `score` of one output (transformers' initialiser; seed torch for the same head each time), and no
    dropout before it, as RL frameworks set a critic's (verl: `classifier_dropout = 0`). The policy's LM head
    is not read. `from_pretrained` goes to the class's `from_pretrained` (`dtype=`, `local_files_only=`, ...).

    Raises UsageError when the folder's weights lack a backbone tensor: transformers would fill it with random
    values and the critic would silently not start from the policy."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    from harts.schema.errors import UsageError

    config = AutoConfig.from_pretrained(policy_dir, local_files_only=from_pretrained.get("local_files_only", False))
    config.num_labels, config.classifier_dropout = 1, 0.0
    config.architectures = None   # the policy's class; save_pretrained writes the critic's
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()   # its table says the LM head is unused and `score` new: both expected
    try:
        critic, info = critic_class(config.model_type).from_pretrained(policy_dir, config=config,
                                                                       output_loading_info=True, **from_pretrained)
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = sorted(key for key in info.get("missing_keys") or () if not key.startswith("score."))
    if missing:
        raise UsageError(f"{policy_dir}: the policy's weights lack {len(missing)} backbone tensor(s) (first: "
                         f"{missing[0]}); fix: pass a complete causal-LM folder of the same family")
    return critic
