"""The fair queue (llmgw.core.fairqueue): classes in order, tenants in turn, each tenant's
requests in arrival order, and nothing lost or duplicated, whatever arrives and leaves."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core.fairqueue import FairQueue

CLASSES = ("high", "normal", "low")
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.sampled_from(CLASSES), st.sampled_from("abcd")),
        st.tuples(st.just("pop"), st.just(""), st.just("")),
        st.tuples(st.just("remove"), st.integers(0, 50), st.just("")),
    ),
    max_size=120,
)


@settings(max_examples=400, deadline=None)
@given(OPS)
def test_classes_in_order_tenants_in_turn_arrival_order_kept(
    ops: list[tuple[str, object, object]],
) -> None:
    q: FairQueue[int] = FairQueue(CLASSES)
    waiting: dict[int, tuple[str, str]] = {}
    served: list[tuple[str, str]] = []
    n = 0
    for op, a, b in ops:
        if op == "push":
            q.push(str(a), str(b), n)
            waiting[n] = (str(a), str(b))
            n += 1
        elif op == "pop":
            item = q.pop()
            if not waiting:
                assert item is None
                continue
            assert item is not None
            assert item in waiting
            cls, tenant = waiting.pop(item)
            # Nothing of a higher class was waiting.
            assert all(CLASSES.index(c) >= CLASSES.index(cls) for c, _ in waiting.values())
            # Nothing of the same tenant came before it and still waits.
            assert all(i > item for i, (c, t) in waiting.items() if (c, t) == (cls, tenant))
            served.append((cls, tenant))
        else:
            item = int(str(a))
            if item in waiting:
                cls, tenant = waiting.pop(item)
                assert q.remove(cls, tenant, item)
            else:
                assert not q.remove("normal", "a", item)
        assert len(q) == len(waiting)


def test_a_tenant_with_many_waiting_delays_another_by_one_request() -> None:
    q: FairQueue[str] = FairQueue(CLASSES)
    for i in range(100):
        q.push("normal", "noisy", f"n{i}")
    q.push("normal", "quiet", "q0")
    q.push("normal", "quiet", "q1")
    order = [q.pop() for _ in range(6)]
    assert order == ["n0", "q0", "n1", "q1", "n2", "n3"]
    q.push("high", "vip", "v0")
    assert q.pop() == "v0"


def test_an_unknown_class_waits_behind_every_known_one() -> None:
    # A priority class this router does not know must not jump the queue.
    q: FairQueue[str] = FairQueue(CLASSES)
    q.push("urgent!!", "mallory", "m0")
    q.push("normal", "alice", "a0")
    q.push("low", "bob", "b0")
    assert [q.pop(), q.pop(), q.pop()] == ["a0", "m0", "b0"]
    assert q.remove("also-unknown", "mallory", "m0") is False
