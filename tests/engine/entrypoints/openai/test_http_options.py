"""The server's HTTP options as vLLM's: HTTPS with client certificates (--ssl-*), a proxy's path
prefix (--root-path) under which the API key is asked for as at the root, no docs pages
(--disable-fastapi-docs), no per-request log line (--disable-uvicorn-access-log). The
certificates come from openssl, a CA of the test's own."""
import ssl
import subprocess

import httpx
import pytest

from tests.engine.entrypoints.openai.conftest import Server

KEY = {"Authorization": "Bearer sekret"}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")

    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=cpuserve test CA")
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "extendedKeyUsage=clientAuth")):
        (d / f"{name}.ext").write_text(ext + "\n")
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")
    return d


def test_https_with_client_certificates_under_a_root_path(pki):
    client = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    client.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
    s = Server("--ssl-keyfile", str(pki / "server.key"), "--ssl-certfile", str(pki / "server.pem"),
               "--ssl-ca-certs", str(pki / "ca.pem"), "--ssl-cert-reqs", "2", "--root-path", "/llm",
               "--api-key", "sekret", "--disable-fastapi-docs", "--disable-uvicorn-access-log", tls=client)
    try:
        with httpx.Client(verify=client, timeout=60) as c:
            for prefix in ("", "/llm"):  # a proxy passes the prefix on or strips it: the key is asked for both ways
                assert c.get(f"{s.url}{prefix}/v1/models").status_code == 401
                assert c.get(f"{s.url}{prefix}/v1/models", headers=KEY).json()["data"][0]["id"] == "smollm2"
            r = c.post(s.url + "/llm/v1/completions", headers=KEY, json={"prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
            assert [c.get(s.url + p).status_code for p in ("/docs", "/redoc", "/openapi.json")] == [404] * 3
        anonymous = ssl.create_default_context(cafile=str(pki / "ca.pem"))  # trusts the server, has no certificate
        with pytest.raises(httpx.TransportError):
            httpx.get(s.url + "/health", verify=anonymous, timeout=10)
        with pytest.raises(httpx.TransportError):  # plain HTTP on the HTTPS port
            httpx.get(s.url.replace("https", "http") + "/health", timeout=10)
    finally:
        log = s.stop()
    assert f"serving smollm2 on https://127.0.0.1:{s.port}/llm/v1" in log
    assert "request_id=" not in log  # no line per request


def test_the_docs_and_the_request_log_are_there_by_default(server):
    assert httpx.get(server.url + "/openapi.json").json()["info"]["title"] == "cpuserve"
    assert httpx.get(server.url + "/docs").status_code == 200
    assert "path=/docs status=200" in server.output()
