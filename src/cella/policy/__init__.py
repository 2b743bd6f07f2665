"""Pure decision logic (no I/O): egress rules. Also imported by the egress proxy's addon,
which runs in mitmproxy's own interpreter, so nothing here may import beyond the stdlib."""
