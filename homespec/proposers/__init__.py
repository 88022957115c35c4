"""Proposers guess the next k tokens; the target verifies them. See base.Proposer."""

from homespec.proposers.base import Proposal, Proposer

__all__ = ["Proposal", "Proposer"]
