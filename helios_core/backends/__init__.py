"""Execution backends: implementations of the op catalogue (the numpy reference backend first)."""
