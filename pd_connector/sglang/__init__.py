"""SGLang transfer backend ``pd``: KV transfer between SGLang prefill and decode servers over pd_connector.

``plugin.register`` (the ``sglang.srt.plugins`` entry point) makes ``--disaggregation-transfer-backend pd``
select the classes of ``conn.py``; they keep SGLang's bootstrap protocol (bootstrap server, host/port/room)
and move the KV pages with the engine-agnostic ``pd_connector.transfer.TransferEngine``. Every SGLang internal
they use (the ``Common*`` bases, enum maps, metadata rows) goes through ``compat.py``, checked at
registration. Nothing here is imported by the main environment except through SGLang, so SGLang is not a
dependency of the package.
"""
