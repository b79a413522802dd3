"""The seat queue's order, bounds and expected wait, without sockets or an event loop:
strict priority between bands, deficit round robin in tokens within one, arrival order
for one tenant, and the refusals made at once."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.fleet.scheduler import (
    NO_CLAIM,
    Claim,
    Queues,
    Scheduler,
    ServiceRate,
    expected_wait,
)
from narwhal.protocol.errors import NarwhalError

# A reference DRR, written as Shreedhar and Varghese describe it: a turn credits the
# tenant whose turn it is with its quantum, it serves while its deficit covers its head,
# and the next tenant's turn begins when it cannot; one item per `pop`.


@dataclass
class _RefFlow:
    weight: float
    items: deque[tuple[str, float]] = field(default_factory=deque)
    deficit: float = 0.0


@dataclass
class _RefBand:
    flows: dict[str, _RefFlow] = field(default_factory=dict)
    active: deque[str] = field(default_factory=deque)
    credited: bool = False


class Reference:
    def __init__(self, quantum: float) -> None:
        self.quantum = quantum
        self.bands: dict[int, _RefBand] = {}

    def push(self, item: str, claim: Claim) -> None:
        band = self.bands.setdefault(claim.priority, _RefBand())
        if claim.tenant not in band.flows:
            band.flows[claim.tenant] = _RefFlow(claim.weight)
            band.active.append(claim.tenant)
        band.flows[claim.tenant].items.append((item, claim.cost))

    def pop(self) -> str:
        priority = min(p for p, band in self.bands.items() if band.active)
        band = self.bands[priority]
        while True:
            flow = band.flows[band.active[0]]
            if not band.credited:
                flow.deficit += self.quantum * flow.weight
                band.credited = True
            item, cost = flow.items[0]
            if cost <= flow.deficit:
                flow.items.popleft()
                flow.deficit -= cost
                if not flow.items:
                    del band.flows[band.active.popleft()]
                    band.credited = False
                return item
            band.active.rotate(-1)
            band.credited = False

    def remove(self, item: str) -> None:
        for band in self.bands.values():
            for tenant, flow in list(band.flows.items()):
                for queued in flow.items:
                    if queued[0] == item:
                        flow.items.remove(queued)
                        if not flow.items:
                            if band.active[0] == tenant:
                                band.credited = False
                            band.active.remove(tenant)
                            del band.flows[tenant]
                        return


TENANTS = {
    "a": Claim("a", weight=1.0),
    "b": Claim("b", weight=2.0),
    "c": Claim("c", weight=0.5),
    "d": Claim("d", priority=1, weight=3.0),
}

# Operations: push an item of a tenant with a cost, pop, or remove the k-th queued item.
operations = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.sampled_from(sorted(TENANTS)), st.integers(1, 40)),
        st.tuples(st.just("pop"), st.just(""), st.just(0)),
        st.tuples(st.just("remove"), st.just(""), st.integers(0, 30)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(operations, st.sampled_from([1.0, 4.0, 16.0, 64.0]))
def test_the_order_is_deficit_round_robin_between_tenants_and_strict_between_bands(
    ops: list[tuple[str, str, int]], quantum: float
) -> None:
    scheduler: Scheduler[str] = Scheduler(quantum)
    reference = Reference(quantum)
    queued: list[str] = []
    for n, (op, tenant, value) in enumerate(ops):
        if op == "push":
            item = f"{tenant}{n}"
            claim = Claim(
                tenant, TENANTS[tenant].priority, TENANTS[tenant].weight, cost=float(value)
            )
            scheduler.push(item, claim)
            reference.push(item, claim)
            queued.append(item)
        elif op == "pop" and queued:
            # Looking at the head any number of times changes nothing.
            head = scheduler.peek()
            assert scheduler.peek() == head
            assert scheduler.pop() == head == reference.pop()
            queued.remove(head)
        elif op == "remove" and queued:
            item = queued.pop(value % len(queued))
            assert scheduler.remove(item)
            reference.remove(item)
        assert len(scheduler) == len(queued)
    while queued:
        item = reference.pop()
        assert scheduler.pop() == item
        queued.remove(item)
    assert scheduler.peek() is None and len(scheduler) == 0


@given(st.lists(st.tuples(st.integers(1, 5000), st.booleans()), max_size=60))
def test_one_tenant_in_one_band_is_served_in_arrival_order(
    pushes: list[tuple[int, bool]],
) -> None:
    scheduler: Scheduler[int] = Scheduler()
    expected: deque[int] = deque()
    for n, (cost, pop) in enumerate(pushes):
        scheduler.push(n, Claim(cost=float(cost)))
        expected.append(n)
        if pop:
            assert scheduler.pop() == expected.popleft()
    assert [scheduler.pop() for _ in range(len(expected))] == list(expected)


def test_without_claims_it_is_the_fifo_it_replaces() -> None:
    scheduler: Scheduler[int] = Scheduler()
    for n in range(10):
        scheduler.push(n)
    scheduler.remove(3)
    assert [scheduler.pop() for _ in range(9)] == [0, 1, 2, 4, 5, 6, 7, 8, 9]
    with pytest.raises(IndexError):
        scheduler.pop()


def test_a_more_important_band_is_served_first_whatever_its_arrival() -> None:
    scheduler: Scheduler[str] = Scheduler()
    for n in range(3):
        scheduler.push(f"batch{n}", Claim("batch", priority=5))
    scheduler.push("chat", Claim("chat", priority=0))
    assert scheduler.peek() == "chat"
    assert scheduler.pop() == "chat"
    scheduler.push("urgent", Claim("ops", priority=-1))
    assert scheduler.peek() == "urgent"
    assert [scheduler.pop() for _ in range(4)] == ["urgent", "batch0", "batch1", "batch2"]


def served_tokens(scheduler: Scheduler[str], budget: float) -> dict[str, float]:
    """Pop until `budget` tokens are served; tokens per tenant (named by the item)."""
    served: dict[str, float] = {}
    total = 0.0
    while total < budget:
        item = scheduler.pop()
        tenant, cost = item.split(":")[0], float(item.split(":")[1])
        served[tenant] = served.get(tenant, 0.0) + cost
        total += cost
    return served


def test_backlogged_tenants_are_served_tokens_in_proportion_to_their_weights() -> None:
    scheduler: Scheduler[str] = Scheduler()
    for n in range(400):
        # Tenant a asks for long answers, b for short ones: tokens are shared, not turns.
        scheduler.push(f"a:{1000}:{n}", Claim("a", weight=3.0, cost=1000.0))
        scheduler.push(f"b:{150}:{n}", Claim("b", weight=1.0, cost=150.0))
    served = served_tokens(scheduler, 100_000)
    assert served["a"] / served["b"] == pytest.approx(3.0, rel=0.05)


def test_equal_weights_share_tokens_not_requests() -> None:
    scheduler: Scheduler[str] = Scheduler()
    for n in range(200):
        scheduler.push(f"long:2000:{n}", Claim("long", cost=2000.0))
        scheduler.push(f"short:100:{n}", Claim("short", cost=100.0))
    served = served_tokens(scheduler, 40_000)
    assert served["long"] / served["short"] == pytest.approx(1.0, rel=0.1)


def test_a_light_tenant_waits_for_about_one_request_of_a_flood() -> None:
    scheduler: Scheduler[str] = Scheduler()
    for n in range(100):
        scheduler.push(f"flood{n}", Claim("flood", cost=500.0))
    for _ in range(10):
        scheduler.pop()
    scheduler.push("light", Claim("light", cost=500.0))
    order = [scheduler.pop() for _ in range(3)]
    assert "light" in order[:2]


def test_an_emptied_queue_loses_its_unspent_deficit() -> None:
    # Quantum 10: tenant a spends 6 of its first turn's 10 and empties; were the 4 kept,
    # its 14-token request would be served at its next turn instead of the one after.
    scheduler: Scheduler[str] = Scheduler(quantum=10.0)
    scheduler.push("a1", Claim("a", cost=6.0))
    for n in range(4):
        scheduler.push(f"b{n}", Claim("b", cost=10.0))
    assert scheduler.pop() == "a1"
    scheduler.push("a2", Claim("a", cost=14.0))
    assert [scheduler.pop() for _ in range(3)] == ["b0", "b1", "a2"]


def test_a_lone_tenants_turn_ends_when_its_credit_does() -> None:
    # Quantum 10, requests of 3: a turn pays for three. Tenant a, alone, spends two of
    # its turn's; b arrives and waits only for the third.
    scheduler: Scheduler[str] = Scheduler(quantum=10.0)
    for n in range(1, 7):
        scheduler.push(f"a{n}", Claim("a", cost=3.0))
    assert [scheduler.pop(), scheduler.pop()] == ["a1", "a2"]
    for n in range(1, 4):
        scheduler.push(f"b{n}", Claim("b", cost=3.0))
    order = [scheduler.pop() for _ in range(len(scheduler))]
    assert order == ["a3", "b1", "b2", "b3", "a4", "a5", "a6"]


def test_a_head_looked_at_but_not_served_is_not_charged() -> None:
    # A quantum of more than one request, so that deficits carried decide the order.
    looked: Scheduler[str] = Scheduler(quantum=250.0)
    plain: Scheduler[str] = Scheduler(quantum=250.0)
    for scheduler in (looked, plain):
        for n in range(5):
            scheduler.push(f"a{n}", Claim("a", cost=300.0))
            scheduler.push(f"b{n}", Claim("b", weight=2.0, cost=100.0))
    order: list[str] = []
    while len(looked):
        for _ in range(3):  # placement failed twice for this head
            head = looked.peek()
        assert head is not None
        assert looked.pop() == head
        order.append(head)
    assert order == [plain.pop() for _ in range(10)]


def test_a_waiter_that_leaves_is_removed_and_nobody_is_charged() -> None:
    scheduler: Scheduler[str] = Scheduler()
    for n in range(3):
        scheduler.push(f"a{n}", Claim("a", cost=10.0))
    scheduler.push("b0", Claim("b", cost=10.0))
    assert scheduler.peek() == "a0"
    assert scheduler.remove("a0") and not scheduler.remove("a0")
    assert "a0" not in scheduler and "a1" in scheduler
    assert scheduler.queued_by_tenant() == {"a": 2, "b": 1}
    assert [scheduler.pop() for _ in range(3)] == ["a1", "b0", "a2"]
    assert scheduler.queued_by_tenant() == {} and scheduler.queued("a") == 0


def test_only_a_less_important_band_gives_way_its_newest_first() -> None:
    scheduler: Scheduler[str] = Scheduler()
    scheduler.push("low-a1", Claim("a", priority=2))
    scheduler.push("low-b1", Claim("b", priority=2))
    scheduler.push("low-a2", Claim("a", priority=2))
    scheduler.push("mid", Claim("c", priority=1))
    # An equal band does not give way.
    assert scheduler.displace(2) is None
    # A more important one takes the place of the least important band's newest.
    assert scheduler.displace(0) == "low-a2"
    scheduler.push("top", Claim("e", priority=0))
    assert scheduler.displace(0) == "low-b1"
    scheduler.push("top2", Claim("e", priority=0))
    assert scheduler.displace(1) == "low-a1"
    scheduler.push("m2", Claim("c", priority=1))
    assert scheduler.least_important() == 1
    assert scheduler.displace(1) is None
    assert [scheduler.pop() for _ in range(len(scheduler))] == ["top", "top2", "mid", "m2"]
    assert scheduler.displace(0) is None and scheduler.least_important() is None


def test_work_ahead_counts_more_important_bands_and_a_fair_share_of_its_own() -> None:
    scheduler: Scheduler[str] = Scheduler()
    scheduler.push("vip", Claim("vip", priority=0, cost=500.0))
    for n in range(5):
        scheduler.push(f"flood{n}", Claim("flood", priority=1, weight=2.0, cost=1000.0))
    scheduler.push("mine", Claim("me", priority=1, cost=200.0))
    scheduler.push("late", Claim("low", priority=2, cost=9999.0))
    # Band 0's 500; in its band, its own 200 queued; while it is served those and its own
    # 100, the flood, at twice its weight, is served 2 * 300 of its 5000; band 2: nothing.
    assert scheduler.ahead(Claim("me", 1, cost=100.0)) == pytest.approx(500 + 200 + 600)
    # A light weight waits for all the others hold; a heavy one for a sliver of it.
    assert scheduler.ahead(Claim("new", 1, weight=0.01, cost=100.0)) == pytest.approx(
        500 + 5000 + 200
    )
    assert scheduler.ahead(Claim("new", 1, weight=100.0, cost=100.0)) == pytest.approx(500 + 2 + 1)
    # The most important band waits for nothing but its own.
    assert scheduler.ahead(Claim("vip", priority=0, cost=10.0)) == 500.0
    assert scheduler.ahead(Claim(priority=-1)) == 0.0
    assert Scheduler[str]().ahead(NO_CLAIM) == 0.0


def test_the_service_rate_counts_only_time_with_requests_waiting() -> None:
    rate = ServiceRate(window_s=10.0, min_samples=3, min_span_s=1.0)
    assert rate.rate(0.0) is None
    rate.served(100.0, 0.0)  # the first end of a backlog only starts the clock
    rate.served(100.0, 1.0)
    rate.served(100.0, 2.0)
    assert rate.rate(2.0) is None, "two intervals are too little to go on"
    rate.served(100.0, 3.0)
    assert rate.rate(3.0) == pytest.approx(100.0)
    # Nobody waited for 20 s: that time is no measure of the pool's speed.
    rate.idle()
    rate.served(400.0, 23.0)
    rate.served(400.0, 24.0)
    assert rate.rate(24.0) is None, "the samples before the idle time have left the window"
    rate.served(400.0, 24.5)
    rate.served(400.0, 25.0)
    assert rate.rate(25.0) == pytest.approx(1200.0 / 2.0)
    assert rate.rate(40.0) is None, "nothing served within the window"


def test_expected_wait_is_unknown_without_a_rate() -> None:
    assert expected_wait(1000.0, None) is None
    assert expected_wait(1000.0, 0.0) is None
    assert expected_wait(1000.0, 250.0) == 4.0


def busy_queues(rate: float, now: float) -> Queues[str, str]:
    """Queues whose pool "p" is known to serve `rate` tokens per second at `now`."""
    queues: Queues[str, str] = Queues()
    for n in range(5):
        queues.served("p", rate, now - 4 + n)
    return queues


def test_a_request_expected_to_wait_past_its_objective_is_refused_at_once() -> None:
    queues = busy_queues(100.0, now=10.0)
    for n in range(10):
        assert queues.admit(f"b{n}", "p", Claim("batch", cost=100.0), 10.0, 1000) is None
    chat = Claim("chat", cost=100.0, objective_s=2.0)
    # Ahead of the first: its fair share of batch's, 100 tokens: 1 s. Ahead of the
    # second: the first's 100 and 200 of batch's: 3 s.
    assert queues.admit("c0", "p", chat, 10.0, 1000) is None
    with pytest.raises(NarwhalError) as caught:
        queues.admit("c1", "p", chat, 10.0, 1000)
    error = caught.value
    assert (error.status, error.retry_after) == (503, 3)
    assert error.message == "expected queue wait 3.0 s exceeds tenant `chat`'s ttft_objective_s 2 s"
    with pytest.raises(NarwhalError) as caught:
        queues.admit("c1", "p", Claim("chat", cost=100.0, deadline=11.5), 10.0, 1000)
    assert caught.value.message == (
        "expected queue wait 3.0 s exceeds the 1.5 s left before its deadline"
    )
    # Both bounds: the tighter is named.
    both = Claim("chat", cost=100.0, objective_s=3.0, deadline=12.0)
    with pytest.raises(NarwhalError) as caught:
        queues.admit("c1", "p", both, 10.0, 1000)
    assert "2.0 s left before its deadline" in caught.value.message
    assert queues.queued() == 11


def test_an_unknown_rate_never_refuses_on_the_wait() -> None:
    queues: Queues[str, str] = Queues()
    for n in range(50):
        claim = Claim("chat", cost=1000.0, objective_s=0.001, deadline=0.0)
        assert queues.admit(f"c{n}", "p", claim, 10.0, 1000) is None
    assert queues.queued_by_tenant() == {"chat": 50}


def test_a_tenant_over_max_queued_is_429_in_every_pool_together() -> None:
    queues = busy_queues(100.0, now=10.0)
    claim = Claim("batch", cost=100.0, max_queued=3)
    queues.admit("1", "p", claim, 10.0, 1000)
    queues.admit("2", "q", claim, 10.0, 1000)
    queues.admit("3", "p", claim, 10.0, 1000)
    with pytest.raises(NarwhalError) as caught:
        queues.admit("4", "p", claim, 10.0, 1000)
    error = caught.value
    # Its 200 tokens queued in pool p, at 100 a second.
    assert (error.status, error.code, error.retry_after) == (429, "rate_limit_exceeded", 2)
    assert "tenant `batch`'s queue is full (3 requests" in error.message
    assert "max_queued" in error.message
    with pytest.raises(NarwhalError) as caught:
        queues.admit("4", "q", claim, 10.0, 1000)
    assert caught.value.retry_after == 1, "pool q's rate is unknown"


def test_a_full_queue_sheds_the_least_important_band_in_any_pool() -> None:
    queues: Queues[str, str] = Queues()
    queues.admit("p-low", "p", Claim("bulk", priority=3), 0.0, 3)
    queues.admit("q-lower", "q", Claim("bulk", priority=5), 0.0, 3)
    queues.admit("p-mid", "p", Claim("x", priority=1), 0.0, 3)
    with pytest.raises(NarwhalError) as caught:
        queues.admit("same", "p", Claim("y", priority=5), 0.0, 3)
    assert caught.value.status == 503
    # Without a tenant, a full queue answers as it always has.
    with pytest.raises(NarwhalError) as untenanted:
        queues.admit("plain", "p", Claim(priority=5), 0.0, 3)
    assert (untenanted.value.status, untenanted.value.retry_after) == (429, 1)
    assert caught.value.message == (
        "the router's queue is full (3 requests wait for a seat; serving.queue_capacity)"
    )
    shed = queues.admit("top", "p", Claim("vip", priority=0), 0.0, 3)
    assert shed is not None
    victim, error = shed
    assert victim == "q-lower"
    assert (error.status, error.retry_after) == (503, 1)
    assert error.message.startswith("shed: a more important request took its place in the queue")
    assert "band 5 gives way to band 0" in error.message
    shed = queues.admit("top2", "q", Claim("vip", priority=0), 0.0, 3)
    assert shed is not None and shed[0] == "p-low"
    assert queues.queued() == 3 and len(queues.pools["q"]) == 1


def test_in_a_full_queue_a_lighter_tenant_of_the_band_takes_the_floods_newest_place() -> None:
    queues: Queues[str, str] = Queues()
    for n in range(4):
        queues.admit(f"a{n}", "p" if n % 2 else "q", Claim("flood"), 0.0, 4)
    shed = queues.admit("b0", "p", Claim("light"), 0.0, 4)
    assert shed is not None and shed[0] == "a3"
    error = shed[1]
    assert (error.status, error.refusal) == (503, "shed")
    assert error.message.startswith("shed: tenant `flood` held the most of the router's full queue")
    assert queues.admit("b1", "q", Claim("light"), 0.0, 4) is not None
    # Two each: the light tenant's next would leave it holding more than the flood.
    with pytest.raises(NarwhalError) as caught:
        queues.admit("b2", "p", Claim("light"), 0.0, 4)
    assert caught.value.refusal == "queue_full"
    # Weight counts: a tenant of weight 3 holds its share with three times the work.
    assert queues.admit("c0", "p", Claim("heavy", weight=3.0, cost=2.0), 0.0, 4) is not None
    assert queues.queued_by_tenant() == {"flood": 1, "light": 2, "heavy": 1}


def test_a_weight_or_quantum_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="weight must be > 0"):
        Scheduler[str]().push("x", Claim("t", weight=0.0))
    with pytest.raises(ValueError, match="quantum must be > 0"):
        Scheduler[str](quantum=0.0)
