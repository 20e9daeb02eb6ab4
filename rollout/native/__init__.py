"""The project's own rollout engine (CPU and GPU): scheduler, sampler, engine."""

from rollout.native.engine import NativeEngine

__all__ = ["NativeEngine"]
