"""The order in which `krex compare` runs its candidates: randomized palindromic blocks.

Each block runs every candidate twice, in a random order and then in the reverse of that
order (for two candidates: ABBA or BAAB). Within a block every candidate's two runs sit
at the same mean position, so a drift that is linear over the block (a GPU warming up,
clocks settling, a neighbour's load rising) shifts every candidate's block mean by the
same amount and cancels in their ratio; a fixed ABAB order would bias the comparison by
half a step of drift. Randomizing the order of each block keeps any periodic drift or
carry-over effect (a candidate that leaves the caches or the clocks in a state the next
one inherits) from lining up with one candidate. The seed is recorded so a comparison's
order can be replayed."""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["Slot", "block_order"]


@dataclass(frozen=True)
class Slot:
    block: int  # 0-based
    position: int  # 0-based place within the block (0 .. 2K-1)
    candidate: int  # index into the candidates


def block_order(candidates: int, block: int, rng: random.Random) -> list[Slot]:
    """The runs of one block: a random order of the candidates, then its reverse."""
    if candidates < 2:
        raise ValueError("a comparison needs at least two candidates")
    order = list(range(candidates))
    rng.shuffle(order)
    seq = order + order[::-1]
    return [Slot(block, i, c) for i, c in enumerate(seq)]
