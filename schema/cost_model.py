"""L2's cost model: what one computed decoder row costs, in units of one causal attention pair.

For one entity (a consumer's residual rows, or a producer) the paper's
Appendix A.2 counts n computed rows, A query-key pairs (each computed row at
position t attends to t + 1 keys) and R = sum q_i k_i, the rectangle a
blockwise attention backward touches (q_i rows created by trajectory i, whose
last key is at depth k_i = its length). Forward costs alpha_F n + beta_F A,
backward alpha_B n + beta_B R. The placement pass balances these; `harts
stats` reports balance in them too (`cost_balance`), next to rows.
"""
from __future__ import annotations

from typing import NamedTuple

DEFAULT_PAIRS_PER_TOKEN = 65536   # alpha_F / beta_F for the paper's models (place_windows' docstring)


class RowCostWeights(NamedTuple):
    token_forward: int    # alpha_F
    pair_forward: int     # beta_F
    token_backward: int   # alpha_B
    pair_backward: int    # beta_B

    def cost(self, rows: int, pairs: int, rectangle: int) -> int:
        """Forward + backward cost of n = rows, A = pairs, R = rectangle."""
        return ((self.token_forward + self.token_backward) * rows
                + self.pair_forward * pairs + self.pair_backward * rectangle)


def row_cost_weights(pairs_per_token: int) -> RowCostWeights:
    """Weights for a model whose row's linear work equals `pairs_per_token` attention pairs.

    Backward is twice forward. 0 drops the attention terms: every computed row
    costs the same (1 forward, 2 backward), so balance is in rows.
    """
    if pairs_per_token < 0:
        raise ValueError(f"pairs_per_token must be >= 0, got {pairs_per_token}")
    if pairs_per_token == 0:
        return RowCostWeights(1, 0, 2, 0)
    return RowCostWeights(pairs_per_token, 1, 2 * pairs_per_token, 2)
