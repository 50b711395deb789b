"""Medusa-1: the heads, their drafter over a static tree, their training task and tree tuner."""
