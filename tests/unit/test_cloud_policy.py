"""The pure parts of the proxy's cloud credentials: where an AWS request is scoped, what a
service-account key must hold, and the rules' validation."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from cella.config import DaemonSettings
from cella.models import AwsSigning, GcpToken, HeaderRule, NetworkPolicy
from cella.policy.cloud import scope_of_authorization, scope_of_host, service_account_problem


@pytest.mark.parametrize(
    ("host", "scope"),
    [
        ("s3.amazonaws.com", ("s3", "us-east-1")),
        ("s3.us-west-2.amazonaws.com", ("s3", "us-west-2")),
        ("my.bucket.s3.eu-central-1.amazonaws.com", ("s3", "eu-central-1")),
        ("bucket.s3.amazonaws.com", ("s3", "us-east-1")),
        ("s3-eu-west-1.amazonaws.com", ("s3", "eu-west-1")),
        ("s3.dualstack.ap-south-1.amazonaws.com", ("s3", "ap-south-1")),
        ("sts.amazonaws.com", ("sts", "us-east-1")),
        ("dynamodb.us-east-1.amazonaws.com", ("dynamodb", "us-east-1")),
        ("sqs.us-gov-west-1.amazonaws.com", ("sqs", "us-gov-west-1")),
        ("abc123.execute-api.eu-west-1.amazonaws.com", ("execute-api", "eu-west-1")),
        ("bedrock-runtime.us-east-1.amazonaws.com", ("bedrock", "us-east-1")),
        ("runtime.sagemaker.us-east-1.amazonaws.com", ("sagemaker", "us-east-1")),
        ("S3.CN-NORTH-1.AMAZONAWS.COM.CN.", ("s3", "cn-north-1")),
        ("amazonaws.com", None),
        ("s3.example.com", None),
        ("evil-amazonaws.com", None),
    ],
)
def test_scope_of_a_host_name(host: str, scope: tuple[str, str] | None) -> None:
    assert scope_of_host(host) == scope


def test_the_guests_own_signature_names_the_scope() -> None:
    header = (
        "AWS4-HMAC-SHA256 Credential=AKIAEXAMPLE/20260101/eu-west-3/kinesis/aws4_request, "
        "SignedHeaders=host;x-amz-date, Signature=00"
    )
    assert scope_of_authorization(header) == ("kinesis", "eu-west-3")
    assert scope_of_authorization("Bearer abc") is None


def test_a_service_account_key_is_checked() -> None:
    key = {
        "type": "service_account",
        "client_email": "a@p.iam.gserviceaccount.com",
        "private_key": "-----BEGIN PRIVATE KEY-----\n...",
        "token_uri": "https://oauth2.googleapis.com/token",
    }
    assert service_account_problem(json.dumps(key)) is None
    assert "not JSON" in (service_account_problem("{nope") or "")
    user = {**key, "type": "authorized_user"}
    assert "not a service account" in (service_account_problem(json.dumps(user)) or "")
    partial = {k: v for k, v in key.items() if k != "private_key"}
    assert "lacks private_key" in (service_account_problem(json.dumps(partial)) or "")
    plain = {**key, "token_uri": "http://oauth2.googleapis.com/token"}
    assert "not https" in (service_account_problem(json.dumps(plain)) or "")


def test_cloud_rules_are_validated() -> None:
    policy = NetworkPolicy(
        headers=[HeaderRule(hosts=["api.test"], name="X-Key", value="{secret:k}")],
        aws=[AwsSigning(access_key_id="id", secret_access_key="key", session_token="tok")],
        gcp=[GcpToken(service_account="sa", scopes=[" https://scope/a "])],
        env={"AWS_REGION": "eu-west-1"},
    )
    assert policy.aws[0].hosts == ["*.amazonaws.com"]
    assert policy.gcp[0].hosts == ["*.googleapis.com"] and policy.gcp[0].scopes == [
        "https://scope/a"
    ]
    assert policy.secret_names == ["k", "id", "key", "tok", "sa"]
    with pytest.raises(ValidationError, match="named hosts"):
        AwsSigning(hosts=["*"], access_key_id="id", secret_access_key="key")
    with pytest.raises(ValidationError, match="named hosts"):
        GcpToken(hosts=["10.0.0.0/8"], service_account="sa", scopes=["s"])
    with pytest.raises(ValidationError):
        GcpToken(service_account="sa", scopes=[])
    with pytest.raises(ValidationError, match="is not a scope"):
        GcpToken(service_account="sa", scopes=["a b"])
    with pytest.raises(ValidationError, match="not an environment variable name"):
        NetworkPolicy(env={"1BAD": "x"})
    with pytest.raises(ValidationError):
        AwsSigning(access_key_id="id", secret_access_key="key", region="Not A Region")


def test_the_operators_aws_hosts_are_names() -> None:
    hosts = ["minio.internal", "*.r2.example.com"]
    assert DaemonSettings(egress_aws_hosts=hosts).egress_aws_hosts == hosts
    for bad in ("*", "10.0.0.0/8", "a b.com"):
        with pytest.raises(ValidationError, match="is not a domain"):
            DaemonSettings(egress_aws_hosts=[bad])
