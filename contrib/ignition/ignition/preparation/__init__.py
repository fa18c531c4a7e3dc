"""Reusable preparation pieces: manifest building and contract declarations."""
