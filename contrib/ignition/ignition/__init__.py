"""Ignition: the offline preparation toolkit for Helios.

Ignition turns published model artifacts (GGUF files, tokenizer data, chat
templates) into the inputs the Helios serving core consumes. Nothing here runs
on the serving path.
"""

__version__ = "0.1.0"
