"""Small wording helpers shared by the command-line front ends."""
from __future__ import annotations


def plural(n: int, word: str) -> str:
    """'1 microbatch', '2 microbatches', '1 trajectory', '3 trajectories', '1,024 rows' (thousands separated)."""
    if n == 1:
        return f"{n:,} {word}"
    if word.endswith("y") and word[-2:-1] not in "aeiou":
        return f"{n:,} {word[:-1]}ies"
    return f"{n:,} {word}{'es' if word.endswith(('ch', 'sh', 's', 'x')) else 's'}"
