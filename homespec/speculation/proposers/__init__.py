"""Proposers guess the next k tokens; the target verifies them. See base.Proposer."""

from homespec.speculation.proposers.base import Evidence, Preview, Proposal, ProposalInfo, Proposer, ProposerCost

__all__ = ["Evidence", "Preview", "Proposal", "ProposalInfo", "Proposer", "ProposerCost"]
