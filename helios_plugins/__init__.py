"""First-party plugins of Helios, registered through the ``helios`` entry points."""
