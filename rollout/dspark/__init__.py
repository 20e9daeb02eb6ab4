"""DSpark speculative decoding: drafter, proposer, lossless verifier, drafter training."""

from rollout.dspark.model import Draft, Drafter, DSparkConfig, load_drafter, save_drafter
from rollout.dspark.schedule import SpecConfig

__all__ = ["DSparkConfig", "Draft", "Drafter", "SpecConfig", "load_drafter", "save_drafter"]
