"""Data plane: write KV block runs from local registered memory into a peer's registered memory."""
