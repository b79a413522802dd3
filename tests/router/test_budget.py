"""The retry budget as a token bucket."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from narwhal.router.budget import RetryBudget


def test_initial_credit_allows_that_many_retries_then_denies() -> None:
    budget = RetryBudget(3, 0.5)
    assert [budget.try_spend() for _ in range(4)] == [True, True, True, False]
    assert budget.spent == 3 and budget.denied == 1


def test_successes_earn_fractional_credit() -> None:
    budget = RetryBudget(1, 0.25)
    assert budget.try_spend()
    for _ in range(3):
        budget.on_success()
    assert not budget.try_spend()
    budget.on_success()
    assert budget.try_spend()


def test_a_zero_budget_never_retries() -> None:
    budget = RetryBudget(0, 1.0)
    budget.on_success()
    assert not budget.try_spend()


@given(
    initial=st.integers(min_value=0, max_value=20),
    replenish=st.floats(min_value=0, max_value=5),
    events=st.lists(st.booleans(), max_size=200),
)
def test_credit_stays_within_zero_and_the_initial_size(
    initial: int, replenish: float, events: list[bool]
) -> None:
    budget = RetryBudget(initial, replenish)
    successes = 0
    for is_success in events:
        if is_success:
            budget.on_success()
            successes += 1
        else:
            budget.try_spend()
        assert 0.0 <= budget.credit <= initial
    # Retries can never exceed the initial credit plus what successes earned.
    assert budget.spent <= initial + successes * replenish + 1e-9
