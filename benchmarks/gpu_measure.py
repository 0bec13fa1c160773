"""Measuring and reporting for ``gpu.py``: what a half measured and which checks failed, timed calls, row errors."""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any


class Results:
    """What a half measured: per configuration its seconds per round; the checks that failed."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {}
        self.failures: list[str] = []

    def add(self, name: str, seconds: float) -> None:
        """Record one round's seconds of ``name``."""
        self.seconds.setdefault(name, []).append(seconds)

    def median(self, name: str) -> float:
        """The median of ``name``'s rounds."""
        return statistics.median(self.seconds[name])

    def ratio(self, label: str, top: str, bottom: str, target: float | None = None, paired: bool = True) -> None:
        """Print ``top``'s seconds over ``bottom``'s (a time ratio; inverted, a tokens/s one): the median of the
        rounds' ratios where ``paired`` (the two measured in alternating rounds), else the ratio of the medians."""
        if top not in self.seconds or bottom not in self.seconds:
            print(f"  {label:58s} not measured")
            return
        if paired:
            each = [a / b for a, b in zip(self.seconds[top], self.seconds[bottom])]
            value = statistics.median(each)
            spread = f"  rounds {min(each):.3f}..{max(each):.3f}" if len(each) > 1 else ""
        else:
            value, spread = self.median(top) / self.median(bottom), ""
        verdict = "" if target is None else f"  target >= {target}: {'met' if value >= target else 'BELOW TARGET'}"
        print(f"  {label:58s} {value:7.3f}{verdict}{spread}")

    def check(self, passed: bool, text: str) -> None:
        """Print ``text`` as a check's outcome; a failed one is recorded."""
        print(f"  {'ok  ' if passed else 'FAIL'} {text}")
        if not passed:
            self.failures.append(text)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Run a step; an exception ends it (printed and recorded as a failure), not the half."""
        try:
            yield
        except Exception as error:  # noqa: BLE001 - one failed step must not lose the rest of a GPU run
            print(f"  FAIL {name}: {type(error).__name__}: {error}")
            print("".join(traceback.format_exc().splitlines(keepends=True)[-12:]), file=sys.stderr)
            self.failures.append(f"{name}: {type(error).__name__}: {error}")


def no_wait() -> None:
    """Nothing to wait for (a CPU, or a call that returns once its work is done)."""


def timed(run: Callable[[], Any], sync: Callable[[], None]) -> tuple[float, Any]:
    """Wall seconds of one call of ``run`` (``sync`` waits for the device before the clock stops), and its result."""
    began = time.perf_counter()
    result = run()
    sync()
    return time.perf_counter() - began, result


def median_call(run: Callable[[], Any], calls: int, sync: Callable[[], None]) -> float:
    """The median seconds of ``calls`` calls of ``run``."""
    return statistics.median(timed(run, sync)[0] for _ in range(calls))


def relative_row_error(rows: Any, reference: Any) -> float:
    """The largest ``|row - reference row| / |reference row|`` of two ``[tokens, hidden]`` tensors."""
    rows, reference = rows.float().cpu(), reference.float().cpu()
    if rows.shape != reference.shape:
        return float("inf")
    return float(((rows - reference).norm(dim=-1) / reference.norm(dim=-1).clamp_min(1e-12)).max())
