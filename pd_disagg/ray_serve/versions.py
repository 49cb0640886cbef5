"""The Ray release lines the Ray Serve application runs on, checked at start.

``app.build_app`` calls ``check_version`` in the process that builds the application (``serve run``'s
driver), before any deployment is made, so an unproven Ray fails with one message naming the version this was
proven on instead of somewhere inside Serve's internals. Same shape as the engines' gate
(``pd_connector.vllm.compat.versions``).
"""

from __future__ import annotations

#: Release lines the integration test runs (integration_tests/test_ray_serve.py): the ``ray`` extra's pin.
SUPPORTED = ("2.60",)
#: The release every Serve API used here was proven on (named in the start-up error).
PROVEN_ON = "ray 2.60.0"


def unsupported_reason(version: str) -> str | None:
    """Why this Ray cannot run the application, or None when it can."""
    if any(version == line or version.startswith(line + ".") for line in SUPPORTED):
        return None
    return (
        f"pd-disagg's Ray Serve application supports Ray {', '.join(s + '.x' for s in SUPPORTED)} "
        f"(tested with {PROVEN_ON}), but this is Ray {version}: install the supported one "
        "(pip install 'pd-disagg[ray]') or a pd-disagg release made for this one"
    )


def check_version() -> None:
    """Raise ``RuntimeError`` when the installed Ray is not supported."""
    import ray

    reason = unsupported_reason(str(ray.__version__))
    if reason is not None:
        raise RuntimeError(reason)
