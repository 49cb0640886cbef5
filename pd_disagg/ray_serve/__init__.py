"""pd-disagg on Ray Serve (the ``ray`` extra): ``versions`` is the Ray release gate, checked at start."""
