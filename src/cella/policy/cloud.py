"""Cloud credentials the egress proxy uses for a sandbox, the pure parts: where an AWS
request is scoped (service, region), what the guest sees instead of keys, and whether a
secret holds a usable service-account key (stdlib only: the proxy imports it too)."""

from __future__ import annotations

import json
import re

# What an AWS SDK or `curl --aws-sigv4` inside the guest signs with; the proxy drops that
# signature and signs again with the real keys, which never enter the guest.
DUMMY_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "AKIACELLAPROXYSIGNS0",
    "AWS_SECRET_ACCESS_KEY": "cella-egress-proxy-signs-aws-requests-for-you",
}
AWS_SUFFIXES = (".amazonaws.com", ".amazonaws.com.cn")
REGION = re.compile(r"^[a-z]{2}(-gov|-iso[a-z]?)?-[a-z]+-\d+$")
SCOPE = re.compile(r"Credential=[^/,\s]+/\d{8}/([a-z0-9-]+)/([a-z0-9-]+)/aws4_request")
NOT_SERVICES = {"dualstack", "fips"}
SIGNING_NAMES = {  # endpoint prefixes that sign under another name
    "bedrock-runtime": "bedrock",
    "bedrock-agent-runtime": "bedrock",
    "email": "ses",
    "runtime.sagemaker": "sagemaker",
    "s3-control": "s3",
}
GLOBAL_REGION = "us-east-1"
SERVICE_ACCOUNT_FIELDS = ("client_email", "private_key", "token_uri")


def scope_of_authorization(header: str) -> tuple[str, str] | None:
    """(service, region) from a SigV4 Authorization header's credential scope."""
    found = SCOPE.search(header)
    return (found.group(2), found.group(1)) if found else None


def scope_of_host(host: str) -> tuple[str, str] | None:
    """(service, region) from an AWS endpoint name: `s3.us-west-2.amazonaws.com`,
    `bucket.s3.amazonaws.com`, `s3-eu-west-1.amazonaws.com`, `sts.amazonaws.com`,
    `x.execute-api.eu-west-1.amazonaws.com`; None for a name that is not AWS's."""
    name = host.lower().rstrip(".")
    suffix = next((s for s in AWS_SUFFIXES if name.endswith(s)), None)
    if suffix is None:
        return None
    labels = [part for part in name[: -len(suffix)].split(".") if part not in NOT_SERVICES]
    if not labels or not labels[0]:
        return None
    for i, label in enumerate(labels):
        if label == "s3" or label.startswith("s3-"):  # virtual-hosted buckets come first
            legacy = label[3:]
            if REGION.match(legacy):
                return "s3", legacy
            region = next((x for x in labels[i + 1 :] if REGION.match(x)), GLOBAL_REGION)
            return "s3", region
    at = next((i for i, label in enumerate(labels) if REGION.match(label)), None)
    if at is None:
        region, service_labels = (GLOBAL_REGION, labels)
    else:
        region, service_labels = labels[at], labels[:at]
    if not service_labels:
        return None
    prefix = ".".join(service_labels[-2:])
    if prefix in SIGNING_NAMES:
        return SIGNING_NAMES[prefix], region
    service = service_labels[-1]
    return SIGNING_NAMES.get(service, service), region


def service_account_problem(text: str) -> str | None:
    """Why `text` is not a service account's JSON key (None when it is one)."""
    try:
        info = json.loads(text)
    except ValueError:
        return "not JSON (a service account's key file is)"
    if not isinstance(info, dict) or info.get("type") != "service_account":
        return 'not a service account\'s key ("type": "service_account")'
    missing = [f for f in SERVICE_ACCOUNT_FIELDS if not isinstance(info.get(f), str)]
    if missing:
        return f"the service account's key lacks {', '.join(missing)}"
    if not str(info["token_uri"]).startswith("https://"):
        return "its token_uri is not https"
    return None
