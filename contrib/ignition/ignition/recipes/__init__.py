"""Recipes: each declares one model family's semantic metadata and programs."""
