"""Shared helpers of the model fidelity tests (tests/test_executor.py, tests/test_qwen3_next.py).

Trees that stress chunk boundaries, plan compilation from token lists, the
Hugging Face per-trajectory reference (in float32, and with a float64
linear-attention core), and the gradient comparison rules.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
from dataclasses import replace

import numpy as np
import torch
from hypothesis import strategies as st

from harts.compiler.ir.trajectories import TrajectoryBatch
from harts.compiler.pipeline import CompileOptions, compile_batch
from harts.executor.losses import LossConfig
from harts.executor.models.hf_reference import trajectory_logprobs
from harts.executor.models.init_model import kimi_linear_config, qwen3_next_config
from harts.executor.runtime import run_step

VOCAB = 256


def tiny_kimi_linear():
    """Tiny Kimi Linear with a non-zero router score-correction bias."""
    from transformers import KimiLinearForCausalLM

    torch.manual_seed(0)
    model = KimiLinearForCausalLM(kimi_linear_config("tiny", VOCAB)).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
    return model


def tiny_qwen3_next():
    """Tiny Qwen3-Next with slow linear-attention decays and non-trivial norms (state crosses chunks)."""
    from transformers import Qwen3NextForCausalLM

    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(qwen3_next_config("tiny", VOCAB)).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                # The initialiser draws A in [0.01, 16]: most heads forget within a few tokens,
                # so a wrong state handed over a chunk boundary could go unseen. Slow decays
                # (exp(-A softplus(a + dt_bias)) ~ 0.74..0.99 per token) carry state across chunks.
                A_log = layer.linear_attn.A_log
                A_log.copy_(torch.empty_like(A_log).uniform_(0.005, 0.2).log())
            # Non-trivial norm weights (the initialiser leaves 1 + 0 everywhere).
            for module in layer.modules():
                if type(module).__name__ == "Qwen3NextRMSNorm":
                    module.weight.normal_(0.0, 0.1)
    return model


def boundary_tree(rng, vocab: int = VOCAB) -> list[list[int]]:
    """Forks at 64 (on a boundary), 65 (just after), 63 (just before), 130 (second chunk),
    a chain of short segments at 100..103, a duplicate, strict prefixes and an unrelated tree."""
    base = list(rng.integers(3, vocab, 170))
    tail = lambda n: list(rng.integers(3, vocab, n))   # noqa: E731
    return [
        base[:170], base[:64] + tail(40), base[:65] + tail(20), base[:63] + tail(12), base[:130] + tail(9),
        base[:100] + tail(5), base[:101] + tail(4), base[:102] + tail(6), base[:170],   # duplicate
        base[:120], base[:30],                                                            # strict prefixes
        tail(50),
    ]


def compile_lists(lists, chunk_size=64, dp=1, capacity=4096, advantages=None, old=None, loss_masks=None, levels=None):
    batch = TrajectoryBatch.from_token_lists(lists, advantages=advantages, loss_masks=loss_masks)
    if old is not None:
        batch = replace(batch, old_logprobs=old.astype(np.float32), has_old_logprobs=np.ones(len(lists), bool))
    return compile_batch(batch, CompileOptions(chunk_size=chunk_size, dp=dp, capacity=capacity, levels=levels)).plan


def hf_reference(model, lists):
    """Per-trajectory log-probabilities and the gradients of the step's token-mean NLL."""
    model.zero_grad(set_to_none=True)
    logprobs, total, count = [], 0.0, 0
    for tokens in lists:
        lp = trajectory_logprobs(model, tokens)
        logprobs.append(lp.detach().cpu().numpy())
        total = total - lp.sum()
        count += len(tokens) - 1
    (total / count).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logprobs, grads


# transformers' torch fallback of each family's chunked delta rule, by module and function name.
LINEAR_ATTENTION_FALLBACKS = {
    "qwen3_next": ("transformers.models.qwen3_next.modeling_qwen3_next", "torch_chunk_gated_delta_rule"),
    "kimi_linear": ("transformers.models.kimi_linear.modeling_kimi_linear", "chunk_kimi_delta_attention"),
}


@contextlib.contextmanager
def float64_linear_attention_core(model_type: str):
    """transformers' fallback core, rebuilt from its own source with its one float32 cast made float64.

    The fallbacks cast q, k, v, beta and g to float32 whatever the model's dtype, so a `.double()` model
    still runs its delta rule in float32 and is no float64 reference for what that rule computes (the
    gate parameters' gradients above all: an audit compared against such a "reference" and blamed HARTS
    for transformers' own rounding). Fails loudly if the source no longer has exactly that one cast.
    """
    import importlib

    module_name, function_name = LINEAR_ATTENTION_FALLBACKS[model_type]
    module = importlib.import_module(module_name)
    original = getattr(module, function_name)
    source = inspect.getsource(inspect.unwrap(original))
    assert source.count("torch.float32") == 1, f"{function_name}: expected one float32 cast in its source"
    namespace = dict(vars(module))
    exec(source[source.index("def "):].replace("torch.float32", "torch.float64"), namespace)   # its own code
    setattr(module, function_name, namespace[function_name])
    try:
        yield
    finally:
        setattr(module, function_name, original)


def hf_float64_reference(model, lists):
    """`hf_reference` on a float64 copy of `model` whose linear-attention core runs in float64 too
    (`float64_linear_attention_core`); what the model's modules cast to float32 themselves (their
    RMSNorms, the gate's `A_log.float()`) stays float32, in HARTS's runs as in this one."""
    model64 = copy.deepcopy(model).double()
    for module in model64.modules():
        if hasattr(module, "config"):
            module.config._experts_implementation = "eager"   # grouped_mm has no float64 kernel
    with float64_linear_attention_core(model.config.model_type):
        return hf_reference(model64, lists)


def check_float32_gradients_as_accurate_as_transformers(model, seed: int = 0) -> None:
    """Compact float32 gradients are as close to the float64 reference as transformers' own float32 run
    per trajectory: for every parameter, within 2x its error (measured: at most 1.4x on both families),
    or 1e-7 of the largest gradient where its error is below that. Against the float32 run itself (the
    1e-4 rule above) a parameter whose gradient nearly cancels (Gated DeltaNet's A_log, dt_bias) can
    look far off when both are equally far from the exact value."""
    lists = boundary_tree(np.random.default_rng(seed))
    ours = {name: grad.double() for name, grad in run_step(compile_lists(lists), model).grads.items()}
    _, theirs = hf_reference(model, lists)
    _, exact = hf_float64_reference(model, lists)
    floor = 1e-7 * max(float(g.norm()) for g in exact.values())
    for name, want in exact.items():
        our_error = float((ours[name] - want).norm())
        their_error = float((theirs[name].double() - want).norm())
        assert our_error <= 2.0 * max(their_error, floor), (name, our_error, their_error)


def relative_error(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-30) -> float:
    return float((a - b).norm() / b.norm().clamp_min(floor))


def gradient_floor(grads: dict) -> float:
    """A parameter whose gradient is zero in exact arithmetic (say, an attention query on a path
    where it can only read itself) holds float noise, whose relative error means nothing;
    its error is measured against 1e-4 of the largest gradient instead (an absolute
    tolerance of 1e-8 of the largest gradient, far above float32 noise, far below any signal)."""
    return 1e-4 * max(float(g.norm()) for g in grads.values())


@st.composite
def small_forests(draw, vocab: int = VOCAB):
    """Trajectories branching off earlier ones at random depths."""
    lists = [draw(st.lists(st.integers(3, vocab - 1), min_size=2, max_size=40))]
    for _ in range(draw(st.integers(1, 6))):
        base = lists[draw(st.integers(0, len(lists) - 1))]
        cut = draw(st.integers(0, len(base)))
        lists.append(base[:cut] + draw(st.lists(st.integers(3, vocab - 1), min_size=max(0, 2 - cut), max_size=25)))
    return lists


# ----------------------------------------------------------------------------- checks every model family passes


def check_matches_hugging_face(model, seed: int = 0) -> None:
    """Compact log-probabilities and nll gradients equal the HF model run per trajectory."""
    lists = boundary_tree(np.random.default_rng(seed))
    plan = compile_lists(lists)
    mb = plan.microbatches[0]
    assert len(mb["replay_rows"]) > 0 and len(mb["export_row"]) > 0 and mb["num_rounds"] >= 2
    result = run_step(plan, model, mode="compact")
    want_logprobs, want_grads = hf_reference(model, lists)
    for i, want in enumerate(want_logprobs):
        got = result.logprobs[str(i)]
        assert np.isnan(got[0])
        assert np.max(np.abs(got[1:] - want)) <= 1e-5, f"trajectory {i}"
    # Every parameter the reference reaches, we reach; and only those.
    assert {n for n, g in result.grads.items() if g.abs().sum() > 0} == {
        n for n, g in want_grads.items() if g.abs().sum() > 0}
    floor = gradient_floor(want_grads)
    worst = max((relative_error(result.grads[n], g, floor), n) for n, g in want_grads.items())
    assert worst[0] <= 1e-4, worst


def check_modes_agree(model, mode: str, seed: int = 1) -> None:
    """`mode` and compact agree on log-probabilities, every objective's gradients and MoE statistics."""
    rng = np.random.default_rng(seed)
    lists = boundary_tree(rng)
    old = rng.normal(-3.0, 0.5, sum(len(t) for t in lists))
    plan = compile_lists(lists, advantages=rng.normal(size=len(lists)), old=old)
    for loss in (LossConfig("nll", moe_aux_coef=0.01, moe_z_coef=0.001), LossConfig("ppo", kl_coef=0.0),
                 LossConfig("grpo")):
        compact = run_step(plan, model, mode="compact", loss=loss)
        other = run_step(plan, model, mode=mode, loss=loss, pack_expanded=False)
        assert abs(compact.loss - other.loss) <= 1e-5 * max(1.0, abs(compact.loss))
        assert abs(compact.moe_aux_loss - other.moe_aux_loss) <= 1e-6
        assert abs(compact.moe_z_loss - other.moe_z_loss) <= 1e-5
        for layer, load in compact.moe_load.items():
            np.testing.assert_allclose(load, other.moe_load[layer], rtol=0, atol=0)
        floor = gradient_floor(compact.grads)
        for name, grad in compact.grads.items():
            assert relative_error(other.grads[name], grad, floor) <= 1e-4, (loss.kind, name)
        for key, lp in compact.logprobs.items():
            assert np.nanmax(np.abs(lp - other.logprobs[key])) <= 1e-5


def check_loss_positions_only_keep_the_step(model, seed: int = 4) -> None:
    """`logprobs="loss"` gives the loss, gradients and MoE statistics of "all"; log-probabilities
    equal where the objective weighs a position and NaN elsewhere (compact with windows, expanded)."""
    rng = np.random.default_rng(seed)
    lists = boundary_tree(rng)
    masks = [(rng.random(len(t)) < 0.3).astype(np.uint8) for t in lists]
    masks[0][:] = 0                                   # a trajectory the loss never reads
    old = rng.normal(-3.0, 0.5, sum(len(t) for t in lists))
    plan = compile_lists(lists, advantages=rng.normal(size=len(lists)), old=old, loss_masks=masks,
                         capacity=200, levels="l1+l2")
    assert plan.producers, "the compact run should read a window producer"
    for mode, loss in (("compact", LossConfig("grpo", moe_aux_coef=0.01)), ("expanded", LossConfig("nll"))):
        every = run_step(plan, model, mode=mode, loss=loss)
        only = run_step(plan, model, mode=mode, loss=loss, logprobs="loss")
        assert abs(only.loss - every.loss) <= 1e-6 * max(1.0, abs(every.loss)), mode
        assert abs(only.moe_aux_loss - every.moe_aux_loss) <= 1e-7
        floor = gradient_floor(every.grads)
        for name, grad in every.grads.items():
            assert relative_error(only.grads[name], grad, floor) <= 1e-5, (mode, name)
        for i, mask in enumerate(masks):
            got, want = only.logprobs[str(i)], every.logprobs[str(i)]
            weighed = mask.astype(bool)
            weighed[0] = False
            assert np.all(np.isnan(got[~weighed])), (mode, i)
            assert np.max(np.abs(got[weighed] - want[weighed]), initial=0.0) <= 1e-6, (mode, i)


def check_expert_loads_count_every_occurrence(model, seed: int = 2) -> None:
    lists = boundary_tree(np.random.default_rng(seed))
    result = run_step(compile_lists(lists), model, mode="compact", backward=False)
    top_k = model.config.num_experts_per_tok
    sparse = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    assert sorted(result.moe_load) == sparse
    for load in result.moe_load.values():
        assert load.sum() == top_k * sum(len(t) for t in lists)


def check_random_forest_compact_equals_expanded(model, lists, chunk_size: int, dp: int) -> None:
    """A random forest compiled with B = chunk_size and D = dp: compact and expanded (packed under
    the plan's capacity) agree on every log-probability and gradient."""
    dp = min(dp, len(lists))
    plan = compile_lists(lists, chunk_size=chunk_size, dp=dp, capacity=max(len(t) for t in lists) + 30)
    compact = run_step(plan, model, mode="compact")
    expanded = run_step(plan, model, mode="expanded")
    for key, lp in compact.logprobs.items():
        assert np.nanmax(np.abs(lp - expanded.logprobs[key])) <= 1e-5
    floor = gradient_floor(compact.grads)
    for name, grad in compact.grads.items():
        assert relative_error(expanded.grads[name], grad, floor) <= 1e-4, name


def check_recomputation_keeps_gradients_and_statistics(model) -> None:
    """Full-layer recomputation: the same loss, MoE statistics and gradients as without it."""
    lists = boundary_tree(np.random.default_rng(3))
    plan = compile_lists(lists)
    loss = LossConfig("nll", moe_aux_coef=0.01, moe_z_coef=0.001)
    plain = run_step(plan, model, loss=loss)
    recomputed = run_step(plan, model, loss=loss, recompute=True)
    assert recomputed.loss == plain.loss and recomputed.moe_aux_loss == plain.moe_aux_loss
    for layer, load in plain.moe_load.items():
        np.testing.assert_array_equal(recomputed.moe_load[layer], load)
    for name, grad in plain.grads.items():
        torch.testing.assert_close(recomputed.grads[name], grad, rtol=1e-6, atol=1e-9)
