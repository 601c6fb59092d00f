"""Deferred-launch thresholds: the one home of their rules (docs/user-guide/tuning.md).

A model launches a step only once at least ``B`` requests are runnable on it, ``B`` read
from its ``ThresholdTable`` at ``N``, the global number of active requests. Three rules,
written here once and used by the scheduler, config validation, the tuner, the threshold
search, the ``simulate`` command and the simulated runtime:

- **lookup**: ``B(N) = values[min(N, len - 1)]``; the last value repeats for every larger N.
- **fill**: a table from the B tuned at a few N (``ThresholdTable.from_tuned``): entry n takes
  the B of the largest tuned N <= n, and 1 below the smallest tuned N and at index 0. A B
  deadlock-free at N stays so at every larger n (the slack is the same, n is larger), so the
  filled table is deadlock-free wherever its tuned points are.
- **admissibility** (no deadlock): with ``R_i`` replicas of model i, each applying ``B_i`` to
  the requests placed on it, the replicas can hold ``sum_i R_i (B_i - 1)`` requests without
  any of them launching, so some replica can always launch iff that slack is below N
  (``is_admissible``; the proof is in ``tuning/replicas.py``). ``check_tables`` applies it to
  whole tables at every N.

Plain Python, no third-party imports: the scheduler (which never imports torch) and the
config read it as cheaply as the tuner does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence


class ThresholdTable:
    """One model's deferred-launch thresholds, indexed by the active-request count N.

    Immutable and hashable. The one type thresholds have from the solver to the scheduler
    (tuner answer, Ray, model replica, engine): ``table[n]`` is entry n as written, ``at(n)``
    the lookup rule. A table equals another table, or a list or tuple, with the same values
    (a config's ``batch_thresholds``, a JSON body's list). At a JSON edge it is a list
    (``to_list``); ``json_hook`` is the ``enc_hook`` that writes it so.
    """

    __slots__ = ("values",)
    values: tuple[int, ...]

    def __init__(self, values: Iterable[int] = (1,)) -> None:
        values = tuple(int(b) for b in values)
        if not values or min(values) < 1:
            raise ValueError(f"thresholds must be a non-empty list of B >= 1, got {list(values)}")
        object.__setattr__(self, "values", values)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("a ThresholdTable is immutable")

    def __reduce__(self) -> tuple[type[ThresholdTable], tuple[tuple[int, ...]]]:
        return (ThresholdTable, (self.values,))  # pickles across Ray as its values

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ThresholdTable):
            return self.values == other.values
        if isinstance(other, (list, tuple)):
            return self.values == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.values)

    def __repr__(self) -> str:
        return f"ThresholdTable({list(self.values)})"

    @classmethod
    def of(cls, values: ThresholdTable | Sequence[int]) -> ThresholdTable:
        """A table from a list (``batch_thresholds`` of a config, a tuner's answer)."""
        return values if isinstance(values, ThresholdTable) else cls(values)

    @classmethod
    def from_tuned(cls, tuned: Mapping[int, int], top: int | None = None) -> ThresholdTable:
        """The fill rule: entries 0..top (default: the largest tuned N), each the B of the
        largest tuned N <= n; 1 below the smallest tuned N and at index 0."""
        points = sorted((int(n), int(b)) for n, b in tuned.items() if int(n) >= 1)
        last = top if top is not None else (points[-1][0] if points else 0)
        values, k, current = [1], 0, 1
        for n in range(1, last + 1):
            while k < len(points) and points[k][0] <= n:
                current = points[k][1]
                k += 1
            values.append(current)
        return cls(tuple(values))

    def at(self, n: int) -> int:
        """B at N active requests (the lookup rule)."""
        return self.values[max(0, min(n, len(self.values) - 1))]

    def extended(self, top: int) -> ThresholdTable:
        """The same thresholds written out for N = 0..top (entries past ``top`` dropped)."""
        return ThresholdTable(tuple(self.at(n) for n in range(top + 1)))

    def to_list(self) -> list[int]:
        return list(self.values)

    def __len__(self) -> int:
        return len(self.values)

    def __iter__(self) -> Iterator[int]:
        return iter(self.values)

    def __getitem__(self, n: int) -> int:
        """Entry ``n`` as written (``at`` applies the lookup rule past the end)."""
        return self.values[n]


def json_hook(obj: object) -> object:
    """``enc_hook`` for msgspec: a ``ThresholdTable`` is its list at a JSON edge."""
    if isinstance(obj, ThresholdTable):
        return obj.to_list()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def deferral_slack(thresholds: Sequence[int], replicas: Sequence[int] | None = None) -> int:
    """``sum_i R_i (B_i - 1)``: requests the replicas can hold without any of them launching
    (every replica of model i applies ``B_i`` to its own share; ``replicas`` default 1)."""
    counts = replicas if replicas is not None else [1] * len(thresholds)
    return sum(r * (b - 1) for b, r in zip(thresholds, counts, strict=True))


def is_admissible(
    n_requests: int, thresholds: Sequence[int], replicas: Sequence[int] | None = None
) -> bool:
    """No deadlock iff ``sum_i R_i (B_i - 1) < N``: some replica can always launch."""
    return all(b >= 1 for b in thresholds) and deferral_slack(thresholds, replicas) < n_requests


def check_admissible(
    n_requests: int, thresholds: Sequence[int], replicas: Sequence[int] | None = None
) -> None:
    """``ValueError`` saying why, unless ``is_admissible``."""
    if n_requests < 1:
        raise ValueError(f"need at least one active request, got N={n_requests}")
    if any(b < 1 for b in thresholds):
        raise ValueError(f"thresholds must be >= 1, got B={tuple(thresholds)}")
    if not is_admissible(n_requests, thresholds, replicas):
        slack = deferral_slack(thresholds, replicas)
        rule = "sum(B_i - 1)"
        if replicas is not None:
            rule = f"sum(R_i (B_i - 1)) with R={tuple(replicas)}"
        raise ValueError(
            f"thresholds B={tuple(thresholds)} deadlock at N={n_requests}: the models can hold "
            f"{rule} = {slack} >= N requests without any of them launching"
        )


def first_deadlock(
    tables: Sequence[ThresholdTable], replicas: Sequence[int] | None = None
) -> int | None:
    """The smallest N >= 1 at which the tables' thresholds are not admissible, else None.
    Past the longest table nothing changes but N, so checking up to its length suffices."""
    longest = max((len(t) for t in tables), default=0)
    for n in range(1, longest + 1):
        if not is_admissible(n, [t.at(n) for t in tables], replicas):
            return n
    return None


def check_tables(
    tables: Mapping[str, ThresholdTable], replicas: Mapping[str, int] | None = None
) -> None:
    """``ValueError`` naming the first N where these per-model tables can deadlock."""
    names = list(tables)
    counts = [int((replicas or {}).get(name, 1)) for name in names]
    n = first_deadlock([tables[name] for name in names], counts)
    if n is None:
        return
    values = [tables[name].at(n) for name in names]
    terms = " + ".join(
        f"{r}*({b}-1) [{name}]" for name, b, r in zip(names, values, counts, strict=True)
    )
    raise ValueError(
        f"batch_thresholds can deadlock at {n} active requests: "
        f"sum(R_i (B_i - 1)) = {terms} = {deferral_slack(values, counts)} must stay below {n} "
        "(R_i = num_replicas: every replica applies the thresholds)"
    )
