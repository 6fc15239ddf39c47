"""Integer helpers for the host code that sizes kernel launches.

Triton's ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions: called from Python, each takes
~2 us on a desktop CPU and more on a busy server's, and an eager step sizes a few hundred launches with them.
These are the same arithmetic as plain functions (~0.1 us). Kernels keep using Triton's own.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``a / b`` rounded up, for positive ``b``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` for ``n`` >= 1; 0 for 0, as Triton's."""
    n = int(n)
    return 1 << (n - 1).bit_length() if n > 0 else 0


def k_step(k: int, group: int, widest: int, narrowest: int) -> int | None:
    """The widest step along K, a power of two from ``widest`` down to ``narrowest`` columns, that divides ``k`` and
    fits groups of ``group`` columns (a multiple of the group or a divisor of it); None if there is none."""
    block = widest
    while block >= narrowest:
        if k % block == 0 and (block % group == 0 or group % block == 0):
            return block
        block //= 2
    return None
