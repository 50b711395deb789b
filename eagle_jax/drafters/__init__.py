"""Drafters: everything that proposes tokens for the target to verify, behind one protocol."""

from eagle_jax.decoding.protocol import Accepted, Draft, Drafter
from eagle_jax.drafters.draft_model.drafter import DraftModelDrafter, self_draft_model
from eagle_jax.drafters.eagle.drafter import EagleDrafter
from eagle_jax.drafters.pld import PromptLookupDrafter

__all__ = ["Accepted", "Draft", "Drafter", "DraftModelDrafter", "EagleDrafter", "PromptLookupDrafter",
           "self_draft_model"]
