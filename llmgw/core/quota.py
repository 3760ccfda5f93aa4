"""Fleet-wide limits as arithmetic: windows, leases, what a counter's total grants, and the
`x-ratelimit-*` headers a refusal carries.

Every router of the fleet counts a key's requests and tokens in the same JetStream counter
(one subject per key and window, `llmgw.core.subjects.limit_counter`): the server adds each
router's increment atomically and answers with the new total, so the fleet's count is exact
with no coordination between routers. A router takes a *lease* of requests at a time (one
increment for several requests), so a busy key costs one round trip per lease, and uses
a lease only in the window it was taken in. Since the total decides what each increment
grants, the routers together never grant more than the limit in a window; what they may
under-grant is the unused rest of their leases when the window ends (under
`LEASE_FRACTION` of the limit per router).

Pure: the router (llmgw.router.quotas) holds the counters and the clock.
"""

from __future__ import annotations

import math

LEASE_FRACTION = 0.02
"""A lease is this share of a window's allowance (at least one request)."""
TOKENS_WINDOW_S = 60.0


MAX_RATE_WINDOW_S = 60.0
"""The longest window, that of the slowest rate a key may have (llmgw.core.tenancy's
MIN_RATE): a limit under one request in it is counted as one. The windows' counters live
ten minutes (llmgw.bus.provisioning's LIMITS_MAX_AGE_S): a longer window would be forgotten
before it ends. And a rate of 1e-320 is above 0, but 1 / 1e-320 is inf, a window no
integer counts."""


def rate_window_s(per_s: float) -> float:
    """The window a requests/s limit is counted in: a second, or long enough to hold one
    request when the limit is under 1/s (0.2/s: 5 s), at most MAX_RATE_WINDOW_S."""
    return 1.0 if per_s >= 1.0 else min(1.0 / per_s, MAX_RATE_WINDOW_S)


def allowance(per_s: float) -> int:
    """Requests allowed per window of `rate_window_s(per_s)`."""
    return max(1, math.floor(per_s * rate_window_s(per_s) + 1e-9))


def window(wall: float, span_s: float) -> int:
    """The number of the window of `span_s` seconds holding UNIX time `wall`."""
    return int(wall // span_s)


def reset_in(wall: float, span_s: float) -> float:
    """Seconds until the window holding `wall` ends."""
    return span_s - (wall % span_s)


def lease_size(allowed: int) -> int:
    return max(1, math.floor(allowed * LEASE_FRACTION))


def granted(total_after: int, lease: int, allowed: int) -> int:
    """What an increment of `lease` grants, given the counter's total after it: the part of
    the lease that fits under `allowed`. Increments are applied one after another, so the
    grants of all routers in a window add up to at most `allowed`."""
    return max(0, min(lease, allowed - (total_after - lease)))


def reset_text(seconds: float) -> str:
    """A duration as OpenAI writes `x-ratelimit-reset-*`: `1s`, `250ms`, `6m0s`, `1h2m3s`."""
    if seconds < 1.0:
        return f"{max(1, round(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def rate_headers(
    kind: str, limit: float, remaining: float, reset_s: float
) -> tuple[tuple[str, str], ...]:
    """`x-ratelimit-limit-<kind>`, `-remaining-<kind>`, `-reset-<kind>` (kind: requests or
    tokens), as OpenAI sends them."""
    return (
        (f"x-ratelimit-limit-{kind}", f"{limit:g}"),
        (f"x-ratelimit-remaining-{kind}", str(max(0, math.floor(remaining)))),
        (f"x-ratelimit-reset-{kind}", reset_text(reset_s)),
    )


def retry_after(reset_s: float) -> int:
    """Whole seconds for `Retry-After`: never 0 (a client would retry at once)."""
    return max(1, math.ceil(reset_s))
