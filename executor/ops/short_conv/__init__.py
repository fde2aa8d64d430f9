"""Short causal depthwise convolution (KDA / Gated DeltaNet) over compact rows.

`conv_context` builds each row's window of ancestor rows once per microbatch;
`short_conv` is the gather fast path; `naive_short_conv` runs F.conv1d per
expanded trajectory and is its specification.
"""

from .gather import conv_context, short_conv
from .naive import naive_short_conv

__all__ = ["conv_context", "naive_short_conv", "short_conv"]
