"""AlpaServe §3.4: M/D/1 queueing formulas for two models on two devices, served one model
per device ("simple") or by a 2-stage pipeline over both, and the Fig. 10 overhead limits.
Times are in seconds, rates in requests per second."""

from __future__ import annotations

import math


def md1_latency(rate: float, service: float) -> float:
    """Mean sojourn time of an M/D/1 queue: D + λD² / (2(1 − λD)); inf when λD ≥ 1."""
    load = rate * service
    if load >= 1:
        return math.inf
    return service + rate * service**2 / (2 * (1 - load))


def simple_latency(total_rate: float, service: float, share: float = 0.5) -> float:
    """Mean latency with one model per device, model 1 taking `share` of the requests."""
    return (share * md1_latency(share * total_rate, service)
            + (1 - share) * md1_latency((1 - share) * total_rate, service))


def pipeline_latency(total_rate: float, whole: float, slowest_stage: float) -> float:
    """Mean latency of a pipeline over both devices fed the merged stream: D_s + λD_m² /
    (2(1 − λD_m)), with D_s a request's whole latency and D_m its slowest stage."""
    load = total_rate * slowest_stage
    if load >= 1:
        return math.inf
    return whole + total_rate * slowest_stage**2 / (2 * (1 - load))


def alpha_max(load: float) -> float:
    """Fig. 10: the largest communication overhead α (D_s = 2D_m = αD) at which the pipeline
    still matches the simple placement, for total load u = λD in (0, 2) split evenly.
    Solves α + uα²/(8 − 4uα) = 1 + u/(4 − 2u), the smaller root of a quadratic."""
    u = load
    w = 1 + u / (4 - 2 * u)
    b = 8 + 4 * u * w
    return (b - math.sqrt(b * b - 96 * u * w)) / (6 * u)


def beta_max(load: float) -> float:
    """Fig. 10: the largest stage imbalance β (D_s = D, D_m = βD/2) at which the pipeline
    still matches the simple placement: (−u + √(u² − 4u + 8)) / (2 − u)."""
    u = load
    return (-u + math.sqrt(u * u - 4 * u + 8)) / (2 - u)
