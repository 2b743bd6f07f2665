"""LangSmith's `proxy_config` as cella's egress rules.

`access_control.allow_list` becomes allow rules; a `deny_list` alone means "everything but
these" (allow `*`, deny the list). Patterns are cella's rules: exact names, `*.domain`,
IPs, CIDRs. Rules cella cannot honour are refused by name, never ignored: regex patterns,
AWS SigV4 signing, GCP and Azure tokens, rewrites, relays, callbacks."""

from __future__ import annotations

from typing import Any

from cella import errors
from cella.models import NetworkPolicy
from cella.server.compat.langsmith.shapes import not_supported


def network_of(config: Any) -> NetworkPolicy:
    if not isinstance(config, dict):
        raise errors.InvalidArgument("proxy_config must be an object")
    unknown = set(config) - {"rules", "access_control", "no_proxy", "description"}
    if unknown:
        raise not_supported(f"proxy_config fields {sorted(unknown)}")
    for rule in config.get("rules") or []:
        name = rule.get("name", "?") if isinstance(rule, dict) else "?"
        kind = rule.get("type", "headers") if isinstance(rule, dict) else "?"
        raise not_supported(
            f"proxy rule {name!r} (type {kind}); cella injects credentials "
            "through its own secrets (PUT /v1/secrets, auth bearer or basic)"
        )
    access = config.get("access_control") or {}
    allow = list(access.get("allow_list") or [])
    deny = list(access.get("deny_list") or [])
    for pattern in allow + deny:
        if str(pattern).startswith("~"):
            raise not_supported(f"regex pattern {pattern!r} in access_control")
    if deny and not allow:
        allow = ["*"]
    try:
        return NetworkPolicy(allow=allow, deny=deny)
    except ValueError as exc:
        raise errors.InvalidArgument(f"access_control: {exc}") from None
