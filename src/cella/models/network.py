"""Egress policy, secrets and the egress decision log."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field, IPvAnyAddress, field_validator, model_validator

from cella.policy.delegation import API_HOST
from cella.policy.egress import MAX_RULES, parse_rule

Inject = Literal["anywhere", "header"]
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
SECRET_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


def _rules(values: list[str]) -> list[str]:
    for value in values:
        parse_rule(value)  # ValueError -> 400 with the rule and what is wrong
    return [v.strip() for v in values]


def _named_hosts(values: list[str]) -> list[str]:
    for value in values:
        if parse_rule(value).domain in (None, "*"):
            raise ValueError(f"{value!r}: a rule that acts on requests works on named hosts")
    return [v.strip() for v in values]


HEADER_NAME = r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,128}$"
SECRET_REF = re.compile(r"\{secret:([A-Za-z0-9][A-Za-z0-9._-]{0,127})\}")
IDENTITY_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
IDENTITY_REF = re.compile(r"\{identity:([A-Za-z0-9][A-Za-z0-9._-]{0,63})\}")


class HeaderRule(BaseModel):
    """A header the egress proxy sets on requests to `hosts` (whatever the sandbox sent in
    its place). `{secret:NAME}` in the value stands for the tenant's secret NAME, which never
    enters the sandbox; TLS to those hosts is intercepted for it."""

    model_config = {"extra": "forbid"}

    hosts: list[str] = Field(min_length=1, max_length=64, description="domain or *.domain rules")
    name: str = Field(pattern=HEADER_NAME)
    value: str = Field(max_length=8192)

    _hosts = field_validator("hosts")(_named_hosts)

    @field_validator("value")
    @classmethod
    def _value(cls, value: str) -> str:
        if any(c in value for c in "\r\n\0"):
            raise ValueError("a header value cannot contain CR, LF or NUL")
        return value

    @property
    def secrets(self) -> list[str]:
        return SECRET_REF.findall(self.value)

    @property
    def identities(self) -> list[str]:
        return IDENTITY_REF.findall(self.value)


class IdentityToken(BaseModel):
    """A workload identity token: a JWT the egress proxy mints for the sandbox whenever a
    header rule's value names it (`{identity:NAME}`), signed with the daemon's key
    (`/.well-known/jwks.json`): `iss` the daemon's issuer, `sub`
    `spiffe://cella/tenant/TENANT/sandbox/ID`, `aud` this audience, valid `ttl_seconds`.
    The sandbox never holds it, nor any key to make one."""

    model_config = {"extra": "forbid"}

    audience: str = Field(min_length=1, max_length=1024)
    ttl_seconds: int = Field(default=300, ge=30, le=3600)

    @field_validator("audience")
    @classmethod
    def _audience(cls, value: str) -> str:
        if any(not c.isprintable() for c in value):
            raise ValueError("an audience is printable text")
        return value


UPSTREAM_URL = re.compile(r"^(socks5|http)://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253}):(\d{1,5})$")


class UpstreamProxy(BaseModel):
    """A proxy of the tenant's own that the egress proxy sends this sandbox's allowed
    connections through (after its rules decided them; nothing in the sandbox sees it):
    `socks5://host:port` (RFC 1928, with RFC 1929 user and password) or
    `http://host:port` (HTTP CONNECT, with Basic proxy credentials). Its address is held to
    the operator's boundary like any destination; when it cannot be reached or refuses,
    the connection fails rather than going out directly."""

    model_config = {"extra": "forbid"}

    url: str = Field(max_length=300, description="socks5://host:port or http://host:port")
    username: str | None = Field(default=None, min_length=1, max_length=255)
    password_secret: str | None = Field(
        default=None, pattern=SECRET_NAME, description="the tenant's secret holding the password"
    )

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        found = UPSTREAM_URL.match(value.strip())
        if found is None or not 1 <= int(found.group(3)) <= 65535:
            raise ValueError(
                f"{value!r}: an upstream proxy is socks5://host:port or http://host:port"
            )
        return value.strip()

    @model_validator(mode="after")
    def _pair(self) -> UpstreamProxy:
        if self.password_secret is not None and self.username is None:
            raise ValueError("a password needs a username")
        return self

    @property
    def scheme(self) -> str:
        return self.url.partition("://")[0]

    @property
    def host(self) -> str:
        return self.url.partition("://")[2].rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.url.rpartition(":")[2])


AWS_HOSTS = ["*.amazonaws.com"]
GOOGLE_API_HOSTS = ["*.googleapis.com"]  # storage.googleapis.com among them
AWS_NAME = r"^[a-z0-9][a-z0-9-]{0,62}$"


class AwsSigning(BaseModel):
    """The egress proxy signs requests to `hosts` with AWS Signature V4, with the keys in
    the tenant's secrets named here; the guest's own signature (made with the dummy keys
    its commands see) is dropped. Service and region come from the request's own signature
    scope, else the host name, else `service`/`region`."""

    model_config = {"extra": "forbid"}

    hosts: list[str] = Field(
        default_factory=lambda: list(AWS_HOSTS), min_length=1, max_length=64,
        description="domain or *.domain rules (S3-compatible stores: their names)",
    )  # fmt: skip
    access_key_id: str = Field(pattern=SECRET_NAME, description="secret holding the key id")
    secret_access_key: str = Field(pattern=SECRET_NAME, description="secret holding the key")
    session_token: str | None = Field(
        default=None, pattern=SECRET_NAME, description="secret holding a session token"
    )
    region: str = Field(default="us-east-1", pattern=AWS_NAME)
    service: str = Field(default="s3", pattern=AWS_NAME)

    _hosts = field_validator("hosts")(_named_hosts)

    @property
    def secrets(self) -> list[str]:
        names = [self.access_key_id, self.secret_access_key, self.session_token]
        return [n for n in names if n is not None]


class GcpToken(BaseModel):
    """The egress proxy adds `Authorization: Bearer` to requests to `hosts`, with OAuth
    access tokens it mints (and caches to expiry) from the service-account JSON in the
    tenant's secret `service_account`, for `scopes`."""

    model_config = {"extra": "forbid"}

    hosts: list[str] = Field(
        default_factory=lambda: list(GOOGLE_API_HOSTS), min_length=1, max_length=64
    )
    service_account: str = Field(pattern=SECRET_NAME, description="secret holding the JSON")
    scopes: list[str] = Field(min_length=1, max_length=32)

    _hosts = field_validator("hosts")(_named_hosts)

    @field_validator("scopes")
    @classmethod
    def _scopes(cls, values: list[str]) -> list[str]:
        for value in values:
            if not value.strip() or any(c.isspace() for c in value.strip()):
                raise ValueError(f"{value!r} is not a scope")
        return [v.strip() for v in values]

    @property
    def secrets(self) -> list[str]:
        return [self.service_account]


class CallbackRule(BaseModel):
    """The egress proxy asks `url` whether a request to `hosts` may go, and with which
    headers: a POST of JSON (host, port, the sandbox; with `full_request` the request too,
    its secrets left as placeholders), signed by the daemon (`X-LangSmith-Signature-JWT`,
    verified against `/.well-known/jwks.json`). The answer `{"allow": true, "headers":
    {...}, "ttl_seconds": N}` is kept N seconds per host and port (never for
    `full_request`); anything else, or no answer within `timeout_seconds`, refuses the
    request (403). The URL's address is held to the operator's boundary."""

    model_config = {"extra": "forbid"}

    hosts: list[str] = Field(min_length=1, max_length=64, description="domain or *.domain rules")
    url: str = Field(max_length=2048, pattern=r"^https?://[^\s/?#]+(/[^\s]*)?$")
    full_request: bool = False
    timeout_seconds: float = Field(default=5.0, gt=0, le=30)

    _hosts = field_validator("hosts")(_named_hosts)


Credentials = Literal["strip", "redact", "keep"]


class SandboxPort(BaseModel):
    """A port of one of the tenant's sandboxes (an id or a name; a name is resolved to the
    sandbox's id when the rule is set)."""

    model_config = {"extra": "forbid"}

    sandbox: str = Field(min_length=1, max_length=128)
    port: int = Field(ge=1, le=65535)


class RewriteRule(BaseModel):
    """Requests from this sandbox to `host` (HTTP or HTTPS, any port) are answered by the
    server on `to.port` of another sandbox of the same tenant, never sent out. The egress
    proxy carries them there through the daemon, as service URLs reach a guest port.
    `credentials` is what the other sandbox gets of the credential headers (Authorization,
    Proxy-Authorization, Cookie, X-Api-Key, and every header a header, secret or callback
    rule of this sandbox would add for `host`): `strip` removes them, `redact` keeps each
    with its value `redacted` (after an auth scheme such as `Bearer `), `keep` passes them
    with the secrets in them. Only `keep` lets a secret reach the other sandbox."""

    model_config = {"extra": "forbid"}

    host: str = Field(max_length=253, description="an exact domain name, not an address")
    to: SandboxPort
    credentials: Credentials = "strip"

    @field_validator("host")
    @classmethod
    def _host(cls, value: str) -> str:
        rule = parse_rule(value)
        if rule.domain in (None, "*") or rule.wildcard or rule.port is not None:
            raise ValueError(
                f"{value!r}: a rewrite's host is one exact domain name (no wildcard, port "
                "or address: a rewrite routes to a sandbox, never to an address)"
            )
        if rule.domain == API_HOST:
            raise ValueError(f"{API_HOST} is cella's own API (access delegation)")
        return rule.domain


class NetworkPolicy(BaseModel):
    """Where a sandbox may connect. Default deny; deny rules win.

    A rule is `host[:port]`: `pypi.org`, `*.github.com` (subdomains only), `*` (every name),
    an IP or CIDR (`10.1.0.0/16`); without a port it covers every port. `headers` are set on
    the way out, `aws` requests are signed, `gcp` ones get tokens (credentials from the
    tenant's secrets, never in the guest); `env` is set for every command while it holds;
    `rewrites` answer a host name with a port of another of the tenant's sandboxes."""

    model_config = {"extra": "forbid"}

    allow: list[str] = Field(default_factory=list, max_length=MAX_RULES)
    deny: list[str] = Field(default_factory=list, max_length=MAX_RULES)
    headers: list[HeaderRule] = Field(default_factory=list, max_length=32)
    aws: list[AwsSigning] = Field(default_factory=list, max_length=8)
    gcp: list[GcpToken] = Field(default_factory=list, max_length=8)
    env: dict[str, str] = Field(
        default_factory=dict,
        max_length=64,
        description="plain variables for every command (tools that want a credential "
        "variable present while the proxy adds the real one)",
    )
    callbacks: list[CallbackRule] = Field(default_factory=list, max_length=8)
    rewrites: list[RewriteRule] = Field(default_factory=list, max_length=32)
    public_ports: bool = Field(
        default=False,
        description="servers in the sandbox answer anyone who knows their host name "
        "(`{port}-{sandbox_id}.{domain}`) without a token, as E2B's sandboxes do by default",
    )
    identity_tokens: dict[str, IdentityToken] = Field(
        default_factory=dict,
        max_length=16,
        description="workload identity tokens by name, put into requests by header rules "
        "whose value names them (`Bearer {identity:NAME}`): JWTs the proxy mints and "
        "the daemon's JWKS verifies",
    )
    upstream_proxy: UpstreamProxy | None = Field(
        default=None, description="a proxy of the tenant's own its allowed traffic goes through"
    )
    port_host: str | None = Field(
        default=None,
        max_length=253,
        pattern=r"^[A-Za-z0-9.${}:_-]+$",
        description="the Host header servers in the sandbox see on requests through its "
        "service URLs and host names (`${PORT}` is the port); default `127.0.0.1:PORT`",
    )

    _check_allow = field_validator("allow")(_rules)
    _check_deny = field_validator("deny")(_rules)

    @field_validator("rewrites")
    @classmethod
    def _rewrites(cls, rules: list[RewriteRule]) -> list[RewriteRule]:
        hosts = [r.host for r in rules]
        twice = sorted({h for h in hosts if hosts.count(h) > 1})
        if twice:
            raise ValueError(f"one rewrite a host: {', '.join(twice)} has more")
        return rules

    @field_validator("identity_tokens")
    @classmethod
    def _identity_names(cls, tokens: dict[str, IdentityToken]) -> dict[str, IdentityToken]:
        for name in tokens:
            if not re.match(IDENTITY_NAME, name):
                raise ValueError(f"{name!r} is not an identity token name (letters, digits, ._-)")
        return tokens

    @model_validator(mode="after")
    def _identities_named(self) -> NetworkPolicy:
        for rule in self.headers:
            unknown = [n for n in rule.identities if n not in self.identity_tokens]
            if unknown:
                raise ValueError(
                    f"header {rule.name}: identity token {unknown[0]!r} is not among "
                    f"identity_tokens ({', '.join(self.identity_tokens) or 'none'})"
                )
        return self

    def host_for(self, port: int) -> str:
        """The Host header a server in the sandbox sees on `port`."""
        if self.port_host is None:
            return f"127.0.0.1:{port}"
        return self.port_host.replace("${PORT}", str(port))

    @field_validator("env")
    @classmethod
    def _env(cls, env: dict[str, str]) -> dict[str, str]:
        for name, value in env.items():
            if not re.match(ENV_NAME, name):
                raise ValueError(f"{name!r} is not an environment variable name")
            if "\0" in value or len(value) > 8192:
                raise ValueError(f"{name}: a value holds no NUL and at most 8192 characters")
        return env

    @property
    def secret_names(self) -> list[str]:
        """Every tenant secret the rules use."""
        rules: list[HeaderRule | AwsSigning | GcpToken] = [*self.headers, *self.aws, *self.gcp]
        names = [name for rule in rules for name in rule.secrets]
        if self.upstream_proxy is not None and self.upstream_proxy.password_secret:
            names.append(self.upstream_proxy.password_secret)
        return list(dict.fromkeys(names))


class SecretPut(BaseModel):
    """A credential kept on the host. Its value is never returned by the API and never
    enters a sandbox: sandboxes see a placeholder that the egress proxy swaps for the value
    in requests to `hosts` only (TLS to those hosts is intercepted for it)."""

    model_config = {"extra": "forbid"}

    value: str = Field(min_length=1, max_length=65536)
    hosts: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="domain, *.domain or IP rules; none: the secret is used only where a "
        "header, AWS or GCP rule names it (no placeholder is swapped anywhere)",
    )
    auth: Literal["bearer", "basic"] | None = Field(
        default=None,
        description="also add an Authorization header with it to requests that carry none",
    )
    username: str = Field(
        default="x-access-token", max_length=256, description="user name for basic auth"
    )
    inject: Inject = Field(
        default="anywhere",
        description="anywhere: the placeholder is swapped in URL, headers and body; header: "
        "only the Authorization header (from `auth`) carries it, nothing is swapped. Use "
        "header for hosts that store what they are sent, or the guest can read it back",
    )
    metadata: dict[str, str] = Field(
        default_factory=dict, max_length=32, description="the owner's notes, kept as given"
    )

    @model_validator(mode="after")
    def _inject(self) -> SecretPut:
        if self.inject == "header" and self.auth is None:
            raise ValueError("inject=header needs auth (bearer or basic)")
        return self

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, values: list[str]) -> list[str]:
        for value in values:
            rule = parse_rule(value)
            if rule.port is not None:
                raise ValueError(f"{value!r}: secrets are bound to hosts, not ports")
            if rule.domain == "*":
                raise ValueError("a secret is bound to named hosts, not to every host ('*')")
        return [v.strip() for v in values]

    @field_validator("value")
    @classmethod
    def _value(cls, value: str) -> str:
        if any(c in value for c in "\r\n\0"):
            raise ValueError("a secret value cannot contain CR, LF or NUL")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str]) -> dict[str, str]:
        if any(len(k) > 128 or len(v) > 1024 for k, v in value.items()):
            raise ValueError("metadata keys are at most 128 characters, values 1024")
        return value


class Secret(BaseModel):
    model_config = {"from_attributes": True}

    inject: Inject = "anywhere"
    name: str
    hosts: list[str]
    auth: Literal["bearer", "basic"] | None = None
    username: str | None = None
    version: int = Field(default=1, description="1, then one more at each replacement")
    metadata: dict[str, str] = Field(default_factory=dict)
    created_at: datetime
    updated_at: datetime


class SecretList(BaseModel):
    secrets: list[Secret]


class KeyRotation(BaseModel):
    resealed: int = Field(description="secret values now sealed under the new key")


class EgressBoundary(BaseModel):
    """The operator's line around every tenant's egress rules: addresses not public and
    `protected` ones are reached only through `names` (the operator's host table) or inside
    `tenant_networks`."""

    protected: list[str] = Field(description="the host's own and the fleet nodes' addresses")
    tenant_networks: list[str] = Field(description="non-public networks tenants may open")
    names: list[str] = Field(description="names in the operator's host table (egress_hosts)")


class FleetAddresses(BaseModel):
    """Every fleet node's address, as the gateway sees the cluster."""

    model_config = {"extra": "forbid"}

    addresses: list[IPvAnyAddress] = Field(max_length=65536)


class EgressRewrite(BaseModel):
    """Where a rewrite rule sent a request, and what it did to its credential headers."""

    sandbox: str
    port: int
    credentials: Credentials
    headers: list[str] = Field(
        default_factory=list, description="credential headers stripped or redacted"
    )


class EgressDecision(BaseModel):
    """One connection (or HTTP request) a sandbox tried, and what the proxy decided."""

    id: int
    at: datetime
    host: str
    port: int
    allowed: bool
    reason: str
    protocol: str | None = None
    method: str | None = None
    status: int | None = None
    bytes_out: int | None = Field(default=None, description="request body / tunnel bytes sent")
    bytes_in: int | None = Field(default=None, description="response body / tunnel bytes received")
    credentials: list[str] = Field(default_factory=list, description="secrets added to it")
    rewrite: EgressRewrite | None = None
    error: str | None = None


class EgressLog(BaseModel):
    decisions: list[EgressDecision]
