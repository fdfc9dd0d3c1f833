"""Bearer-token authentication and TLS over loopback; after each refusal a good call still works."""

import shutil
import subprocess

import grpc
import pytest
from serving_support import client_of

from serving.grpc.auth import read_token

TOKEN = "s3cret-token"


def generate(client):
    return client.generate([1, 2, 3], max_tokens=3, temperature=0, ignore_eos=True, timeout=30)


@pytest.mark.parametrize(
    "token,why",
    [
        (None, "missing bearer token"),
        ("wrong", "invalid bearer token"),
        (TOKEN + "x", "invalid bearer token"),
        ("", "missing bearer token"),
    ],
)
def test_calls_without_the_right_token_are_unauthenticated(serve, token, why):
    server = serve(auth_token=TOKEN)
    with client_of(server, token=token) as client:
        for call in (generate, lambda c: c.model_info(), lambda c: c.server_stats()):
            with pytest.raises(grpc.RpcError) as info:
                call(client)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and why in info.value.details()
        assert client.health() == "SERVING"  # health checks stay open for probes
    with client_of(server, token=TOKEN) as client:
        assert len(generate(client).token_ids) == 3
        assert client.model_info().vocab_size == 512


def test_read_token(tmp_path):
    path = tmp_path / "token"
    path.write_text("abc\n")
    assert read_token(None, str(path)) == "abc" and read_token("xyz") == "xyz" and read_token() is None
    path.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_token(None, str(path))


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(d / "key.pem"),
            "-out",
            str(d / "cert.pem"),
        ],
        check=True,
        capture_output=True,
    )
    return d / "cert.pem", d / "key.pem"


def test_tls_with_auth(serve, certificate):
    cert, key = certificate
    server = serve(tls_cert_file=str(cert), tls_key_file=str(key), auth_token=TOKEN)
    with client_of(server, root_certificates=cert.read_bytes(), tls_server_name="localhost", token=TOKEN) as client:
        assert len(generate(client).token_ids) == 3
    with client_of(server, root_certificates=cert.read_bytes(), tls_server_name="localhost") as client:
        with pytest.raises(grpc.RpcError) as info:
            generate(client)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with client_of(server, token=TOKEN) as plaintext:  # a plaintext client cannot talk to a TLS server
        with pytest.raises(grpc.RpcError) as info:
            plaintext.model_info(timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
