"""The retry budget: a token bucket refilled by successes, so retries never multiply load."""

from __future__ import annotations


class RetryBudget:
    """`initial` credits at start; each retry spends one; each success earns `replenish`.

    The balance never exceeds `initial`, so after an outage the fleet sees at most that
    many extra attempts before successes have paid for more.
    """

    __slots__ = ("credit", "denied", "initial", "replenish", "spent")

    def __init__(self, initial: int, replenish: float) -> None:
        self.initial = initial
        self.replenish = replenish
        self.credit = float(initial)
        self.spent = 0
        self.denied = 0

    def try_spend(self) -> bool:
        if self.credit >= 1.0:
            self.credit -= 1.0
            self.spent += 1
            return True
        self.denied += 1
        return False

    def on_success(self) -> None:
        self.credit = min(float(self.initial), self.credit + self.replenish)
