"""Egress: the host-side proxy every guest connection goes through, and its supervisor."""
