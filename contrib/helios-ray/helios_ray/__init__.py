"""Helios on Ray Serve: one ``helios run`` process per replica behind Ray Serve's HTTP proxy.

``build_app(run_args, num_replicas=N)`` returns the application to pass to ``serve.run``; the
replicas report healthy only while Helios's ``/ready`` answers 200, and prefix-affinity routing
(on by default) sends requests with the same prompt start to the same replica.
"""

from helios_ray.deployment import HeliosIngress, HeliosServer, affinity_key, build_app
from helios_ray.process import HeliosProcess, HeliosStartupError
from helios_ray.router import PrefixAffinityRouter, rendezvous_order

__all__ = [
    "HeliosIngress",
    "HeliosProcess",
    "HeliosServer",
    "HeliosStartupError",
    "PrefixAffinityRouter",
    "affinity_key",
    "build_app",
    "rendezvous_order",
]
