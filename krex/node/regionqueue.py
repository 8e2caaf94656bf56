"""The order in which a GPU's queued regions get the GPU.

A region holds the GPU exclusively, so the GPU's exclusive time is what tenants compete
for. First come, first served (`fifo`) gives each tenant exclusive time in proportion to
what it submits: a tenant with many commands and long regions takes most of it, and a
tenant with one short region waits behind all of that.

`fair` (the default) is start-time fair queuing (Goyal, Vin and Cheng, "Start-time Fair
Queueing", SIGCOMM 1996) over region time. Each tenant has a virtual time: the exclusive
seconds it has used (entry plus region), divided by its weight. The next region is the
oldest queued one of the tenant with the least virtual time. A tenant that had nothing
queued starts again at the virtual time of the region being served (never below it), so
idling banks no credit. Within a tenant, regions keep their arrival order.

The bound this gives: a region whose tenant had nothing queued waits for the region being
served plus at most one region of each other tenant that has regions queued, however many
regions those tenants queue; every region is at most `--max-region` long. A tenant with
regions queued receives, over any interval in which it stays backlogged, exclusive time
within one maximal region of its weight's share.

Both queues are used under krexd's lock; neither locks itself."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from krex.errors import UsageError

KINDS = ("fair", "fifo")
DEFAULT = "fair"
DEFAULT_WEIGHT = 1.0
MAX_TENANTS = 4096  # tenants remembered per GPU before idle ones are forgotten


class Queued(Protocol):
    tenant: str


R = TypeVar("R", bound=Queued)


class FifoQueue(Generic[R]):
    """First come, first served."""

    kind = "fifo"

    def __init__(self) -> None:
        self._q: collections.deque[R] = collections.deque()

    def push(self, req: R) -> None:
        self._q.append(req)

    def pop(self) -> R:
        return self._q.popleft()

    def start_inline(self, tenant: str) -> None:
        """A region of `tenant` got the GPU without queuing (nothing to do in FIFO order)."""

    def charge(self, tenant: str, seconds: float) -> None:
        """A region of `tenant` used the GPU this long (nothing to do in FIFO order)."""

    def shares(self) -> dict[str, float]:
        return {}

    def __iter__(self) -> Iterator[R]:
        return iter(list(self._q))

    def __len__(self) -> int:
        return len(self._q)


@dataclass
class _Tenant(Generic[R]):
    weight: float
    vtime: float = 0.0  # exclusive seconds used / weight
    used_s: float = 0.0
    waiting: collections.deque[R] = field(default_factory=collections.deque)


class FairQueue(Generic[R]):
    """Start-time fair queuing on region time (see the module docstring)."""

    kind = "fair"

    def __init__(self, weight: Callable[[str], float] | None = None) -> None:
        self._weight = weight or (lambda _t: DEFAULT_WEIGHT)
        self._tenants: dict[str, _Tenant[R]] = {}
        self._vnow = 0.0  # the virtual start time of the region served last
        self._seq = 0
        self._arrival: dict[int, int] = {}  # id(req) -> arrival number: ties go to the oldest

    def _tenant(self, name: str) -> _Tenant[R]:
        t = self._tenants.get(name)
        if t is None:
            w = self._weight(name)
            t = self._tenants[name] = _Tenant(weight=w if w > 0 else DEFAULT_WEIGHT, vtime=self._vnow)
        return t

    def push(self, req: R) -> None:
        t = self._tenant(req.tenant)
        if not t.waiting:
            t.vtime = max(t.vtime, self._vnow)  # idling banks no credit
        t.waiting.append(req)
        self._seq += 1
        self._arrival[id(req)] = self._seq

    def pop(self) -> R:
        best: _Tenant[R] | None = None
        for t in self._tenants.values():
            if not t.waiting:
                continue
            if best is None or (t.vtime, self._arrival[id(t.waiting[0])]) < (
                best.vtime,
                self._arrival[id(best.waiting[0])],
            ):
                best = t
        if best is None:
            raise IndexError("pop from an empty region queue")
        self._vnow = max(self._vnow, best.vtime)
        req = best.waiting.popleft()
        self._arrival.pop(id(req), None)
        if len(self._tenants) > MAX_TENANTS:  # forget idle ones: back, they start at _vnow anyway
            for n in [n for n, t in self._tenants.items() if not t.waiting and t.vtime <= self._vnow]:
                del self._tenants[n]
        return req

    def start_inline(self, tenant: str) -> None:
        """A region of `tenant` got the GPU without queuing (nothing was queued)."""
        t = self._tenant(tenant)
        t.vtime = max(t.vtime, self._vnow)
        self._vnow = t.vtime

    def charge(self, tenant: str, seconds: float) -> None:
        t = self._tenant(tenant)
        t.used_s += seconds
        t.vtime += seconds / t.weight

    def shares(self) -> dict[str, float]:
        """Each tenant's exclusive seconds so far on this GPU."""
        return {n: round(t.used_s, 6) for n, t in self._tenants.items()}

    def __iter__(self) -> Iterator[R]:
        reqs = [r for t in self._tenants.values() for r in t.waiting]
        return iter(sorted(reqs, key=lambda r: self._arrival[id(r)]))

    def __len__(self) -> int:
        return sum(len(t.waiting) for t in self._tenants.values())


def make(kind: str, weights: dict[str, float]) -> FifoQueue[R] | FairQueue[R]:
    if kind == "fifo":
        return FifoQueue()
    return FairQueue(lambda t: weights.get(t, DEFAULT_WEIGHT))


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise UsageError(f"unknown region queue {kind!r}", f"use one of: {', '.join(KINDS)}")
    return kind


def parse_weights(text: str) -> dict[str, float]:
    """'alice=2,bob=0.5' -> {'alice': 2.0, 'bob': 0.5}. Tenants not named weigh 1."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        try:
            w = float(value)
        except ValueError:
            w = -1.0
        if not sep or not name.strip() or not w > 0 or w == float("inf"):
            raise UsageError(
                f"bad tenant weight {part!r}",
                "write NAME=WEIGHT pairs with positive weights, e.g. alice=2,bob=1",
            )
        out[check_tenant(name.strip())] = w
    return out


_TENANT_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._@-+:")


def check_tenant(name: str) -> str:
    if not 0 < len(name) <= 64 or not set(name) <= _TENANT_OK:
        raise UsageError(
            f"bad tenant name {name!r}",
            "use 1-64 characters from letters, digits and . _ @ - + :",
        )
    return name
