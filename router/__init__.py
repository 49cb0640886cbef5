"""pd-router: the OpenAI-compatible front door of a P/D-disaggregated cluster (see docs/router.md)."""
