"""LangSmith's `proxy_config` as cella's egress rules.

`access_control.allow_list` becomes allow rules; a `deny_list` alone means "everything but
these" (allow `*`, deny the list). Patterns are cella's rules: exact names, `*.domain`,
IPs, CIDRs. Header rules become cella header rules: a `workspace_secret` ("{NAME}") is the
tenant's secret NAME, an `opaque` value is stored as a tenant secret of its own (write-only,
like every secret), `plaintext` is sent as is; the guest never sees the secrets. Rules cella
cannot honour are refused by name, never ignored: regex patterns, AWS SigV4 signing, GCP and
Azure tokens, rewrites, relays. A `callback` rule becomes a cella callback rule
(`CallbackRule`: the proxy asks its URL, signed with the daemon's key)."""

from __future__ import annotations

import re
import secrets
from typing import Any

from cella import errors
from cella.models import CallbackRule, HeaderRule, NetworkPolicy, SecretPut
from cella.server.compat.langsmith.shapes import not_supported
from cella.service.daemon import Daemon

HEADER_RULE_FIELDS = {"name", "type", "enabled", "description", "headers", "match_hosts"}
CALLBACK_RULE_FIELDS = {"name", "type", "enabled", "description", "match_hosts", "callback"}
CALLBACK_FIELDS = {"url", "mode", "timeout_seconds"}
WORKSPACE_REF = re.compile(r"\{([A-Za-z0-9][A-Za-z0-9._-]{0,127})\}")


def network_of(config: Any, svc: Daemon, tenant: str) -> NetworkPolicy:
    if not isinstance(config, dict):
        raise errors.InvalidArgument("proxy_config must be an object")
    unknown = set(config) - {"rules", "access_control", "no_proxy", "description"}
    if unknown:
        raise not_supported(f"proxy_config fields {sorted(unknown)}")
    access = config.get("access_control") or {}
    allow = list(access.get("allow_list") or [])
    deny = list(access.get("deny_list") or [])
    for pattern in allow + deny:
        if str(pattern).startswith("~"):
            raise not_supported(f"regex pattern {pattern!r} in access_control")
    if deny and not allow:
        allow = ["*"]
    try:
        # the rules are checked before any opaque header value is stored as a secret
        svc.egress.check_rules(NetworkPolicy(allow=allow, deny=deny))
        headers: list[HeaderRule] = []
        callbacks: list[CallbackRule] = []
        for rule in config.get("rules") or []:
            if isinstance(rule, dict) and rule.get("type") == "callback":
                callbacks += callback_rules(rule)
            else:
                headers += header_rules(rule, svc, tenant)
        return NetworkPolicy(allow=allow, deny=deny, headers=headers, callbacks=callbacks)
    except ValueError as exc:
        raise errors.InvalidArgument(f"proxy_config: {exc}") from None


def callback_rules(rule: dict[str, Any]) -> list[CallbackRule]:
    """A callback rule as cella reads it: `{"type": "callback", "match_hosts": [...],
    "callback": {"url", "mode": "host" | "full_request", "timeout_seconds"}}`."""
    name = rule.get("name", "?")
    extra = set(rule) - CALLBACK_RULE_FIELDS
    callback = rule.get("callback")
    if extra or not isinstance(callback, dict) or set(callback) - CALLBACK_FIELDS:
        what = sorted(extra) if extra else "its callback's fields"
        raise not_supported(f"proxy rule {name!r} ({what})")
    if rule.get("enabled") is False:
        return []
    mode = callback.get("mode") or "host"
    if mode not in ("host", "full_request"):
        raise errors.InvalidArgument(f"proxy rule {name!r}: mode is host or full_request")
    fields: dict[str, Any] = {
        "hosts": rule.get("match_hosts") or [],
        "url": callback.get("url"),
        "full_request": mode == "full_request",
    }
    if callback.get("timeout_seconds") is not None:
        fields["timeout_seconds"] = callback["timeout_seconds"]
    return [CallbackRule.model_validate(fields)]


def header_rules(rule: Any, svc: Daemon, tenant: str) -> list[HeaderRule]:
    if not isinstance(rule, dict):
        raise errors.InvalidArgument("a proxy rule is an object")
    name, kind = rule.get("name", "?"), rule.get("type")
    extra = set(rule) - HEADER_RULE_FIELDS
    if kind not in (None, "headers", "header") or extra:
        what = f"type {kind}" if kind not in (None, "headers", "header") else sorted(extra)
        raise not_supported(f"proxy rule {name!r} ({what})")
    if rule.get("enabled") is False:
        return []
    hosts = list(rule.get("match_hosts") or [])
    if not hosts or not rule.get("headers"):
        raise errors.InvalidArgument(f"proxy rule {name!r} needs match_hosts and headers")
    out = []
    for header in rule["headers"]:
        kind = header.get("type") or "plaintext"
        value = str(header.get("value") or "")
        if kind == "workspace_secret":
            value = WORKSPACE_REF.sub(r"{secret:\1}", value if "{" in value else f"{{{value}}}")
        elif kind == "opaque":  # a secret given inline: kept as one of the tenant's
            stored = f"opaque-{secrets.token_hex(6)}"
            svc.egress.put_secret(tenant, stored, SecretPut(value=value, hosts=hosts))
            value = f"{{secret:{stored}}}"
        elif kind != "plaintext":
            raise not_supported(f"header value type {kind!r} in rule {name!r}")
        out.append(HeaderRule(hosts=hosts, name=str(header.get("name") or ""), value=value))
    return out
