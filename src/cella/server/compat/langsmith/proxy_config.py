"""LangSmith's `proxy_config` as cella's egress rules.

`access_control.allow_list` becomes allow rules; a `deny_list` alone means "everything but
these" (allow `*`, deny the list). Patterns are cella's rules: exact names, `*.domain`,
IPs, CIDRs. Header rules become cella header rules: a `workspace_secret` ("{NAME}") is the
tenant's secret NAME, an `opaque` value is stored as a tenant secret of its own (write-only,
like every secret), `plaintext` is sent as is; the guest never sees the secrets. An `aws`
rule with static keys becomes an AWS signing rule (`*.amazonaws.com` and the operator's
`egress_aws_hosts`), a `gcp` rule a GCP token rule (`*.googleapis.com`); a rule's `env_vars`
are set for every command while it is enabled. Rules cella cannot honour are refused by
name, never ignored: regex patterns, AWS roles (STS with LangSmith's External ID),
Azure tokens, relays, rewrites to an outside host, path and header matching. A `callback`
rule becomes a cella callback rule (`CallbackRule`: the proxy asks its URL, signed with the
daemon's key); a `rewrite` rule to a sandbox becomes one cella `RewriteRule` per host of
`match_hosts` (the fields of the langsmith package's generated `RuleRewrite`: `sandbox`,
`port`, `credentials`). Nothing is stored until all of it is valid."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from cella import errors
from cella.models import (
    AwsSigning,
    CallbackRule,
    GcpToken,
    HeaderRule,
    NetworkPolicy,
    RewriteRule,
    SecretPut,
)
from cella.models.network import AWS_HOSTS, GOOGLE_API_HOSTS
from cella.policy.cloud import service_account_problem
from cella.server.compat.langsmith.shapes import not_supported
from cella.service.daemon import Daemon

RULE_FIELDS = {"name", "type", "enabled", "description", "env_vars"}
HEADER_RULE_FIELDS = RULE_FIELDS | {"headers", "match_hosts"}
AWS_RULE_FIELDS = RULE_FIELDS | {"aws"}
GCP_RULE_FIELDS = RULE_FIELDS | {"gcp"}
CALLBACK_RULE_FIELDS = {"name", "type", "enabled", "description", "match_hosts", "callback"}
CALLBACK_FIELDS = {"url", "mode", "timeout_seconds"}
REWRITE_RULE_FIELDS = RULE_FIELDS | {"match_hosts", "rewrite"}
REWRITE_FIELDS = {"sandbox", "port", "credentials", "host"}
WORKSPACE_REF = re.compile(r"\{([A-Za-z0-9][A-Za-z0-9._-]{0,127})\}")


@dataclass
class Opaque:
    """Inline secret values, named now and stored only once the whole config is valid."""

    pending: list[tuple[str, SecretPut]] = field(default_factory=list)

    def add(self, value: str, hosts: list[str]) -> str:
        name = f"opaque-{secrets.token_hex(6)}"
        self.pending.append((name, SecretPut(value=value, hosts=hosts)))
        return name

    def store(self, svc: Daemon, tenant: str) -> None:
        for name, body in self.pending:
            svc.egress.put_secret(tenant, name, body)


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
    opaque = Opaque()
    try:
        svc.egress.check_rules(NetworkPolicy(allow=allow, deny=deny))
        headers: list[HeaderRule] = []
        aws: list[AwsSigning] = []
        gcp: list[GcpToken] = []
        env: dict[str, str] = {}
        callbacks: list[CallbackRule] = []
        rewrites: list[RewriteRule] = []
        aws_hosts = [*AWS_HOSTS, *svc.settings.egress_aws_hosts]
        for rule in config.get("rules") or []:
            if not isinstance(rule, dict):
                raise errors.InvalidArgument("a proxy rule is an object")
            name, kind = rule.get("name", "?"), rule.get("type") or "headers"
            if kind == "callback":  # its own fields, checked by callback_rules
                callbacks += callback_rules(rule)
                continue
            if kind == "rewrite":
                if rule.get("enabled") is not False:
                    rewrites += rewrite_rules(rule)
                    env_of(rule, env)
                continue
            fields = {"aws": AWS_RULE_FIELDS, "gcp": GCP_RULE_FIELDS}.get(kind, HEADER_RULE_FIELDS)
            extra = set(rule) - fields
            if kind not in ("headers", "header", "aws", "gcp") or extra:
                what = f"type {kind}" if not extra else sorted(extra)
                raise not_supported(f"proxy rule {name!r} ({what})")
            if rule.get("enabled") is False:
                continue  # a disabled rule adds nothing, its env_vars neither
            if kind == "aws":
                aws.append(aws_rule(rule, aws_hosts, opaque))
            elif kind == "gcp":
                gcp.append(gcp_rule(rule, opaque))
            else:
                headers += header_rules(rule, opaque)
            env_of(rule, env)
        policy = NetworkPolicy(
            allow=allow,
            deny=deny,
            headers=headers,
            aws=aws,
            gcp=gcp,
            env=env,
            callbacks=callbacks,
            rewrites=rewrites,
        )
    except (ValueError, ValidationError) as exc:
        raise errors.InvalidArgument(f"proxy_config: {exc}") from None
    opaque.store(svc, tenant)
    return policy


def secret_of(given: Any, what: str, hosts: list[str], opaque: Opaque) -> str:
    """A proxy secret (`workspace_secret` or `opaque`) as the name of a tenant secret."""
    if not isinstance(given, dict) or given.get("type") not in ("workspace_secret", "opaque"):
        raise errors.InvalidArgument(
            f"{what} must be a workspace_secret or opaque value (plaintext is not supported)"
        )
    value = str(given.get("value") or "")
    if given["type"] == "opaque":
        return opaque.add(value, hosts)
    found = WORKSPACE_REF.fullmatch(value) or WORKSPACE_REF.fullmatch(f"{{{value}}}")
    if found is None:
        raise errors.InvalidArgument(f"{what}: {value!r} is not a workspace secret's name")
    return found.group(1)


def aws_rule(rule: dict[str, Any], hosts: list[str], opaque: Opaque) -> AwsSigning:
    name, block = rule.get("name", "?"), rule.get("aws")
    if not isinstance(block, dict):
        raise errors.InvalidArgument(f"proxy rule {name!r} needs an aws block")
    if block.get("role_arn"):
        raise not_supported(
            f"proxy rule {name!r}: AWS role_arn (STS AssumeRole with LangSmith's workspace "
            "External ID); cella has no such identity: give access_key_id and "
            "secret_access_key"
        )
    extra = set(block) - {"access_key_id", "secret_access_key", "role_arn"}
    if extra:
        raise not_supported(f"proxy rule {name!r}: aws fields {sorted(extra)}")
    if "access_key_id" not in block or "secret_access_key" not in block:
        raise errors.InvalidArgument(
            f"proxy rule {name!r}: AWS auth requires role_arn or both static credentials"
        )
    return AwsSigning(
        hosts=hosts,
        access_key_id=secret_of(block["access_key_id"], "access_key_id", hosts, opaque),
        secret_access_key=secret_of(block["secret_access_key"], "secret_access_key", hosts, opaque),
    )


def gcp_rule(rule: dict[str, Any], opaque: Opaque) -> GcpToken:
    name, block = rule.get("name", "?"), rule.get("gcp")
    if not isinstance(block, dict):
        raise errors.InvalidArgument(f"proxy rule {name!r} needs a gcp block")
    extra = set(block) - {"service_account_json", "scopes"}
    if extra:
        raise not_supported(f"proxy rule {name!r}: gcp fields {sorted(extra)}")
    if not block.get("scopes"):
        raise errors.InvalidArgument(f"proxy rule {name!r}: gcp proxy auth rules require scopes")
    given = block.get("service_account_json")
    if isinstance(given, dict) and given.get("type") == "opaque":
        text = str(given.get("value") or "")
        why = service_account_problem(text)
        if why is not None:
            raise errors.InvalidArgument(f"proxy rule {name!r}: service_account_json: {why}")
        given = {**given, "value": json.dumps(json.loads(text))}  # one line, as secrets are
    hosts = list(GOOGLE_API_HOSTS)
    account = secret_of(given, "service_account_json", hosts, opaque)
    return GcpToken(hosts=hosts, service_account=account, scopes=list(block["scopes"]))


def env_of(rule: dict[str, Any], env: dict[str, str]) -> None:
    """A rule's `env_vars` into the policy's; two rules may not set one name differently."""
    given = rule.get("env_vars") or {}
    if not isinstance(given, dict):
        raise errors.InvalidArgument("env_vars must be a mapping of names to values")
    for key, value in given.items():
        if key in env and env[key] != str(value):
            raise errors.InvalidArgument(f"env_vars: {key} is set differently by two rules")
        env[str(key)] = str(value)


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


def rewrite_rules(rule: dict[str, Any]) -> list[RewriteRule]:
    """A rewrite rule to a sandbox's port, one cella rule per name of `match_hosts`: `{"type":
    "rewrite", "match_hosts": [...], "rewrite": {"sandbox", "port", "credentials"}}`."""
    name = rule.get("name", "?")
    extra = set(rule) - REWRITE_RULE_FIELDS
    if extra:
        raise not_supported(f"proxy rule {name!r} ({sorted(extra)})")
    rewrite = rule.get("rewrite")
    if not isinstance(rewrite, dict):
        raise errors.InvalidArgument(f"proxy rule {name!r} needs a rewrite block")
    extra = set(rewrite) - REWRITE_FIELDS
    if extra:
        raise not_supported(f"proxy rule {name!r}: rewrite fields {sorted(extra)}")
    if rewrite.get("host"):
        raise not_supported(
            f"proxy rule {name!r}: a rewrite to an outside host; cella rewrites a name to a "
            "port of another sandbox (rewrite.sandbox)"
        )
    if not rewrite.get("sandbox"):
        raise errors.InvalidArgument(f"proxy rule {name!r}: rewrite needs sandbox (or host)")
    hosts = list(rule.get("match_hosts") or [])
    if not hosts:
        raise errors.InvalidArgument(f"proxy rule {name!r} needs match_hosts")
    to = {"sandbox": rewrite["sandbox"], "port": rewrite.get("port")}
    credentials = rewrite.get("credentials") or "strip"  # LangSmith's default
    return [
        RewriteRule.model_validate({"host": host, "to": to, "credentials": credentials})
        for host in hosts
    ]


def header_rules(rule: dict[str, Any], opaque: Opaque) -> list[HeaderRule]:
    name = rule.get("name", "?")
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
            value = f"{{secret:{opaque.add(value, hosts)}}}"
        elif kind != "plaintext":
            raise not_supported(f"header value type {kind!r} in rule {name!r}")
        out.append(HeaderRule(hosts=hosts, name=str(header.get("name") or ""), value=value))
    return out
