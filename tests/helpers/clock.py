"""A clock a test moves by hand, for code that takes one (`LeaseTable(clock=...)`): a timeout is then tested at its
deadline exactly, just before and just after, with no sleep and whatever the machine's load."""

from __future__ import annotations

# a step a test can take to land just past a deadline: a power of two, so that `start + n * STEP` is exact in binary
# (a deadline 30 s after 1000.0 is passed by 1030.0009765625, not by a sum that rounds back onto it)
STEP = 2.0 ** -10


class FakeClock:
    """Seconds that move only when the test says (`advance`); called as time.monotonic is."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now
