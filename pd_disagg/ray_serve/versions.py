"""The Ray release lines the Ray Serve application runs on, checked at start.

``app.build_app`` calls ``check_version`` in the process that builds the application (``serve run``'s
driver), before any deployment is made, so an unproven Ray fails with one message naming the version this was
proven on instead of somewhere inside Serve's internals. The same gate as vLLM's
(``pd_connector.release_gate``).
"""

from __future__ import annotations

from pd_connector.release_gate import ReleaseGate

#: Release lines the integration test runs (integration_tests/test_ray_serve.py): the ``ray`` extra's pin.
SUPPORTED = ("2.60",)
#: The release every Serve API used here was proven on (named in the start-up error).
PROVEN_ON = "ray 2.60.0"
GATE = ReleaseGate("pd-disagg's Ray Serve application", "Ray", SUPPORTED, PROVEN_ON, extra="ray")


def unsupported_reason(version: str) -> str | None:
    """Why this Ray cannot run the application, or None when it can."""
    return GATE.unsupported_reason(version)


def check_version() -> None:
    """Raise ``RuntimeError`` when the installed Ray is not supported."""
    import ray

    GATE.check(str(ray.__version__))
