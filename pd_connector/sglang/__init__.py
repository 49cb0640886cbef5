"""SGLang transfer backend ``pd``: KV transfer between SGLang prefill and decode servers over pd_connector.

``plugin.register`` (the ``sglang.srt.plugins`` entry point) makes ``--disaggregation-transfer-backend pd``
select the classes of ``conn.py``; they keep SGLang's bootstrap protocol (bootstrap server, host/port/room)
and move the KV pages with the engine-agnostic ``pd_connector.transfer.TransferEngine``. Nothing here is
imported by the main environment except through SGLang, so SGLang is not a dependency of the package.
"""
