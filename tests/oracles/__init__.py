"""Test oracles: deliberately simple, independent reference implementations.

Nothing in this package may import Helios or Ignition code; tests compare the
project's results against these.
"""
