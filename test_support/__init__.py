"""Test doubles and load shared by the unit tests and the benchmarks; not part of the shipped package.

``fake_vllm``: a fake vLLM OpenAI server with vLLM's exact framing, the router tests' engines and the router
benchmark's upstream. It lives outside ``pd_disagg`` (the shipped commands: tiny model, launcher, demo, server
harness) so that nothing installed with ``pip install pd-disagg`` is a stand-in for an engine.

``fault_proxy``: a loopback TCP proxy that injects delay, stalls, resets and garbage bytes on a seeded
schedule, for the transfer engine's failure tests and the chaos benchmark (issue 23).

``spinner``: a thread running Python for as long as a block runs, the GIL load of an engine's own threads, for
the transport tests and ``benchmarks.transport``.
"""
