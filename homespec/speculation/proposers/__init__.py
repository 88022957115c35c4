"""Proposers guess the next k tokens; the target verifies them. See base.Proposer."""

from homespec.speculation.proposers.base import Proposal, Proposer

__all__ = ["Proposal", "Proposer"]
