"""Rewards: rule-based verifiers, weighted terms, user functions, an HTTP judge, and the Scorer.

Kept light to import (the learner imports `metrics`): sympy loads on the first math check and
aiohttp with the first judge term.
"""

from asyncgrpo.rewards.metrics import reward_term_metrics

__all__ = ["reward_term_metrics"]
