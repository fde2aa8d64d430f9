"""HARTS inside a training loop: compile a batch in memory, run it, step the optimizer.

Run: `python examples/train_loop.py` (CPU, well under a minute).

Each step of the loop:

1. "rolls out" a few step-wise agent trajectories (random tokens here; an RL
   framework gives you token ids, loss masks, advantages and the behaviour
   policy's log-probabilities);
2. compiles them with `harts.api.compile_trajectories` (in memory, no files);
3. runs the plan with `harts.api.run(plan, model, loss="grpo")`: one forward
   and backward over the compact rows, gradients left in each parameter's
   `.grad`, exactly as one `loss.backward()` over the whole step would;
4. calls `optimizer.step()`.

See docs/integration.md for what each argument means.
"""
from __future__ import annotations

import numpy as np
import torch
from transformers import KimiLinearForCausalLM

import harts.api as harts
from harts.executor.models.init_model import kimi_linear_config
from harts.schema.summary import plan_statistics

VOCAB = 256
CHUNK = 64          # must equal the chunk size of the linear-attention kernel you train with


def rollout_group(rng: np.random.Generator, prompt: list[int], group_size: int = 2, turns: int = 3):
    """Step-wise samples of `group_size` rollouts that share `prompt`.

    A rollout is prompt, then per turn an action (the policy's tokens, loss
    mask 1) and a tool output (loss mask 0). Step-wise RL trains on the history
    through each action, so a rollout of n turns gives n nested prefixes.
    """
    samples = []
    rewards = rng.permutation([1.0] + [0.0] * (group_size - 1))   # one rollout of the group succeeded
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)       # GRPO, one per rollout
    for r in range(group_size):
        tokens, mask = list(prompt), [0] * len(prompt)
        for t in range(turns):
            action = rng.integers(3, VOCAB, int(rng.integers(8, 24))).tolist()
            tokens, mask = tokens + action, mask + [1] * len(action)
            samples.append({"id": f"r{r}-t{t}", "tokens": list(tokens), "loss_mask": list(mask),
                            "advantage": float(advantages[r])})
            tool = rng.integers(3, VOCAB, int(rng.integers(20, 60))).tolist()
            tokens, mask = tokens + tool, mask + [0] * len(tool)
    return samples


def main() -> None:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    # A tiny random Kimi Linear model (KDA + MLA + MoE). With a real checkpoint:
    # AutoModelForCausalLM.from_pretrained(path), or `harts init-model` for a random one on disk.
    model = KimiLinearForCausalLM(kimi_linear_config("tiny", VOCAB)).float()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    system_prompt = rng.integers(3, VOCAB, 100).tolist()

    for step in range(2):
        batch = []
        for task in range(2):                       # two GRPO groups, each with its own task text
            prompt = system_prompt + rng.integers(3, VOCAB, 40).tolist()
            batch += [dict(s, id=f"step{step}-task{task}-{s['id']}") for s in rollout_group(rng, prompt)]
        tokens = [s["tokens"] for s in batch]
        ids = [s["id"] for s in batch]
        masks = [s["loss_mask"] for s in batch]
        advantages = [s["advantage"] for s in batch]          # one float per trajectory (or a list per token)

        # Behaviour-policy log-probabilities. A framework records them at rollout
        # time (or recomputes them); here a forward-only HARTS pass stands in.
        # Alignment: old[i] = log p(tokens[i] | tokens[:i]); index 0 is never a target.
        probe = harts.compile_trajectories(tokens, ids=ids, chunk_size=CHUNK)
        behaviour = harts.run(probe, model, backward=False).logprobs
        old = [np.nan_to_num(behaviour[i], nan=0.0) for i in ids]

        plan = harts.compile_trajectories(tokens, ids=ids, loss_masks=masks, advantages=advantages,
                                          old_logprobs=old, dp=1, capacity=65536, chunk_size=CHUNK)
        stats = plan_statistics(plan)
        result = harts.run(plan, model, loss="grpo")   # zeroes .grad, then forward + backward
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

        # On-policy (old == current), the GRPO ratio is 1, so the token-mean loss is
        # -sum(A * mask) / (number of positions i >= 1 with mask 1) over the whole step.
        trained = sum(sum(m[1:]) for m in masks)
        expected = -sum(a * sum(m[1:]) for a, m in zip(advantages, masks)) / trained
        first = ids[0]
        print(f"step {step}: {stats['trajectories']} trajectories, {stats['original_tokens']} tokens -> "
              f"{stats['compact_tokens']} compact rows ({stats['compression']:.2f}x)")
        print(f"step {step}: loss {result.loss:.6f} (on-policy value {expected:.6f}), grad norm {float(grad_norm):.4f}, "
              f"moe aux {result.moe_aux_loss:.4f}, {result.seconds:.2f}s")
        # NaN at index 0 (nothing predicts the first token); the last tokens are the policy's action.
        print(f"step {step}: logprobs[{first!r}] has {len(result.logprobs[first])} entries: "
              f"first {np.array2string(result.logprobs[first][:3], precision=4)}, "
              f"last {np.array2string(result.logprobs[first][-3:], precision=4)}")


if __name__ == "__main__":
    main()
