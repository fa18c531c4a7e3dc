"""The runtime: native model loading, shared packing, the engine and its worker."""
