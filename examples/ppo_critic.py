"""PPO with a learned critic on one HARTS plan: values, GAE, then the policy and the critic updates.

Run: `python examples/ppo_critic.py` (CPU, about half a minute).

The critic shares prefixes exactly as the policy does, so both run on plans
of the same trajectories. The critic is the policy's family with a value head
(`harts.critic_class("kimi_linear")`, the token-classification class HARTS adds
where transformers has none), started from the policy's backbone. One PPO step:

1. "roll out" step-wise agent trajectories (random tokens here) and score
   each with a reward on its last token;
2. forward-only passes give the behaviour policy's log-probabilities and
   the critic's values (`harts.run(plan, critic, loss="value",
   backward=False).values`: value i is read before token i, as
   log-probabilities are);
3. GAE over each trajectory's trained positions (loss mask 1) gives
   per-token advantages and returns (with gamma 1, a trajectory's last
   return is its reward);
4. the policy trains with `loss="ppo"` on a plan carrying those advantages,
   the critic with `LossConfig(kind="value", value_clip=0.2)` on the returns.

See docs/integration.md#a-critic for the arguments.
"""
from __future__ import annotations

import numpy as np
import torch
from transformers import KimiLinearForCausalLM

import harts.api as harts
from harts.executor.models.init_model import kimi_linear_config

VOCAB = 256
CHUNK = 64
GAMMA, LAMBDA = 1.0, 0.95


def rollouts(rng: np.random.Generator, prompt: list[int], count: int = 3, turns: int = 3) -> list[dict]:
    """Step-wise samples: the history through each action of `count` rollouts sharing `prompt`; the reward
    (1 or 0, on the sample's last token) is the rollout's outcome."""
    samples = []
    for r in range(count):
        tokens, mask = list(prompt), [0] * len(prompt)
        reward = float(rng.random() < 0.5)
        for t in range(turns):
            action = rng.integers(3, VOCAB, int(rng.integers(8, 20))).tolist()
            tokens, mask = tokens + action, mask + [1] * len(action)
            samples.append({"id": f"r{r}-t{t}", "tokens": list(tokens), "loss_mask": list(mask), "reward": reward})
            tool = rng.integers(3, VOCAB, int(rng.integers(20, 50))).tolist()
            tokens, mask = tokens + tool, mask + [0] * len(tool)
    return samples


def gae(values: np.ndarray, mask: np.ndarray, reward: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-token advantages and returns of one trajectory: GAE over its trained positions in order (each
    the next one's predecessor), the reward on the last; 0 and NaN elsewhere (never read)."""
    steps = np.flatnonzero(mask[1:]) + 1          # trained positions, index 0 never
    advantages, returns = np.zeros(len(mask)), np.full(len(mask), np.nan)
    running, next_value = 0.0, 0.0
    for k, i in enumerate(steps[::-1]):
        last = k == 0
        delta = (reward if last else 0.0) + (0.0 if last else GAMMA * next_value) - values[i]
        running = delta + GAMMA * LAMBDA * running
        advantages[i], returns[i] = running, running + values[i]
        next_value = values[i]
    return advantages, returns


def main() -> None:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    policy = KimiLinearForCausalLM(kimi_linear_config("tiny", VOCAB)).float()
    config = kimi_linear_config("tiny", VOCAB)
    config.num_labels, config.classifier_dropout = 1, 0.0
    critic = harts.critic_class("kimi_linear")(config).float()   # its `score` head is the value head
    critic.model.load_state_dict(policy.model.state_dict())      # started from the policy's backbone
    policy_optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=1e-3)
    system_prompt = rng.integers(3, VOCAB, 80).tolist()

    for step in range(2):
        batch = []
        for task in range(2):
            prompt = system_prompt + rng.integers(3, VOCAB, 30).tolist()
            batch += [dict(s, id=f"step{step}-task{task}-{s['id']}") for s in rollouts(rng, prompt)]
        tokens, ids = [s["tokens"] for s in batch], [s["id"] for s in batch]
        masks = [np.array(s["loss_mask"]) for s in batch]

        # Behaviour log-probabilities and old values: forward-only passes over a plan of the batch (here split
        # into small microbatches, to show that values do not depend on how a plan groups trajectories).
        probe = harts.compile_trajectories(tokens, ids=ids, loss_masks=masks, chunk_size=CHUNK, capacity=400)
        old_logprobs = harts.run(probe, policy, backward=False).logprobs
        old_values = harts.run(probe, critic, loss="value", backward=False).values
        advantages, returns = {}, {}
        for s, mask in zip(batch, masks):
            advantages[s["id"]], returns[s["id"]] = gae(old_values[s["id"]].astype(np.float64), mask, s["reward"])

        # The policy's plan carries the per-token advantages and old log-probabilities (NaN where unread).
        plan = harts.compile_trajectories(tokens, ids=ids, loss_masks=masks, chunk_size=CHUNK,
                                          advantages=[advantages[i] for i in ids],
                                          old_logprobs=[old_logprobs[i] for i in ids])
        policy_step = harts.run(plan, policy, loss="ppo")
        policy_optimizer.step()
        critic_step = harts.run(plan, critic, loss=harts.LossConfig(kind="value", value_clip=0.2),
                                returns=returns, old_values=old_values)
        critic_optimizer.step()

        # The critic's update read its values before stepping: the same as the probe's, from another plan.
        drift = max(np.nanmax(np.abs(critic_step.values[i] - old_values[i])) for i in ids)
        print(f"step {step}: {len(batch)} trajectories, {sum(map(len, tokens))} tokens -> "
              f"{sum(len(mb['row_token']) for mb in plan.microbatches)} compact rows "
              f"({len(probe.microbatches)} microbatches in the probe plan, {len(plan.microbatches)} in the update's)")
        print(f"step {step}: policy ppo loss {policy_step.loss:.6f}, critic value loss {critic_step.loss:.6f}, "
              f"values agree across the two plans within {drift:.1e}")


if __name__ == "__main__":
    main()
