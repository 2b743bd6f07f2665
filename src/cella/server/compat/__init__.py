"""Wire-compatible front ends for third-party sandbox SDKs."""
