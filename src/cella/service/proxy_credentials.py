"""What the egress proxy is given for a sandbox's credentials: its secret bindings, its
header rules and its cloud rules, each with the values of the secrets they name (kept on
the host; the guest holds placeholders or nothing)."""

from __future__ import annotations

import base64
from typing import Any

from cella.config import upstream_parts
from cella.models import AwsSigning, NetworkPolicy
from cella.store import SandboxRecord, SecretRecord, Store


def bindings(store: Store, row: SandboxRecord) -> list[dict[str, Any]]:
    out = []
    for ref in row.secrets.values():
        secret = store.get_secret(row.tenant, ref.secret)
        if secret is None:
            continue  # deleted since: the placeholder stays a placeholder
        out.append(
            {
                "name": ref.secret,
                "placeholder": ref.placeholder,
                "value": secret.value,
                "hosts": secret.hosts,
                "header": _auth_header(secret),
                "inject": secret.inject,
                "username": secret.username,
            }
        )
    return out


def header_rules(store: Store, row: SandboxRecord) -> list[dict[str, Any]]:
    """Header rules with their secrets filled in (a rule whose secret is gone is not
    applied: sending half a credential is worse than none)."""
    out = []
    for rule in row.network.headers:
        value, used = rule.value, []
        for name in rule.secrets:
            secret = store.get_secret(row.tenant, name)
            if secret is None:
                break
            value = value.replace(f"{{secret:{name}}}", secret.value)
            used.append({"name": name, "value": secret.value})
        else:
            rendered = {"hosts": rule.hosts, "name": rule.name, "value": value}
            minted = [  # `{identity:NAME}`: the proxy mints the token per request
                {"name": n, **row.network.identity_tokens[n].model_dump()}
                for n in rule.identities
                if n in row.network.identity_tokens
            ]
            out.append({**rendered, "secrets": used, "identities": minted})
    return out


def cloud_rules(
    store: Store, tenant: str, policy: NetworkPolicy
) -> dict[str, list[dict[str, Any]]]:
    """AWS signing and GCP token rules (of a sandbox's rules with its bucket mounts') with
    their secrets' values (a rule whose secret is gone is not applied, as for headers)."""
    values = {n: store.get_secret(tenant, n) for n in policy.secret_names}
    found = {n: v.value for n, v in values.items() if v is not None}
    aws = [
        {**rule.model_dump(), **{k: found[n] for k, n in _named(rule).items()}}
        | {"secrets": rule.secrets}
        for rule in policy.aws
        if all(n in found for n in rule.secrets)
    ]
    gcp = [
        {"hosts": r.hosts, "scopes": r.scopes, "secret": r.service_account, "info": sa.value}
        for r in policy.gcp
        if (sa := values[r.service_account]) is not None
    ]
    return {"aws": aws, "gcp": gcp}


def _named(rule: AwsSigning) -> dict[str, str]:
    """The rule's fields that name a secret: the proxy gets their values in their place."""
    fields = {"access_key_id": rule.access_key_id, "secret_access_key": rule.secret_access_key}
    return fields | ({"session_token": rule.session_token} if rule.session_token else {})


def _auth_header(secret: SecretRecord) -> list[str] | None:
    if secret.auth == "bearer":
        return ["Authorization", f"Bearer {secret.value}"]
    if secret.auth == "basic":
        pair = f"{secret.username or 'x-access-token'}:{secret.value}"
        return ["Authorization", "Basic " + base64.b64encode(pair.encode()).decode()]
    return None


def upstream(
    store: Store, row: SandboxRecord, tenant_default: str | None = None
) -> dict[str, Any] | None:
    """The sandbox's own upstream proxy, its password read from the tenant's secret; else
    the operator's for its tenant (`egress_tenant_upstreams`), whose address is the
    operator's choice and so not held to the boundary."""
    proxy = row.network.upstream_proxy
    if proxy is None:
        return {**upstream_parts(tenant_default), "operator": True} if tenant_default else None
    password = None
    if proxy.password_secret is not None:
        secret = store.get_secret(row.tenant, proxy.password_secret)
        password = secret.value if secret is not None else ""  # gone: the proxy refuses
    return {
        "scheme": proxy.scheme,
        "host": proxy.host,
        "port": proxy.port,
        "username": proxy.username,
        "password": password,
    }
