"""The trace: sandbox events (written in one place, secrets redacted there) and exporters."""
