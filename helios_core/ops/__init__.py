"""The op catalogue: versioned semantic operators that program nodes name."""
