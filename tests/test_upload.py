"""--upload-repo against a fake Hugging Face Hub: a local HTTP server answering the Hub API's create-repo,
preupload and commit endpoints, so huggingface_hub's real client runs end to end without a network."""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers import run_cli

pytest.importorskip("huggingface_hub")
constants = pytest.importorskip("huggingface_hub.constants")


class FakeHub(BaseHTTPRequestHandler):
    repos: dict[str, dict[str, bytes]] = {}
    refuse = False

    def log_message(self, *args):
        pass

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        parts = self.path.split("?")[0].strip("/").split("/")
        if self.refuse:
            return self._reply(403, {"error": "You don't have the rights to create a model under this namespace"})
        if parts[:3] == ["api", "repos", "create"]:
            req = json.loads(body)
            repo = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
            self.repos.setdefault(repo, {})
            return self._reply(200, {"url": f"http://{self.headers['Host']}/{repo}"})
        if parts[0] == "api" and parts[1] == "models" and parts[4] == "preupload":
            files = json.loads(body)["files"]
            return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                               for f in files]})
        if parts[0] == "api" and parts[1] == "models" and parts[4] == "commit":
            repo = f"{parts[2]}/{parts[3]}"
            for line in body.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    self.repos[repo][item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            return self._reply(200, {"commitUrl": f"http://{self.headers['Host']}/{repo}/commit/{'0' * 40}",
                                     "commitOid": "0" * 40})
        return self._reply(404, {"error": f"fake hub: no {self.path}"})


@pytest.fixture
def fake_hub(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_fake_token")
    FakeHub.repos.clear()
    FakeHub.refuse = False
    yield FakeHub
    server.shutdown()


def test_every_writing_command_uploads_its_output(fake_hub, model_dir, tmp_path):
    src = model_dir("phi3")
    run_cli("split-gateup", src, "-o", tmp_path / "split", "--upload-repo", "acme/phi3-split")
    run_cli("fuse-gateup", tmp_path / "split", "-o", tmp_path / "fused", "--upload-repo", "acme/phi3-fused")
    run_cli("extract", src, "-o", tmp_path / "ffn.safetensors", "--upload-repo", "acme/phi3-ffn")
    r = run_cli("convert", src, "--to", "torch", "-o", tmp_path / "t", "--upload-repo", "acme/phi3-t", "--json")
    assert json.loads(r.stdout)["uploaded"].endswith("/acme/phi3-t")
    for repo, out in (("acme/phi3-split", tmp_path / "split"), ("acme/phi3-fused", tmp_path / "fused"),
                      ("acme/phi3-t", tmp_path / "t")):
        files = {p.name: p.read_bytes() for p in out.iterdir()}
        assert fake_hub.repos[repo] == files, repo  # every file, byte for byte
    assert set(fake_hub.repos["acme/phi3-ffn"]) == {"ffn.safetensors", "ffn.json"}


def test_a_refused_upload_keeps_the_output_and_says_how(fake_hub, model_dir, tmp_path):
    fake_hub.refuse = True
    r = run_cli("split-gateup", model_dir("phi3"), "-o", tmp_path / "split", "--upload-repo", "acme/x", ok=False)
    assert r.exit_code == 2 and "was written, but uploading it to acme/x failed" in r.output
    assert "hf upload acme/x" in r.output and (tmp_path / "split" / "model.safetensors").is_file()


def test_a_bad_repo_id_is_refused_before_writing(model_dir, tmp_path):
    r = run_cli("split-gateup", model_dir("phi3"), "-o", tmp_path / "split", "--upload-repo", "no-slash", ok=False)
    assert "a Hub repo id is org/name" in r.output and not (tmp_path / "split").exists()
