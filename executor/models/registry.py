"""Which runner executes which Hugging Face model family (`config.model_type`).

A runner wraps a loaded `*ForCausalLM`, reuses its modules, and exposes
`hidden_states(layout, stats) -> [R, D]` over an `ExecLayout`'s rows plus the
model's `top_k` (experts per token). Adding a family means adding a module in
`executor/models/` and one line here.
"""
from __future__ import annotations

import importlib

from harts.schema.errors import HartsError

RUNNERS = {
    "kimi_linear": ("harts.executor.models.kimi_linear", "KimiLinearRunner"),
    "qwen3_next": ("harts.executor.models.qwen3_next", "Qwen3NextRunner"),
}


def runner_class(model) -> type:
    """The runner class of `model`'s family; a HartsError (one line with its fix) if there is none."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in RUNNERS:
        raise HartsError(f"model type {model_type!r} is not supported yet; fix: use one of "
                         f"{', '.join(sorted(RUNNERS))} (harts init-model writes one)")
    module, name = RUNNERS[model_type]
    return getattr(importlib.import_module(module), name)


def runner_for(model, **options):
    return runner_class(model)(model, **options)


def config_architectures(config: dict) -> list[str]:
    """The class names a config.json's `architectures` lists: a list of strings, as save_pretrained writes it;
    a lone string counts as one name, and anything else (missing, null, a number) as none."""
    names = config.get("architectures")
    if isinstance(names, str):
        return [names]
    return [name for name in names if isinstance(name, str)] if isinstance(names, list) else []
