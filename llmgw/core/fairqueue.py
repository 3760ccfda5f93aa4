"""A fair queue: requests waiting for a model, by priority class, then by tenant in turn.

Classes are served strictly in order (every `high` request before any `normal`); within a
class the tenants (API keys) with requests waiting take turns, one request each, and each
tenant's requests leave in the order they came. So one tenant with a thousand requests
queued delays another tenant's next request by one request, not a thousand, and a class
above can starve the classes below only while it has requests waiting (which is what
priority means). Pure: the items are whatever the caller waits on.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    """Items by class (in the order of `classes`), then round-robin by tenant."""

    def __init__(self, classes: Sequence[str]) -> None:
        self.classes = tuple(classes)
        self._by_class: dict[str, OrderedDict[str, deque[T]]] = {c: OrderedDict() for c in classes}
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def _tenants(self, cls: str) -> OrderedDict[str, deque[T]]:
        found = self._by_class.get(cls)
        return found if found is not None else self._by_class[self.classes[-1]]

    def push(self, cls: str, tenant: str, item: T) -> None:
        """Add `item`; an unknown class is the last class."""
        tenants = self._tenants(cls)
        q = tenants.get(tenant)
        if q is None:
            q = tenants[tenant] = deque()
        q.append(item)
        self._n += 1

    def pop(self) -> T | None:
        """The next item: the first class with items, its next tenant in turn."""
        for tenants in self._by_class.values():
            if not tenants:
                continue
            tenant, q = next(iter(tenants.items()))
            item = q.popleft()
            if q:
                tenants.move_to_end(tenant)  # its turn is over
            else:
                del tenants[tenant]
            self._n -= 1
            return item
        return None

    def remove(self, cls: str, tenant: str, item: T) -> bool:
        """Take `item` out (a request that gave up); False when it is not here."""
        tenants = self._tenants(cls)
        q = tenants.get(tenant)
        if q is None:
            return False
        try:
            q.remove(item)
        except ValueError:
            return False
        if not q:
            del tenants[tenant]
        self._n -= 1
        return True
