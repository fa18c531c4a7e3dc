"""Helios: a serving framework for prepared LLM cores."""

__version__ = "0.1.0"
