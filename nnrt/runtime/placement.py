"""Where a compiled model runs: which device takes which operations, and why
work landed on the CPU instead of the device that would have run it.

Pure data, built by ``Runtime.compile`` and updated when an execution moves
the model to the CPU after a driver failure (``compiled.placement``).

Fallback kinds:

- ``unsupported``: no other candidate device supports the operation (its
  type or operands);
- ``refused``: the chosen device failed to prepare its part;
- ``died`` / ``failed``: the device died (DEAD_OBJECT) or failed an
  execution; from then on the whole model runs on the CPU.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class Fallback:
    kind: str           # "unsupported", "refused", "died" or "failed"
    device: str         # the device that did not run it ("" when none could)
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


@dataclass(frozen=True)
class PlacedStep:
    device: str
    operations: tuple[int, ...]          # indexes into the model's main subgraph
    operation_types: tuple[str, ...]
    fallback: Fallback | None = None     # why this step runs where it does, when it fell back
    # Why partitioning placed it here rather than on a device it reports
    # faster ("kept off far: ...": that device's round trip costs more than
    # its speed saves); "" when it is simply the fastest.
    note: str = ""

    def __repr__(self) -> str:
        ops = ", ".join(f"{i}:{t}" for i, t in zip(self.operations, self.operation_types))
        why = "".join(f" ({x})" for x in (self.fallback, self.note) if x)
        return f"<step on {self.device}: {ops}{why}>"


@dataclass(frozen=True)
class Placement:
    steps: tuple[PlacedStep, ...]

    @property
    def fallbacks(self) -> tuple[Fallback, ...]:
        return tuple(s.fallback for s in self.steps if s.fallback is not None)

    def device_of(self, operation: int) -> str:
        """The device that runs operation ``operation`` of the main subgraph."""
        for s in self.steps:
            if operation in s.operations:
                return s.device
        raise KeyError(operation)

    def __str__(self) -> str:
        """A line per step: its operations one by one when there are a few
        (``litert: 0 ADD``), else as index ranges and a count per type
        (``litert: operations 0-89, 90 in all: 40 CONV_2D, 20 ADD, ...``), so
        a 90-operation model prints a line a person can read."""
        lines = []
        for s in self.steps:
            if len(s.operations) <= _LISTED:
                ops = ", ".join(f"{i} {t}" for i, t in zip(s.operations, s.operation_types))
            else:
                counts = Counter(s.operation_types).most_common()
                ops = (f"operations {_ranges(s.operations)}, {len(s.operations)} in all: "
                       + ", ".join(f"{n} {t}" for t, n in counts))
            lines.append(f"{s.device}: {ops}" + "".join(f"  [{x}]" for x in (s.fallback, s.note)
                                                         if x))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Placement {'; '.join(repr(s)[1:-1] for s in self.steps)}>"


_LISTED = 6   # a step of at most this many operations lists them one by one


def _ranges(indexes: tuple[int, ...]) -> str:
    """``0-41, 43, 45-89``: sorted indexes as runs of consecutive ones."""
    runs: list[list[int]] = []
    for i in sorted(indexes):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def notes_of(notes: dict[int, str], indexes) -> str:
    """A step's note: the distinct notes of its operations ``indexes``."""
    return "; ".join(dict.fromkeys(notes[k] for k in indexes if k in notes))


def groups(assignment: list) -> list[tuple[object, list[int]]]:
    """Consecutive operations on one device, as ``partition.split`` cuts steps."""
    out: list[tuple[object, list[int]]] = []
    for k, device in enumerate(assignment):
        if out and out[-1][0] is device:
            out[-1][1].append(k)
        else:
            out.append((device, [k]))
    return out
