"""Which of two experts runs each denoising step (Wan 2.2): the flow-matching Euler schedule's timesteps, computed in
pure Python exactly as the scheduler computes them, compared with the boundary `boundary_ratio * num_train_timesteps`.

The recorder checks this arithmetic against the installed scheduler for every step count the planner accepts."""

from __future__ import annotations

import struct
from typing import List, Mapping

#: The scheduler whose timesteps `flow_match_timesteps` reproduces (without dynamic shifting or custom sigmas).
SCHEDULER = "FlowMatchEulerDiscreteScheduler"


def _f32(value: float) -> float:
    """`value` rounded to the nearest float32 (what a float32 tensor holds)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def _shift32(sigma: float, shift: float) -> float:
    """The scheduler's table of sigmas, shifted in float32 arithmetic."""
    shift = _f32(shift)
    return _f32(_f32(shift * sigma) / _f32(1.0 + _f32(_f32(shift - 1.0) * sigma)))


def _linspace(start: float, stop: float, count: int) -> List[float]:
    """`count` evenly spaced float64 values from `start` to `stop`, both included (as numpy spaces them)."""
    if count == 1:
        return [start]
    step = (stop - start) / (count - 1)
    if step == 0:
        values = [i / (count - 1) * (stop - start) + start for i in range(count)]
    else:
        values = [i * step + start for i in range(count)]
    values[-1] = stop
    return values


def flow_match_timesteps(steps: int, *, shift: float, num_train_timesteps: int = 1000) -> List[float]:
    """The timesteps a flow-matching Euler scheduler with a static `shift` runs for `steps` steps (float32 values)."""
    n = num_train_timesteps
    sigma_max = _shift32(_f32(_f32(float(n)) / n), shift)
    sigma_min = _shift32(_f32(_f32(1.0) / n), shift)
    timesteps = _linspace(sigma_max * n, sigma_min * n, steps)
    sigmas = [t / n for t in timesteps]
    shifted = [_f32(shift * s / (1 + (shift - 1) * s)) for s in sigmas]
    return [_f32(s * n) for s in shifted]


def experts_per_step(experts: Mapping, steps: int) -> List[str]:
    """The expert of each of `steps` denoising steps.

    Args:
        experts (`Mapping`): `{"high_noise", "low_noise"}` (component names), `"boundary_ratio"` and `"schedule"`
            (`{"scheduler", "shift", "num_train_timesteps"}`): the high-noise expert runs the steps whose timestep is
            at least `boundary_ratio * num_train_timesteps`, the low-noise one the others.
    """
    schedule = experts["schedule"]
    if schedule.get("scheduler") != SCHEDULER:
        raise ValueError(f"Expert schedules of {schedule.get('scheduler')!r} are not supported (only {SCHEDULER}).")
    n = int(schedule["num_train_timesteps"])
    boundary = _f32(float(experts["boundary_ratio"]) * n)
    timesteps = flow_match_timesteps(steps, shift=float(schedule["shift"]), num_train_timesteps=n)
    return [experts["high_noise"] if t >= boundary else experts["low_noise"] for t in timesteps]
