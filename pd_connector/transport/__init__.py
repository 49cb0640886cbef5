"""Data plane: write KV block runs from local registered memory into a peer's registered memory.

Used by the transfer engine (``pd_connector.transfer``) in every engine worker process: ``factory`` builds the
configured transport, ``base`` is the interface all of them implement.
"""
