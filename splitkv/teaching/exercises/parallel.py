"""Exercise of notebook 07: when does splitting a verify step's prefix across GPUs pay?

The notebook models one verify call on ``W`` GPUs, each holding ``1/W`` of
every prefix (:class:`StepModel`)::

    t_1(P) = a + P b / B                   one GPU
    t_W(P) = a + P b / (W B) + c           W GPUs: a shard each, then the exchange

with ``a`` the fixed cost of a call (µs), ``b`` the prefix K+V bytes per
token (the whole batch), ``B`` the bandwidth one GPU streams them at and
``c`` the all-gather and merge (µs). :func:`check_prefix_for_speedup` checks
the learner's ``prefix_for_speedup(model, world_size, speedup=1.0)``: the
prefix length at which ``t_1 / t_W`` reaches ``speedup``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable

from . import Unsolved, checks

__all__ = ["StepModel", "check_prefix_for_speedup"]


@dataclass(frozen=True)
class StepModel:
    """The two-term time of one verify call, plus the exchange when it runs on several GPUs.

    Attributes:
        fixed_us: the fixed cost ``a`` of one call on one GPU (launch, latency, merge tail), µs.
        bandwidth: the bytes per second ``B`` one GPU streams the prefix at.
        comm_us: the all-gather of the ranks' states and their merge ``c``, µs.
        bytes_per_token: the prefix K+V bytes ``b`` per token of prefix, all sequences of the batch together.
    """

    fixed_us: float
    bandwidth: float
    comm_us: float
    bytes_per_token: float

    def time_us(self, prefix: float, world_size: int = 1) -> float:
        """Modelled µs of one call with ``prefix`` tokens per sequence, each of ``world_size`` GPUs reading a shard."""
        read = prefix * self.bytes_per_token / (world_size * self.bandwidth) * 1e6
        return self.fixed_us + read + (self.comm_us if world_size > 1 else 0.0)

    def speedup(self, prefix: float, world_size: int) -> float:
        """Modelled one-GPU time over the ``world_size``-GPU time."""
        return self.time_us(prefix, 1) / self.time_us(prefix, world_size)


def _prefix_reaching(model: StepModel, world_size: int, speedup: float) -> float:
    """The prefix at which ``model.speedup(P, world_size)`` reaches ``speedup``, found by bisection on the model
    itself: the checker knows what the answer must satisfy, not the formula the learner derives. The speedup
    grows with the prefix (its derivative has the sign of ``a + c - a / W > 0``), so the root is unique."""
    lo, hi = 0.0, 1.0
    while model.speedup(hi, world_size) < speedup:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if model.speedup(mid, world_size) < speedup else (lo, mid)
    return hi


def _hint(got: float, want: float, model: StepModel, world_size: int, speedup: float) -> str:
    """A guess at the mistake behind a wrong prefix, by comparing with the usual slips."""
    def tokens(read_us: float) -> float:
        return read_us * 1e-6 * model.bandwidth / model.bytes_per_token

    slips = [
        (want * model.bytes_per_token, "that is bytes of prefix; divide by bytes_per_token for tokens"),
        (want * 1e6, "a factor 1e6 off: fixed_us and comm_us are microseconds, bandwidth is bytes per second"),
        (want * 1e-6, "a factor 1e-6 off: fixed_us and comm_us are microseconds, bandwidth is bytes per second"),
        (tokens(speedup * model.comm_us / (1 - speedup / world_size)),
         "the fixed cost is in both times: it enters as (speedup - 1) * fixed_us"),
        (tokens(speedup * model.comm_us * world_size), "solve a + x = s (a + x / W + c) for x exactly"),
        (tokens((speedup - 1) * model.fixed_us / (1 - speedup / world_size)),
         "only the W GPUs pay the exchange: it enters as speedup * comm_us"),
    ]
    for value, hint in slips:
        if math.isclose(got, value, rel_tol=1e-6):
            return f" ({hint})"
    return f" (at your prefix the model gives model.speedup(prefix, {world_size}) = {model.speedup(got, world_size):.3f})"


def _call(fn: Callable[..., float], model: StepModel, world_size: int, speedup: float) -> float:
    """The learner's answer; an exception becomes a checker message that names the case."""
    try:
        return fn(model, world_size, speedup)
    except Unsolved:
        raise  # the stub is not written yet: exercise() says so
    except Exception as err:  # the learner's code may raise anything
        raise AssertionError(f"{model}, {world_size} GPUs, speedup {speedup}: raised {type(err).__name__}: {err}"
                             + (" (a speedup of W or more is out of reach: return math.inf)"
                                if speedup >= world_size else "")) from err


@checks("parallel", "prefix_for_speedup")
def check_prefix_for_speedup(fn: Callable[..., float]) -> str:
    """Check ``fn(model, world_size, speedup=1.0)`` on fresh random models: break-even, targets, out of reach."""
    rng = random.Random()
    checked = 0
    for _ in range(60):
        model = StepModel(fixed_us=rng.uniform(5.0, 60.0), bandwidth=rng.uniform(1e12, 5e12),
                          comm_us=rng.uniform(2.0, 40.0), bytes_per_token=rng.choice([1024, 4096, 8192, 32768, 65536]))
        world = rng.choice([2, 3, 4, 8])
        for s in (1.0, rng.uniform(1.05, 0.97 * world)):
            got, want = _call(fn, model, world, s), _prefix_reaching(model, world, s)
            what = f"{model}, {world} GPUs, speedup {s:.3f}"
            if not isinstance(got, (int, float)) or math.isnan(got) or got < 0:
                raise AssertionError(f"{what}: got {got!r}, expected a prefix length >= 0 in tokens")
            if not math.isclose(got, want, rel_tol=1e-6):
                raise AssertionError(f"{what}: got {got:.6g} tokens, expected {want:.6g}"
                                     + _hint(got, want, model, world, s))
            assert math.isclose(model.speedup(want, world), s, rel_tol=1e-9)
            checked += 1
        for s in (float(world), world + 0.5):
            got = _call(fn, model, world, s)
            if got != math.inf:
                raise AssertionError(f"{model}, {world} GPUs, speedup {s}: got {got!r}; the speedup only tends to "
                                     f"{world} as the prefix grows, so return math.inf")
    return f"passed: prefix_for_speedup matches {checked} break-even points and targets, and says math.inf past W"
